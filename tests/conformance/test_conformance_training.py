"""Training conformance of every registered train strategy, on debug features captured under its
contract and its quickstart manifest (``conformance_kit.debug_run``):

- a seeded run reproduces the golden losses (``tests/trainer/golden/<algorithm>_debug_loss.json``;
  ``SPECRAY_UPDATE_GOLDEN=1`` rewrites them, keeping the file's overrides);
- N steps, a resume from the checkpoint and N more equal 2N straight steps (losses and weights);
- 2 DDP ranks (gloo) equal 1 rank with 2 accumulation steps after the same steps.
"""

import json
import os

import pytest
import torch
from conformance_kit import GOLDEN_STEPS, UPDATE_GOLDEN, final_weights, golden_path, losses, read_golden, records

from specray.pipeline.jobs.train import run_training
from specray.trainer.assembly import build_trainer


def test_seeded_debug_run_reproduces_the_golden_loss(debug_runs, algorithm):
    golden = read_golden(algorithm)
    _, straight = debug_runs(algorithm)
    got = losses(straight)
    if os.environ.get(UPDATE_GOLDEN):
        golden_path(algorithm).write_text(json.dumps({**golden, "losses": got}, indent=1) + "\n")
        golden = read_golden(algorithm)
    assert len(got) == len(golden["losses"]) == GOLDEN_STEPS
    for step, (loss, want) in enumerate(zip(got, golden["losses"]), 1):
        assert loss == pytest.approx(want, rel=1e-4, abs=1e-5), f"step {step}"
    assert got[-1] < got[0]
    last = records(straight)[-1]
    assert len(last["acc_by_pos"]) > 0 and last["tau_tf"] >= 1.0  # the strategy's summary (trainer/strategies)
    assert (straight / "curves.png").stat().st_size > 10_000


def test_resume_equals_a_straight_run(debug_runs, algorithm, tmp_path):
    run, straight = debug_runs(algorithm)
    spec = run.config(tmp_path / "resumed").train_spec()
    first = build_trainer(spec)
    first.fit(progress=False, until=GOLDEN_STEPS // 2)  # "crash" after the checkpoint of step N
    first.loader.close()
    resumed = build_trainer(spec)
    assert resumed.resume() == GOLDEN_STEPS // 2
    assert (tmp_path / "resumed" / "checkpoints" / f"step-{GOLDEN_STEPS // 2:08d}").is_dir()
    resumed.fit(progress=False)
    resumed.loader.close()
    assert losses(tmp_path / "resumed") == losses(straight)
    a, b = final_weights(straight), final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_ddp_ranks_equal_one_rank_with_accumulation(debug_runs, algorithm, tmp_path):
    run, _ = debug_runs(algorithm)
    steps = ["optim.total_steps=3", "optim.micro_batch_size=1"]
    run_training(run.config(tmp_path / "one", *steps, "optim.accumulation_steps=2"), progress=False)
    run_training(run.config(tmp_path / "two", *steps, "trainer.world_size=2"), progress=False)
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-6, msg=name)
    # AdamW and clipping hide a gradient's scale from the weights; the records do not
    for a, b in zip(records(tmp_path / "one"), records(tmp_path / "two"), strict=True):
        assert (a["loss"], a["grad_norm"], a["tokens"]) == pytest.approx((b["loss"], b["grad_norm"], b["tokens"]),
                                                                         rel=1e-5), a["step"]
