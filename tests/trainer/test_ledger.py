"""The ack ledger: atomic append, replay, lineage across attempts, recovery plan, audit, torn txns,
the writer's checks, temp files of killed appends, a stream started from another ledger's checkpoint.

(Snapshots: tests/trainer/test_ledger_snapshots.py.)"""

import json
import multiprocessing
import os
import re
import signal

import pytest
import torch

from specray.capture.store import FeatureStore, SampleRef, TensorMeta, temp_name
from specray.trainer.ledger import Ledger, LedgerError, LedgerState, audit, recovery_plan


class Unchecked(Ledger):
    """A writer without the writer's checks: it writes histories replay must refuse (as a second
    writer or a damaged backup would leave them), to test replay. No snapshots."""

    def _check(self, txn) -> None:
        self._state = LedgerState(seq=txn.seq)

    def _write_snapshot(self, seq, txn_data) -> None:
        pass


def _ref(sample_id: str) -> SampleRef:
    return SampleRef(sample_id, f"features/{sample_id}.safetensors", (TensorMeta("input_ids", (4,), "int64"),),
                     4, 128, "sha256:" + "0" * 64, "c0ffee")


def _refs(*ids: str) -> list[SampleRef]:
    return [_ref(i) for i in ids]


def _crashed_then_resumed(ledger: Ledger) -> None:
    """Attempt 0 trains s1, s2, checkpoints at 2, trains s3 and dies with w4 dispatched.

    Attempt 1 resumes from (0, 2); its window s3 re-splits w3 + w4 (Q 4 -> 2), only 2 of them fit.
    """
    ledger.attempt(0, parent=None, world_size=2, quantum=2, checkpoint=None, run="r")
    for step, ids in ((1, "ab"), (2, "cd")):
        ledger.dispatched(0, step, f"w{step}", _refs(*ids))
        ledger.trained(0, step, f"w{step}", list(ids))
    ledger.checkpointed(0, 2, "ck-0-2")
    ledger.dispatched(0, 3, "w3", _refs("e", "f"))
    ledger.trained(0, 3, "w3", ["e", "f"])
    ledger.dispatched(0, 4, "w4", _refs("g", "h"))
    ledger.attempt(1, parent=(0, 2), world_size=1, quantum=2, checkpoint="ck-0-2", run="r")
    ledger.dispatched(1, 3, "x3", _refs("e", "f"))
    ledger.trained(1, 3, "x3", ["f", "e"])
    ledger.checkpointed(1, 3, "ck-1-3")


