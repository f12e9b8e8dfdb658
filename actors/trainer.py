"""The trainer gang: DP ranks on Ray Train that train the shared training core, exactly once.

    result = run_trainer_gang(spec, num_workers=2, storage_path="runs/x/ray-train", broker=broker)
    export_checkpoint(result.checkpoint, "runs/x/export")

``spec`` is a ``trainer/assembly.py::TrainSpec`` (``TrainJobConfig.train_spec()``). Each Ray
Train worker (``TorchTrainer``: ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs; with GPUs,
``use_gpu`` and NCCL, the rank on ``ray.train.torch.get_device()``; without, gloo on the CPU —
``gang_scaling``) builds its rank with ``build_rank`` on that device and trains
through ``trainer/loop.py::TrainRun`` — the same drafter, strategy, step, metrics records and
checkpoint save/resume as ``specray train``; this module adds only the ledger and Ray's
protocol — and runs one of two sources.

**Online** (``broker=`` a ``SampleBroker``; ``spec.manifest`` None). Per optimizer step ``s``:

1. every rank asks the broker for window ``(attempt, s)`` and gets the same ``Q`` refs;
2. rank 0 appends ``dispatched`` (the refs) to the ledger (``trainer/ledger.py``);
3. ``split_window`` deals the refs over the ``DP × accumulation`` micro-batch slots; rank
   ``r`` trains slots ``r·A … r·A + A − 1`` (``TrainRun.train_step``, DDP over NCCL on GPUs, gloo on CPUs);
4. the sample ids each rank trained are all-gathered and rank 0 appends one ``trained`` txn.

Every ``spec.checkpoint_every`` steps and at the end of the stream rank 0 writes the
``trainer/checkpoint.py`` step directory (``TrainRun.save``, with the ledger position in its ``extra``) and every
rank calls ``ray.train.report``, which persists it as ``<storage>/<name>/checkpoint-aAAA-sSSSSSSSS``.
Only once that returns does rank 0 append ``checkpointed``, delete the features of the windows
trained since the previous checkpoint, append ``deleted`` and ``release`` their capacity.
Training stops at the end of the stream (``broker.close()``) or at the attempt's step target,
whichever comes first; refs still queued then stay in the broker for a later run. The step
target (which the LR schedule spans) is ``optim.total_steps``, or, with ``stream_samples=N``
(the samples of the stream's pass, as the online pipeline passes it), counted from samples at
every attempt start: the resumed step plus ``ceil((N − samples in the resumed history) / Q)``
for this attempt's ``Q``, so a resume with another world size trains exactly what is left.

**Recovery.** Every worker-group start (first start, Ray Train's restart after a failure, or
a new run with the same storage and name) is a new *attempt*. The resume point is the newest
of ``ray.train.get_checkpoint()`` and the ledger's ``checkpointed`` txns of this run: Ray Train
registers a reported checkpoint asynchronously, so a group that dies right after ``report``
can leave Ray pointing at the previous one while the ledger already names the newer one. A
run with neither starts from ``resume_from``, else from the ledger's last checkpoint (the
stream's model), else from scratch. ``resume_from`` must be this ledger's checkpoint, or
another ledger's that starts this stream (the attempt records it as its ``origin``; refused
once this ledger holds checkpoints of its own: ``actors/gang_recovery.py``). Before anything is written, every rank checks that the
chosen directory holds what its name claims: the ledger position saved in it (ledger uri,
attempt, step) and its step must be the resume point's, or the gang stops with
``CheckpointMismatchError`` (``actors/gang_recovery.py``). Rank 0 then appends ``attempt``,
finishes deletions a crash interrupted, and rewinds the broker: every dispatched sample outside
the checkpoint's history goes back to the front of the queue and is re-split for this attempt's
``Q`` (the world size may differ). So a crash mid-window, between an optimizer step and its
checkpoint, between the checkpoint's report and its ``checkpointed`` txn, or during deletion
leaves every sample trained exactly once in the final model's lineage.

**Lost features.** A dispatched feature can be gone: a ``ray://`` blob dies with the capture
actor that owned it, and resuming from an older checkpoint than the newest re-dispatches
samples whose blobs a later checkpoint already deleted. A corrupt blob (its bytes do not match
the checksum of its SampleRef) is as good as gone. When the producer can capture again
(``broker.enable_recapture()``, as the online pipeline's does), such samples are re-dispatched
in their place; a rank that cannot read one reports it (``report_lost``) and waits up to
``RECAPTURE_TIMEOUT_S`` until it is captured again, bit for bit (same batch, same key, same
checksum), then trains the window as dispatched. Without such a producer the gang stops with
``FeaturesLostError``: training on around a hole would break exactly-once.

**Terminal errors.** A failed stream (``StreamFailedError``: the producer called
``broker.fail``), features that cannot come back (``FeaturesLostError``) and a checkpoint that
is not what it claims (``CheckpointMismatchError``) would fail again after any restart. The
ranks exchange such an error before the next collective (so none waits in DDP's all-reduce for
one that stopped), every rank returns at the same step without a checkpoint, and
``run_trainer_gang`` raises it in the driver with its message, without a Ray Train restart.

**Offline** (``spec.manifest``, no broker). Each rank reads its slice with
``FeatureLoader`` for as many epochs as ``optim.total_steps`` needs; its order is a pure
function of (seed, epoch, position) and its state rides in the checkpoint, so resuming needs
no dispatch log (and a different world size resumes at the same global position). Nothing
is deleted (manifests are immutable); the ledger records only attempts and checkpoints.
This is simpler and as robust as pushing manifest refs through the broker.

**Live acceptance and progress.** With ``spec.live_eval`` rank 0 measures the drafter on the
serving engine before each checkpoint (``serving/live_eval.py``, the checkpoint hook of
``trainer/loop.py``) and adds ``tau_live`` and ``live_accept_by_pos`` to that step's record;
the other ranks wait in the checkpoint's collectives. With ``on_record=`` rank 0 pushes every
record to a ``ProgressBoard`` actor as it is made, and a driver thread hands it to ``on_record``
(``actors/progress.py``). With ``spec.tracking`` rank 0 also logs every record to TensorBoard,
W&B or MLflow (``trainer/tracking.py``); each attempt opens its own tracker run.

Storage: a local directory or ``s3://`` (endpoint from ``$SPECRAY_S3_ENDPOINT``, like the
feature store); the ledger defaults to ``<storage>/<name>/ledger``.

``FaultPlan`` (``actors/gang_faults.py``) injects the crash points the tests kill at
(``os._exit`` in the worker, armed once through a marker file so the restarted group does not
crash again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from specray.actors.broker import StreamFailedError, Window
from specray.actors.cluster import check_cluster_gpus
from specray.actors.gang_faults import FaultPlan, MidWindowCrash
from specray.actors.gang_recovery import (AttemptPlanner, CheckpointMismatchError, FeaturesLostError, Resume,
                                          check_position, checkpoint_name, ray_path, storage_filesystem)
from specray.actors.progress import ProgressFeed
from specray.capture.contract import CaptureContract
from specray.capture.store import FeatureChecksumError, FeatureNotFoundError, SampleRef, open_store, read_manifest
from specray.capture.devices import check_ray_devices, resolve_device
from specray.trainer.assembly import (TrainSpec, build_rank, check_capture_fits, check_manifest_fits,
                                      count_draft_vocab, feature_loader, rank_tracker, whole_target_hook)
from specray.trainer.ledger import Ledger, LedgerError
from specray.trainer.loader import TrainBatch, collate
from specray.serving.live_eval import checkpoint_hook
from specray.trainer.loop import TrainRun

FIT_GRACE_S = 90.0  # after timeout_s: time for the workers to notice the deadline and the group to stop
RECAPTURE_TIMEOUT_S = 600.0  # a rank waits this long for lost features to be captured again
# A restart cannot help: a failed stream, lost features, a checkpoint that is not what it claims, a
# ledger that refuses what the gang would write.
TERMINAL_ERRORS = (StreamFailedError, FeaturesLostError, CheckpointMismatchError, LedgerError)


class GangFailedError(RuntimeError):
    """The gang failed more often than ``max_failures``; its checkpoints and ledger are intact."""


class _GangEnded(Exception):
    """A terminal error (``TERMINAL_ERRORS``) every rank learned of: the gang returns, Ray Train does not restart it."""

    def __init__(self, error: str, message: str):
        super().__init__(f"{error}: {message}")
        self.error, self.message = error, message


def _terminal(error: BaseException) -> tuple[str, str]:
    """(class name, message) of a terminal error; a Ray task error's message is its cause's, without the traceback."""
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    kind = next(cls for cls in TERMINAL_ERRORS if isinstance(error, cls))
    return kind.__name__, str(cause)


@dataclass(frozen=True)
class GangResult:
    step: int  # optimizer steps in the final model
    # The final Ray Train checkpoint: a directory (a path, or an s3:// URI on s3:// storage) holding a
    # trainer/checkpoint.py step dir, which export_checkpoint takes as is.
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
        self.device = worker_device(train)
        parts = build_rank(train, contract, rank=rank, world_size=world_size, provenance=provenance,
                           draft_vocab=spec.get("draft_vocab"), device=self.device)
        if self.online:  # FeatureLoader checks a manifest's contract itself
            parts.expected.check_compatible(contract, what="the stream's features")
        self.core = parts.core
        if self.fault is not None and self.fault.point == "mid_window":
            self.core.strategy = MidWindowCrash(self.core.strategy, self.fault, rank, self.accumulation)
        self.run_state = TrainRun(self.core, log_every=train.log_every, extra=parts.extra)
        live = checkpoint_hook(train.live_eval)
        self.on_checkpoint = whole_target_hook(train, live, self.device) if rank == 0 else None
        self.progress = spec.get("progress") if rank == 0 else None
        self.loader = None if self.online else feature_loader(train, manifest, self.store, parts.expected,
                                                               rank=rank, world_size=world_size, device=self.device)
        self.ledger = Ledger(spec["ledger_uri"]) if rank == 0 else None
        self.planner = None if rank != 0 else AttemptPlanner(
            self.ledger, run_uri=spec["run_uri"], resume_from=spec["resume_from"], broker=spec.get("broker"),
            store=self.store if self.online else None, store_uri=spec.get("store_uri"))
        self.attempt = -1
        self.trained_windows: list[Window] = []  # rank 0: trained since the last checkpoint, features not yet deleted
        self.last_checkpoint: int | None = None
        self.location: str | None = None
        self.run_state.tracker = rank_tracker(train, rank)

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

    def _agreed(self, work: Callable):
        """``work()`` on every rank; when any rank hits a terminal error, every rank raises it (``_GangEnded``)."""
        try:
            result, error = work(), None
        except TERMINAL_ERRORS as e:
            result, error = None, _terminal(e)
        ended = [e for e in self._gather(error) if e is not None]
        if ended:
            raise _GangEnded(*ended[0])
        return result

    def _decided(self, work: Callable):
        """Rank 0 runs ``work()``; every rank gets its result, or raises its terminal error (``_GangEnded``)."""
        outcome = None
        if self.rank == 0:
            try:
                outcome = ("done", work())
            except TERMINAL_ERRORS as e:
                outcome = ("ended", _terminal(e))
        kind, value = self._broadcast(outcome)
        if kind == "ended":
            raise _GangEnded(*value)
        return value

    def _publish(self, record: dict | None) -> None:
        """Rank 0: hand a metrics record to the driver's progress feed (no wait)."""
        if record is not None and self.progress is not None:
            self.progress.push.remote(record)

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
        """Choose the resume point (rank 0), load and check it (every rank), then record the attempt (rank 0)."""
        self._remaining()
        ray_checkpoint = ray.train.get_checkpoint()
        resume: Resume = self._decided(lambda: self.planner.choose(ray_checkpoint))
        if resume.location is not None:
            self._agreed(lambda: self._load(resume))
        self.attempt, total_steps = self._decided(lambda: self._write_attempt(resume))
        self.core.settings = dataclasses.replace(self.core.settings, total_steps=total_steps)  # the LR schedule's too
        self.run_state.record_fields = {"attempt": self.attempt}

    def _write_attempt(self, resume: Resume) -> tuple[int, int]:
        """Rank 0: record the attempt; (its id, the step it trains to)."""
        attempt = self.planner.write(resume, world_size=self.world_size, quantum=self.quantum)
        samples = self.spec["stream_samples"]
        if samples is None:
            return attempt, self.train.optim.total_steps
        return attempt, self.planner.total_steps(resume, stream_samples=samples, quantum=self.quantum)

    def _load(self, resume: Resume) -> None:
        filesystem = storage_filesystem(resume.location)
        checkpoint = ray.train.Checkpoint(ray_path(resume.location, filesystem), filesystem=filesystem)
        with checkpoint.as_directory() as directory:
            check_position(directory, resume)
            loader_state = self.run_state.load(directory)
        if self.loader is not None:
            self.loader.load_state_dict(loader_state)
        self.last_checkpoint, self.location = self.step, resume.location

    # -- training --------------------------------------------------------------------------

    def run(self) -> dict | None:
        try:
            self.start_attempt()
            if self.online:
                self._train_online()
            else:
                self._train_offline()
        except _GangEnded as ended:  # every rank, at the same point: no checkpoint, no restart
            self._close()
            return {"ended": ended.error, "message": ended.message} if self.rank == 0 else None
        if self.last_checkpoint != self.step:
            self._checkpoint()
        self._close()
        if self.rank != 0:
            return None
        return {"step": self.step, "checkpoint": self.location, "metrics": self.run_state.records,
                "attempt": self.attempt}

    def _close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.run_state.close()

    def _train_offline(self) -> None:
        while self.step < self.core.settings.total_steps:
            self._remaining()
            start = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(self.accumulation)]
            self._publish(self.run_state.train_step(batches, data_wait=time.perf_counter() - start))
            self._fault("after_step_before_checkpoint")
            if self.step % self.train.checkpoint_every == 0:
                self._checkpoint()

    def _train_online(self) -> None:
        while self.step < self.core.settings.total_steps:
            start = time.perf_counter()
            window, batches = self._agreed(self._next_window)
            if window is None:
                break  # end of stream: every rank gets None for the same step
            self._publish(self.run_state.train_step(batches, data_wait=time.perf_counter() - start))
            acks = self._gather([sid for b in batches for sid in b.sample_ids])
            if self.rank == 0:
                self._ack(window, [sid for rank_ids in acks for sid in rank_ids])
            self._fault("after_step_before_checkpoint")
            if self.step % self.train.checkpoint_every == 0:
                self._checkpoint()

    def _next_window(self) -> tuple[Window | None, list[TrainBatch]]:
        """The next step's window (every rank gets the same) and this rank's micro-batches of it."""
        timeout = self._remaining()
        request = self.spec["broker"].next_window.remote(self.attempt, self.step + 1, timeout=timeout)
        window: Window | None = ray.get(request, timeout=None if timeout is None else timeout + 30)
        if window is None:
            return None, []
        if self.rank == 0:
            self.ledger.dispatched(self.attempt, window.step, window.window_id, window.refs)
        slots = split_window(window.refs, self.world_size * self.accumulation)
        mine = slots[self.rank * self.accumulation:(self.rank + 1) * self.accumulation]
        return window, [self._batch(slot, window) for slot in mine]

    def _batch(self, slot: list[SampleRef], window: Window) -> TrainBatch:
        max_length = self.train.max_length
        if slot:
            batch = collate(self._read(slot), [r.sample_id for r in slot], max_length=max_length)
        else:
            filler = collate(self._read([window.refs[0]]), [], max_length=max_length)
            batch = dataclasses.replace(filler, loss_mask=torch.zeros_like(filler.loss_mask), num_tokens=0)
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def _read(self, refs: list[SampleRef]) -> list[dict[str, torch.Tensor]]:
        """The features of ``refs``; lost or corrupt ones are captured again when the producer can (module docstring)."""
        features: dict[str, dict[str, torch.Tensor]] = {}
        todo = list(refs)
        for _ in range(3):  # a re-captured blob can be lost again only if its new owner dies too
            gone, corrupt = [], []
            for ref in todo:
                try:
                    features[ref.sample_id] = self.store.get(ref)
                except FeatureNotFoundError:
                    gone.append(ref)
                except FeatureChecksumError:
                    corrupt.append(ref)
            todo = gone + corrupt
            if not todo:
                return [features[r.sample_id] for r in refs]
            self._wait_recaptured(gone, corrupt)
        raise FeaturesLostError(f"step {self.step + 1}: samples {[r.sample_id for r in todo][:3]} were lost again "
                                "after 3 re-captures")

    def _wait_recaptured(self, gone: list[SampleRef], corrupt: list[SampleRef]) -> None:
        """Ask the producer to capture these samples again and wait until it did (``FeaturesLostError`` if it cannot)."""
        broker = self.spec["broker"]
        ids = [r.sample_id for r in gone + corrupt]
        if not ray.get(broker.report_lost.remote(gone + corrupt), timeout=60):
            what = []
            if gone:
                what.append(f"the features of {len(gone)} dispatched samples are gone (e.g. "
                            f"{[r.sample_id for r in gone[:3]]})")
            if corrupt:
                what.append(f"the feature blobs of {len(corrupt)} dispatched samples are corrupt: their bytes do not "
                            f"match the checksum of their SampleRef (e.g. {[r.key for r in corrupt[:3]]})")
            raise FeaturesLostError(
                f"step {self.step + 1}: {'; '.join(what)} in {self.spec['store_uri']}, and no producer of this stream "
                "can capture them again. Run the stream's producer with re-capture (as the online pipeline does), "
                "or restore the blobs and resume"
            )
        timeout = min(RECAPTURE_TIMEOUT_S, self._remaining() or RECAPTURE_TIMEOUT_S)
        if not ray.get(broker.wait_recaptured.remote(ids, timeout=timeout), timeout=timeout + 60):
            raise FeaturesLostError(f"step {self.step + 1}: samples {ids[:3]} were not captured again within "
                                    f"{timeout:.0f} s; is the producer running?")

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
        self._publish(self.run_state.checkpoint_record(self.on_checkpoint))  # rank 0: the live fields, if any
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
        self._fault("after_report")
        self.last_checkpoint, self.location = self.step, location
        if self.rank == 0:
            self.ledger.checkpointed(self.attempt, self.step, location)
            self._fault("after_checkpointed")
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


