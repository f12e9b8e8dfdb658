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

**``resume_from``** (a run with no checkpoint of its own) is read for its recorded position
first (``recorded_position``: its ``latest`` pointer and ``state.pt`` only):

- saved under *this* ledger: resumed as a parent, if the ledger describes that model (the
  attempt is recorded and trained that step); a checkpoint only Ray Train knew is recorded first;
- saved under *another* ledger, and this ledger holds no checkpoint yet: its model, optimizer and
  step start this stream. The attempt records it as its ``origin`` (provenance: the other
  ledger's position and the location), with no parent: the stream's lineage, its recovery plans
  and its audit cover what this stream trains, exactly once, from the origin's step on;
- saved under another ledger while this one holds checkpoints of its own stream: refused
  (``CheckpointMismatchError``), since continuing from it would make the stream's recorded
  history not the trained one.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs
import ray
import torch

from specray.actors.broker import StreamFailedError
from specray.capture.store import BlobStore
from specray.trainer.checkpoint import LATEST_FILE, STATE_FILE, latest_checkpoint
from specray.trainer.ledger import Ledger, LedgerState, RecoveryPlan, recovery_plan

_CHECKPOINT_NAME = re.compile(r"checkpoint-a(\d+)-s(\d+)/?$")
_STEP_DIR = re.compile(r"^step-\d{8,}$")


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


def storage_filesystem(storage_path: str):
    """Ray Train's filesystem for ``storage_path``: for s3:// the endpoint specray uses, else pyarrow's choice.

    ``s3://`` takes its endpoint from ``$SPECRAY_S3_ENDPOINT`` (as the feature store and the
    ledger do), credentials and region from the usual ``AWS_*`` variables; None lets pyarrow
    resolve the URI (local paths, or S3 at AWS).
    """
    endpoint = os.environ.get("SPECRAY_S3_ENDPOINT")
    if not storage_path.startswith("s3://") or not endpoint:
        return None
    url = urlparse(endpoint)
    return pyarrow.fs.S3FileSystem(endpoint_override=url.netloc, scheme=url.scheme or "https",
                                   region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))


def ray_path(uri: str, filesystem) -> str:
    """A path for Ray Train: with an explicit filesystem, the URI without its scheme."""
    return uri.split("://", 1)[1] if filesystem is not None and "://" in uri else uri


def same_ledger(a: str, b: str) -> bool:
    """Whether two ledger URIs name one ledger (a local path and its file:// URI are one)."""
    def canonical(uri: str) -> str:
        if "://" in uri and not uri.startswith("file://"):
            return uri.rstrip("/")
        return str(Path(uri.removeprefix("file://")).resolve())

    return canonical(a) == canonical(b)


def recorded_position(location: str) -> tuple[int, dict | None]:
    """(step, ledger position) a gang checkpoint directory holds, from its ``latest`` and ``state.pt`` only."""
    filesystem = storage_filesystem(location)
    if filesystem is None:
        filesystem, root = pyarrow.fs.FileSystem.from_uri(location if "://" in location else Path(location).resolve().as_uri())
    else:
        root = ray_path(location, filesystem)
    root = root.rstrip("/")
    infos = filesystem.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    steps = sorted(i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory and _STEP_DIR.match(i.base_name))
    if LATEST_FILE in {i.base_name for i in infos}:
        with filesystem.open_input_stream(f"{root}/{LATEST_FILE}") as f:
            named = f.read().decode().strip()
        steps = [named] if named in steps else steps
    if not steps:
        raise CheckpointMismatchError(f"checkpoint {location} holds no training checkpoint (no step-* directory); "
                                      "resume from a checkpoint this gang wrote")
    with filesystem.open_input_stream(f"{root}/{steps[-1]}/{STATE_FILE}") as f:
        state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    return state["step"], state["extra"].get("ledger")


@dataclass(frozen=True)
class Resume:
    """The resume point of an attempt (all None: from scratch)."""

    parent: tuple[int, int] | None  # (attempt, step) of this ledger's checkpoint
    location: str | None  # its directory, <run>/checkpoint-aAAA-sSSSSSSSS
    position: dict | None  # the ledger position the directory must hold: {"uri", "attempt", "step"}
    origin: dict | None = None  # another ledger's checkpoint starting this stream: {"ledger", "attempt", "step", "location"}

    @property
    def step(self) -> int:
        """The step the model is at once loaded (0 from scratch)."""
        return self.position["step"] if self.position else 0


