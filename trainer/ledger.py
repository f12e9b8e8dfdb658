"""The durable ack ledger of an online feature stream (DESIGN.md §4, seed §7.4).

Online features are consume-once: a blob is deleted after the model has trained on it, so
"which samples is this model made of?" must be answered by a log, not by the store. The
ledger is that log: an append-only sequence of transactions in one directory (``file://`` or
``s3://``, opened like the feature store), one object per transaction::

    <ledger>/txn-0000000000.json            {"seq": 0, "kind": "attempt", "time": ..., ...}
    <ledger>/txn-0000000001.json            {"seq": 1, "kind": "dispatched", ...}
    <ledger>/snapshot-0000000041.json.gz    the replay state of txns 0-41 (at a checkpoint)

A transaction is written atomically and create-only (file: temp file + fsync + hard link +
directory fsync; s3: one conditional PUT, ``If-None-Match: *``), so an existing transaction is
never replaced and of two writers racing for one sequence number exactly one wins; the other
gets a ``LedgerError``. There is a single writer: rank 0 of the trainer gang (or a driver). A
file that does not parse, or lacks its kind's fields, is a ``LedgerError`` naming the file; so
is a gap in the sequence. The writer checks every transaction against its replay state before
writing it (``LedgerState.apply``), so it never writes one that replay would refuse. When it
opens the ledger (its first append) it removes the ``.tmp-*`` files of appends a killed writer
left (file://): with one writer, no other append is in progress then.

Kinds, and the order they are written in per window (``dispatched → trained → checkpointed →
deleted``):

- ``attempt``: ``attempt`` (int, one per worker-group start), ``parent`` (``{"attempt", "step"}``
  of this ledger's checkpoint it resumed from, or null), ``world_size``, ``quantum`` (Q),
  ``checkpoint`` (location resumed from, or null), ``run`` (the training run that made it, e.g.
  the Ray Train run directory; several runs may continue one stream) and ``origin``: null, or
  ``{"ledger", "attempt", "step", "location"}`` of another ledger's checkpoint whose model starts
  this stream (provenance: that model's history is the other ledger's; this one's exactly-once
  covers what the stream trains after it, from the origin's step on).
- ``dispatched``: ``attempt``, ``step`` (the optimizer step the window feeds, 1-based: the step
  count after it), ``window`` (id), ``refs`` (full SampleRef metadata in window order, so a
  window can be re-dispatched from the ledger alone). Written before any rank trains on it.
- ``trained``: ``attempt``, ``step``, ``window``, ``sample_ids`` acknowledged by every rank
  after the optimizer step (gathered over the process group; one txn per step).
- ``checkpointed``: ``attempt``, ``step``, ``location``; written once the checkpoint of that
  step is durable in storage.
- ``deleted``: ``windows`` and ``keys`` whose features were removed (only windows covered by a
  checkpoint; deletion is idempotent, so a crash mid-deletion is finished on restart).

**Snapshots.** After each ``checkpointed`` txn ``N`` the writer stores its replay state as
``snapshot-N.json.gz`` (a JSON header with the digests of the state and of txn ``N``, then the
state, gzip'd; the newest ``KEEP_SNAPSHOTS`` are kept). ``replay`` reads the newest valid
snapshot and the transactions after it, so a resume reads O(transactions since the last
checkpoint) objects, not the whole history; the result equals a full replay
(``replay(full=True)``). A torn or corrupt snapshot, or one that does not match its txn, is
skipped with a warning (the next older one, else the full replay). The listing still covers
every transaction: a gap anywhere is an error.

Replay answers the questions recovery and audit ask (``trainer/ledger_state.py``). The
*lineage* of the model at a checkpoint ``(attempt k, step t)`` is what it was trained on: the
``trained`` txns of attempt ``k`` up to step ``t``, preceded by the lineage of ``k``'s parent
checkpoint, recursively. ``recovery_plan`` turns a checkpoint into what a resumed run must do:
the samples already in its history, the refs to re-dispatch (every dispatched sample outside
the history, in original order, whatever window it was in) and the keys still to delete.
``audit`` checks the promise: every source sample trained exactly once in the final model's
lineage, none lost, no feature of the stream left in the store (other datasets may share its
root).

Sample ids must be unique within a stream (a new producer pass gets new ids, e.g.
``"epoch1/<id>"``): the ledger identifies samples by id.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import hashlib
import json
import os
import re
import uuid
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from specray.capture.store import (TMP_MARK, BlobStore, FeatureChecksumError, FeatureNotFoundError, FeatureStore,
                                   SampleRef, is_temp_of, open_fs)
from specray.trainer.ledger_state import (TXN_FIELDS, TXN_FILE, LedgerError, LedgerState, Txn,  # noqa: F401 (re-exported)
                                          ref_from_json, ref_to_json, txn_name)

SNAPSHOT_FILE = re.compile(r"^snapshot-(\d{10})\.json\.gz$")
SNAPSHOT_FORMAT = 1
KEEP_SNAPSHOTS = 2  # the newest and one before it (a torn newest one falls back to it)
TMP_PREFIX = ".tmp-"  # a file:// append (or snapshot) not yet linked into place


def snapshot_name(seq: int) -> str:
    return f"snapshot-{seq:010d}.json.gz"


# A create-only PUT refused: the key exists (412), or another conditional write of it is in progress (409).
_S3_EXISTS_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


def _s3_error_code(error: OSError) -> str | None:
    """The S3 error code s3fs translated into ``error`` (it keeps the botocore error as the cause)."""
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Ledger:
    """Append and read the transactions under ``uri`` (one writer; any number of readers)."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None):
        self.uri = uri
        self.fs, root, self.protocol = open_fs(uri, endpoint_url=endpoint_url)
        self.root = root.rstrip("/")
        if self.protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)
        self._state: LedgerState | None = None  # the writer's: every txn through the last one it wrote or read
        self._snapshots: list[int] = []  # the writer's: seqs of the snapshots on storage
        self._replayed: LedgerState | None = None  # the last replay's (a writer opened after it starts from it)

    def __repr__(self) -> str:
        return f"Ledger({self.uri!r})"

    def _path(self, seq: int) -> str:
        return f"{self.root}/{txn_name(seq)}"

    def _snapshot_path(self, seq: int) -> str:
        return f"{self.root}/{snapshot_name(seq)}"

    def _names(self) -> list[str]:
        if self.protocol == "s3":
            self.fs.invalidate_cache(self.root)
        try:
            return [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    @staticmethod
    def _parse(names: list[str]) -> tuple[list[int], list[int]]:
        """(transaction seqs, snapshot seqs), each sorted."""
        seqs = sorted(int(m.group(1)) for m in map(TXN_FILE.match, names) if m)
        snapshots = sorted(int(m.group(1)) for m in map(SNAPSHOT_FILE.match, names) if m)
        return seqs, snapshots

    def _check_gaps(self, seqs: list[int]) -> None:
        missing = sorted(set(range(len(seqs))) - set(seqs))
        if missing:
            raise LedgerError(
                f"ledger {self.uri} has no {self._path(missing[0])} but has later transactions: a transaction "
                "was lost; restore it from a backup (replaying around it would misstate what was trained)"
            )

    # -- reading ---------------------------------------------------------------------------

    def read(self) -> list[Txn]:
        """Every transaction in sequence order; raises ``LedgerError`` on a torn file or a gap."""
        seqs, _ = self._parse(self._names())
        self._check_gaps(seqs)
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

    def replay(self, *, full: bool = False) -> LedgerState:
        """The replay state: the newest valid snapshot plus the transactions after it (``full``: every txn)."""
        seqs, snapshots = self._parse(self._names())
        state = self._replay(seqs, [] if full else snapshots)
        self._replayed = state.fork()
        return state

    def _replay(self, seqs: list[int], snapshots: list[int]) -> LedgerState:
        self._check_gaps(seqs)
        state = self._newest_snapshot(snapshots, last=seqs[-1] if seqs else -1)
        start = state.seq + 1 if state is not None else 0
        return LedgerState.from_txns((self._load(seq) for seq in seqs[start:]), start=state)

    def _newest_snapshot(self, snapshots: list[int], *, last: int) -> LedgerState | None:
        for seq in reversed(snapshots):
            state, problem = self._read_snapshot(seq) if seq <= last else (None, f"past the last transaction {last}")
            if state is not None:
                return state
            warnings.warn(f"ledger snapshot {self._snapshot_path(seq)} is skipped: {problem}; replaying the "
                          "transactions before it from an older snapshot or from the start", stacklevel=3)
        return None

    def _read_snapshot(self, seq: int) -> tuple[LedgerState | None, str]:
        """The state snapshot ``seq`` holds, or (None, why it is not valid)."""
        try:
            header, _, state = gzip.decompress(self.fs.cat_file(self._snapshot_path(seq))).partition(b"\n")
            header = json.loads(header)
        except (OSError, EOFError, zlib.error, ValueError) as e:  # gone (pruned), torn, or not gzip'd JSON
            return None, f"unreadable ({type(e).__name__}: {e})"
        if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT or header.get("seq") != seq:
            return None, f"not a format-{SNAPSHOT_FORMAT} specray ledger snapshot of seq {seq}"
        if header.get("state_sha256") != _sha256(state):
            return None, "corrupt (its state does not match its digest)"
        if header.get("txn_sha256") != _sha256(self.fs.cat_file(self._path(seq))):
            return None, f"not a snapshot of this ledger's {txn_name(seq)} (its digest differs)"
        return LedgerState.from_json(json.loads(state)), ""

    def count(self) -> int:
        """How many transactions the ledger holds (without reading them)."""
        return len(self._parse(self._names())[0])

    # -- writing ---------------------------------------------------------------------------

    def _open_writer(self) -> None:
        """The writer's start: remove temp files of killed appends, replay (or take the last replay's state)."""
        names = self._names()
        if self.protocol == "file":
            for name in names:
                if name.startswith(TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):  # not ours to race for: only one writer may run
                        os.unlink(f"{self.root}/{name}")
        seqs, self._snapshots = self._parse(names)
        last = seqs[-1] if seqs else -1
        replayed, self._replayed = self._replayed, None
        self._state = replayed if replayed is not None and replayed.seq == last else self._replay(seqs, self._snapshots)

    def append(self, kind: str, **fields) -> Txn:
        """Durably write the next transaction; returns it once it is on storage.

        Refused with a ``LedgerError`` before anything is written when replay would refuse it.
        """
        if kind not in TXN_FIELDS:
            raise ValueError(f"unknown ledger transaction kind {kind!r}; use one of {sorted(TXN_FIELDS)}")
        lacking = [name for name in TXN_FIELDS[kind] if name not in fields]
        if lacking:
            raise ValueError(f"a {kind!r} transaction needs {lacking}")
        if self._state is None:
            self._open_writer()
        seq = self._state.seq + 1
        body = dict(fields, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"))
        data = json.dumps({"seq": seq, "kind": kind, **body}, sort_keys=True).encode()
        txn = Txn(seq, kind, {k: v for k, v in json.loads(data).items() if k not in ("seq", "kind")})  # as read back
        self._check(txn)
        try:
            self._write_new(self._path(seq), data)
        except BaseException:
            self._state = None  # it holds the txn that was not written: the next append opens the ledger again
            raise
        if kind == "checkpointed":
            self._write_snapshot(seq, data)
        return txn

    def _check(self, txn: Txn) -> None:
        """Apply ``txn`` to the writer's state; raises (nothing applied) when replay would refuse it."""
        self._state.apply(txn, writing=True)

    def _second_writer(self, path: str) -> LedgerError:
        return LedgerError(f"ledger transaction {path} already exists: another process writes this ledger; "
                           "exactly one writer (rank 0 of the gang) may append")

    def _write_new(self, path: str, data: bytes) -> None:
        if self.protocol == "s3":
            # One PUT with If-None-Match: * (readers see all of it or nothing; the store refuses it
            # when the key exists, so of two racing writers exactly one wins).
            try:
                self.fs.pipe_file(path, data, mode="create")
            except OSError as e:
                if isinstance(e, FileExistsError) or _s3_error_code(e) in _S3_EXISTS_CODES:
                    raise self._second_writer(path) from None
                raise
            return
        tmp = self._write_temp(data)
        try:
            os.link(tmp, path)  # unlike rename, fails instead of replacing an existing txn
        except FileExistsError:
            raise self._second_writer(path) from None
        except FileNotFoundError:  # another writer opened the ledger and removed our temp file
            raise self._second_writer(path) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._fsync_root()

    def _write_temp(self, data: bytes) -> str:
        tmp = f"{self.root}/{TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _fsync_root(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_snapshot(self, seq: int, txn_data: bytes) -> None:
        """Store the writer's state through txn ``seq`` (just written), then prune older snapshots."""
        state = json.dumps(self._state.to_json(), sort_keys=True, separators=(",", ":")).encode()
        header = {"format": SNAPSHOT_FORMAT, "seq": seq, "state_sha256": _sha256(state), "txn_sha256": _sha256(txn_data)}
        data = gzip.compress(json.dumps(header, sort_keys=True).encode() + b"\n" + state, compresslevel=6, mtime=0)
        path = self._snapshot_path(seq)
        if self.protocol == "s3":
            self.fs.pipe_file(path, data)  # one PUT: readers see all of it or nothing
        else:
            os.replace(self._write_temp(data), path)
            self._fsync_root()
        self._snapshots.append(seq)
        while len(self._snapshots) > KEEP_SNAPSHOTS:
            old = self._snapshot_path(self._snapshots.pop(0))
            if self.protocol == "s3":
                self.fs.rm_file(old)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)

    def attempt(self, attempt: int, *, parent: tuple[int, int] | None, world_size: int, quantum: int,
                checkpoint: str | None, run: str, origin: dict | None = None) -> Txn:
        parent_json = {"attempt": parent[0], "step": parent[1]} if parent else None
        return self.append("attempt", attempt=attempt, parent=parent_json, world_size=world_size, quantum=quantum,
                           checkpoint=checkpoint, run=run, origin=origin)

    def dispatched(self, attempt: int, step: int, window: str, refs: Iterable[SampleRef]) -> Txn:
        return self.append("dispatched", attempt=attempt, step=step, window=window, refs=[ref_to_json(r) for r in refs])

    def trained(self, attempt: int, step: int, window: str, sample_ids: Iterable[str]) -> Txn:
        return self.append("trained", attempt=attempt, step=step, window=window, sample_ids=list(sample_ids))

    def checkpointed(self, attempt: int, step: int, location: str) -> Txn:
        return self.append("checkpointed", attempt=attempt, step=step, location=location)

    def deleted(self, windows: Iterable[str], keys: Iterable[str]) -> Txn:
        return self.append("deleted", windows=list(windows), keys=list(keys))


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
