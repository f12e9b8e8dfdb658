"""The pipeline driver's train stage: the progress bar fed by rank 0's records, and the gang's
metrics.jsonl / curves.png (the Ray path is tested in tests/actors/test_trainer_gang.py)."""

import json
from types import SimpleNamespace

from specray.pipeline.config import PipelineConfig, load_config
from specray.pipeline.jobs.pipeline import _train_summary, _TrainProgress


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "acc_by_pos": [0.1 * step, 0.05], "tau_tf": 1.2, "tokens_per_s": 900.0,
            **extra}


def test_the_bar_follows_the_records_and_keeps_the_latest_tau_live():
    with _TrainProgress(4, progress=True) as on_record:
        on_record(_record(1))
        on_record(_record(2))
        on_record(_record(2, tau_live=1.75, live_accept_by_pos=[0.5, 0.25]))
        on_record(_record(3))
        assert on_record.bar.n == 3
        postfix = on_record.bar.postfix
        assert "tau_live=1.75" in postfix and "loss=4.700" in postfix and "acc1=0.30" in postfix and "tok/s=900" in postfix


def test_the_gang_records_become_metrics_jsonl_and_curves(tmp_path):
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", [f"output.run_dir={tmp_path}"])
    metrics = [_record(1), _record(2, tau_live=1.5, live_accept_by_pos=[0.4, 0.1]), _record(3),
               _record(4, tau_live=1.75, live_accept_by_pos=[0.5, 0.25])]
    result = SimpleNamespace(metrics=metrics, step=4, checkpoint="ckpt", ledger_uri="ledger", attempts=[{}])
    summary = _train_summary(cfg, result)
    assert summary["tau_live"] == 1.75 and summary["live_accept_by_pos"] == [0.5, 0.25]
    lines = (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == metrics
    assert (tmp_path / "train" / "curves.png").stat().st_size > 10_000
