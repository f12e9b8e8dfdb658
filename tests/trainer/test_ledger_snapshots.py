"""Ledger snapshots: written at each checkpoint, equal to a full replay, read instead of the txns they
cover (object reads counted on file:// and on the S3 server), skipped when torn, corrupt or foreign."""

import gzip
import json
import os
import warnings

import pytest

from specray.capture.store import SampleRef, TensorMeta
from specray.trainer.ledger import KEEP_SNAPSHOTS, Ledger, snapshot_name


def _refs(step: int) -> list[SampleRef]:
    return [SampleRef(f"s{step:03d}-{i}", f"features/s{step:03d}-{i}.safetensors",
                      (TensorMeta("input_ids", (4 + i,), "int64"),), 4 + i, 128, "sha256:" + "0" * 64, "c0ffee")
            for i in range(2)]


def _train(ledger: Ledger, attempt: int, steps: range, *, every: int) -> None:
    """``attempt`` trains one window per step; every ``every`` steps a checkpoint, then its windows' deletion."""
    pending = []
    for step in steps:
        window = f"a{attempt}-w{step}"
        ledger.dispatched(attempt, step, window, _refs(step))
        ledger.trained(attempt, step, window, [r.sample_id for r in _refs(step)])
        pending.append(window)
        if step % every == 0:
            ledger.checkpointed(attempt, step, f"ck-{attempt}-{step}")
            ledger.deleted(pending, [r.key for w in pending for r in _refs(int(w.rsplit("w", 1)[1]))])
            pending = []


def _long_history(ledger: Ledger) -> None:
    """Attempt 0: steps 1-23, checkpoints at 5, 10, 15, 20; it dies, attempt 1 resumes from 20: steps 21-43."""
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    _train(ledger, 0, range(1, 24), every=5)
    ledger.attempt(1, parent=(0, 20), world_size=2, quantum=2, checkpoint="ck-0-20", run="r")
    _train(ledger, 1, range(21, 44), every=5)  # last checkpoint 40; steps 41-43 after it


class Reads:
    """Counts object reads (``cat_file``) of a ledger's filesystem."""

    def __init__(self, monkeypatch, ledger: Ledger):
        self.paths: list[str] = []
        cat_file = ledger.fs.cat_file

        def counted(path, *args, **kwargs):
            self.paths.append(path)
            return cat_file(path, *args, **kwargs)

        monkeypatch.setattr(ledger.fs, "cat_file", counted)


def _snapshots(ledger: Ledger) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in ledger.fs.ls(ledger.root, detail=False) if "snapshot-" in p)


def test_replay_from_a_snapshot_equals_a_full_replay_after_every_transaction(tmp_path):
    uri = str(tmp_path / "ledger")
    ledger = Ledger(uri)
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    appends = 0
    for step in range(1, 13):
        _train(ledger, 0, range(step, step + 1), every=3)
        state = Ledger(uri).replay()
        assert state == Ledger(uri).replay(full=True) and state.seq == Ledger(uri).count() - 1
        appends += 1
    checkpoints = [c["step"] for c in Ledger(uri).replay().checkpoints]
    assert checkpoints == [3, 6, 9, 12]
    # one snapshot per checkpoint (at its checkpointed txn), the newest KEEP_SNAPSHOTS kept
    seqs = [t.seq for t in ledger.read() if t.kind == "checkpointed"]
    assert _snapshots(ledger) == [snapshot_name(s) for s in seqs[-KEEP_SNAPSHOTS:]]


def test_resume_reads_the_newest_snapshot_and_the_transactions_after_it(tmp_path, monkeypatch):
    uri = str(tmp_path / "ledger")
    _long_history(Ledger(uri))
    _check_reads(monkeypatch, uri)


@pytest.mark.s3
def test_resume_reads_the_newest_snapshot_and_the_transactions_after_it_on_s3(seaweedfs, monkeypatch):
    uri = seaweedfs.uri(f"ledger-snapshots-{os.urandom(4).hex()}")
    _long_history(Ledger(uri))
    _check_reads(monkeypatch, uri)


