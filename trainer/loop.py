"""The training core every driver shares: one step, one metrics record, one checkpoint save/resume.

``TrainRun`` is one rank's training state around a ``TrainerCore``: the optimizer step counter,
tokens seen and metric records. ``specray train`` (``Trainer`` below) and the Ray trainer gang
(``actors/trainer.py``, which adds the ledger and Ray's checkpoint protocol) both train through
``TrainRun.train_step`` and checkpoint through ``TrainRun.save`` / ``TrainRun.load``, on any device.

A metrics record (every ``log_every`` steps, and whenever a driver flushes, e.g. before a
checkpoint) holds: step, loss, lr, grad norm, tokens, tokens/s, the step time split into data
wait, forward, backward and optimizer, and the strategy's metrics (``acc_by_pos``, ``tau_tf``,
…). A checkpoint holds the drafter, optimizer, scheduler, RNG, the loader position, tokens
seen and the record history, so N steps + resume + N steps equals 2N straight steps.

``Trainer.fit`` runs optimizer steps ``[start, total_steps)`` from a ``FeatureLoader``; rank 0
appends each record to ``<run_dir>/metrics.jsonl`` and writes a checkpoint every
``checkpoint_every`` steps (and at the end) under ``<run_dir>/checkpoints``.

Rank 0 hands each record to ``tracker`` (``trainer/tracking.py``: TensorBoard, W&B, MLflow)
as it is made, and the record of a checkpoint again once the hook added its fields.

A *checkpoint hook* (``CheckpointHook``) runs on rank 0 before each checkpoint is written and
adds its fields to that step's record: the drivers inject the live evaluation this way
(``serving/live_eval.py``: ``tau_live``, ``live_accept_by_pos``, …), so ``trainer/`` never
imports ``serving/``. The RNGs a step draws from are restored after the hook, so a run trains
the same steps with or without it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from specray.trainer.checkpoint import capture_rng_state, latest_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint
from specray.trainer.core import StepResult, TrainerCore
from specray.trainer.loader import FeatureLoader, TrainBatch
from specray.trainer.tracking import Tracker

CheckpointHook = Callable[["TrainRun"], dict]
"""``hook(run) -> fields`` added to the metrics record of ``run.step``, on rank 0 before the checkpoint."""


class MetricsWindow:
    """Step results summed between two metrics records."""

    def __init__(self):
        self.steps, self.loss, self.grad_norm, self.lr, self.tokens, self.wall = 0, 0.0, 0.0, 0.0, 0, 0.0
        self.seconds = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, result: StepResult, tokens: int, data_wait: float, wall: float) -> None:
        self.steps += 1
        self.loss += result.loss
        self.grad_norm += result.grad_norm
        self.lr = result.lr
        self.tokens += tokens
        self.wall += wall
        self.seconds["data"] += data_wait
        for key, value in result.seconds.items():
            self.seconds[key] += value
        for key, value in result.sums.items():
            self.sums[key] = self.sums.get(key, 0) + value

    def record(self, step: int, tokens_seen: int, strategy) -> dict:
        return {
            "step": step,
            "loss": self.loss / self.steps,
            "lr": self.lr,
            "grad_norm": self.grad_norm / self.steps,
            "tokens": tokens_seen,
            "tokens_per_s": self.tokens / self.wall,
            "step_seconds": {k: v / self.steps for k, v in self.seconds.items()},
            **strategy.summarize(self.sums),
        }


class TrainRun:
    """One rank's training: a ``TrainerCore`` plus step, tokens seen and metric records.

    ``extra`` is what every checkpoint carries besides the training state (algorithm, drafter
    config, contract, provenance: what an export needs). ``record_fields`` are added to every
    metrics record (the gang's ``attempt``). ``tracker`` (rank 0's, or None) logs every record.
    """

    def __init__(self, core: TrainerCore, *, log_every: int, extra: dict | None = None):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.core, self.log_every = core, log_every
        self.extra = extra or {}
        self.record_fields: dict = {}
        self.step = 0
        self.tokens_seen = 0
        self.records: list[dict] = []
        self.tracker: Tracker | None = None
        self._window = MetricsWindow()

    @property
    def is_main(self) -> bool:
        return self.core.rank == 0

    def train_step(self, batches: list[TrainBatch], *, data_wait: float = 0.0) -> dict | None:
        """One optimizer step over this rank's micro-batches; returns a record every ``log_every`` steps."""
        start = time.perf_counter()
        result = self.core.train_step(batches, self.step)
        tokens = sum(b.num_tokens for b in batches)
        if self.core.distributed:
            count = torch.tensor([tokens], dtype=torch.int64, device=self.core.device)
            dist.all_reduce(count)
            tokens = int(count)
        self.tokens_seen += tokens
        self.step += 1
        self._window.add(result, tokens, data_wait, data_wait + time.perf_counter() - start)
        return self.flush() if self.step % self.log_every == 0 else None

    def flush(self) -> dict | None:
        """A record of the steps since the last one (None if there were none)."""
        if not self._window.steps:
            return None
        record = {**self._window.record(self.step, self.tokens_seen, self.core.strategy), **self.record_fields}
        self.records.append(record)
        self._window = MetricsWindow()
        if self.tracker is not None:
            self.tracker.log(record)
        return record

    def checkpoint_record(self, hook: CheckpointHook | None) -> dict | None:
        """Before a checkpoint: the record of this step (flushed now if the last one is older), with
        ``hook(self)``'s fields added on rank 0 (the RNG state is restored after the hook). None
        when no step ran since the last record, or without a hook."""
        if hook is None:
            return None
        self.flush()
        record = self.records[-1] if self.records and self.records[-1]["step"] == self.step else None
        if record is not None and self.is_main:
            rng = capture_rng_state()
            try:
                record.update(hook(self))
            finally:
                restore_rng_state(rng)
            if self.tracker is not None:
                self.tracker.log(record)  # the hook's fields
        return record

    def close(self) -> None:
        """Close the tracker (its files complete, its runs finished)."""
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def save(self, directory: str | Path, *, loader_state: dict, keep_last: int | None, **extra) -> None:
        """Rank 0 writes the checkpoint of the current step under ``directory`` (other ranks: nothing)."""
        if not self.is_main:
            return
        core = self.core
        state = dict(self.extra, tokens_seen=self.tokens_seen, metrics_history=self.records,
                     last_metrics=self.records[-1] if self.records else None, **extra)
        save_checkpoint(directory, self.step, model=core.model.state_dict(), optimizer=core.optimizer.state_dict(),
                        scheduler=core.scheduler.state_dict(), loader=loader_state, rng=capture_rng_state(),
                        extra=state, keep_last=keep_last)

    def load(self, path: str | Path) -> dict:
        """Resume from a checkpoint (a step dir, or a directory's latest); returns the loader state."""
        ckpt = load_checkpoint(path)
        self.core.model.load_state_dict(ckpt.model)
        self.core.load_state_dict({"optimizer": ckpt.optimizer, "scheduler": ckpt.scheduler})
        restore_rng_state(ckpt.rng)
        self.step = ckpt.step
        self.tokens_seen = ckpt.extra.get("tokens_seen", 0)
        self.records = [r for r in ckpt.extra.get("metrics_history", []) if r["step"] <= ckpt.step]
        self._window = MetricsWindow()
        return ckpt.loader


