"""Chat templates that are not prefix-stable, generation markers, template kwargs and named templates."""

import copy
import shutil
from pathlib import Path

import pytest

from specray.capture.chat import (NAMED_TEMPLATES, jinja_literal, resolve_chat_template, turn_spans,
                                  with_template_kwargs)
from specray.capture.data import ChatRenderer, Conversation
from specray.capture.target import load_target, resolve_target_dir, template_fingerprint

QWEN3 = Path(__file__).with_name("templates") / "qwen3.jinja"  # Qwen3's structure: <think> on the last turn only
TURNS = (("user", "Hi"), ("assistant", "Hello there"), ("user", "More?"), ("assistant", "Sure."))
THREE = TURNS + (("user", "And?"), ("assistant", "Done."))


@pytest.fixture
def tok(debug_target):
    return copy.deepcopy(debug_target.tokenizer)  # the session target's tokenizer stays untouched


def _supervised(tok, conversation: Conversation) -> str:
    sample = ChatRenderer(tok, max_length=4096).render(conversation)
    whole = tok.apply_chat_template(conversation.as_chat(), tokenize=False)
    assert sample.input_ids.tolist() == tok(whole, add_special_tokens=False)["input_ids"]  # what serving sees
    return tok.decode(sample.input_ids[sample.loss_mask])


def test_qwen3_template_is_not_prefix_stable_and_renders_every_turns_answer(tok):
    tok.chat_template = QWEN3.read_text()
    chat = Conversation("c", THREE).as_chat()
    whole = tok.apply_chat_template(chat, tokenize=False)
    first_two = tok.apply_chat_template(chat[:2], tokenize=False)
    assert not whole.startswith(first_two)  # the <think> block moves to the last turn: no prefix stability
    assert whole.count("<think>") == 1 and first_two.count("<think>") == 1
    # earlier answers as the conversation holds them; the last as the target generates it after the prompt
    assert _supervised(tok, Conversation("c", THREE)) == (
        "Hello there<|im_end|>Sure.<|im_end|><think>\n\n</think>\n\nDone.<|im_end|>")