def worker_device(train: TrainSpec) -> torch.device:
    """This gang worker's device: ``train.device`` against the GPUs Ray granted it (``ray.get_gpu_ids()``:
    a worker without a grant may still see its node's GPUs); on CUDA, the one Ray Train assigned it."""
    device = resolve_device(train.device, field=train.device_field, gpus=len(ray.get_gpu_ids()),
                            fix="set train.gpus_per_worker=1 (or more) so that Ray grants each worker a GPU, or "
                                f"{train.device_field}=auto")
    return ray.train.torch.get_device() if device.type == "cuda" else device


def gang_scaling(num_workers: int, cpus_per_worker: float, gpus_per_worker: int) -> tuple[ScalingConfig, TorchConfig]:
    """Ray Train's resources and process group for the gang: GPU workers (``use_gpu``) with NCCL,
    or CPU workers with gloo."""
    if gpus_per_worker < 0:
        raise ValueError(f"train.gpus_per_worker must be >= 0, got {gpus_per_worker}")
    resources = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    scaling = ScalingConfig(num_workers=num_workers, use_gpu=gpus_per_worker > 0, resources_per_worker=resources)
    return scaling, TorchConfig(backend="nccl" if gpus_per_worker else "gloo")


def _gang_worker(spec: dict) -> dict | None:
    import specray.actors.object_store  # noqa: F401  (registers ray:// stores in this worker)

    torch.set_num_threads(1)  # one logical CPU per worker
    context = ray.train.get_context()
    return _GangRank(spec, context.get_world_rank(), context.get_world_size()).run()


