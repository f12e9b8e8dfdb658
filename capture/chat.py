"""Chat templates: named templates, template files, template kwargs, and the supervised spans of a rendering.

**The template a target renders with** (``data.chat_template``, ``data.chat_template_kwargs``):

- ``None`` (the default): the tokenizer's own ``chat_template``;
- a name in ``NAMED_TEMPLATES`` (``chatml``, ``llama3``), for targets whose tokenizer has none;
- a path to a Jinja file (``*.jinja``).

Template kwargs (e.g. ``{enable_thinking: false}``) are written into the template itself, as
top-level ``{%- set name = value -%}`` lines before it (``with_template_kwargs``): every renderer of
the target (capture, the trainer's live evaluation, serving) then renders with the same values,
and the template fingerprint (``capture/target.py``), a digest of the template text, covers them.
A value set this way wins over the same name passed at render time.

**Supervised spans** (``supervised_spans``: the character spans of a rendered conversation a
drafter learns to produce; seed §7.2). The whole conversation is rendered once, ``F``; each
assistant turn ``i`` contributes the text the target generates for it, end-of-turn included:

- a template with ``{% generation %}`` markers names the spans itself (transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``); an end-of-turn token right
  after a marked span joins it;
- otherwise each turn is rendered on its own: ``A_i = render(messages[:i], add_generation_prompt)``
  (the prompt the target answers turn ``i`` from) and ``G_i = render(messages[:i+1])``; the text of
  ``G_i`` after their common prefix, up to and including the first end-of-turn token
  (``tokenizer.eos_token``), is what the target generates for turn ``i``. Its characters are
  aligned (``difflib``) with turn ``i``'s region of ``F`` (from where ``F`` leaves ``A_i`` to
  ``F``'s next end-of-turn), and the matched characters are supervised.

Templates need not be prefix-stable. Qwen3's template writes an empty ``<think>\\n\\n</think>\\n\\n``
block into the last assistant turn only (a turn after the last user message); with it, an earlier
answer is supervised as ``Hello<|im_end|>`` (what ``F`` holds for it) and the last one as
``<think>\\n\\n</think>\\n\\nSure.<|im_end|>`` (what the target generates after the generation
prompt); with ``enable_thinking: false`` the generation prompt holds the empty block and the last
turn is supervised as ``Sure.<|im_end|>``. ``reasoning_content`` of a message is passed to the
template, which renders it where it supports it; what it renders into a generated turn is
supervised like the rest of that turn.

The last answer of a ``cut`` conversation (stopped at a token limit) ends at its content: the
end-of-turn the template adds after it is not the model's.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Both mark the assistant's text with {% generation %}: supervised spans come from the markers.
NAMED_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
        "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    "llama3": (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
        "{%- else -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
}


def resolve_chat_template(spec: str | None, *, field: str = "data.chat_template") -> str | None:
    """The template text of ``spec``: a name in ``NAMED_TEMPLATES`` or a path to a Jinja file (None: None)."""
    if spec is None:
        return None
    if spec in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"{field}={spec!r} is neither a named template ({sorted(NAMED_TEMPLATES)}) nor a file; "
                         "give one of those names or the path of a Jinja chat template")
    text = path.read_text(encoding="utf-8")
    if "{{" not in text and "{%" not in text:
        raise ValueError(f"{field}={spec!r}: {path} holds no Jinja expression; it is not a chat template")
    return text


def check_chat_template(spec: str | None) -> str | None:
    """A config's chat template: a named template as it is, a template file as an absolute path (jobs run in
    other directories); anything else is the error naming the field."""
    if spec is None or spec in NAMED_TEMPLATES:
        return spec
    resolve_chat_template(spec, field="chat_template")
    return str(Path(spec).expanduser().resolve())


def check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A config's template kwargs, refused unless each is a settable name with a JSON-like value."""
    with_template_kwargs("", kwargs)
    return kwargs


