"""Where a new attempt of the trainer gang resumes from, and what it must do before it trains.

Rank 0 of every worker-group start (``actors/trainer.py``, **Recovery**) runs an
``AttemptPlanner`` in two halves, so that nothing is written before every rank has checked the
checkpoint it is about to load:

    resume = planner.choose(ray.train.get_checkpoint())     # reads only
    check_position(local_checkpoint_dir, resume)             # every rank, before loading it
    attempt = planner.write(resume, world_size=2, quantum=4) # ledger txns, deletions, broker rewind

A checkpoint directory is named ``checkpoint-aAAA-sSSSSSSSS`` after the attempt and step that
wrote it, and holds the ledger position it was saved at (``extra["ledger"]``: ledger uri,
attempt, step). The name is only a claim: ``check_position`` compares the recorded position and
step with the resume point and refuses a directory that was replaced or belongs to another
ledger (``CheckpointMismatchError``) instead of training on from a model the ledger does not
describe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from specray.actors.broker import StreamFailedError
from specray.capture.store import BlobStore
from specray.trainer.checkpoint import STATE_FILE, latest_checkpoint
from specray.trainer.ledger import Ledger, LedgerState, RecoveryPlan, recovery_plan

_CHECKPOINT_NAME = re.compile(r"checkpoint-a(\d+)-s(\d+)/?$")


class FeaturesLostError(RuntimeError):
    """Samples the resumed model has not trained on have no readable features any more."""


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's recorded ledger position is not the one its name and the ledger claim."""


def checkpoint_name(attempt: int, step: int) -> str:
    return f"checkpoint-a{attempt:03d}-s{step:08d}"


def parse_checkpoint_name(location: str) -> tuple[int, int]:
    match = _CHECKPOINT_NAME.search(location)
    if match is None:
        raise ValueError(f"{location} is not a trainer-gang checkpoint (checkpoint-aAAA-sSSSSSSSS); "
                         "resume from a checkpoint run_trainer_gang wrote")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Resume:
    """The resume point of an attempt (all None: from scratch)."""

    parent: tuple[int, int] | None  # (attempt, step) of the checkpoint
    location: str | None  # its directory, <run>/checkpoint-aAAA-sSSSSSSSS
    ledger_uri: str | None  # the ledger it must have been saved under (None: resume_from, any ledger)


def check_position(directory: str | Path, resume: Resume) -> None:
    """Raise ``CheckpointMismatchError`` unless ``directory`` holds ``resume.parent`` of ``resume.ledger_uri``.

    Reads only the small ``extra`` of ``state.pt`` (memory-mapped), before any rank loads it.
    """
    attempt, step = resume.parent
    path = latest_checkpoint(directory)
    if path is None:
        raise CheckpointMismatchError(f"checkpoint {resume.location} holds no training checkpoint (no step-* "
                                      "directory with model and state); resume from a checkpoint this gang wrote")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    recorded = state["extra"].get("ledger")
    expected = {"uri": resume.ledger_uri or (recorded or {}).get("uri"), "attempt": attempt, "step": step}
    if state["step"] == step and recorded == expected:
        return
    raise CheckpointMismatchError(
        f"checkpoint {resume.location} is resumed as attempt {attempt} step {step} of the ledger "
        f"{resume.ledger_uri or '(any)'}, but it holds step {state['step']} saved at ledger position {recorded}: "
        "the directory was replaced, or it belongs to another run or ledger. Resume with the ledger it was trained "
        "under (ledger_uri), or start a new run (a new name or storage_path)"
    )


class AttemptPlanner:
    """Rank 0's side of an attempt start: choose the resume point, then record it (module docstring)."""

    def __init__(self, ledger: Ledger, *, run_uri: str, resume_from: str | None, broker=None,
                 store: BlobStore | None = None, store_uri: str | None = None):
        self.ledger, self.run_uri, self.resume_from = ledger, run_uri, resume_from
        self.broker, self.store, self.store_uri = broker, store, store_uri  # online: the stream
        self._state: LedgerState | None = None
        self._plan: RecoveryPlan | None = None

    def _resume_point(self, state: LedgerState, ray_checkpoint) -> Resume:
        """The newest of Ray's checkpoint and this run's ledger checkpoints, else ``resume_from``, else the
        ledger's last checkpoint (the stream's model), else from scratch."""
        candidates = [(c["attempt"], c["step"], c["location"]) for c in state.checkpoints
                      if state.attempts.get(c["attempt"], {}).get("run") == self.run_uri]
        if ray_checkpoint is not None:
            location = f"{self.run_uri}/{Path(ray_checkpoint.path).name}"
            candidates.append((*parse_checkpoint_name(location), location))
        if not candidates and self.resume_from:
            attempt, step = parse_checkpoint_name(self.resume_from)
            return Resume((attempt, step), self.resume_from, None)
        if not candidates and state.last_checkpoint() is not None:
            last = state.last_checkpoint()
            candidates.append((last["attempt"], last["step"], last["location"]))
        if not candidates:
            return Resume(None, None, None)
        attempt, step, location = max(candidates, key=lambda c: (c[0], c[1]))
        return Resume((attempt, step), location, self.ledger.uri)

    def choose(self, ray_checkpoint) -> Resume:
        """The resume point and (online) the recovery plan; raises the stream's failure or lost features."""
        if self.broker is not None:
            failed = ray.get(self.broker.stats.remote(), timeout=60)["failed"]
            if failed:
                raise StreamFailedError(f"the feature stream failed: {failed}")
        self._state = self.ledger.replay()
        resume = self._resume_point(self._state, ray_checkpoint)
        if self.broker is not None:
            recapture = ray.get(self.broker.describe.remote(), timeout=60)["recapture"]
            self._plan = recovery_plan(self._state, resume.parent, store=self.store, recapture=recapture)
            if self._plan.lost and not recapture:
                raise FeaturesLostError(
                    f"resuming from checkpoint {resume.parent}: {len(self._plan.lost)} dispatched samples outside its "
                    f"history have no readable features in {self.store_uri} any more (e.g. "
                    f"{[r.sample_id for r in self._plan.lost[:3]]}): deleted under a later checkpoint, gone with the "
                    "store, or corrupt, and no producer of this stream can capture them again. Resume from the "
                    "ledger's latest checkpoint, or run the stream's producer with re-capture"
                )
        return resume

    def write(self, resume: Resume, *, world_size: int, quantum: int) -> int:
        """Append the attempt (and a checkpoint only Ray knew), finish deletions, rewind the broker."""
        state, parent = self._state, resume.parent
        if parent is not None and state.find_checkpoint(*parent) is None:
            self.ledger.checkpointed(*parent, resume.location)  # Ray registered it; the group died before the ledger said so
        attempt = state.next_attempt
        self.ledger.attempt(attempt, parent=parent, world_size=world_size, quantum=quantum,
                            checkpoint=resume.location, run=self.run_uri)
        plan = self._plan
        if plan is not None:
            if plan.delete_keys:
                for key in plan.delete_keys:
                    self.store.delete(key)
                self.ledger.deleted(plan.delete_windows, plan.delete_keys)
            ray.get(self.broker.rewind.remote(
                attempt, quantum=quantum, world_size=world_size, step=parent[1] if parent else 0,
                redispatch=plan.redispatch, history=sorted(plan.history),
            ), timeout=120)
        return attempt
