"""The durable ack ledger of an online feature stream (DESIGN.md §4, seed §7.4).

Online features are consume-once: a blob is deleted after the model has trained on it, so
"which samples is this model made of?" must be answered by a log, not by the store. The
ledger is that log: an append-only sequence of transactions in one directory (``file://`` or
``s3://``, opened like the feature store), one object per transaction::

    <ledger>/txn-0000000000.json   {"seq": 0, "kind": "attempt", "time": ..., ...}
    <ledger>/txn-0000000001.json   {"seq": 1, "kind": "dispatched", ...}

A transaction is written atomically and create-only (file: temp file + fsync + hard link +
directory fsync; s3: one conditional PUT, ``If-None-Match: *``), so an existing transaction is
never replaced and of two writers racing for one sequence number exactly one wins; the other
gets a ``LedgerError``. There is a single writer: rank 0 of the trainer gang (or a driver). A
file that does not parse, or lacks its kind's fields, is a ``LedgerError`` naming the file; so
is a gap in the sequence.

Kinds, and the order they are written in per window (``dispatched → trained → checkpointed →
deleted``):

- ``attempt``: ``attempt`` (int, one per worker-group start), ``parent`` (``{"attempt", "step"}``
  of the checkpoint it resumed from, or null), ``world_size``, ``quantum`` (Q), ``checkpoint``
  (location resumed from, or null), ``run`` (the training run that made it, e.g. the Ray
  Train run directory; several runs may continue one stream).
- ``dispatched``: ``attempt``, ``step`` (the optimizer step the window feeds, 1-based: the step
  count after it), ``window`` (id), ``refs`` (full SampleRef metadata in window order, so a
  window can be re-dispatched from the ledger alone). Written before any rank trains on it.
- ``trained``: ``attempt``, ``step``, ``window``, ``sample_ids`` acknowledged by every rank
  after the optimizer step (gathered over the process group; one txn per step).
- ``checkpointed``: ``attempt``, ``step``, ``location``; written once the checkpoint of that
  step is durable in storage.
- ``deleted``: ``windows`` and ``keys`` whose features were removed (only windows covered by a
  checkpoint; deletion is idempotent, so a crash mid-deletion is finished on restart).

Replay answers the questions recovery and audit ask. The *lineage* of the model at a
checkpoint ``(attempt k, step t)`` is what it was trained on: the ``trained`` txns of attempt
``k`` up to step ``t``, preceded by the lineage of ``k``'s parent checkpoint, recursively.
``recovery_plan`` turns a checkpoint into what a resumed run must do: the samples already in
its history, the refs to re-dispatch (every dispatched sample outside the history, in
original order, whatever window it was in) and the keys still to delete. ``audit`` checks the
promise: every source sample trained exactly once in the final model's lineage, none lost,
no feature of the stream left in the store (other datasets may share its root).

Sample ids must be unique within a stream (a new producer pass gets new ids, e.g.
``"epoch1/<id>"``): the ledger identifies samples by id.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable

from specray.capture.store import (TMP_MARK, BlobStore, FeatureChecksumError, FeatureNotFoundError, FeatureStore,
                                   SampleRef, TensorMeta, is_temp_of, open_fs)

TXN_FILE = re.compile(r"^txn-(\d{10})\.json$")
TXN_FIELDS = {
    "attempt": ("attempt", "parent", "world_size", "quantum", "checkpoint", "run"),
    "dispatched": ("attempt", "step", "window", "refs"),
    "trained": ("attempt", "step", "window", "sample_ids"),
    "checkpointed": ("attempt", "step", "location"),
    "deleted": ("windows", "keys"),
}


class LedgerError(ValueError):
    """The ledger is torn, has a gap, has a second writer, or contradicts itself."""


def _txn_name(seq: int) -> str:
    return f"txn-{seq:010d}.json"


# A create-only PUT refused: the key exists (412), or another conditional write of it is in progress (409).
_S3_EXISTS_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


def _s3_error_code(error: OSError) -> str | None:
    """The S3 error code s3fs translated into ``error`` (it keeps the botocore error as the cause)."""
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code")


def ref_to_json(ref: SampleRef) -> dict:
    return asdict(ref)


def ref_from_json(data: dict) -> SampleRef:
    tensors = tuple(TensorMeta(t["name"], tuple(t["shape"]), t["dtype"]) for t in data["tensors"])
    return SampleRef(data["sample_id"], data["key"], tensors, data["num_tokens"], data["num_bytes"],
                     data["checksum"], data["contract"])


@dataclass(frozen=True)
class Txn:
    seq: int
    kind: str
    body: dict  # the kind's fields (TXN_FIELDS), plus "time"


class Ledger:
    """Append and read the transactions under ``uri`` (one writer; any number of readers)."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None):
        self.uri = uri
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url)
        self.root = root.rstrip("/")
        if self.protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)
        self._next_seq: int | None = None

    def __repr__(self) -> str:
        return f"Ledger({self.uri!r})"

    def _path(self, seq: int) -> str:
        return f"{self.root}/{_txn_name(seq)}"

    def _seqs(self) -> list[int]:
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(TXN_FILE.match, names) if m)

    # -- reading ---------------------------------------------------------------------------

    def read(self) -> list[Txn]:
        """Every transaction in sequence order; raises ``LedgerError`` on a torn file or a gap."""
        if self.protocol == "s3":
            self.fs.invalidate_cache(self.root)
        seqs = self._seqs()
        missing = sorted(set(range(len(seqs))) - set(seqs))
        if missing:
            raise LedgerError(
                f"ledger {self.uri} has no {self._path(missing[0])} but has later transactions: a transaction "
                "was lost; restore it from a backup (replaying around it would misstate what was trained)"
            )
        return [self._load(seq) for seq in seqs]

    def _load(self, seq: int) -> Txn:
        path = self._path(seq)
        try:
            data = json.loads(self.fs.cat_file(path))
        except (ValueError, UnicodeDecodeError) as e:
            raise LedgerError(f"ledger transaction {path} is torn or not JSON ({e}); restore it from a backup") from None
        if not isinstance(data, dict) or data.get("seq") != seq or data.get("kind") not in TXN_FIELDS:
            raise LedgerError(
                f"ledger transaction {path} is not a specray transaction of seq {seq} "
                f"(kind {data.get('kind') if isinstance(data, dict) else None!r}); restore it from a backup"
            )
        lacking = [name for name in TXN_FIELDS[data["kind"]] if name not in data]
        if lacking:
            raise LedgerError(f"ledger transaction {path} ({data['kind']}) lacks {lacking}; restore it from a backup")
        body = {k: v for k, v in data.items() if k not in ("seq", "kind")}
        return Txn(seq, data["kind"], body)

    def replay(self) -> "LedgerState":
        return LedgerState.from_txns(self.read())

    def count(self) -> int:
        """How many transactions the ledger holds (without reading them)."""
        if self.protocol == "s3":
            self.fs.invalidate_cache(self.root)
        return len(self._seqs())

    # -- writing ---------------------------------------------------------------------------

    def append(self, kind: str, **fields) -> Txn:
        """Durably write the next transaction; returns it once it is on storage."""
        if kind not in TXN_FIELDS:
            raise ValueError(f"unknown ledger transaction kind {kind!r}; use one of {sorted(TXN_FIELDS)}")
        lacking = [name for name in TXN_FIELDS[kind] if name not in fields]
        if lacking:
            raise ValueError(f"a {kind!r} transaction needs {lacking}")
        if self._next_seq is None:
            seqs = self._seqs()
            self._next_seq = seqs[-1] + 1 if seqs else 0
        seq = self._next_seq
        body = dict(fields, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"))
        data = json.dumps({"seq": seq, "kind": kind, **body}, sort_keys=True).encode()
        self._write_new(self._path(seq), data)
        self._next_seq = seq + 1
        return Txn(seq, kind, body)

    def _write_new(self, path: str, data: bytes) -> None:
        second_writer = LedgerError(
            f"ledger transaction {path} already exists: another process writes this ledger; "
            "exactly one writer (rank 0 of the gang) may append"
        )
        if self.protocol == "s3":
            # One PUT with If-None-Match: * (readers see all of it or nothing; the store refuses it
            # when the key exists, so of two racing writers exactly one wins).
            try:
                self.fs.pipe_file(path, data, mode="create")
            except OSError as e:
                if isinstance(e, FileExistsError) or _s3_error_code(e) in _S3_EXISTS_CODES:
                    raise second_writer from None
                raise
            return
        tmp = f"{self.root}/.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # unlike rename, fails instead of replacing an existing txn
        except FileExistsError:
            raise second_writer from None
        finally:
            os.unlink(tmp)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def attempt(self, attempt: int, *, parent: tuple[int, int] | None, world_size: int, quantum: int,
                checkpoint: str | None, run: str) -> Txn:
        parent_json = {"attempt": parent[0], "step": parent[1]} if parent else None
        return self.append("attempt", attempt=attempt, parent=parent_json, world_size=world_size, quantum=quantum,
                           checkpoint=checkpoint, run=run)

    def dispatched(self, attempt: int, step: int, window: str, refs: Iterable[SampleRef]) -> Txn:
        return self.append("dispatched", attempt=attempt, step=step, window=window, refs=[ref_to_json(r) for r in refs])

    def trained(self, attempt: int, step: int, window: str, sample_ids: Iterable[str]) -> Txn:
        return self.append("trained", attempt=attempt, step=step, window=window, sample_ids=list(sample_ids))

    def checkpointed(self, attempt: int, step: int, location: str) -> Txn:
        return self.append("checkpointed", attempt=attempt, step=step, location=location)

    def deleted(self, windows: Iterable[str], keys: Iterable[str]) -> Txn:
        return self.append("deleted", windows=list(windows), keys=list(keys))


@dataclass
class LedgerState:
    """What replaying the transactions gives (built by ``Ledger.replay``).

    Replay checks that the history is one a gang can write, and raises ``LedgerError`` naming
    the first transaction that breaks it: attempt ids increase and an attempt resumes from an
    earlier attempt's checkpoint (never its own, which would loop the lineage); a window is
    dispatched once, by a recorded attempt, at the step after the attempt's last trained one;
    an attempt trains consecutive steps from its parent's step + 1, each the window dispatched
    for that step with exactly its samples; an attempt that dispatched windows checkpoints only
    its resumed step or a step it trained (an attempt that never dispatched, e.g. offline
    training, is not checked).
    """

    attempts: dict[int, dict] = field(default_factory=dict)  # attempt id -> attempt txn body
    windows: dict[str, list[SampleRef]] = field(default_factory=dict)  # window id -> refs, in dispatch order
    trained: dict[int, list[dict]] = field(default_factory=dict)  # attempt -> trained bodies, by step
    checkpoints: list[dict] = field(default_factory=list)  # checkpointed bodies, in write order
    deleted_windows: set[str] = field(default_factory=set)
    _dispatched_by: dict[str, tuple[int, int, int]] = field(default_factory=dict, repr=False)  # window -> (seq, attempt, step)
    _dispatching: set[int] = field(default_factory=set, repr=False)  # attempts that dispatched a window
    _attempt_seq: dict[int, int] = field(default_factory=dict, repr=False)  # attempt -> seq of its txn

    @classmethod
    def from_txns(cls, txns: Iterable[Txn]) -> "LedgerState":
        state = cls()
        for txn in txns:
            getattr(state, f"_apply_{txn.kind}")(txn)
        for attempt, body in state.attempts.items():
            parent = body["parent"]
            if parent and parent["attempt"] in state.attempts and parent["attempt"] > attempt:
                raise LedgerError(f"{_txn_name(state._attempt_seq[attempt])} (attempt): attempt {attempt} resumes from "
                                  f"attempt {parent['attempt']}, which started later; restore the ledger from a backup")
        return state

    def _floor(self, attempt: int) -> int:
        parent = self.attempts[attempt]["parent"]
        return parent["step"] if parent else 0

    def _last_step(self, attempt: int) -> int:
        trained = self.trained.get(attempt)
        return trained[-1]["step"] if trained else self._floor(attempt)

    def _apply_attempt(self, txn: Txn) -> None:
        body, where = txn.body, f"{_txn_name(txn.seq)} (attempt)"
        attempt, parent = body["attempt"], body["parent"]
        if self.attempts and attempt <= max(self.attempts):
            raise LedgerError(f"{where}: attempt {attempt} starts after attempt {max(self.attempts)}; attempt ids "
                              "increase with every start (a second writer?); restore the ledger from a backup")
        if parent and parent["attempt"] == attempt:
            raise LedgerError(f"{where}: attempt {attempt} resumes from a checkpoint of itself; "
                              "restore the ledger from a backup")
        self.attempts[attempt] = body
        self._attempt_seq[attempt] = txn.seq

    def _apply_dispatched(self, txn: Txn) -> None:
        body, where = txn.body, f"{_txn_name(txn.seq)} (dispatched)"
        attempt, step, window = body["attempt"], body["step"], body["window"]
        if window in self._dispatched_by:
            raise LedgerError(f"{where}: window {window} was dispatched already by "
                              f"{_txn_name(self._dispatched_by[window][0])}; restore the ledger from a backup")
        if attempt not in self.attempts:
            raise LedgerError(f"{where}: attempt {attempt} dispatches window {window} but has no attempt txn before it")
        if step != self._last_step(attempt) + 1:
            raise LedgerError(f"{where}: attempt {attempt} dispatches step {step}, but its next step is "
                              f"{self._last_step(attempt) + 1}; restore the ledger from a backup")
        self.windows[window] = [ref_from_json(r) for r in body["refs"]]
        self._dispatched_by[window] = (txn.seq, attempt, step)
        self._dispatching.add(attempt)

    def _apply_trained(self, txn: Txn) -> None:
        body, where = txn.body, f"{_txn_name(txn.seq)} (trained)"
        attempt, step, window = body["attempt"], body["step"], body["window"]
        if window not in self._dispatched_by:
            raise LedgerError(f"{where}: window {window} was trained but never dispatched")
        if step != self._last_step(attempt) + 1:
            raise LedgerError(f"{where}: attempt {attempt} trains step {step} after step {self._last_step(attempt)}; "
                              "an attempt trains consecutive steps once each; restore the ledger from a backup")
        seq, by, at = self._dispatched_by[window]
        if (by, at) != (attempt, step):
            raise LedgerError(f"{where}: window {window} was dispatched for attempt {by} step {at} "
                              f"({_txn_name(seq)}), not attempt {attempt} step {step}")
        expected = sorted(ref.sample_id for ref in self.windows[window])
        if sorted(body["sample_ids"]) != expected:
            raise LedgerError(f"{where}: attempt {attempt} step {step} acknowledged {sorted(body['sample_ids'])} "
                              f"but window {window} holds {expected}")
        self.trained.setdefault(attempt, []).append(body)

    def _apply_checkpointed(self, txn: Txn) -> None:
        attempt, step = txn.body["attempt"], txn.body["step"]
        trained = {t["step"] for t in self.trained.get(attempt, [])}
        if attempt in self._dispatching and step != self._floor(attempt) and step not in trained:
            raise LedgerError(f"{_txn_name(txn.seq)} (checkpointed): step {step} of attempt {attempt}, which it never "
                              f"trained (its last trained step is {self._last_step(attempt)}); restore the ledger from a "
                              "backup")
        self.checkpoints.append(txn.body)

    def _apply_deleted(self, txn: Txn) -> None:
        self.deleted_windows.update(txn.body["windows"])

    @property
    def next_attempt(self) -> int:
        return max(self.attempts, default=-1) + 1

    def last_checkpoint(self) -> dict | None:
        """The newest ``checkpointed`` body (the head of the live lineage), or None."""
        return self.checkpoints[-1] if self.checkpoints else None

    def find_checkpoint(self, attempt: int, step: int) -> dict | None:
        return next((c for c in self.checkpoints if (c["attempt"], c["step"]) == (attempt, step)), None)

    def lineage(self, attempt: int, step: int) -> list[dict]:
        """``trained`` bodies the model at checkpoint (attempt, step) is made of, oldest first."""
        parts: list[list[dict]] = []
        current: tuple[int, int] | None = (attempt, step)
        while current is not None:
            a, s = current
            if a not in self.attempts:
                raise LedgerError(f"checkpoint (attempt {a}, step {s}) names an attempt the ledger has no attempt txn for")
            parent = self.attempts[a]["parent"]  # an earlier attempt (checked by replay): the walk ends
            parts.append([t for t in self.trained.get(a, []) if t["step"] <= s])
            current = (parent["attempt"], parent["step"]) if parent else None
        return [t for part in reversed(parts) for t in part]


@dataclass(frozen=True)
class RecoveryPlan:
    """What a run resuming from ``parent`` must do before it trains (see ``recovery_plan``)."""

    parent: tuple[int, int] | None  # (attempt, step) of the checkpoint resumed from
    history: frozenset[str]  # sample ids in the lineage of that checkpoint
    redispatch: list[SampleRef]  # dispatched samples outside the history, in original order
    delete_windows: list[str]  # lineage windows without a deleted txn (deletion crashed or never ran)
    delete_keys: list[str]  # their keys
    lost: list[SampleRef]  # dispatched samples outside the history whose features are gone


def _intact(store: BlobStore, ref: SampleRef) -> bool:
    """Whether ``ref``'s blob is in ``store`` and matches its size and checksum."""
    try:
        store.get(ref)
    except (FeatureNotFoundError, FeatureChecksumError):
        return False
    return True


def recovery_plan(state: LedgerState, parent: tuple[int, int] | None, *, store: BlobStore | None = None,
                  recapture: bool = False) -> RecoveryPlan:
    """Resume from checkpoint ``parent`` (None = from scratch): history, re-dispatch, deletions.

    A sample is re-dispatched iff it was dispatched and is not in the history. One whose
    features are gone — deleted (a window trained under a later checkpoint than ``parent``),
    or, when ``store`` is given, missing or corrupt there (each blob is read and checked against
    its SampleRef's checksum: a resume reads at most the samples in flight) — is reported in
    ``lost``; it is also re-dispatched, in its place, when ``recapture`` says a producer will
    capture it again (``actors/broker.py``), and left out otherwise.
    """
    lineage = state.lineage(*parent) if parent else []
    history = frozenset(sid for t in lineage for sid in t["sample_ids"])
    lineage_windows = [t["window"] for t in lineage]
    delete_windows = [w for w in lineage_windows if w not in state.deleted_windows]
    delete_keys = list(dict.fromkeys(ref.key for w in delete_windows for ref in state.windows[w]))
    covered = set(lineage_windows)
    deleted_keys = {ref.key for w in state.deleted_windows for ref in state.windows.get(w, ())}
    redispatch: dict[str, SampleRef] = {}
    lost: dict[str, SampleRef] = {}
    for window, refs in state.windows.items():
        if window in covered:
            continue
        for ref in refs:
            if ref.sample_id in history or ref.sample_id in redispatch or ref.sample_id in lost:
                continue
            if ref.key in deleted_keys or (store is not None and not _intact(store, ref)):
                lost[ref.sample_id] = ref
                if not recapture:
                    continue
            redispatch[ref.sample_id] = ref
    return RecoveryPlan(parent, history, list(redispatch.values()), delete_windows, delete_keys, list(lost.values()))


@dataclass(frozen=True)
class AuditReport:
    final: tuple[int, int] | None  # checkpoint whose lineage was audited
    trained: int  # sample trainings in that lineage (with repeats)
    duplicates: dict[str, int]  # sample id -> times trained, where > 1
    missing: list[str]  # source samples never trained in the lineage
    unexpected: list[str]  # trained samples that are not source samples
    leftover_keys: list[str]  # blobs still in the feature store

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected or self.leftover_keys)

    def summary(self) -> str:
        def few(items) -> str:
            items = list(items)
            return f"{len(items)} {items[:5]}{' ...' if len(items) > 5 else ''}"

        return (f"audit of checkpoint {self.final}: {self.trained} trained, duplicates {few(self.duplicates)}, "
                f"missing {few(self.missing)}, unexpected {few(self.unexpected)}, leftover {few(self.leftover_keys)}")


