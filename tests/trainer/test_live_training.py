"""Live acceptance at the checkpoints of ``specray train`` (serving/live_eval.py as the trainer's checkpoint hook)."""

import json

import pytest

from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.train import run_training


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=cap", "target.name=debug", "data.max_samples=8", "data.max_length=128", "capture.algorithm=dflash",
        f"output.run_dir={root / 'cap'}", "capture.dtype=float32",
    ])
    run_capture(cfg, progress=False)
    return root / "cap" / "manifest.parquet"


def _train(manifest, run_dir, *overrides):
    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        "target.name=debug", f"data.manifest={manifest}", f"output.run_dir={run_dir}", "optim.total_steps=4",
        "optim.warmup_steps=1", "trainer.checkpoint_every=3", "trainer.log_every=2", "objective.num_anchors=4",
        "live_eval.num_prompts=2", "live_eval.max_tokens=6", "live_eval.batch_size=2", *overrides,
    ])
    summary = run_training(cfg, progress=False)
    return summary, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_checkpoint_records_carry_live_acceptance_and_training_is_unchanged(manifest, tmp_path):
    summary, records = _train(manifest, tmp_path / "on")
    # checkpoints at steps 3 (not a log step: flushed for the hook) and 4 (the end)
    assert [r["step"] for r in records] == [2, 3, 4]
    live = {r["step"]: r for r in records if "tau_live" in r}
    assert sorted(live) == [3, 4]
    for r in live.values():
        assert 1.0 <= r["tau_live"] <= 8.0
        assert len(r["live_accept_by_pos"]) == 7  # block 8: the worker's largest round verifies 7 drafts
        assert all(0.0 <= a <= 1.0 for a in r["live_accept_by_pos"])
        assert r["live_prompts"] == 2 and 0 < r["live_tokens"] <= 12 and r["live_rounds"] > 0
    assert "tau_live" in summary.table()
    assert (tmp_path / "on" / "curves.png").stat().st_size > 10_000
    checkpoint = json.loads((tmp_path / "on" / "train.json").read_text())["final"]
    assert checkpoint["tau_live"] == live[4]["tau_live"]

    _, plain = _train(manifest, tmp_path / "off", "live_eval.enabled=false", "trainer.log_every=1")
    assert [r["step"] for r in plain] == [1, 2, 3, 4] and not any("tau_live" in r for r in plain)
    # the hook restores every RNG a step draws from: the same steps train the same with and without it
    loss = [r["loss"] for r in plain]
    assert [r["loss"] for r in records] == [pytest.approx((loss[0] + loss[1]) / 2, rel=1e-12), loss[2], loss[3]]
    assert (tmp_path / "off" / "curves.png").exists()
