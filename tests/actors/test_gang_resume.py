"""Online resumes that change what the gang counts from: a larger gang resumes a stream and trains
exactly what is left (step targets from samples, not quanta); a fresh ledger starts a stream from
another ledger's checkpoint (its origin), and that checkpoint is refused once the ledger has its own."""

import pytest

from specray.actors.trainer import CheckpointMismatchError, FaultPlan, GangFailedError, run_trainer_gang
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.ledger import Ledger

from gang_support import TIMEOUT_S, Stream, offline_manifest, train_spec

pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def _prompt_ray_train(monkeypatch):
    # Ray Train polls its workers every 2 s by default; reports and failure detection wait for it.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


def test_a_larger_gang_resumes_the_stream_and_trains_what_is_left(ray_cluster, debug_target, tmp_path):
    """16 samples: 3 steps of Q = 4 checkpointed, the gang dies; resumed with Q = 8 it trains the last 4 in step 4.

    Each run's optim.total_steps is what one pass takes at its Q (4, then 2), as the online pipeline sets it:
    the resumed gang, already at step 3, must count its target from the samples left."""
    stream = Stream(tmp_path, debug_target, num_samples=16, max_inflight=24)
    storage = str(tmp_path / "ray")
    try:
        small = train_spec(tmp_path, "grow", "optim.micro_batch_size=1", "optim.accumulation_steps=4",
                           "trainer.checkpoint_every=3", "optim.total_steps=4")
        plan = FaultPlan(point="after_checkpointed", step=3, marker=str(tmp_path / "crashed"))
        with pytest.raises(GangFailedError):
            run_trainer_gang(small, num_workers=1, storage_path=storage, broker=stream.broker, stream_samples=16,
                             fault=plan, max_failures=0, timeout_s=TIMEOUT_S)
        large = train_spec(tmp_path, "grow", "optim.micro_batch_size=2", "optim.accumulation_steps=2",
                           "trainer.checkpoint_every=3", "optim.total_steps=2")
        result = run_trainer_gang(large, num_workers=2, storage_path=storage, broker=stream.broker, stream_samples=16,
                                  max_failures=0, timeout_s=TIMEOUT_S)
        stream.finish(result)  # the audit: all 16 trained exactly once, nothing left in the store
    finally:
        stream.close()
    assert [(a["quantum"], a["parent"]) for a in result.attempts] == [(4, None), (8, {"attempt": 0, "step": 3})]
    assert result.step == 4 and load_checkpoint(result.checkpoint).step == 4
    state = Ledger(result.ledger_uri).replay()
    assert [(t["attempt"], t["step"], len(t["sample_ids"])) for t in state.lineage(1, 4)] == [
        (0, 1, 4), (0, 2, 4), (0, 3, 4), (1, 4, 4)]


def test_a_fresh_online_ledger_starts_a_stream_from_another_ledgers_checkpoint(ray_cluster, debug_target, tmp_path):
    """An offline run's checkpoint (step 2 of its own ledger) starts an online stream of 18 samples (Q = 4):
    steps 3-7, its origin recorded, the stream trained exactly once. A later run of another name on that
    stream's ledger is refused the same checkpoint, before anything is written."""
    manifest = offline_manifest(tmp_path / "offline", debug_target)
    offline = run_trainer_gang(train_spec(tmp_path / "offline", "seed", f"data.manifest={manifest}",
                                          "optim.total_steps=2"),
                               num_workers=1, storage_path=str(tmp_path / "offline-ray"), timeout_s=TIMEOUT_S)
    assert offline.step == 2
    stream = Stream(tmp_path, debug_target)
    ledger_uri = str(tmp_path / "stream-ledger")
    try:
        result = run_trainer_gang(train_spec(tmp_path, "online", "optim.total_steps=5"), num_workers=2,
                                  storage_path=str(tmp_path / "ray"), ledger_uri=ledger_uri, broker=stream.broker,
                                  resume_from=offline.checkpoint, stream_samples=18, timeout_s=TIMEOUT_S)
        stream.finish(result)
        ledger = Ledger(ledger_uri)
        count = ledger.count()
        with pytest.raises(CheckpointMismatchError, match=r"was saved under the ledger .*offline-ray/seed/ledger "
                                                          r"\(attempt 0, step 2\), not this run's ledger .*stream-ledger, "
                                                          r"which holds checkpoints of its own stream"):
            run_trainer_gang(train_spec(tmp_path, "other"), num_workers=1, storage_path=str(tmp_path / "ray"),
                             ledger_uri=ledger_uri, broker=stream.broker, resume_from=offline.checkpoint,
                             timeout_s=TIMEOUT_S)
        assert ledger.count() == count  # the ledger still replays, and says what it said
    finally:
        stream.close()
    origin = {"ledger": offline.ledger_uri, "attempt": 0, "step": 2, "location": offline.checkpoint}
    assert [(a["parent"], a["origin"]) for a in result.attempts] == [(None, origin)]
    assert result.step == 2 + 5  # windows 4, 4, 4, 4, 2 after the origin's 2 steps
    state = ledger.replay()
    assert [t["step"] for t in state.lineage(0, 7)] == [3, 4, 5, 6, 7] and state.origin(0, 7) == origin
    assert Ledger(offline.ledger_uri).replay() == Ledger(offline.ledger_uri).replay(full=True)  # untouched, valid
