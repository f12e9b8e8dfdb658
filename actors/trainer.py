"""The trainer gang: DP ranks on Ray Train that train the shared training core, exactly once.

    result = run_trainer_gang(spec, num_workers=2, storage_path="runs/x/ray-train", broker=broker)
    export_checkpoint(result.checkpoint, "runs/x/export")

``spec`` is a ``trainer/assembly.py::TrainSpec`` (``TrainJobConfig.train_spec()``). Each Ray
Train worker (``TorchTrainer``, gloo, 1 CPU) builds its rank with ``build_rank`` and trains
through ``trainer/loop.py::TrainRun`` — the same drafter, strategy, step, metrics records and
checkpoint save/resume as ``specray train``; this module adds only the ledger and Ray's
protocol — and runs one of two sources.

**Online** (``broker=`` a ``SampleBroker``; ``spec.manifest`` None). Per optimizer step ``s``:

1. every rank asks the broker for window ``(attempt, s)`` and gets the same ``Q`` refs;
2. rank 0 appends ``dispatched`` (the refs) to the ledger (``trainer/ledger.py``);
3. ``split_window`` deals the refs over the ``DP × accumulation`` micro-batch slots; rank
   ``r`` trains slots ``r·A … r·A + A − 1`` (``TrainRun.train_step``, DDP over gloo);
4. the sample ids each rank trained are all-gathered and rank 0 appends one ``trained`` txn.

Every ``spec.checkpoint_every`` steps and at the end of the stream rank 0 writes the
``trainer/checkpoint.py`` step directory (``TrainRun.save``, with the ledger position in its ``extra``) and every
rank calls ``ray.train.report``, which persists it as ``<storage>/<name>/checkpoint-aAAA-sSSSSSSSS``.
Only once that returns does rank 0 append ``checkpointed``, delete the features of the windows
trained since the previous checkpoint, append ``deleted`` and ``release`` their capacity.
Training stops at the end of the stream (``broker.close()``) or at ``optim.total_steps``,
whichever comes first (the LR schedule spans ``total_steps``: set it to the expected number of
windows); refs still queued then stay in the broker for a later run.

**Recovery.** Every worker-group start (first start, Ray Train's restart after a failure, or
a new run with the same storage and name) is a new *attempt*. The resume point is the newest
of ``ray.train.get_checkpoint()`` and the ledger's ``checkpointed`` txns of this run: Ray Train
registers a reported checkpoint asynchronously, so a group that dies right after ``report``
can leave Ray pointing at the previous one while the ledger already names the newer one. A
run with neither starts from ``resume_from``, else from the ledger's last checkpoint (the
stream's model), else from scratch. Rank 0 then appends ``attempt``, finishes deletions a
crash interrupted, and rewinds the broker: every dispatched sample outside the checkpoint's
history goes back to the front of the queue and is re-split for this attempt's ``Q`` (the
world size may differ). So a crash mid-window, between an optimizer step and its checkpoint,
or during deletion leaves every sample trained exactly once in the final model's lineage.

**Lost features.** A dispatched feature can be gone: a ``ray://`` blob dies with the capture
actor that owned it, and resuming from an older checkpoint than the newest re-dispatches
samples whose blobs a later checkpoint already deleted. When the producer can capture again
(``broker.enable_recapture()``, as the online pipeline's does), such samples are re-dispatched
in their place; a rank that cannot read one reports it (``report_lost``) and waits up to
``RECAPTURE_TIMEOUT_S`` until it is captured again, bit for bit (same batch, same key, same
checksum), then trains the window as dispatched. Without such a producer it raises
``FeaturesLostError``: training on around a hole would break exactly-once.

**Offline** (``spec.manifest``, no broker). Each rank reads its slice with
``FeatureLoader`` for as many epochs as ``optim.total_steps`` needs; its order is a pure
function of (seed, epoch, position) and its state rides in the checkpoint, so resuming needs
no dispatch log (and a different world size resumes at the same global position). Nothing
is deleted (manifests are immutable); the ledger records only attempts and checkpoints.
This is simpler and as robust as pushing manifest refs through the broker.

Storage: a local directory or ``s3://`` (endpoint from ``$SPECRAY_S3_ENDPOINT``, like the
feature store); the ledger defaults to ``<storage>/<name>/ledger``.

``FaultPlan`` injects the crash points the tests kill at (``os._exit`` in the worker, armed
once through a marker file so the restarted group does not crash again).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

import pyarrow.fs
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from specray.actors.broker import Window
from specray.capture.contract import CaptureContract
from specray.capture.store import FeatureNotFoundError, SampleRef, open_store, read_manifest
from specray.trainer.assembly import (TrainSpec, build_rank, check_capture_fits, check_manifest_fits,
                                      count_draft_vocab, feature_loader)
from specray.trainer.ledger import Ledger, LedgerState, recovery_plan
from specray.trainer.loader import TrainBatch, collate
from specray.trainer.loop import TrainRun

FAULT_POINTS = ("mid_window", "after_step_before_checkpoint", "during_delete")
CRASH_EXIT_CODE = 87
FIT_GRACE_S = 90.0  # after timeout_s: time for the workers to notice the deadline and the group to stop
RECAPTURE_TIMEOUT_S = 600.0  # a rank waits this long for lost features to be captured again
_CHECKPOINT_NAME = re.compile(r"checkpoint-a(\d+)-s(\d+)/?$")


class GangFailedError(RuntimeError):
    """The gang failed more often than ``max_failures``; its checkpoints and ledger are intact."""


class FeaturesLostError(RuntimeError):
    """Samples the resumed model has not trained on have no features any more."""


@dataclass(frozen=True)
class FaultPlan:
    """Crash rank ``rank`` once at ``point`` of optimizer step ``step`` (1-based), for tests.

    - ``mid_window``: after ``after`` of the rank's micro-batches of step ``step`` ran forward
      and backward (``0 <= after < accumulation_steps``), before the optimizer step;
    - ``after_step_before_checkpoint``: right after the ``trained`` txn of step ``step``;
    - ``during_delete``: at the checkpoint of step ``step``, after ``after`` feature keys were
      deleted and before the ``deleted`` txn (rank 0: only rank 0 deletes).

    The crash is ``os._exit``; it happens only while ``marker`` does not exist and creates it
    first, so the group Ray Train restarts runs through.
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
        if self.point == "during_delete" and self.rank != 0:
            raise ValueError("during_delete crashes rank 0 (the only rank that deletes features); use rank=0")

    def maybe_crash(self, point: str, step: int, rank: int) -> None:
        if (point, step, rank) != (self.point, self.step, self.rank) or os.path.exists(self.marker):
            return
        with open(self.marker, "w") as f:
            f.write(f"{point} step {step} rank {rank} pid {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        os._exit(CRASH_EXIT_CODE)


@dataclass(frozen=True)
class GangResult:
    step: int  # optimizer steps in the final model
    # The final Ray Train checkpoint: a directory holding a trainer/checkpoint.py step dir, which
    # export_checkpoint takes as is; on s3:// storage, fetch it first (ray.train.Checkpoint.to_directory).
    checkpoint: str
    metrics: list[dict]  # metric records of the final model's history (loss, lr, acc_by_pos, tau_tf, ...)
    attempts: list[dict]  # this run's ledger attempt txns: one per worker-group start
    ledger_uri: str
    run_path: str  # the Ray Train run directory, <storage_path>/<name>


def split_window(refs: Sequence[SampleRef], num_slots: int) -> list[list[SampleRef]]:
    """Deal a window over ``num_slots = DP × accumulation`` micro-batch slots, contiguously.

    Slot ``s = rank × accumulation + i`` is micro-batch ``i`` of rank ``rank`` (the index
    TrainerCore keys its anchors with). Slot ``s`` gets ``refs[s·n // S : (s+1)·n // S]``: a
    full window (``n = Q = S × micro_batch``) gives every slot ``micro_batch`` refs, so 2 ranks
    × 1 accumulation train what 1 rank × 2 does. The final partial window is spread as evenly
    as possible: ``n = 5, S = 4 → sizes [1, 1, 1, 2]``; ``n = 3 → [0, 1, 1, 1]``. An empty slot
    trains a loss-masked copy of a real sample (zero gradient, zero metric counts), so every
    rank still runs its ``accumulation`` forward/backward passes and the DDP all-reduce matches.
    """
    n = len(refs)
    return [list(refs[s * n // num_slots:(s + 1) * n // num_slots]) for s in range(num_slots)]


def checkpoint_name(attempt: int, step: int) -> str:
    return f"checkpoint-a{attempt:03d}-s{step:08d}"


def parse_checkpoint_name(location: str) -> tuple[int, int]:
    match = _CHECKPOINT_NAME.search(location)
    if match is None:
        raise ValueError(f"{location} is not a trainer-gang checkpoint (checkpoint-aAAA-sSSSSSSSS); "
                         "resume from a checkpoint run_trainer_gang wrote")
    return int(match.group(1)), int(match.group(2))


class _MidWindowCrash:
    """The strategy, crashing before micro-batch ``fault.after`` of ``fault.step`` on ``fault.rank``."""

    def __init__(self, strategy, fault: FaultPlan, rank: int, accumulation: int):
        self._strategy, self._fault, self._rank, self._accumulation = strategy, fault, rank, accumulation

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def generator(self, step: int, micro_index: int) -> torch.Generator:
        if micro_index == self._rank * self._accumulation + self._fault.after:
            self._fault.maybe_crash("mid_window", step + 1, self._rank)
        return self._strategy.generator(step, micro_index)


class _GangRank:
    """One worker of the gang: build, resume, train, checkpoint (see the module docstring)."""

    def __init__(self, spec: dict, rank: int, world_size: int):
        train: TrainSpec = spec["train"]
        self.train, self.spec, self.rank, self.world_size = train, spec, rank, world_size
        self.online = spec["online"]
        self.accumulation = train.optim.accumulation_steps
        self.quantum = world_size * train.micro_batch_size * self.accumulation
        self.fault: FaultPlan | None = spec["fault"]
        manifest = None
        if self.online:
            contract = CaptureContract.from_json(spec["contract"])
            self.store = open_store(spec["store_uri"], endpoint_url=spec["endpoint_url"])
            provenance = {"stream": spec["store_uri"], "ledger": spec["ledger_uri"]}
        else:
            manifest = read_manifest(train.manifest, endpoint_url=train.endpoint_url)
            contract = manifest.contract
            self.store = open_store(manifest.store_uri, endpoint_url=train.endpoint_url)
            provenance = {"manifest": train.manifest, "samples": len(manifest.refs)}
        parts = build_rank(train, contract, rank=rank, world_size=world_size, provenance=provenance,
                           draft_vocab=spec.get("draft_vocab"))
        if self.online:  # FeatureLoader checks a manifest's contract itself
            parts.expected.check_compatible(contract, what="the stream's features")
        self.core = parts.core
        if self.fault is not None and self.fault.point == "mid_window":
            self.core.strategy = _MidWindowCrash(self.core.strategy, self.fault, rank, self.accumulation)
        self.run_state = TrainRun(self.core, log_every=train.log_every, extra=parts.extra)
        self.loader = None if self.online else feature_loader(train, manifest, self.store, parts.expected,
                                                               rank=rank, world_size=world_size)
        self.ledger = Ledger(spec["ledger_uri"]) if rank == 0 else None
        self.attempt = -1
        self.trained_windows: list[Window] = []  # rank 0: trained since the last checkpoint, features not yet deleted
        self.last_checkpoint: int | None = None
        self.location: str | None = None

    @property
    def step(self) -> int:
        return self.run_state.step

    # -- collectives -----------------------------------------------------------------------

    def _broadcast(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _fault(self, point: str, count: int | None = None) -> None:
        if self.fault is not None and (count is None or count == self.fault.after):
            self.fault.maybe_crash(point, self.step, self.rank)

    def _remaining(self) -> float | None:
        deadline = self.spec["deadline"]
        if deadline is None:
            return None
        remaining = deadline - time.time()
        if remaining <= 0:
            raise TimeoutError(f"the trainer gang ran past its timeout_s at step {self.step}")
        return remaining

    # -- attempt start ---------------------------------------------------------------------

    def start_attempt(self) -> None:
        self._remaining()
        ray_checkpoint = ray.train.get_checkpoint()
        decision = self._plan_attempt(ray_checkpoint) if self.rank == 0 else None
        decision = self._broadcast(decision)
        self.attempt = decision["attempt"]
        self.run_state.record_fields = {"attempt": self.attempt}
        if decision["location"] is not None:
            self._load(decision["location"])

    def _resume_point(self, state: LedgerState, ray_checkpoint) -> tuple[tuple[int, int] | None, str | None]:
        run = self.spec["run_uri"]
        candidates = [(c["attempt"], c["step"], c["location"]) for c in state.checkpoints
                      if state.attempts.get(c["attempt"], {}).get("run") == run]
        if ray_checkpoint is not None:
            location = f"{run}/{Path(ray_checkpoint.path).name}"
            candidates.append((*parse_checkpoint_name(location), location))
        if not candidates and self.spec["resume_from"]:
            candidates.append((*parse_checkpoint_name(self.spec["resume_from"]), self.spec["resume_from"]))
        if not candidates and state.last_checkpoint() is not None:
            last = state.last_checkpoint()
            candidates.append((last["attempt"], last["step"], last["location"]))
        if not candidates:
            return None, None
        attempt, step, location = max(candidates, key=lambda c: (c[0], c[1]))
        return (attempt, step), location

    def _plan_attempt(self, ray_checkpoint) -> dict:
        state = self.ledger.replay()
        parent, location = self._resume_point(state, ray_checkpoint)
        plan = None
        if self.online:
            recapture = ray.get(self.spec["broker"].describe.remote(), timeout=60)["recapture"]
            plan = recovery_plan(state, parent, store=self.store, recapture=recapture)
            if plan.lost and not recapture:
                raise FeaturesLostError(
                    f"resuming from checkpoint {parent}: {len(plan.lost)} dispatched samples outside its history have "
                    f"no features any more (e.g. {[r.sample_id for r in plan.lost[:3]]}): deleted under a later "
                    "checkpoint, or gone with the store, and no producer of this stream can capture them again. "
                    "Resume from the ledger's latest checkpoint, or run the stream's producer with re-capture"
                )
        if parent is not None and state.find_checkpoint(*parent) is None:
            self.ledger.checkpointed(*parent, location)  # Ray registered it; the group died before the ledger said so
        attempt = state.next_attempt
        self.ledger.attempt(attempt, parent=parent, world_size=self.world_size, quantum=self.quantum,
                            checkpoint=location, run=self.spec["run_uri"])
        if plan is not None:
            if plan.delete_keys:
                for key in plan.delete_keys:
                    self.store.delete(key)
                self.ledger.deleted(plan.delete_windows, plan.delete_keys)
            ray.get(self.spec["broker"].rewind.remote(
                attempt, quantum=self.quantum, world_size=self.world_size, step=parent[1] if parent else 0,
                redispatch=plan.redispatch, history=sorted(plan.history),
            ), timeout=120)
        return {"attempt": attempt, "location": location}

    def _load(self, location: str) -> None:
        filesystem = storage_filesystem(location)
        checkpoint = ray.train.Checkpoint(_ray_path(location, filesystem), filesystem=filesystem)
        with checkpoint.as_directory() as directory:
            loader_state = self.run_state.load(directory)
        if self.loader is not None:
            self.loader.load_state_dict(loader_state)
        self.last_checkpoint, self.location = self.step, location

    # -- training --------------------------------------------------------------------------

    def run(self) -> dict | None:
        self.start_attempt()
        if self.online:
            self._train_online()
        else:
            self._train_offline()
        if self.last_checkpoint != self.step:
            self._checkpoint()
        if self.loader is not None:
            self.loader.close()
        if self.rank != 0:
            return None
        return {"step": self.step, "checkpoint": self.location, "metrics": self.run_state.records,
                "attempt": self.attempt}

    def _train_offline(self) -> None:
        while self.step < self.train.optim.total_steps:
            self._remaining()
            start = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(self.accumulation)]
            self.run_state.train_step(batches, data_wait=time.perf_counter() - start)
            self._fault("after_step_before_checkpoint")
            if self.step % self.train.checkpoint_every == 0:
                self._checkpoint()

    def _train_online(self) -> None:
        broker = self.spec["broker"]
        while self.step < self.train.optim.total_steps:
            timeout = self._remaining()
            request = broker.next_window.remote(self.attempt, self.step + 1, timeout=timeout)
            window: Window | None = ray.get(request, timeout=None if timeout is None else timeout + 30)
            if window is None:
                break  # end of stream: every rank gets None for the same step
            if self.rank == 0:
                self.ledger.dispatched(self.attempt, window.step, window.window_id, window.refs)
            slots = split_window(window.refs, self.world_size * self.accumulation)
            mine = slots[self.rank * self.accumulation:(self.rank + 1) * self.accumulation]
            start = time.perf_counter()
            batches = [self._batch(slot, window) for slot in mine]
            self.run_state.train_step(batches, data_wait=time.perf_counter() - start)
            acks = self._gather([sid for b in batches for sid in b.sample_ids])
            if self.rank == 0:
                self._ack(window, [sid for rank_ids in acks for sid in rank_ids])
            self._fault("after_step_before_checkpoint")
            if self.step % self.train.checkpoint_every == 0:
                self._checkpoint()

    def _batch(self, slot: list[SampleRef], window: Window) -> TrainBatch:
        max_length = self.train.max_length
        if slot:
            return collate(self._read(slot), [r.sample_id for r in slot], max_length=max_length)
        filler = collate(self._read([window.refs[0]]), [], max_length=max_length)
        return dataclasses.replace(filler, loss_mask=torch.zeros_like(filler.loss_mask), num_tokens=0)

    def _read(self, refs: list[SampleRef]) -> list[dict[str, torch.Tensor]]:
        """The features of ``refs``; lost ones are captured again when the producer can (module docstring)."""
        features: dict[str, dict[str, torch.Tensor]] = {}
        todo = list(refs)
        for _ in range(3):  # a re-captured blob can be lost again only if its new owner dies too
            lost = []
            for ref in todo:
                try:
                    features[ref.sample_id] = self.store.get(ref)
                except FeatureNotFoundError:
                    lost.append(ref)
            if not lost:
                return [features[r.sample_id] for r in refs]
            broker = self.spec["broker"]
            ids = [r.sample_id for r in lost]
            if not ray.get(broker.report_lost.remote(lost), timeout=60):
                raise FeaturesLostError(
                    f"step {self.step + 1}: the features of {len(lost)} dispatched samples are gone (e.g. {ids[:3]}) "
                    f"from {self.spec['store_uri']}, and no producer of this stream can capture them again"
                )
            timeout = min(RECAPTURE_TIMEOUT_S, self._remaining() or RECAPTURE_TIMEOUT_S)
            if not ray.get(broker.wait_recaptured.remote(ids, timeout=timeout), timeout=timeout + 60):
                raise FeaturesLostError(f"step {self.step + 1}: samples {ids[:3]} were not captured again within "
                                        f"{timeout:.0f} s; is the producer running?")
            todo = lost
        raise FeaturesLostError(f"step {self.step + 1}: samples {[r.sample_id for r in todo][:3]} were lost again "
                                "after 3 re-captures")

    def _ack(self, window: Window, acked: list[str]) -> None:
        expected = [r.sample_id for r in window.refs]
        if sorted(acked) != sorted(expected):
            raise RuntimeError(f"step {self.step}: the ranks acknowledged {sorted(acked)} but window "
                               f"{window.window_id} holds {sorted(expected)}")
        self.ledger.trained(self.attempt, self.step, window.window_id, acked)
        self.trained_windows.append(window)

    # -- checkpoint and deletion -----------------------------------------------------------

    def _checkpoint(self) -> None:
        self.run_state.flush()
        name = checkpoint_name(self.attempt, self.step)
        location = f"{self.spec['run_uri']}/{name}"
        directory = tempfile.mkdtemp(prefix="specray-ckpt-") if self.rank == 0 else None
        try:
            checkpoint = None
            if self.rank == 0:
                position = self.loader.state_dict() if self.loader is not None else {}
                ledger = {"uri": self.spec["ledger_uri"], "attempt": self.attempt, "step": self.step}
                self.run_state.save(directory, loader_state=position, keep_last=None, ledger=ledger)
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({"step": self.step, "attempt": self.attempt}, checkpoint=checkpoint, checkpoint_dir_name=name)
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self.last_checkpoint, self.location = self.step, location
        if self.rank == 0:
            self.ledger.checkpointed(self.attempt, self.step, location)
            if self.online:
                self._delete_trained()

    def _delete_trained(self) -> None:
        """Features of windows the durable checkpoint covers: delete, log, free capacity."""
        windows, self.trained_windows = self.trained_windows, []
        refs = [r for w in windows for r in w.refs]
        if not refs:
            return
        for done, ref in enumerate(refs):
            self._fault("during_delete", count=done)
            self.store.delete(ref.key)
        self.ledger.deleted([w.window_id for w in windows], [r.key for r in refs])
        ray.get(self.spec["broker"].release.remote([r.sample_id for r in refs]), timeout=120)


def _gang_worker(spec: dict) -> dict | None:
    import specray.actors.object_store  # noqa: F401  (registers ray:// stores in this worker)

    torch.set_num_threads(1)  # one logical CPU per worker
    context = ray.train.get_context()
    return _GangRank(spec, context.get_world_rank(), context.get_world_size()).run()


# -- driver ----------------------------------------------------------------------------------


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


def _ray_path(uri: str, filesystem) -> str:
    """A path for Ray Train: with an explicit filesystem, the URI without its scheme."""
    return uri.split("://", 1)[1] if filesystem is not None and "://" in uri else uri


def _absolute(path_or_uri: str) -> str:
    """Workers run in another directory: local paths must be absolute (URIs stay as they are)."""
    return path_or_uri if "://" in path_or_uri else str(Path(path_or_uri).resolve())


def _check_stream(broker, spec: TrainSpec, quantum: int) -> dict:
    stream = ray.get(broker.describe.remote(), timeout=60)
    if not stream["contract"] or not stream["store_uri"]:
        raise ValueError("the SampleBroker was started without contract= and store_uri=; the gang needs both to "
                         "read the stream (start_sample_broker(..., contract=contract, store_uri=uri))")
    check_capture_fits(spec.algorithm, CaptureContract.from_json(stream["contract"]).algorithm,
                       field="drafter.algorithm", where=" in the SampleBroker's stream")
    need = quantum * spec.checkpoint_every
    if stream["max_inflight"] < need:
        raise ValueError(
            f"the broker holds at most max_inflight={stream['max_inflight']} features, but features are deleted only "
            f"after a checkpoint covers them, so the gang needs Q × trainer.checkpoint_every = {quantum} × "
            f"{spec.checkpoint_every} = {need} in flight. Raise max_inflight to >= {need} or lower "
            "trainer.checkpoint_every"
        )
    return stream


def _fit(trainer: TorchTrainer, timeout_s: float | None):
    """``trainer.fit()``, given up on ``FIT_GRACE_S`` after ``timeout_s`` (the workers stop at timeout_s)."""
    if timeout_s is None:
        return trainer.fit()
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="specray-gang-fit", daemon=True)
    thread.start()
    thread.join(timeout_s + FIT_GRACE_S)
    if thread.is_alive():
        raise TimeoutError(f"the trainer gang did not finish within timeout_s={timeout_s} (+{FIT_GRACE_S:.0f} s grace)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def run_trainer_gang(
    spec: TrainSpec, *, num_workers: int, storage_path: str, ledger_uri: str | None = None, broker=None,
    resume_from: str | None = None, max_failures: int = 1, fault: FaultPlan | None = None,
    timeout_s: float | None = None, cpus_per_worker: float = 1.0,
) -> GangResult:
    """Train ``spec`` with ``num_workers`` DP ranks; online from ``broker``, else offline from ``spec.manifest``.

    The Ray Train run is ``<storage_path>/<spec.name>``: rerunning with the same storage and
    name resumes it (from its newest checkpoint, with any ``num_workers``). ``ledger_uri``
    defaults to ``<storage_path>/<spec.name>/ledger``; an online stream's ledger must stay
    the same across runs that continue one model. ``max_failures`` worker-group restarts are
    allowed before ``GangFailedError``. Each worker reserves ``cpus_per_worker`` logical CPUs,
    and Ray sizes its torch thread pool to match. Features captured for another algorithm
    than ``spec.drafter``'s are refused before the gang starts.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    online = broker is not None
    if online == (spec.manifest is not None):
        raise ValueError("give exactly one feature source: broker= for online training (with data.manifest null), "
                         f"or data.manifest for offline training; got broker={broker!r}, manifest={spec.manifest!r}")
    quantum = num_workers * spec.micro_batch_size * spec.optim.accumulation_steps
    if fault is not None and fault.point == "mid_window" and fault.after >= spec.optim.accumulation_steps:
        raise ValueError(f"a mid_window fault crashes before micro-batch `after` of a step; use 0 <= after < "
                         f"optim.accumulation_steps = {spec.optim.accumulation_steps}")
    spec = dataclasses.replace(spec, run_dir=_absolute(spec.run_dir),
                               manifest=_absolute(spec.manifest) if spec.manifest else None)
    storage_path = _absolute(storage_path)
    run_uri = f"{storage_path.rstrip('/')}/{spec.name}"
    ledger_uri = _absolute(ledger_uri) if ledger_uri else f"{run_uri}/ledger"
    job = {"train": spec, "online": online, "run_uri": run_uri, "ledger_uri": ledger_uri, "fault": fault,
           "resume_from": _absolute(resume_from) if resume_from else None,
           "deadline": time.time() + timeout_s if timeout_s is not None else None}
    if online:
        stream = _check_stream(broker, spec, quantum)
        job.update(broker=broker, contract=stream["contract"], store_uri=stream["store_uri"],
                   endpoint_url=stream["endpoint_url"])
    else:
        check_manifest_fits(spec, read_manifest(spec.manifest, endpoint_url=spec.endpoint_url).contract)
        job["draft_vocab"] = count_draft_vocab(spec)  # counted once here, not by every rank
    filesystem = storage_filesystem(storage_path)
    trainer = TorchTrainer(
        _gang_worker, train_loop_config=job,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(name=spec.name, storage_path=_ray_path(storage_path, filesystem),
                             storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=spec.keep_last)),
    )
    try:
        result = _fit(trainer, timeout_s)
    except ray.train.TrainingFailedError as e:
        if job["deadline"] is not None and time.time() > job["deadline"]:
            raise TimeoutError(f"the trainer gang ran past timeout_s={timeout_s}; resume it by rerunning with the same "
                               f"storage_path and name") from e
        raise GangFailedError(
            f"the trainer gang failed (max_failures={max_failures} restarts used): {e}. Its checkpoints in {run_uri} "
            f"and the ledger {ledger_uri} are intact: rerun with the same storage_path and name to resume"
        ) from e
    out = result.return_value
    attempts = [a for a in Ledger(ledger_uri).replay().attempts.values() if a["run"] == run_uri]
    return GangResult(out["step"], out["checkpoint"], out["metrics"], attempts, ledger_uri, run_uri)