def check_position(directory: str | Path, resume: Resume) -> None:
    """Raise ``CheckpointMismatchError`` unless ``directory`` holds ``resume.position`` at its step.

    Reads only the small ``extra`` of ``state.pt`` (memory-mapped), before any rank loads it.
    """
    path = latest_checkpoint(directory)
    if path is None:
        raise CheckpointMismatchError(f"checkpoint {resume.location} holds no training checkpoint (no step-* "
                                      "directory with model and state); resume from a checkpoint this gang wrote")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    recorded = state["extra"].get("ledger")
    if state["step"] == resume.step and recorded == resume.position:
        return
    expected = resume.position
    raise CheckpointMismatchError(
        f"checkpoint {resume.location} is resumed as attempt {expected['attempt']} step {expected['step']} of the "
        f"ledger {expected['uri']}, but it holds step {state['step']} saved at ledger position {recorded}: the "
        "directory was replaced, or it belongs to another run or ledger. Resume with the ledger it was trained "
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

    def _here(self, attempt: int, step: int, location: str) -> Resume:
        return Resume((attempt, step), location, {"uri": self.ledger.uri, "attempt": attempt, "step": step})

    def _resume_point(self, state: LedgerState, ray_checkpoint) -> Resume:
        """The newest of Ray's checkpoint and this run's ledger checkpoints, else ``resume_from``, else the
        ledger's last checkpoint (the stream's model), else from scratch."""
        candidates = [(c["attempt"], c["step"], c["location"]) for c in state.checkpoints
                      if state.attempts.get(c["attempt"], {}).get("run") == self.run_uri]
        if ray_checkpoint is not None:
            location = f"{self.run_uri}/{Path(ray_checkpoint.path).name}"
            candidates.append((*parse_checkpoint_name(location), location))
        if not candidates and self.resume_from:
            return self._from_checkpoint(state, self.resume_from)
        if not candidates and state.last_checkpoint() is not None:
            last = state.last_checkpoint()
            candidates.append((last["attempt"], last["step"], last["location"]))
        if not candidates:
            return Resume(None, None, None)
        return self._here(*max(candidates, key=lambda c: (c[0], c[1])))

    def _from_checkpoint(self, state: LedgerState, location: str) -> Resume:
        """``resume_from``: this ledger's checkpoint (a parent) or another's starting the stream (module docstring)."""
        step, position = recorded_position(location)
        if position is None or position.get("step") != step:
            raise CheckpointMismatchError(
                f"resume_from={location} holds step {step} saved at ledger position {position}: it is not a checkpoint "
                "of the trainer gang (which records its ledger position); resume from a checkpoint run_trainer_gang "
                "wrote, or start the drafter from an export (drafter.init_from)")
        attempt = position["attempt"]
        match = _CHECKPOINT_NAME.search(location)
        if match is not None and (int(match.group(1)), int(match.group(2))) != (attempt, step):
            raise CheckpointMismatchError(
                f"resume_from={location} is named after attempt {int(match.group(1))} step {int(match.group(2))} but "
                f"holds attempt {attempt} step {step} of the ledger {position['uri']}: the directory was replaced; "
                "restore it, or resume from another checkpoint")
        if same_ledger(position["uri"], self.ledger.uri):
            problem = state.unresumable(attempt, step)
            if problem is not None:
                raise CheckpointMismatchError(
                    f"resume_from={location} was saved at attempt {attempt} step {step} of this run's ledger "
                    f"{self.ledger.uri}, but the ledger does not describe that model: {problem}. Resume from one of "
                    "the ledger's checkpoints, or start a new stream from it with a fresh ledger (another ledger_uri)")
            return Resume((attempt, step), location, position)
        last = state.last_checkpoint()
        if last is not None:
            raise CheckpointMismatchError(
                f"resume_from={location} was saved under the ledger {position['uri']} (attempt {attempt}, step {step}), "
                f"not this run's ledger {self.ledger.uri}, which holds checkpoints of its own stream (the newest: "
                f"attempt {last['attempt']} step {last['step']}, {last['location']}): training on from another "
                "ledger's model would make this stream's recorded history not the trained one. Resume this stream "
                "from its own checkpoints (no resume_from), or start a new stream from that checkpoint with a fresh "
                "ledger (another ledger_uri, or a new name)")
        origin = {"ledger": position["uri"], "attempt": attempt, "step": step, "location": location}
        return Resume(None, location, position, origin)

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

    def total_steps(self, resume: Resume, *, stream_samples: int, quantum: int) -> int:
        """The step an online attempt ends at: its start step plus the windows of ``quantum`` the
        stream's samples outside the resumed history fill (the world size may differ from the
        attempt that trained the history)."""
        history = len(self._plan.history) if self._plan is not None else 0
        return resume.step + -(-max(stream_samples - history, 0) // quantum)

    def write(self, resume: Resume, *, world_size: int, quantum: int) -> int:
        """Append the attempt (and a checkpoint only Ray knew), finish deletions, rewind the broker."""
        state, parent = self._state, resume.parent
        if parent is not None and state.find_checkpoint(*parent) is None:
            self.ledger.checkpointed(*parent, resume.location)  # Ray registered it; the group died before the ledger said so
        attempt = state.next_attempt
        self.ledger.attempt(attempt, parent=parent, world_size=world_size, quantum=quantum,
                            checkpoint=resume.location, run=self.run_uri, origin=resume.origin)
        plan = self._plan
        if plan is not None:
            if plan.delete_keys:
                for key in plan.delete_keys:
                    self.store.delete(key)
                self.ledger.deleted(plan.delete_windows, plan.delete_keys)
            ray.get(self.broker.rewind.remote(
                attempt, quantum=quantum, world_size=world_size, step=resume.step,
                redispatch=plan.redispatch, history=sorted(plan.history),
            ), timeout=120)
        return attempt
