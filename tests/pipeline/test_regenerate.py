import json

import pytest

from specray.capture.data import load_conversations
from specray.pipeline.cli import main


def test_regenerate_writes_capturable_conversations_and_resumes(tmp_path, capsys):
    out = tmp_path / "self.jsonl"
    args = ["regenerate", "--target", "debug", "--out", str(out), "--num", "3", "--max-tokens", "5", "-q"]
    assert main(args) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in lines)
    convs = list(load_conversations(f"jsonl:{out}"))  # what capture reads
    assert [c.id for c in convs] == [r["id"] for r in lines]
    assert main(args + ["--num", "4"]) == 0  # resumes: only the new one is generated
    assert len(out.read_text().splitlines()) == 4
    assert "already there 3" in capsys.readouterr().out


def _jsonl(path, conversations):
    path.write_text("".join(json.dumps({"id": cid, "messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"
                            for cid, turns in conversations))
    return f"jsonl:{path}"


def test_eval_prompts_planted_in_the_training_data_are_excluded(tmp_path, capsys):
    """An MT-Bench question copied into the training data, one quoted inside a longer request, a
    HumanEval stub, and an MT-Bench second turn: all dropped; the other conversations are kept."""
    from specray.capture.data import eval_prompts

    mtbench = dict(eval_prompts("mtbench"))
    humaneval = dict(eval_prompts("humaneval"))
    stub = next(iter(humaneval.values()))
    dataset = _jsonl(tmp_path / "train.jsonl", [
        ("keep-1", [("user", "What is a good name for a cat?"), ("assistant", "Whiskers.")]),
        ("planted", [("user", mtbench["mtbench-81-turn1"]), ("assistant", "Aloha.")]),
        ("quoted", [("user", "My teacher asked: " + mtbench["mtbench-101-turn1"].upper() + " What do I say?"),
                    ("assistant", "...")]),
        ("stub", [("user", "Fix this:\n" + stub), ("assistant", "...")]),
        ("second-turn", [("user", "Write a loop in C."), ("assistant", "for (;;) {}"),
                         ("user", mtbench["mtbench-121-turn2"]), ("assistant", "Yes.")]),
        ("keep-2", [("user", "Summarise the plot of Hamlet in two lines."), ("assistant", "...")]),
    ])
    out = tmp_path / "self.jsonl"
    assert main(["regenerate", "--target", "debug", "--dataset", dataset, "--out", str(out), "--num", "6",
                 "--max-tokens", "4", "--max-turns", "2", "-q"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["keep-1", "keep-2"]
    printed = capsys.readouterr().out
    for train_id, eval_id in (("planted", "mtbench-81-turn1"), ("quoted", "mtbench-101-turn1"),
                              ("second-turn", "mtbench-121-turn2")):
        assert f"excluded {train_id}: overlaps {eval_id}" in printed
    assert "excluded stub: overlaps humaneval-" in printed
    assert "excluded 4 overlapping 324 eval prompts" in printed
    out.unlink()  # the check is what drops them: without it every conversation is answered
    assert main(["regenerate", "--target", "debug", "--dataset", dataset, "--out", str(out), "--num", "6",
                 "--max-tokens", "4", "--exclude", "none", "-q"]) == 0
    assert len(out.read_text().splitlines()) == 6


def test_a_prompt_kept_out_by_its_n_gram_or_whole_but_not_by_a_few_shared_words():
    from specray.capture.contamination import EvalOverlap

    overlap = EvalOverlap([], extra=[("long", " ".join(f"w{i}" for i in range(20))), ("short", "Can you parallelize it?")])
    assert overlap.match("intro " + " ".join(f"W{i}" for i in range(3, 16)) + " outro") == "long"  # 13 words in a row
    assert overlap.match(" ".join(f"w{i}" for i in range(3, 15))) is None  # 12 words
    assert overlap.match("Now: can you PARALLELIZE it, please") == "short"
    assert overlap.match("can you parallelize this") is None


def test_a_mix_takes_each_kind_up_to_its_share(tmp_path):
    from specray.pipeline.jobs.regenerate import select_prompts

    rows = [(f"chat-{i}", [("user", f"Tell me about the history of town {i}."), ("assistant", ".")]) for i in range(8)]
    rows += [(f"code-{i}", [("user", f"Write a python function number {i}."), ("assistant", ".")]) for i in range(8)]
    rows += [(f"math-{i}", [("user", f"Solve {i} + 3 = x."), ("assistant", ".")]) for i in range(2)]
    dataset = _jsonl(tmp_path / "mixed.jsonl", rows)
    prompts, seen = select_prompts(dataset, num=8, mix={"chat": 0.25, "code": 0.25, "reasoning": 0.5})
    assert seen["kinds"] == {"chat": 2, "code": 2, "reasoning": 2} and seen["short_of"] == {"reasoning": 2}
    assert [p.id for p in prompts] == ["chat-0", "chat-1", "code-0", "code-1", "math-0", "math-1"]


def test_a_line_torn_by_a_kill_is_answered_again(tmp_path):
    from specray.pipeline.jobs.regenerate import answered

    out = tmp_path / "self.jsonl"
    out.write_text(json.dumps({"id": "a", "messages": []}) + "\n" + '{"id": "b", "mess')
    assert answered(out) == {"a"}
    assert out.read_text().endswith("[]}\n")  # the torn line is cut off
    out.write_text("not json\n" + json.dumps({"id": "a"}) + "\n")
    with pytest.raises(ValueError, match="not a regenerated conversation"):
        answered(out)


def test_answers_are_the_targets_greedy_answers_ending_at_its_end_of_turn_or_marked_cut(tmp_path):
    """Each answer, its earlier answers in context, is what transformers' greedy ``generate`` gives:
    up to the end-of-turn token (finish_reason stop), or max_tokens tokens (length, the conversation
    ends there)."""
    import torch

    from specray.capture.target import load_target

    out, max_tokens = tmp_path / "self.jsonl", 48
    assert main(["regenerate", "--out", str(out), "--num", "6", "--max-tokens", str(max_tokens), "--max-turns", "2",
                 "--max-prompt-tokens", "384", "--batch-size", "4", "-q"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    target = load_target()
    tok, eot = target.tokenizer, target.tokenizer.eos_token_id
    reasons = set()
    for record in records:
        messages = record["messages"]
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(answers) == record["turns"] >= 1
        for n, i in enumerate(answers):
            prompt = tok.apply_chat_template(messages[:i], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
            with torch.no_grad():
                generated = target.model.generate(prompt, max_new_tokens=max_tokens, do_sample=False,
                                                  eos_token_id=eot, pad_token_id=eot)[0, prompt.shape[1]:].tolist()
            last = n == len(answers) - 1
            reason = "stop" if generated[-1] == eot else "length"
            assert reason == (record["finish_reason"] if last else "stop"), record["id"]
            text = tok.decode(generated[:-1] if reason == "stop" else generated)
            assert messages[i]["content"] == text, record["id"]
            reasons.add(reason)
    assert reasons == {"stop", "length"}  # both endings are checked
    assert any(r["turns"] == 2 for r in records)
