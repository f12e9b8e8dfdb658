"""Train→serve fidelity (pipeline/bench/fidelity.py) for every registered algorithm on the debug target.

Under greedy decoding a served round's first draft and the teacher-forced position-1 prediction
at that round's anchor answer the same question, so on the target's own greedy answers they must
agree round by round — exactly, with fp32 features. A mismatch is a train/serve defect: the
drafter's context rows, positions or inputs differ between the training strategy and the worker.
"""

from dataclasses import replace

import pytest
import torch
from conformance_kit import MAX_NEW, PROMPTS, VOCAB_OF_KIND, export

from specray.pipeline.bench.fidelity import live_summary, position1_by_round, teacher_forced, trace_live
from specray.serving.engine import Engine
from specray.serving.requests import encode_prompt


@pytest.fixture
def traced(debug_target, debug_drafter, algorithm, tmp_path, monkeypatch):
    """An export of the algorithm's drafter over the target's 8 most frequent greedy tokens (its
    drafts accepted often and dependent on the context) and its greedy traces over ``PROMPTS``."""
    monkeypatch.setitem(VOCAB_OF_KIND, "eight_token", 8)
    drafter_dir = export(debug_drafter(algorithm, "eight_token"), debug_target, tmp_path / "export")
    engine = Engine(debug_target, drafter_dir, max_batch=1, speculation="static", max_waiting=None)
    prompts = [encode_prompt(debug_target.tokenizer, p) for p in PROMPTS]
    return drafter_dir, trace_live(engine, prompts, max_tokens=MAX_NEW)


def test_teacher_forced_position_1_equals_live_acceptance(debug_target, debug_greedy, traced):
    drafter_dir, traces = traced
    for trace in traces:  # the traces are the target's own greedy answers
        assert trace.output_ids[: len(debug_greedy[tuple(trace.prompt_ids)])] == debug_greedy[tuple(trace.prompt_ids)]
    depth = max(n for t in traces for n in t.num_drafts)
    live = live_summary(traces, depth)
    assert live["rounds"] >= 20 and 0.03 < live["pos1"] < 1.0  # rounds that accept and rounds that reject
    at_live = teacher_forced(debug_target, drafter_dir, traces, dtype=torch.float32, at_live=True)
    assert at_live["blocks"] == live["rounds"]
    assert round(at_live["pos1"] * live["rounds"]) == round(live["pos1"] * live["rounds"])
    if len(at_live["acc_by_pos"]) == depth:  # the same chain length: the accepted prefixes agree too
        assert at_live["tau_tf"] == pytest.approx(live["tau"], abs=1e-9)
    by_round = position1_by_round(debug_target, drafter_dir, traces)
    assert by_round == [[r >= 1 for r in t.accepted] for t in traces]  # round by round


def test_anchors_off_by_one_position_break_the_equality(debug_target, traced):
    """The control: teacher-forced blocks one position after each live anchor (the seed's
    one-position-shift pitfall) are other events, and round by round they no longer match."""
    drafter_dir, traces = traced
    kept = [[i for i, a in enumerate(t.anchors) if a + 2 < len(t.prompt_ids) + len(t.output_ids)] for t in traces]
    shifted = [replace(t, anchors=[t.anchors[i] + 1 for i in keep]) for t, keep in zip(traces, kept)]
    moved = position1_by_round(debug_target, drafter_dir, shifted)
    assert sum(map(len, moved)) >= 20
    assert moved != [[t.accepted[i] >= 1 for i in keep] for t, keep in zip(traces, kept)]