def _check_reads(monkeypatch, uri: str) -> None:
    total = Ledger(uri).count()
    full = Ledger(uri).replay(full=True)
    newest = max(t.seq for t in Ledger(uri).read() if t.kind == "checkpointed")  # checkpoint (1, 40)
    reader = Ledger(uri)
    reads = Reads(monkeypatch, reader)
    state = reader.replay()
    assert state == full
    since = total - 1 - newest  # the deletion after checkpoint 40, steps 41-43
    assert since == 7 and len(reads.paths) == 2 + since  # the snapshot, the txn it ends at, the txns after it
    assert reads.paths[0].endswith(snapshot_name(newest))
    assert len(reads.paths) * 10 < total  # 9 of 104 objects
    # the writer opening after that replay reads nothing more, and checks its appends against it
    reader.checkpointed(1, 43, "ck-1-43")
    assert len(reads.paths) == 2 + since
    assert Ledger(uri).replay() == Ledger(uri).replay(full=True)


def _tear(ledger: Ledger, name: str, data: bytes) -> None:
    ledger.fs.pipe_file(f"{ledger.root}/{name}", data)


def _damaged(seq: int, good: bytes) -> dict[str, bytes]:
    """Ways a snapshot goes bad: cut short, a flipped byte in the state, a valid snapshot of another txn."""
    header, _, state = gzip.decompress(good).partition(b"\n")
    fields = json.loads(header)
    flipped = state[:-2] + bytes([state[-2] ^ 1]) + state[-1:]
    foreign = dict(fields, txn_sha256="0" * 64)
    return {
        "torn": good[: len(good) // 2],
        "corrupt": gzip.compress(header + b"\n" + flipped),
        "foreign": gzip.compress(json.dumps(foreign).encode() + b"\n" + state),
        "not-json": gzip.compress(b"{" + b"\n" + state),
    }


@pytest.mark.parametrize("damage", ["torn", "corrupt", "foreign", "not-json"])
def test_a_bad_snapshot_is_skipped_for_an_older_one_then_the_full_replay(tmp_path, monkeypatch, damage):
    uri = str(tmp_path / "ledger")
    _long_history(Ledger(uri))
    ledger = Ledger(uri)
    full = ledger.replay(full=True)
    names = _snapshots(ledger)
    assert len(names) == 2
    for count, name in enumerate(reversed(names), start=1):  # the newest first, then both
        seq = int(name.split("-")[1].split(".")[0])
        _tear(ledger, name, _damaged(seq, ledger.fs.cat_file(f"{ledger.root}/{name}"))[damage])
        reader = Ledger(uri)
        reads = Reads(monkeypatch, reader)
        with pytest.warns(UserWarning) as caught:
            state = reader.replay()
        skipped = [str(w.message).split(" is skipped")[0].rsplit("/", 1)[-1] for w in caught]
        assert skipped == list(reversed(names))[:count]
        assert state == full
        per_bad = 2 if damage == "foreign" else 1  # a foreign one is found out reading its txn
        if count == 1:  # the older snapshot, the txn it ends at, then the txns after it
            older = int(names[0].split("-")[1].split(".")[0])
            assert reads.paths[per_bad].endswith(names[0])
            assert len(reads.paths) == per_bad + 2 + (full.seq - older)
        else:  # every snapshot bad: each read once, then every transaction
            assert len(reads.paths) == 2 * per_bad + full.seq + 1
    # the writer's next checkpoint writes a good snapshot again
    writer = Ledger(uri)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer.checkpointed(1, 43, "ck-1-43")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the newest snapshot is valid: no warning
        assert Ledger(uri).replay() == Ledger(uri).replay(full=True)


def test_a_gap_before_the_snapshot_is_still_an_error(tmp_path):
    from specray.trainer.ledger import LedgerError

    uri = str(tmp_path / "ledger")
    _long_history(Ledger(uri))
    os.unlink(tmp_path / "ledger" / "txn-0000000003.json")
    with pytest.raises(LedgerError, match="has no .*txn-0000000003.json but has later transactions"):
        Ledger(uri).replay()
