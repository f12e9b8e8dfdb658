"""Crash injection for the trainer gang's tests: ``FaultPlan`` kills one worker once at a named point.

    plan = FaultPlan(point="after_report", step=4, marker=str(tmp_path / "crashed"))
    run_trainer_gang(spec, num_workers=2, storage_path=..., fault=plan, max_failures=1)

The points follow one optimizer step and its checkpoint (``actors/trainer.py``): micro-batches
run forward and backward (``mid_window``), the optimizer steps and rank 0 appends ``trained``
(``after_step_before_checkpoint``), every rank reports the checkpoint to Ray Train
(``after_report``), rank 0 appends ``checkpointed`` (``after_checkpointed``) and deletes the
features the checkpoint covers (``during_delete``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FAULT_POINTS = ("mid_window", "after_step_before_checkpoint", "after_report", "after_checkpointed", "during_delete")
RANK0_POINTS = ("after_report", "after_checkpointed", "during_delete")  # around rank 0's ledger writes
CRASH_EXIT_CODE = 87


@dataclass(frozen=True)
class FaultPlan:
    """Crash rank ``rank`` once at ``point`` of optimizer step ``step`` (1-based), for tests.

    - ``mid_window``: after ``after`` of the rank's micro-batches of step ``step`` ran forward
      and backward (``0 <= after < accumulation_steps``), before the optimizer step;
    - ``after_step_before_checkpoint``: right after the ``trained`` txn of step ``step``;
    - ``after_report``: at the checkpoint of step ``step``, once ``ray.train.report`` returned
      (the checkpoint is in storage) and before the ``checkpointed`` txn;
    - ``after_checkpointed``: right after the ``checkpointed`` txn of step ``step``, before any
      feature is deleted (Ray Train may not have registered the checkpoint yet);
    - ``during_delete``: at the checkpoint of step ``step``, after ``after`` feature keys were
      deleted and before the ``deleted`` txn.

    The last three crash rank 0, which writes the ledger. The crash is ``os._exit``; it happens
    only while ``marker`` does not exist and creates it first, so the group Ray Train restarts
    runs through.
    """

    point: str
    step: int
    marker: str
    rank: int = 0
    after: int = 1

    def __post_init__(self):
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; use one of {list(FAULT_POINTS)}")
        if self.step < 1 or self.rank < 0 or self.after < 0:
            raise ValueError(f"fault step must be >= 1 and rank, after >= 0; got {self}")
        if self.point in RANK0_POINTS and self.rank != 0:
            raise ValueError(f"{self.point} crashes rank 0 (the only rank that writes the ledger and deletes "
                             "features); use rank=0")

    def maybe_crash(self, point: str, step: int, rank: int) -> None:
        if (point, step, rank) != (self.point, self.step, self.rank) or os.path.exists(self.marker):
            return
        with open(self.marker, "w") as f:
            f.write(f"{point} step {step} rank {rank} pid {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        os._exit(CRASH_EXIT_CODE)


class MidWindowCrash:
    """The strategy, crashing before micro-batch ``fault.after`` of ``fault.step`` on ``fault.rank``."""

    def __init__(self, strategy, fault: FaultPlan, rank: int, accumulation: int):
        self._strategy, self._fault, self._rank, self._accumulation = strategy, fault, rank, accumulation

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def generator(self, step: int, micro_index: int) -> torch.Generator:
        if micro_index == self._rank * self._accumulation + self._fault.after:
            self._fault.maybe_crash("mid_window", step + 1, self._rank)
        return self._strategy.generator(step, micro_index)
