"""Experiment tracking with the real packages offline: ``specray train`` logs every metric of every
record (live fields of a checkpoint's record included) to a TensorBoard event file, a W&B offline run
and an MLflow file store; a tracker whose package is missing is an error naming the field.
(The gang: tests/actors/test_trainer_gang.py; the pipeline: tests/pipeline/test_pipeline.py.)"""

import builtins
import json
import os

import pytest

from specray.pipeline.config import ConfigError, TrainJobConfig, load_config
from specray.pipeline.jobs.train import run_training
from specray.trainer.tracking import MlflowSettings, Tracker, TrackingSettings, WandbSettings, scalars

from tracking_support import mlflow_metrics, tensorboard_scalars, wandb_history


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from specray.pipeline.config import CaptureJobConfig
    from specray.pipeline.jobs.capture import run_capture

    root = tmp_path_factory.mktemp("features")
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=cap", "target.name=debug", "data.max_samples=8", "data.max_length=128", f"output.run_dir={root / 'cap'}",
        "capture.dtype=float32",
    ])
    run_capture(cfg, progress=False)
    return root / "cap" / "manifest.parquet"


def tracking_overrides(root, prefix: str = "tracking") -> list[str]:
    """Every tracker on, offline, under ``root`` (``prefix``: ``train.tracking`` in a pipeline manifest)."""
    return [f"{prefix}.tensorboard={root / 'tb'}", f"{prefix}.wandb.project=specray-test", f"{prefix}.wandb.mode=offline",
            f"{prefix}.wandb.dir={root / 'wandb'}", f"{prefix}.mlflow.uri=file:{root / 'mlruns'}",
            f"{prefix}.mlflow.experiment=tracking-test"]


def assert_tracked(root, records: list[dict]) -> None:
    """Each tracker holds every number of every record at its step (lists by position from 1)."""
    expected = {}
    for record in records:
        for name, value in scalars(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    for name in ("loss", "lr", "tokens_per_s", "tau_tf", "acc_by_pos/1", "tau_live", "live_accept_by_pos/1"):
        assert name in expected, f"the records lack {name}: nothing to check it against"
    found = {"tensorboard": tensorboard_scalars(root / "tb"), "wandb": wandb_history(root / "wandb"),
             "mlflow": mlflow_metrics((root / "mlruns").as_uri(), "tracking-test")}
    for tracker, logged in found.items():
        assert set(logged) == set(expected), (tracker, set(expected) ^ set(logged))
        for name, by_step in expected.items():
            assert logged[name].keys() == by_step.keys(), (tracker, name)
            for step, value in by_step.items():
                assert logged[name][step] == pytest.approx(value, rel=1e-6), (tracker, name, step)


def test_specray_train_logs_every_record_to_every_tracker(manifest, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        "target.name=debug", f"data.manifest={manifest}", f"output.run_dir={run_dir}", "optim.total_steps=4",
        "optim.warmup_steps=1", "trainer.checkpoint_every=2", "trainer.log_every=1", "objective.num_anchors=4",
        "live_eval.num_prompts=2", "live_eval.max_tokens=6", *tracking_overrides(tmp_path),
    ])
    run_training(cfg, progress=False)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "tau_live" in r] == [2, 4]  # the checkpoints' records
    assert_tracked(tmp_path, records)


def test_scalars_flattens_lists_by_position_and_dicts_by_key():
    record = {"step": 3, "loss": 1.5, "acc_by_pos": [0.5, 0.25], "step_seconds": {"forward": 0.1},
              "attempt": 0, "live_prompts": 2, "note": "text", "flag": True, "missing": None}
    assert scalars(record) == {"loss": 1.5, "acc_by_pos/1": 0.5, "acc_by_pos/2": 0.25, "step_seconds/forward": 0.1,
                               "attempt": 0.0, "live_prompts": 2.0}


def test_a_records_second_logging_adds_only_its_new_fields(tmp_path):
    tracker = Tracker(TrackingSettings(tensorboard=str(tmp_path / "tb")), run_name="r", config={}, run_dir=str(tmp_path))
    logged = []
    tracker.backends[0].log = lambda values, step: logged.append((step, sorted(values)))
    record = {"step": 2, "loss": 1.0}
    tracker.log(record)
    record["tau_live"] = 2.5  # the checkpoint hook's fields
    tracker.log(record)
    tracker.log({"step": 3, "loss": 0.9})
    assert logged == [(2, ["loss"]), (2, ["tau_live"]), (3, ["loss"])]


@pytest.mark.parametrize("field, module, package", [
    ("tensorboard", "tensorboardX", "tensorboardX"), ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow-skinny"),
])
def test_a_configured_tracker_that_is_not_installed_is_an_error_naming_its_field(tmp_path, monkeypatch, field,
                                                                                  module, package):
    settings = TrackingSettings(**{"tensorboard": {"tensorboard": str(tmp_path)},
                                   "wandb": {"wandb": WandbSettings(project="p", dir=str(tmp_path))},
                                   "mlflow": {"mlflow": MlflowSettings(uri=(tmp_path / "m").as_uri())}}[field])
    error = rf"tracking\.{field} is set \(train\.tracking\.{field} in a pipeline manifest\) but the {package} " \
            rf"package is not installed here: pip install .*{package}.*, or set tracking\.{field}=null"
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    with pytest.raises(ImportError, match=error):
        settings.check_installed()  # in the driver, before anything runs
    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(ImportError, match=error):
        Tracker(settings, run_name="r", config={}, run_dir=str(tmp_path))  # on rank 0


def test_tracking_config_errors_name_the_field(tmp_path):
    base = ["target.name=debug", "data.manifest=m.parquet"]
    with pytest.raises(ConfigError, match=r"tracking\.wandb\.project: required and missing"):
        load_config(TrainJobConfig, None, [*base, "tracking.wandb.mode=offline"])
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.uri: 'mlruns' is not a tracking URI; for a local file "
                                          r"store write file:mlruns"):
        load_config(TrainJobConfig, None, [*base, "tracking.mlflow.uri=mlruns"])
    with pytest.raises(ConfigError, match=r"tracking\.tensorbord"):
        load_config(TrainJobConfig, None, [*base, "tracking.tensorbord=tb"])
    spec = load_config(TrainJobConfig, None, [*base, "tracking.tensorboard=tb", "tracking.mlflow.uri=file:ml"]).train_spec()
    assert spec.tracking == TrackingSettings(tensorboard=os.path.abspath("tb"),
                                             mlflow=MlflowSettings(uri=f"file://{os.path.abspath('ml')}"))
    assert load_config(TrainJobConfig, None, base).train_spec().tracking is None  # off by default
