"""Experiment tracking: every metrics record of a training run to TensorBoard, W&B and MLflow.

A manifest turns trackers on in ``tracking`` (``train.tracking`` in a pipeline manifest), each
optional and off by default::

    tracking:
      tensorboard: runs/x/tensorboard                  # event files (tensorboardX)
      wandb: {project: specray, mode: offline}         # W&B; mode offline writes runs to sync later
      mlflow: {uri: file:runs/mlruns, experiment: x}   # any MLflow tracking URI; file: is a file store

Rank 0 logs (``trainer/loop.py::TrainRun`` hands each record to ``Tracker.log`` as it is made):
``specray train``, the Ray trainer gang and so the pipeline. Every number of a record is logged
at its ``step``, a list per position from 1 and a dict per key: ``loss``, ``lr``, ``grad_norm``,
``tokens``, ``tokens_per_s``, ``step_seconds/forward``, ``acc_by_pos/1`` …, ``tau_tf`` and, at a
checkpoint, ``tau_live`` and ``live_accept_by_pos/1`` … (the checkpoint's record comes again
with its live fields; only what is new is logged).

The packages are imported only when their tracker is configured; one that is not installed is
an error naming the field (``check_installed`` in the driver, and again on rank 0). An MLflow
``file:`` URI is a local file store: MLflow 3 opens one only with ``MLFLOW_ALLOW_FILE_STORE=true``,
which this module sets for such a URI (a store the manifest asks for by name).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FIX_INSTALL = "pip install -e '.[dev]' (it pins {package}) or pip install {package}"


def _absolute(path: str) -> str:
    return str(Path(path).resolve())


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WandbSettings(_Settings):
    project: str = Field(..., min_length=1, description="W&B project")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="offline: runs written under dir, to `wandb sync` later; online: sent to W&B as they run")
    dir: str | None = Field(None, description="where W&B writes its run files (None = the train run dir)")

    _dir = field_validator("dir")(classmethod(lambda cls, v: None if v is None else _absolute(v)))


class MlflowSettings(_Settings):
    uri: str = Field(..., min_length=1, description="MLflow tracking URI: file:PATH (a local file store), "
                                                    "http(s)://server, sqlite:///PATH, ...")
    experiment: str = Field("specray", min_length=1, description="MLflow experiment (created if missing)")

    @field_validator("uri")
    @classmethod
    def _absolute_file_store(cls, value: str) -> str:
        """A file store as an absolute file:// URI (rank 0 may run in another directory)."""
        if value.startswith("file:"):
            return Path(value.removeprefix("file://").removeprefix("file:")).resolve().as_uri()
        if ":" not in value:
            raise ValueError(f"{value!r} is not a tracking URI; for a local file store write file:{value}")
        return value


class TrackingSettings(_Settings):
    """The manifest's ``tracking`` section (``train.tracking`` in a pipeline): each tracker off when null.

    Local paths are made absolute when the manifest loads (the gang's rank 0 runs elsewhere)."""

    tensorboard: str | None = Field(None, description="TensorBoard log dir (tensorboardX event files)")
    wandb: WandbSettings | None = Field(None, description="Weights & Biases: {project, mode, dir}")
    mlflow: MlflowSettings | None = Field(None, description="MLflow: {uri, experiment}")

    _tensorboard = field_validator("tensorboard")(classmethod(lambda cls, v: None if v is None else _absolute(v)))

    @property
    def enabled(self) -> bool:
        return bool(self._needed())

    def check_installed(self) -> None:
        """Raise ``ImportError`` naming the field of each configured tracker whose package is missing."""
        for field, package, module in self._needed():
            if importlib.util.find_spec(module) is None:
                raise _missing(field, package)

    def _needed(self) -> list[tuple[str, str, str]]:
        needed = []
        if self.tensorboard is not None:
            needed.append(("tracking.tensorboard", "tensorboardX", "tensorboardX"))
        if self.wandb is not None:
            needed.append(("tracking.wandb", "wandb", "wandb"))
        if self.mlflow is not None:
            needed.append(("tracking.mlflow", "mlflow-skinny", "mlflow"))
        return needed


def _missing(field: str, package: str) -> ImportError:
    return ImportError(f"{field} is set (train.{field} in a pipeline manifest) but the {package} package is not "
                       f"installed here: {FIX_INSTALL.format(package=package)}, or set {field}=null")


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by name, without ``step``: ``{"acc_by_pos": [0.5, 0.2]}`` -> ``acc_by_pos/1``, ``/2``."""
    out: dict[str, float] = {}

    def walk(name: str, value) -> None:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{name}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for position, item in enumerate(value, start=1):
                walk(f"{name}/{position}", item)

    for key, value in record.items():
        if key != "step":
            walk(key, value)
    return out


class _TensorBoard:
    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise _missing("tracking.tensorboard", "tensorboardX") from None
        self.writer = SummaryWriter(logdir=logdir)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, settings: WandbSettings, *, run_name: str, config: dict, run_dir: str):
        try:
            import wandb
        except ImportError:
            raise _missing("tracking.wandb", "wandb") from None
        directory = settings.dir or run_dir
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=settings.project, mode=settings.mode, dir=directory, name=run_name,
                              config=config, reinit="create_new", settings=wandb.Settings(quiet=True, console="off"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, settings: MlflowSettings, *, run_name: str, config: dict):
        if settings.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # module docstring
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("tracking.mlflow", "mlflow-skinny") from None
        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=settings.uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_text(self.run_id, json.dumps(config, indent=2), "config.json")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Tracker:
    """The configured trackers of one run, fed with its metrics records (module docstring)."""

    def __init__(self, settings: TrackingSettings, *, run_name: str, config: dict, run_dir: str):
        self.backends: list = []
        if settings.tensorboard is not None:
            self.backends.append(_TensorBoard(settings.tensorboard))
        if settings.wandb is not None:
            self.backends.append(_Wandb(settings.wandb, run_name=run_name, config=config, run_dir=run_dir))
        if settings.mlflow is not None:
            self.backends.append(_Mlflow(settings.mlflow, run_name=run_name, config=config))
        self._step: int | None = None
        self._logged: set[str] = set()  # names logged at self._step

    def log(self, record: dict) -> None:
        """Log ``record``'s numbers at its step; a step's record logged before logs only its new names."""
        step = record["step"]
        if step != self._step:
            self._step, self._logged = step, set()
        values = {k: v for k, v in scalars(record).items() if k not in self._logged}
        if not values:
            return
        for backend in self.backends:
            backend.log(values, step)
        self._logged |= set(values)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


def open_tracker(settings: TrackingSettings | None, *, run_name: str, config: dict, run_dir: str) -> Tracker | None:
    """The run's tracker (None when no tracker is configured)."""
    if settings is None or not settings.enabled:
        return None
    return Tracker(settings, run_name=run_name, config=config, run_dir=run_dir)
