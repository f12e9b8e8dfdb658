"""TrainerCore: one optimizer step over ``accumulation_steps`` micro-batches (seed §7.5).

AdamW (no weight decay on norms), linear warmup then cosine decay to ``min_lr_ratio × lr``,
gradient accumulation (DDP ``no_sync`` on every micro-batch but the last), global-norm
clipping, optional bf16 autocast. Works on a bare module or under ``torch.distributed`` (gloo on
the CPU, NCCL on CUDA): the same code runs ``specray train`` and the Ray Train gang.

The device is the model's: its parameters, and so the AdamW state, live there, and each
micro-batch is copied there at the step (``TrainBatch.to``, ``non_blocking`` from the loader's
pinned memory on CUDA; on the CPU the batch is used as it is).

The strategy's random anchors come from a generator keyed by (step, global micro-batch index
``rank × accumulation + i``), so 1 rank × 2 accumulation steps and 2 ranks × 1 draw the same
anchors for the same samples, and a resumed step draws what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from specray.trainer.loader import TrainBatch


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 20
    total_steps: int = 200
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0
    accumulation_steps: int = 1
    bf16: bool = False


def lr_factor(step: int, settings: OptimSettings) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): warmup, then cosine."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    span = max(1, settings.total_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    loss: float  # mean over micro-batches (and ranks)
    grad_norm: float
    lr: float
    sums: dict[str, torch.Tensor]  # metric sums from the strategy, reduced over ranks
    seconds: dict[str, float] = field(default_factory=dict)  # forward / backward / optimizer


class TrainerCore:
    def __init__(self, model: nn.Module, strategy, model_config, settings: OptimSettings, *, rank: int = 0, world_size: int = 1):
        if settings.accumulation_steps < 1:
            raise ValueError("optim.accumulation_steps must be >= 1")
        self.model = model
        self.strategy = strategy
        self.model_config = model_config
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.distributed = world_size > 1
        params = [p for p in model.parameters() if p.requires_grad]
        self.device = params[0].device if params else torch.device("cpu")
        on_cuda = self.device.type == "cuda"
        self.train_model = (DistributedDataParallel(model, device_ids=[self.device] if on_cuda else None)
                            if self.distributed else model)
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=settings.betas, eps=settings.eps,
        )
        # reads self.settings at each step: a time-budgeted run may set total_steps during warmup
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, self.settings))
        self._params = params

    def train_step(self, micro_batches: list[TrainBatch], step: int) -> StepResult:
        accum = self.settings.accumulation_steps
        if len(micro_batches) != accum:
            raise ValueError(f"train_step needs {accum} micro-batches (accumulation_steps), got {len(micro_batches)}")
        self.model.train()
        seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        sums: dict[str, torch.Tensor] = {}
        total_loss = 0.0
        for i, batch in enumerate(micro_batches):
            batch = batch.to(self.device, non_blocking=True)
            sync = not self.distributed or i == accum - 1
            with contextlib.nullcontext() if sync else self.train_model.no_sync():
                start = time.perf_counter()
                autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.settings.bf16)
                with autocast:
                    generator = self.strategy.generator(step, self.rank * accum + i)
                    loss, metric = self.strategy.forward_loss(self.train_model, self.model_config, batch, generator)
                mid = time.perf_counter()
                (loss / accum).backward()
                seconds["forward"] += mid - start
                seconds["backward"] += time.perf_counter() - mid
            total_loss += float(loss.detach()) / accum
            for name, value in metric.items():
                sums[name] = sums.get(name, 0) + value
        start = time.perf_counter()
        clip = self.settings.grad_clip if self.settings.grad_clip else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, clip))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds["optimizer"] = time.perf_counter() - start
        if self.distributed:
            packed = torch.tensor([total_loss], dtype=torch.float64, device=self.device)  # NCCL reduces CUDA tensors
            dist.all_reduce(packed)
            total_loss = float(packed) / self.world_size
            for value in sums.values():
                dist.all_reduce(value)
        return StepResult(total_loss, grad_norm, lr, sums, seconds)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