# -- driver ----------------------------------------------------------------------------------


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
    resume_from: str | None = None, stream_samples: int | None = None, max_failures: int = 1,
    fault: FaultPlan | None = None, timeout_s: float | None = None, cpus_per_worker: float = 1.0,
    on_record: Callable[[dict], None] | None = None, gpus_per_worker: int = 0,
) -> GangResult:
    """Train ``spec`` with ``num_workers`` DP ranks; online from ``broker``, else offline from ``spec.manifest``.

    The Ray Train run is ``<storage_path>/<spec.name>``: rerunning with the same storage and
    name resumes it (from its newest checkpoint, with any ``num_workers``). ``ledger_uri``
    defaults to ``<storage_path>/<spec.name>/ledger``; an online stream's ledger must stay
    the same across runs that continue one model. ``resume_from`` (a gang checkpoint directory)
    starts a run with no checkpoint of its own: this ledger's checkpoint, or another ledger's
    whose model starts this stream (module docstring, **Recovery**). ``stream_samples`` (online:
    the samples of the stream's pass) sets each attempt's step target from the samples left
    instead of ``optim.total_steps``. ``max_failures`` worker-group restarts are
    allowed before ``GangFailedError``; a terminal error (a failed stream, features that cannot
    come back, a checkpoint that is not what its name says) is raised as is, without a restart.
    Each worker reserves ``cpus_per_worker`` logical CPUs (Ray sizes its torch thread pool to
    match) and ``gpus_per_worker`` GPUs (``gang_scaling``; the rank trains on ``spec.device``,
    ``auto`` = its GPU when it has one). Features captured for another algorithm than ``spec.drafter``'s are refused before
    the gang starts. ``on_record`` is called in the driver with each metrics record rank 0 makes
    (a record comes again with its live fields once its checkpoint measured them).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    online = broker is not None
    if online == (spec.manifest is not None):
        raise ValueError("give exactly one feature source: broker= for online training (with data.manifest null), "
                         f"or data.manifest for offline training; got broker={broker!r}, manifest={spec.manifest!r}")
    check_ray_devices(spec.device, gpus_per_worker, device_field=spec.device_field, gpus_field="train.gpus_per_worker",
                      who="trainer gang workers")
    check_cluster_gpus(num_workers * gpus_per_worker, gpus_field="train.gpus_per_worker", who="trainer gang workers")
    if stream_samples is not None and (not online or stream_samples < 0):
        raise ValueError(f"stream_samples counts an online stream's samples: give it with broker= and >= 0, got "
                         f"{stream_samples} ({'online' if online else 'offline: use optim.total_steps'})")
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
           "resume_from": _absolute(resume_from) if resume_from else None, "stream_samples": stream_samples,
           "deadline": time.time() + timeout_s if timeout_s is not None else None}
    if online:
        stream = _check_stream(broker, spec, quantum)
        job.update(broker=broker, contract=stream["contract"], store_uri=stream["store_uri"],
                   endpoint_url=stream["endpoint_url"])
    else:
        check_manifest_fits(spec, read_manifest(spec.manifest, endpoint_url=spec.endpoint_url).contract)
    if spec.tracking is not None:
        spec.tracking.check_installed()  # here, not after Ray Train's restarts of a rank that cannot import it
    job["draft_vocab"] = count_draft_vocab(spec)  # counted once here, not by every rank (online: draft_vocab_from)
    with ProgressFeed(on_record) if on_record is not None else contextlib.nullcontext() as feed:
        job["progress"] = feed.board if feed is not None else None
        result = _fit_gang(job, spec, num_workers=num_workers, storage_path=storage_path, max_failures=max_failures,
                           timeout_s=timeout_s, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker)
    out = result.return_value
    if "ended" in out:  # a terminal error every rank agreed on (module docstring)
        raise {cls.__name__: cls for cls in TERMINAL_ERRORS}[out["ended"]](out["message"])
    attempts = [a for a in Ledger(ledger_uri).replay().attempts.values() if a["run"] == run_uri]
    return GangResult(out["step"], out["checkpoint"], out["metrics"], attempts, ledger_uri, run_uri)


def _fit_gang(job: dict, spec: TrainSpec, *, num_workers: int, storage_path: str, max_failures: int,
              timeout_s: float | None, cpus_per_worker: float, gpus_per_worker: int):
    """Ray Train's fit of the gang's workers over ``job``; its failures as ``GangFailedError`` / ``TimeoutError``."""
    run_uri, ledger_uri = job["run_uri"], job["ledger_uri"]
    filesystem = storage_filesystem(storage_path)
    scaling, torch_config = gang_scaling(num_workers, cpus_per_worker, gpus_per_worker)
    trainer = TorchTrainer(
        _gang_worker, train_loop_config=job, scaling_config=scaling, torch_config=torch_config,
        run_config=RunConfig(name=spec.name, storage_path=ray_path(storage_path, filesystem),
                             storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=spec.keep_last)),
    )
    try:
        return _fit(trainer, timeout_s)
    except ray.train.TrainingFailedError as e:
        if job["deadline"] is not None and time.time() > job["deadline"]:
            raise TimeoutError(f"the trainer gang ran past timeout_s={timeout_s}; resume it by rerunning with the same "
                               f"storage_path and name") from e
        raise GangFailedError(
            f"the trainer gang failed (max_failures={max_failures} restarts used): {e}. Its checkpoints in {run_uri} "
            f"and the ledger {ledger_uri} are intact: rerun with the same storage_path and name to resume"
        ) from e