def store_keys(store: BlobStore, keys: Iterable[str]) -> list[str]:
    """Which of ``keys`` are in ``store``, plus temp files of interrupted ``file://`` writes of them.

    Only the given keys are looked at (a store root may hold other datasets' blobs): a
    ``file://`` or ``s3://`` store lists each directory that holds one of them once; other
    backends cannot list, so each key is asked for.
    """
    keys = set(keys)
    if not isinstance(store, FeatureStore):
        return sorted(key for key in keys if store.exists(key))
    names_by_dir: dict[str, set[str]] = {}
    for key in keys:
        directory, _, name = key.rpartition("/")
        names_by_dir.setdefault(directory, set()).add(name)
    found = []
    for directory, names in names_by_dir.items():
        path = f"{store.root}/{directory}".rstrip("/")
        if store.protocol == "s3":
            store.fs.invalidate_cache(path)
        try:
            entries = [p.rsplit("/", 1)[-1] for p in store.fs.ls(path, detail=False)]
        except FileNotFoundError:
            continue
        for entry in entries:
            base = entry.rsplit(TMP_MARK, 1)[0]
            if entry in names or (base in names and is_temp_of(entry, base)):
                found.append(f"{directory}/{entry}" if directory else entry)
    return sorted(found)


def stream_keys(state: LedgerState) -> set[str]:
    """Every key the ledger dispatched."""
    return {ref.key for refs in state.windows.values() for ref in refs}


def audit(ledger: Ledger | LedgerState, *, source_ids: Iterable[str], store: BlobStore,
          final: tuple[int, int] | None = None, keys: Iterable[str] | None = None) -> AuditReport:
    """Check exactly-once training of ``source_ids`` in the lineage of ``final`` (default: newest checkpoint).

    Leftovers are looked for among ``keys``, the keys the stream's producer writes (default:
    every key the ledger dispatched); other blobs under the store root are not the stream's.
    """
    state = ledger.replay() if isinstance(ledger, Ledger) else ledger
    if final is None:
        last = state.last_checkpoint()
        final = (last["attempt"], last["step"]) if last else None
    counts = Counter(sid for t in (state.lineage(*final) if final else []) for sid in t["sample_ids"])
    source = set(source_ids)
    return AuditReport(
        final=final,
        trained=sum(counts.values()),
        duplicates={sid: n for sid, n in sorted(counts.items()) if n > 1},
        missing=sorted(source - set(counts)),
        unexpected=sorted(set(counts) - source),
        leftover_keys=store_keys(store, stream_keys(state) if keys is None else keys),
    )
