"""The training loop: loader → TrainerCore → metrics, checkpoints, exact resume.

``Trainer.fit`` runs optimizer steps ``[start, total_steps)``. Every ``log_every`` steps rank 0
appends a record to ``<run_dir>/metrics.jsonl``: loss, lr, grad norm, tokens/s, per-position
teacher-forced accuracy and CE, ``tau_tf``, and the step time split into data wait, forward,
backward and optimizer. Every ``checkpoint_every`` steps (and at the end) rank 0 writes a
checkpoint with the drafter, optimizer, scheduler, RNG and loader position; ``resume`` loads
the latest one, so N steps + resume + N steps equals 2N straight steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from specray.trainer.checkpoint import capture_rng_state, latest_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint
from specray.trainer.core import TrainerCore
from specray.trainer.loader import FeatureLoader


class Trainer:
    def __init__(
        self, core: TrainerCore, loader: FeatureLoader, *, run_dir: str | Path, total_steps: int,
        checkpoint_every: int, log_every: int, keep_last: int | None = 2, extra: dict | None = None,
    ):
        if total_steps < 1 or checkpoint_every < 1 or log_every < 1:
            raise ValueError("total_steps, checkpoint_every and log_every must be >= 1")
        self.core, self.loader = core, loader
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.total_steps, self.checkpoint_every, self.log_every = total_steps, checkpoint_every, log_every
        self.keep_last = keep_last
        self.extra = extra or {}
        self.step = 0
        self.tokens_seen = 0
        self.is_main = core.rank == 0
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def resume(self) -> int:
        """Load the latest checkpoint if there is one; returns the step training continues from."""
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return 0
        ckpt = load_checkpoint(path)
        self.core.model.load_state_dict(ckpt.model)
        self.core.load_state_dict({"optimizer": ckpt.optimizer, "scheduler": ckpt.scheduler})
        self.loader.load_state_dict(ckpt.loader)
        restore_rng_state(ckpt.rng)
        self.step = ckpt.step
        self.tokens_seen = ckpt.extra.get("tokens_seen", 0)
        if self.is_main and self.metrics_path.exists():  # drop records logged after that checkpoint
            kept = [line for line in self.metrics_path.read_text().splitlines() if json.loads(line)["step"] <= self.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        return self.step

    def save(self) -> None:
        if self.is_main:
            save_checkpoint(
                self.checkpoint_dir, self.step, model=self.core.model.state_dict(),
                optimizer=self.core.optimizer.state_dict(), scheduler=self.core.scheduler.state_dict(),
                loader=self.loader.state_dict(), rng=capture_rng_state(),
                extra=dict(self.extra, tokens_seen=self.tokens_seen), keep_last=self.keep_last,
            )
        if self.core.distributed:
            dist.barrier()

    def fit(self, *, progress: bool = True, until: int | None = None) -> list[dict]:
        """Train to ``total_steps`` (or stop early after step ``until``, e.g. to train in chunks)."""
        stop = min(self.total_steps, until if until is not None else self.total_steps)
        accum = self.core.settings.accumulation_steps
        records: list[dict] = []
        window: dict = {}
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train", disable=not (progress and self.is_main))
        while self.step < stop:
            start = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(accum)]
            data_wait = time.perf_counter() - start
            result = self.core.train_step(batches, self.step)
            tokens = sum(b.num_tokens for b in batches)
            if self.core.distributed:
                count = torch.tensor([tokens], dtype=torch.int64)
                dist.all_reduce(count)
                tokens = int(count)
            self.tokens_seen += tokens
            self.step += 1
            _accumulate(window, result, tokens, data_wait, time.perf_counter() - start)
            if self.step % self.log_every == 0 or self.step == self.total_steps:
                record = self._record(window)
                records.append(record)
                window = {}
                if self.is_main:
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['acc_by_pos'][0]:.2f}", tau=f"{record['tau_tf']:.2f}")
            if self.step % self.checkpoint_every == 0 or self.step in (self.total_steps, stop):
                self.save()
            bar.update(1)
        bar.close()
        return records

    def _record(self, window: dict) -> dict:
        steps = window["steps"]
        metrics = self.core.strategy.summarize(window["sums"])
        seconds = {k: v / steps for k, v in window["seconds"].items()}
        return {
            "step": self.step,
            "loss": window["loss"] / steps,
            "lr": window["lr"],
            "grad_norm": window["grad_norm"] / steps,
            "tokens": self.tokens_seen,
            "tokens_per_s": window["tokens"] / window["wall"],
            "step_seconds": seconds,
            **metrics,
        }


def _accumulate(window: dict, result, tokens: int, data_wait: float, wall: float) -> None:
    window["steps"] = window.get("steps", 0) + 1
    window["loss"] = window.get("loss", 0.0) + result.loss
    window["grad_norm"] = window.get("grad_norm", 0.0) + result.grad_norm
    window["lr"] = result.lr
    window["tokens"] = window.get("tokens", 0) + tokens
    window["wall"] = window.get("wall", 0.0) + wall
    seconds = window.setdefault("seconds", {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0})
    seconds["data"] += data_wait
    for key, value in result.seconds.items():
        seconds[key] += value
    sums = window.setdefault("sums", {})
    for key, value in result.sums.items():
        sums[key] = sums.get(key, 0) + value