def test_append_writes_one_atomic_file_per_txn_and_replays_in_order(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger"))
    ledger.attempt(0, parent=None, world_size=2, quantum=4, checkpoint=None, run="r")
    ledger.dispatched(0, 1, "w1", _refs("a", "b"))
    names = sorted(os.listdir(tmp_path / "ledger"))
    assert names == ["txn-0000000000.json", "txn-0000000001.json"]  # no temp file left behind
    first = json.loads((tmp_path / "ledger" / names[0]).read_text())
    assert first["kind"] == "attempt" and first["seq"] == 0 and first["run"] == "r"

    again = Ledger((tmp_path / "ledger").as_uri())  # a new writer continues the sequence
    again.trained(0, 1, "w1", ["a", "b"])
    txns = again.read()
    assert [(t.seq, t.kind) for t in txns] == [(0, "attempt"), (1, "dispatched"), (2, "trained")]
    assert ledger.replay().windows["w1"] == _refs("a", "b")  # refs round-trip in full

    with pytest.raises(LedgerError, match="txn-0000000002.json already exists: another process"):
        ledger.deleted([], [])  # the first writer's state is stale: a second writer
    with pytest.raises(ValueError, match=r"a 'trained' transaction needs \['sample_ids'\]"):
        again.append("trained", attempt=0, step=1, window="w1")


def test_torn_or_missing_txn_is_an_error_naming_the_file(tmp_path):
    ledger = Ledger(str(tmp_path))
    _crashed_then_resumed(ledger)
    for snapshot in tmp_path.glob("snapshot-*"):  # replay reads txns a snapshot covers only without it
        snapshot.unlink()
    torn = tmp_path / "txn-0000000005.json"
    good = torn.read_bytes()
    torn.write_bytes(good[: len(good) // 2])
    with pytest.raises(LedgerError, match="txn-0000000005.json is torn or not JSON"):
        ledger.replay()
    torn.write_text(json.dumps({"seq": 5, "kind": "trained", "attempt": 0}))
    with pytest.raises(LedgerError, match=r"txn-0000000005.json \(trained\) lacks \['step', 'window', 'sample_ids'\]"):
        ledger.read()
    torn.unlink()
    with pytest.raises(LedgerError, match="has no .*txn-0000000005.json but has later transactions"):
        ledger.read()


def test_lineage_follows_the_attempt_chain(tmp_path):
    ledger = Ledger(str(tmp_path))
    _crashed_then_resumed(ledger)
    state = ledger.replay()
    assert state.next_attempt == 2
    assert state.last_checkpoint()["location"] == "ck-1-3"
    assert [(t["attempt"], t["step"], t["window"]) for t in state.lineage(1, 3)] == [
        (0, 1, "w1"), (0, 2, "w2"), (1, 3, "x3")]  # attempt 0's s3 (w3) is not in it
    assert [t["window"] for t in state.lineage(0, 2)] == ["w1", "w2"]
    assert [t["window"] for t in state.lineage(0, 3)] == ["w1", "w2", "w3"]
    with pytest.raises(LedgerError, match="attempt 7"):
        state.lineage(7, 1)


def test_recovery_plan_redispatches_everything_outside_the_history_in_order(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger"))
    _crashed_then_resumed(ledger)
    ledger.deleted(["w1"], [r.key for r in _refs("a", "b")])  # deletion of w2 crashed before its txn
    state = ledger.replay()

    plan = recovery_plan(state, (0, 2))  # what attempt 1 saw when it started
    assert plan.history == {"a", "b", "c", "d"}
    assert [r.sample_id for r in plan.redispatch] == ["e", "f", "g", "h"]  # w3 was trained but not checkpointed
    assert plan.delete_windows == ["w2"] and plan.delete_keys == [_ref("c").key, _ref("d").key]
    assert plan.lost == []

    plan = recovery_plan(state, (1, 3))  # a restart after attempt 1's checkpoint
    assert plan.history == {"a", "b", "c", "d", "e", "f"}
    assert [r.sample_id for r in plan.redispatch] == ["g", "h"]
    assert plan.delete_windows == ["w2", "x3"]

    scratch = recovery_plan(state, None)  # from scratch, the deleted w1 cannot be trained again
    assert [r.sample_id for r in scratch.redispatch] == list("cdefgh") and [r.sample_id for r in scratch.lost] == ["a", "b"]
    # with a producer that captures again, the lost samples are re-dispatched in their place
    scratch = recovery_plan(state, None, recapture=True)
    assert [r.sample_id for r in scratch.redispatch] == list("abcdefgh") and [r.sample_id for r in scratch.lost] == ["a", "b"]

    ledger.deleted(["x3"], [r.key for r in _refs("e", "f")])
    assert [r.sample_id for r in recovery_plan(ledger.replay(), (0, 2)).lost] == ["e", "f"]  # deleted under the later checkpoint (1, 3)


def test_recovery_plan_counts_a_missing_or_corrupt_blob_as_lost(tmp_path):
    """With a store, each blob outside the history is read and checked: a corrupt one is as good as gone."""
    store = FeatureStore(str(tmp_path / "store"))
    refs = {i: store.put(f"features/{i}.safetensors", {"input_ids": torch.arange(4)}, sample_id=i, num_tokens=4,
                         contract="c0ffee") for i in "abcdef"}
    ledger = Ledger(str(tmp_path / "ledger"))
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    ledger.dispatched(0, 1, "w1", [refs["a"], refs["b"]])
    ledger.trained(0, 1, "w1", ["a", "b"])
    ledger.checkpointed(0, 1, "ck-0-1")
    ledger.dispatched(0, 2, "w2", [refs[i] for i in "cdef"])
    store.delete(refs["d"].key)  # gone
    path = tmp_path / "store" / refs["e"].key
    path.write_bytes(path.read_bytes()[:-1] + b"?")  # corrupt: same size, another checksum
    state = ledger.replay()

    plan = recovery_plan(state, (0, 1), store=store)
    assert [r.sample_id for r in plan.lost] == ["d", "e"] and [r.sample_id for r in plan.redispatch] == ["c", "f"]
    plan = recovery_plan(state, (0, 1), store=store, recapture=True)  # captured again, in their place
    assert [r.sample_id for r in plan.lost] == ["d", "e"] and [r.sample_id for r in plan.redispatch] == list("cdef")


def test_audit_passes_exactly_once_and_catches_duplicates_missing_and_leftovers(tmp_path):
    store = FeatureStore(str(tmp_path / "store"))
    ledger = Ledger(str(tmp_path / "ledger"))
    _crashed_then_resumed(ledger)
    report = audit(ledger, source_ids="abcdef", store=store)
    assert report.ok, report.summary()
    assert report.final == (1, 3) and report.trained == 6

    ledger.attempt(2, parent=(1, 3), world_size=1, quantum=2, checkpoint="ck-1-3", run="r")
    ledger.dispatched(2, 4, "y4", _refs("a", "g"))  # "a" was trained in step 1 already
    ledger.trained(2, 4, "y4", ["a", "g"])
    ledger.checkpointed(2, 4, "ck-2-4")
    store.put_bytes(_ref("g").key, b"never deleted")
    report = audit(ledger, source_ids="abcdefgh", store=store)
    assert not report.ok
    assert report.duplicates == {"a": 2}
    assert report.missing == ["h"] and report.unexpected == []
    assert report.leftover_keys == [_ref("g").key]
    assert "duplicates 1 ['a']" in report.summary()
    assert audit(ledger, source_ids="abcdef", store=store, final=(0, 2)).missing == ["e", "f"]


@pytest.mark.s3
def test_ledger_on_s3(seaweedfs):
    ledger = Ledger(seaweedfs.uri("ledger-test"))
    _crashed_then_resumed(ledger)
    state = Ledger(seaweedfs.uri("ledger-test")).replay()
    assert [t["window"] for t in state.lineage(1, 3)] == ["w1", "w2", "x3"]
    Ledger(seaweedfs.uri("ledger-test")).deleted([], [])  # a second writer takes the next seq
    with pytest.raises(LedgerError, match="another process"):
        ledger.deleted([], [])
    ledger.fs.pipe_file(f"{ledger.root}/txn-0000000003.json", b'{"seq": 3, "ki')
    with pytest.raises(LedgerError, match="txn-0000000003.json is torn"):
        ledger.replay(full=True)
    assert ledger.replay().lineage(1, 3) == state.lineage(1, 3)  # the snapshot of txn 11 covers txn 3


def _started(ledger: Ledger, *steps: tuple[str, str]) -> None:
    """Attempt 0 trains one window per (window, sample ids) pair, steps 1, 2, …"""
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    for step, (window, ids) in enumerate(steps, start=1):
        ledger.dispatched(0, step, window, _refs(*ids))
        ledger.trained(0, step, window, list(ids))


def _duplicate_step(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.trained(0, 1, "w1", ["a", "b"])


def _gapped_steps(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.append("dispatched", attempt=0, step=3, window="w3", refs=[])
    ledger.trained(0, 3, "w3", [])


def _checkpoint_of_an_untrained_step(ledger):
    _started(ledger, ("w1", "ab"), ("w2", "cd"))
    ledger.checkpointed(0, 5, "ck-0-5")


def _window_dispatched_twice(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.dispatched(0, 2, "w1", _refs("c", "d"))


def _attempt_resumed_from_itself(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.checkpointed(0, 1, "ck-0-1")
    ledger.attempt(1, parent=(1, 1), world_size=1, quantum=2, checkpoint="ck-0-1", run="r")


def _trained_other_samples(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.dispatched(0, 2, "w2", _refs("c", "d"))
    ledger.trained(0, 2, "w2", ["c", "x"])


def _parent_recorded_after_its_child(ledger):
    ledger.attempt(0, parent=(1, 0), world_size=1, quantum=2, checkpoint="ck", run="r")
    ledger.attempt(1, parent=(0, 0), world_size=1, quantum=2, checkpoint="ck", run="r")


def _resumed_from_an_unrecorded_checkpoint(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.attempt(1, parent=(0, 1), world_size=1, quantum=2, checkpoint="ck-0-1", run="r")


def _checkpoint_of_an_unrecorded_attempt(ledger):  # e.g. another ledger's checkpoint appended to this one
    _started(ledger, ("w1", "ab"))
    ledger.checkpointed(4, 2, "other/checkpoint-a004-s00000002")


def _parent_and_origin(ledger):
    _started(ledger, ("w1", "ab"))
    ledger.checkpointed(0, 1, "ck-0-1")
    ledger.attempt(1, parent=(0, 1), world_size=1, quantum=2, checkpoint="ck-0-1", run="r",
                   origin={"ledger": "other", "attempt": 0, "step": 1, "location": "ck-0-1"})


INCONSISTENT = pytest.mark.parametrize("history, error", [
    (_duplicate_step, r"txn-0000000003.json \(trained\): attempt 0 trains step 1 after step 1"),
    (_gapped_steps, r"txn-0000000003.json \(dispatched\): attempt 0 dispatches step 3, but its next step is 2"),
    (_checkpoint_of_an_untrained_step, r"txn-0000000005.json \(checkpointed\): a checkpoint of step 5 of attempt 0, "
                                       r"but attempt 0 never trained step 5"),
    (_window_dispatched_twice, r"txn-0000000003.json \(dispatched\): window w1 was dispatched already by txn-0000000001"),
    (_attempt_resumed_from_itself, r"txn-0000000004.json \(attempt\): attempt 1 resumes from a checkpoint of itself"),
    (_trained_other_samples, r"txn-0000000004.json \(trained\): .*\['c', 'x'\] but window w2 holds \['c', 'd'\]"),
    (_parent_recorded_after_its_child, r"txn-0000000000.json \(attempt\): attempt 0 resumes from checkpoint "
                                       r"\(attempt 1, step 0\), which the ledger never recorded"),
    (_resumed_from_an_unrecorded_checkpoint, r"txn-0000000003.json \(attempt\): attempt 1 resumes from checkpoint "
                                             r"\(attempt 0, step 1\), which the ledger never recorded \(no checkpointed"),
    (_checkpoint_of_an_unrecorded_attempt, r"txn-0000000003.json \(checkpointed\): a checkpoint of step 2 of attempt 4, "
                                           r"but attempt 4 has no attempt txn"),
    (_parent_and_origin, r"txn-0000000004.json \(attempt\): attempt 1 names both a parent and an origin"),
], ids=["duplicate-step", "gapped-steps", "untrained-checkpoint", "window-twice", "own-parent", "other-samples",
        "later-parent", "unrecorded-parent", "unrecorded-attempt", "parent-and-origin"])


@INCONSISTENT
def test_replay_refuses_an_inconsistent_history_naming_the_transaction(tmp_path, history, error):
    history(Unchecked(str(tmp_path)))
    with pytest.raises(LedgerError, match=error + r".*; restore the ledger from a backup$"):
        Ledger(str(tmp_path)).replay()


@INCONSISTENT
def test_the_writer_refuses_what_replay_would_refuse_before_writing_it(tmp_path, history, error):
    ledger = Ledger(str(tmp_path))
    with pytest.raises(LedgerError, match=error + r".*; it was not written: the writer's history is not this ledger's"):
        history(ledger)
    refused = int(re.search(r"txn-(\d{10})", error).group(1))
    assert ledger.count() == refused and Ledger(str(tmp_path)).replay().seq == refused - 1  # the rest replays
    ledger.deleted([], [])  # the writer goes on at the refused txn's seq
    assert [t.seq for t in Ledger(str(tmp_path)).read()][-1] == refused


def _append_killed_before_its_link(uri: str) -> None:
    """A writer SIGKILLed mid-append: its temp file is written and fsynced, the txn never linked."""
    import specray.trainer.ledger as ledger_module

    ledger = Ledger(uri)
    ledger_module.os.link = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    ledger.deleted([], [])


def test_temp_files_of_killed_appends_are_removed_when_the_next_writer_opens(tmp_path):
    uri = str(tmp_path / "ledger")
    _started(Ledger(uri), ("w1", "ab"))
    for _ in range(2):
        child = multiprocessing.get_context("fork").Process(target=_append_killed_before_its_link, args=(uri,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == -signal.SIGKILL
        assert len(list((tmp_path / "ledger").glob(".tmp-*"))) == 1  # the second removed the first one's at its open
    assert Ledger(uri).count() == 3  # nothing was appended
    assert Ledger(uri).replay().seq == 2 and len(list((tmp_path / "ledger").glob(".tmp-*"))) == 1  # readers leave it
    writer = Ledger(uri)
    writer.deleted([], [])
    assert not list((tmp_path / "ledger").glob(".tmp-*"))  # the single writer, opening, removed them
    assert [t.seq for t in Ledger(uri).read()] == [0, 1, 2, 3]


def test_a_stream_started_from_another_ledgers_checkpoint_counts_from_its_step(tmp_path):
    """The origin's model is step 6 of another ledger: this stream trains steps 7, 8 and audits only its own samples."""
    store = FeatureStore(str(tmp_path / "store"))
    origin = {"ledger": "s3://bucket/other/ledger", "attempt": 2, "step": 6, "location": "other/checkpoint-a002-s00000006"}
    ledger = Ledger(str(tmp_path / "ledger"))
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=origin["location"], run="r", origin=origin)
    with pytest.raises(LedgerError, match=r"attempt 0 dispatches step 1, but its next step is 7"):
        ledger.dispatched(0, 1, "w1", _refs("a", "b"))
    ledger.dispatched(0, 7, "w7", _refs("a", "b"))
    ledger.trained(0, 7, "w7", ["a", "b"])
    ledger.checkpointed(0, 7, "ck-0-7")
    ledger.dispatched(0, 8, "w8", _refs("c", "d"))
    ledger.attempt(1, parent=(0, 7), world_size=1, quantum=2, checkpoint="ck-0-7", run="r")  # a crash, resumed
    ledger.dispatched(1, 8, "x8", _refs("c", "d"))
    ledger.trained(1, 8, "x8", ["c", "d"])
    ledger.checkpointed(1, 8, "ck-1-8")
    state = Ledger(str(tmp_path / "ledger")).replay(full=True)
    assert [t["step"] for t in state.lineage(1, 8)] == [7, 8]
    assert state.origin(1, 8) == state.origin(0, 7) == origin
    assert recovery_plan(state, (0, 7)).history == {"a", "b"}
    assert audit(state, source_ids="abcd", store=store).ok
    fresh = Ledger(str(tmp_path / "fresh"))
    fresh.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    fresh.dispatched(0, 1, "w1", _refs("a", "b"))
    fresh.trained(0, 1, "w1", ["a", "b"])
    fresh.checkpointed(0, 1, "ck")
    assert fresh.replay().origin(0, 1) is None
    with pytest.raises(LedgerError, match=r"attempt 1's origin \{'ledger': 'x'\} is not \{ledger, attempt, step, location\}"):
        fresh.attempt(1, parent=None, world_size=1, quantum=2, checkpoint=None, run="r", origin={"ledger": "x"})


@pytest.mark.s3
def test_two_writers_racing_on_s3_exactly_one_wins(seaweedfs):
    """Both writers see txn 0 missing before either writes: only the conditional create decides."""
    import threading

    uri = seaweedfs.uri(f"ledger-race-{os.urandom(4).hex()}")
    writers = [Ledger(uri), Ledger(uri)]
    for writer in writers:
        writer.fs.invalidate_cache()
    barrier = threading.Barrier(2, timeout=10)
    exists = writers[0].fs.exists

    def exists_after_both_looked(path, **kwargs):  # a check-then-write would interleave like this
        found = exists(path, **kwargs)
        barrier.wait()
        return found

    outcomes: list = []

    def append(writer: Ledger) -> None:
        writer.fs.exists = exists_after_both_looked
        try:
            outcomes.append(writer.deleted([], []))
        except LedgerError as e:
            outcomes.append(e)
        except threading.BrokenBarrierError:
            outcomes.append("the other writer never looked")

    threads = [threading.Thread(target=append, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for writer in writers:
        writer.fs.exists = exists
    won = [o for o in outcomes if not isinstance(o, (LedgerError, str))]
    lost = [o for o in outcomes if isinstance(o, LedgerError)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert "another process writes this ledger" in str(lost[0])
    assert [t.seq for t in Ledger(uri).read()] == [0]


def test_audit_looks_for_leftovers_among_the_streams_keys_only(tmp_path):
    store = FeatureStore(str(tmp_path / "store"))
    ledger = Ledger(str(tmp_path / "ledger"))
    _crashed_then_resumed(ledger)
    store.put_bytes("other-dataset/x.safetensors", b"another dataset sharing the store root")
    store.put_bytes("features/zz.safetensors", b"another dataset's sample, same directory")
    assert audit(ledger, source_ids="abcdef", store=store).ok

    temp = temp_name(_ref("a").key)  # a write of one of ours that died before its rename
    (tmp_path / "store" / temp).write_bytes(b"partial")
    store.put_bytes("features/q.safetensors", b"captured by the producer, never dispatched")
    report = audit(ledger, source_ids="abcdef", store=store, keys=[_ref(i).key for i in "abcdefghq"])
    assert report.leftover_keys == [temp, "features/q.safetensors"]
    store.delete(_ref("a").key)  # deleting the key takes its dead writes along
    assert audit(ledger, source_ids="abcdef", store=store).ok