def test_qwen3_without_thinking_supervises_each_answer_and_its_end_of_turn(tok):
    tok.chat_template = with_template_kwargs(QWEN3.read_text(), {"enable_thinking": False})
    prompt = tok.apply_chat_template(Conversation("c", TURNS).as_chat()[:3], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the kwarg reached the template
    assert _supervised(tok, Conversation("c", TURNS)) == "Hello there<|im_end|>Sure.<|im_end|>"
    assert _supervised(tok, Conversation("c", THREE)) == "Hello there<|im_end|>Sure.<|im_end|>Done.<|im_end|>"
    cut = Conversation("c", TURNS, cut=True)  # a last answer stopped at a token limit: no end-of-turn of its own
    assert _supervised(tok, cut) == "Hello there<|im_end|>Sure."


def test_reasoning_content_is_rendered_by_the_template_and_supervised_where_generated(tok):
    tok.chat_template = QWEN3.read_text()
    conv = Conversation("c", TURNS, reasoning=(None, "first thought", None, "second thought"))
    assert conv.as_chat()[3]["reasoning_content"] == "second thought"
    whole = tok.apply_chat_template(conv.as_chat(), tokenize=False)
    assert "second thought" in whole and "first thought" not in whole  # Qwen3 drops reasoning of history turns
    assert _supervised(tok, conv) == "Hello there<|im_end|><think>\nsecond thought\n</think>\n\nSure.<|im_end|>"


def test_prefix_stable_template_spans_are_each_answer_and_end_of_turn(tok):
    """The debug target's ChatML: every prefix is stable, so each answer is found as rendered."""
    text, spans = turn_spans(tok, Conversation("c", THREE).as_chat(), tok.eos_token)
    assert [text[s:e] for s, e in spans] == ["Hello there<|im_end|>", "Sure.<|im_end|>", "Done.<|im_end|>"]


def test_generation_markers_name_the_spans(tok):
    """A template with {% generation %} marks its own spans; an answer's end-of-turn outside the marker
    joins it, and a cut last answer loses its end-of-turn."""
    tok.chat_template = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
        "{%- if m['role'] == 'assistant' -%}{{- 'A: ' -}}{%- generation -%}{{- m['content'] -}}{%- endgeneration -%}"
        "{{- '<|im_end|>\\n' -}}{%- else -%}{{- m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    renderer = ChatRenderer(tok, max_length=4096)
    assert renderer.marked
    # 'A: ' is outside the markers: the template says the model does not generate it (a per-turn render
    # would supervise it, as it follows the generation prompt)
    assert _supervised(tok, Conversation("c", TURNS)) == "Hello there<|im_end|>Sure.<|im_end|>"
    assert _supervised(tok, Conversation("c", TURNS, cut=True)) == "Hello there<|im_end|>Sure."


def test_named_templates_carry_generation_markers(tok):
    tok.chat_template = NAMED_TEMPLATES["chatml"]
    assert ChatRenderer(tok, max_length=64).marked
    assert _supervised(tok, Conversation("c", TURNS)) == "Hello there<|im_end|>Sure.<|im_end|>"
    tok.chat_template = NAMED_TEMPLATES["llama3"]
    text = tok.apply_chat_template(Conversation("c", TURNS).as_chat(), tokenize=False)
    assert text.startswith(tok.bos_token + "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    assert _supervised(tok, Conversation("c", TURNS)) == "Hello there<|eot_id|>Sure.<|eot_id|>"


def test_a_target_without_a_template_needs_data_chat_template(tmp_path, debug_target):
    bare = tmp_path / "bare"
    shutil.copytree(resolve_target_dir("debug"), bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="has no chat template.*set data.chat_template"):
        load_target(str(bare))
    target = load_target(str(bare), chat_template=resolve_chat_template("chatml"))
    assert target.chat_template == NAMED_TEMPLATES["chatml"] == target.tokenizer.chat_template
    assert target.target_fingerprint == debug_target.target_fingerprint  # the same weights
    assert target.template_fingerprint != debug_target.template_fingerprint


def test_template_kwargs_are_in_the_fingerprint(debug_target, tmp_path):
    own = load_target("debug", chat_template_kwargs={})
    assert own.chat_template is None and own.template_fingerprint == debug_target.template_fingerprint
    fingerprints = {load_target("debug", chat_template=QWEN3.read_text(), chat_template_kwargs=kwargs).template_fingerprint
                    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True})}
    assert len(fingerprints) == 3 and debug_target.template_fingerprint not in fingerprints
    baked = load_target("debug", chat_template=QWEN3.read_text(), chat_template_kwargs={"enable_thinking": False})
    again = load_target("debug", chat_template=baked.chat_template)  # what a trainer does with a manifest's record
    assert again.template_fingerprint == baked.template_fingerprint
    assert template_fingerprint(baked.tokenizer) == baked.template_fingerprint


def test_template_kwargs_reach_macros_loops_and_win_over_render_time_values():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    values = {"flag": False, "n": 3, "x": 0.5, "s": "it's \"q\"\n\\ é", "nothing": None, "items": [1, "a"],
              "opts": {"k": True}}
    template = with_template_kwargs(
        "{%- macro show() -%}{{ flag }}{%- endmacro -%}{%- for _ in [0] -%}{{ show() }}|{{ n }}|{{ x }}|{{ s }}|"
        "{{ nothing is none }}|{{ items[1] }}|{{ opts.k }}{%- endfor -%}", values)
    assert _compile_jinja_template(template).render(flag=True, n=9) == "False|3|0.5|it's \"q\"\n\\ é|True|a|True"
    with pytest.raises(ValueError, match=r"chat_template_kwargs.x: nan is not a finite number"):
        jinja_literal(float("nan"), "chat_template_kwargs.x")
    for name in ("add_generation_prompt", "none", "for", "2x"):
        with pytest.raises(ValueError, match=rf"'{name}' is not a template variable"):
            with_template_kwargs("", {name: True})
    with pytest.raises(ValueError, match="not a JSON-like value"):
        with_template_kwargs("", {"f": object()})


def test_unknown_chat_template_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"data.chat_template='nope' is neither a named template"):
        resolve_chat_template("nope")
    plain = tmp_path / "plain.txt"
    plain.write_text("no jinja here")
    with pytest.raises(ValueError, match="holds no Jinja expression"):
        resolve_chat_template(str(plain))
    assert resolve_chat_template(str(QWEN3)) == QWEN3.read_text()