def jinja_literal(value: Any, where: str = "chat_template_kwargs") -> str:
    """``value`` (JSON-like: bool, None, number, string, list, dict with string keys) as a Jinja literal."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(c if c.isprintable() and c not in "\\'" else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                          else f"\\U{ord(c):08x}" for c in value)
        return f"'{escaped}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(jinja_literal(v, f"{where}[{i}]") for i, v in enumerate(value)) + "]"
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: dict keys must be strings, got {k!r}")
            items.append(f"{jinja_literal(k)}: {jinja_literal(v, f'{where}.{k}')}")
        return "{" + ", ".join(items) + "}"
    raise ValueError(f"{where}: {value!r} ({type(value).__name__}) is not a JSON-like value "
                     "(bool, null, number, string, list, mapping)")


KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
RESERVED_KWARGS = ("messages", "add_generation_prompt", "tools", "documents")  # what apply_chat_template passes
JINJA_WORDS = frozenset({"true", "false", "none", "True", "False", "None", "and", "or", "not", "in", "is", "if",
                         "else", "elif", "endif", "for", "endfor", "set", "endset", "macro", "endmacro", "block",
                         "endblock", "with", "endwith", "import", "from", "include", "extends", "call", "filter",
                         "raw", "recursive", "loop"})  # names Jinja cannot assign to (constants and keywords)


def with_template_kwargs(template: str, kwargs: dict[str, Any] | None) -> str:
    """``template`` with each of ``kwargs`` set at its top (the module docstring); unchanged without kwargs."""
    if not kwargs:
        return template
    lines = []
    for name, value in sorted(kwargs.items()):
        if not isinstance(name, str) or not KWARG_NAME.match(name) or name in RESERVED_KWARGS or name in JINJA_WORDS:
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name a kwarg can set "
                             f"(an identifier other than {list(RESERVED_KWARGS)})")
        lines.append(f"{{%- set {name} = {jinja_literal(value, f'chat_template_kwargs.{name}')} -%}}")
    return "".join(lines) + template


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and GENERATION_MARKER.search(template) is not None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(tokenizer, chat: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)


def marked_spans(tokenizer, chat: list[dict], end_of_turn: str | None) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the tokens the template's ``{% generation %}`` markers mark), one span
    per marked run, each extended over an ``end_of_turn`` right after it."""
    text = _render(tokenizer, chat, False)
    out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        tokenizer_kwargs={"return_offsets_mapping": True})
    spans: list[tuple[int, int]] = []
    for (start, end), marked in zip(out["offset_mapping"], out["assistant_masks"]):
        if not marked:
            continue
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    if end_of_turn:
        spans = [(s, e + len(end_of_turn)) if text.startswith(end_of_turn, e) else (s, e) for s, e in spans]
    return text, spans


def turn_spans(tokenizer, chat: list[dict], end_of_turn: str) -> tuple[str, list[tuple[int, int]]]:
    """(text, supervised character spans) of a template without markers, turn by turn (module docstring)."""
    text = _render(tokenizer, chat, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, chat[:i], True)
        alone = _render(tokenizer, chat[: i + 1], False)
        start = _common_prefix(prompt, alone)
        stop = alone.find(end_of_turn, start)
        if stop < 0:
            raise ValueError(f"the chat template does not close assistant turns with {end_of_turn!r} (the "
                             "tokenizer's eos_token); use a template that does, or one with {% generation %} markers")
        generated = alone[start: stop + len(end_of_turn)]
        begin = max(_common_prefix(text, prompt), spans[-1][1] if spans else 0)
        end = text.find(end_of_turn, begin)
        if end < 0:
            raise ValueError(f"assistant turn {i} has no {end_of_turn!r} in the rendered conversation")
        region = text[begin: end + len(end_of_turn)]
        matcher = difflib.SequenceMatcher(None, generated, region, autojunk=False)
        matched = [(begin + b, begin + b + size) for _, b, size in matcher.get_matching_blocks() if size]
        if not matched:
            raise ValueError(f"assistant turn {i}: the text the template generates for it ({generated[:40]!r}...) "
                             "does not appear in the rendered conversation")
        spans.extend(matched)
    return text, spans


def cut_last_answer(text: str, spans: list[tuple[int, int]], answer: str) -> list[tuple[int, int]]:
    """``spans`` with the last answer's spans ending where its content ``answer`` ends in ``text`` (a
    cut answer: the end-of-turn after it is the template's, not the model's)."""
    content = answer.strip()  # as a template that trims renders it
    if not content or not spans:
        return spans
    end = text.rfind(content, 0, spans[-1][1])
    if end < 0:
        raise ValueError("the last answer of a cut conversation does not appear in its rendering")
    end += len(content)
    return [(s, min(e, end)) for s, e in spans if s < end]