class Trainer:
    """``specray train``'s loop: a ``TrainRun`` fed by a ``FeatureLoader``, logging and
    checkpointing under ``run_dir``; ``on_checkpoint`` (rank 0) adds fields to each checkpoint's record."""

    def __init__(
        self, run: TrainRun, loader: FeatureLoader, *, run_dir: str | Path, total_steps: int,
        checkpoint_every: int, keep_last: int | None = 2, on_checkpoint: CheckpointHook | None = None,
    ):
        if total_steps < 1 or checkpoint_every < 1:
            raise ValueError("total_steps and checkpoint_every must be >= 1")
        self.run, self.loader = run, loader
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.total_steps, self.checkpoint_every, self.keep_last = total_steps, checkpoint_every, keep_last
        self.on_checkpoint = on_checkpoint
        self.tau_live: float | None = None  # the latest checkpoint's, shown on the progress bar
        if self.run.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    @property
    def core(self) -> TrainerCore:
        return self.run.core

    @property
    def step(self) -> int:
        return self.run.step

    @property
    def extra(self) -> dict:
        return self.run.extra

    def resume(self) -> int:
        """Load the latest checkpoint if there is one; returns the step training continues from."""
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return 0
        self.loader.load_state_dict(self.run.load(path))
        if self.run.is_main and self.metrics_path.exists():  # drop records logged after that checkpoint
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if json.loads(line)["step"] <= self.run.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        return self.run.step

    def save(self) -> None:
        self.run.save(self.checkpoint_dir, loader_state=self.loader.state_dict(), keep_last=self.keep_last)
        if self.core.distributed:
            dist.barrier()

    def fit(self, *, progress: bool = True, until: int | None = None) -> list[dict]:
        """Train to ``total_steps`` (or stop early after step ``until``, e.g. to train in chunks)."""
        stop = min(self.total_steps, until if until is not None else self.total_steps)
        accum = self.core.settings.accumulation_steps
        records: list[dict] = []
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train",
                   disable=not (progress and self.run.is_main))
        while self.step < stop:
            start = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(accum)]
            record = self.run.train_step(batches, data_wait=time.perf_counter() - start)
            if record is None and self.step == self.total_steps:
                record = self.run.flush()
            checkpoint = self.step % self.checkpoint_every == 0 or self.step in (self.total_steps, stop)
            if checkpoint:  # the hook's fields join this step's record before it is logged and saved
                record = self.run.checkpoint_record(self.on_checkpoint) or record
            if record is not None:
                records.append(record)
                self._log(record, bar)
            if checkpoint:
                self.save()
            bar.update(1)
        bar.close()
        return records

    def _log(self, record: dict, bar) -> None:
        if self.run.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.tau_live = record.get("tau_live", self.tau_live)
            bar.set_postfix(progress_fields(record, self.tau_live))


def progress_fields(record: dict, tau_live: float | None) -> dict[str, str]:
    """A progress bar's postfix: loss, position-1 accuracy, tau_tf, tokens/s and the latest tau_live."""
    fields = {"loss": f"{record['loss']:.3f}", "acc1": f"{record['acc_by_pos'][0]:.2f}",
              "tau_tf": f"{record['tau_tf']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
    if tau_live is not None:
        fields["tau_live"] = f"{tau_live:.2f}"
    return fields
