"""SampleBroker: whole windows, the in-flight bound, backpressure, the final window, rewind.

The bookkeeping (``WindowQueue``) is tested in-process; the Ray tests cover what the actor
adds: waiting, timeouts, every rank getting the same window, the deadlock report.
"""

import time

import pytest

from specray.actors.broker import (
    BrokerStalledError,
    StaleAttemptError,
    StreamFailedError,
    WindowQueue,
    start_sample_broker,
)
from specray.capture.store import SampleRef, TensorMeta


def _ref(sample_id: str, num_bytes: int = 100, contract: str = "c0ffee") -> SampleRef:
    return SampleRef(sample_id, f"features/{sample_id}.safetensors", (TensorMeta("input_ids", (4,), "int64"),),
                     4, num_bytes, "sha256:" + "0" * 64, contract)


def _offer(queue: WindowQueue, *ids: str, num_bytes: int = 100) -> None:
    assert queue.try_reserve(len(ids), num_bytes * len(ids))
    queue.offer([_ref(i, num_bytes) for i in ids], reserved_bytes=num_bytes * len(ids))


def _ids(window) -> list[str]:
    return [r.sample_id for r in window.refs]


def test_refs_are_released_only_in_whole_windows():
    queue = WindowQueue(4, max_inflight=16)
    queue.rewind(0, quantum=4, world_size=2, step=0)
    _offer(queue, "a", "b", "c")
    assert queue.try_window(0, 1) == (False, None)
    _offer(queue, "d", "e")
    ready, window = queue.try_window(0, 1)
    assert ready and _ids(window) == ["a", "b", "c", "d"] and window.window_id == "a000-s00000001"
    assert queue.try_window(0, 1) == (True, window)  # idempotent: every rank gets the same refs
    assert queue.try_window(0, 2) == (False, None)  # "e" alone is not a window
    with pytest.raises(ValueError, match="asked for step 5, but the next window is step 2"):
        queue.try_window(0, 5)


def test_a_stall_is_reported_only_while_no_window_can_be_cut():
    """A waiter woken by the offer that filled a window may look before the ranks took it: no deadlock."""
    queue = WindowQueue(4, max_inflight=8)
    queue.rewind(0, quantum=4, world_size=1, step=0)
    _offer(queue, "a", "b", "c", "d")
    assert queue.try_window(0, 1)[1] is not None  # trained, waiting for a checkpoint: 4 of 8 held
    _offer(queue, "e", "f", "g")
    assert "window step 2 (3 of Q=4" in queue.stall_reason(window_waiters=1, reserve_waiters=1)  # a batch of 2 waits
    assert queue.try_reserve(1, 100)
    assert queue.stall_reason(window_waiters=1, reserve_waiters=1) is None  # a producer holds a reservation
    queue.offer([_ref("h")], reserved_bytes=100)  # 8 of 8: the window of step 2 can be cut, not yet taken
    assert queue.stall_reason(window_waiters=1, reserve_waiters=1) is None
    assert _ids(queue.try_window(0, 2)[1]) == ["e", "f", "g", "h"]
    assert "deadlock: all 1 ranks wait for window step 3" in queue.stall_reason(window_waiters=1, reserve_waiters=1)


def test_a_bound_below_the_quantum_is_refused_with_the_fix():
    fix = r"max_inflight=3 features is below the window quantum Q=4 .*Raise max_inflight to at least 4"
    with pytest.raises(ValueError, match=fix):
        WindowQueue(4, max_inflight=3)
    with pytest.raises(ValueError, match="max_inflight=3 features is below the window quantum Q=4"):
        start_sample_broker(4, max_inflight=3)  # checked in the caller, before an actor exists
    queue = WindowQueue(2, max_inflight=3)
    with pytest.raises(ValueError, match="below the window quantum Q=4"):
        queue.rewind(0, quantum=4, world_size=2, step=0)  # a bigger gang on the same stream


def test_offers_need_a_reservation_the_contract_and_unique_ids():
    queue = WindowQueue(2, max_inflight=4, contract_id="c0ffee")
    with pytest.raises(ValueError, match="without a matching reservation"):
        queue.offer([_ref("a")], reserved_bytes=100)
    assert queue.try_reserve(2, 200)
    with pytest.raises(ValueError, match="captured under contract other"):
        queue.offer([_ref("a", contract="other")], reserved_bytes=100)
    queue.offer([_ref("a")], reserved_bytes=100)
    with pytest.raises(ValueError, match="'a' is already in flight"):
        queue.offer([_ref("a")], reserved_bytes=100)
    queue.cancel(1, 100)
    assert queue.stats()["reserved"] == 0 and queue.stats()["inflight"] == 1


def test_final_partial_window_is_released_not_dropped():
    queue = WindowQueue(4, max_inflight=16)
    queue.rewind(0, quantum=4, world_size=2, step=0)
    _offer(queue, *"abcdef")
    assert _ids(queue.try_window(0, 1)[1]) == list("abcd")
    assert queue.try_window(0, 2) == (False, None)  # the stream may still bring two more
    assert queue.try_reserve(1, 100)
    queue.close()
    assert queue.try_window(0, 2) == (False, None)  # a reserved feature is still coming
    queue.offer([_ref("g")], reserved_bytes=100)
    ready, last = queue.try_window(0, 2)
    assert ready and _ids(last) == ["e", "f", "g"] and last.partial
    assert queue.try_window(0, 3) == (True, None) and queue.ended  # end of stream, the same for every rank
    assert queue.try_window(0, 3) == (True, None)
    with pytest.raises(ValueError, match="stream is closed"):
        queue.try_reserve(1, 100)


def test_rewind_requeues_unfinished_windows_in_order_and_resplits_them():
    queue = WindowQueue(4, max_inflight=16)
    queue.rewind(0, quantum=4, world_size=2, step=0)
    _offer(queue, *"abcdefghij")
    first, second = queue.try_window(0, 1)[1], queue.try_window(0, 2)[1]
    assert _ids(first) == list("abcd") and _ids(second) == list("efgh")
    # attempt 0 checkpointed step 1 and died during step 2: one rank, Q = 2 now
    requeued = queue.rewind(1, quantum=2, world_size=1, step=1, history=_ids(first))
    assert requeued == 4
    assert [_ids(queue.try_window(1, s)[1]) for s in (2, 3, 4)] == [["e", "f"], ["g", "h"], ["i", "j"]]
    assert queue.stats()["inflight"] == 6  # a-d freed with the history
    with pytest.raises(StaleAttemptError, match="attempt 0, but the broker serves attempt 1"):
        queue.try_window(0, 3)  # a straggler of the dead group
    with pytest.raises(StaleAttemptError):
        queue.rewind(1, quantum=2, world_size=1, step=1)

    fresh = WindowQueue(2, max_inflight=8)  # a new broker learns dispatched refs from the ledger alone
    fresh.rewind(3, quantum=2, world_size=1, step=4, redispatch=[_ref("x"), _ref("y"), _ref("z")])
    assert _ids(fresh.try_window(3, 5)[1]) == ["x", "y"]
    assert fresh.stats()["inflight"] == 3


def test_release_frees_capacity_and_peaks_are_tracked():
    queue = WindowQueue(2, max_inflight=4, max_inflight_bytes=1000)
    queue.rewind(0, quantum=2, world_size=1, step=0)
    _offer(queue, "a", "b", num_bytes=300)
    assert queue.try_reserve(1, 300)
    assert not queue.fits(1, 300)  # 900 + 300 bytes > 1000, though 4 features would fit
    assert queue.fits(1, 100)
    window = queue.try_window(0, 1)[1]
    assert queue.release(_ids(window)) == 2
    assert queue.release(_ids(window)) == 0  # idempotent
    assert queue.fits(1, 300)
    stats = queue.stats()
    assert (stats["inflight"], stats["inflight_bytes"]) == (1, 300)
    assert (stats["peak_inflight"], stats["peak_inflight_bytes"]) == (3, 900)
    assert stats["dispatched_windows"] == 0 and stats["released_total"] == 2


@pytest.mark.ray
def test_actor_backpressure_blocks_at_the_bound_and_resumes_after_release(ray_cluster):
    import ray

    broker = start_sample_broker(2, max_inflight=4)
    ray.get(broker.rewind.remote(0, quantum=2, world_size=2, step=0), timeout=60)
    assert ray.get(broker.reserve.remote(4, num_bytes=400, timeout=0), timeout=30)
    ray.get(broker.offer.remote([_ref(i) for i in "abcd"], reserved_bytes=400), timeout=30)
    assert ray.get(broker.reserve.remote(1, num_bytes=100, timeout=0), timeout=30) is False
    started = time.monotonic()
    assert ray.get(broker.reserve.remote(1, num_bytes=100, timeout=0.5), timeout=30) is False
    assert time.monotonic() - started >= 0.5
    waiting = broker.reserve.remote(2, num_bytes=200, timeout=60)
    assert ray.wait([waiting], timeout=1.0)[0] == []  # blocked at the bound
    windows = ray.get([broker.next_window.remote(0, 1, timeout=30) for _ in range(2)], timeout=60)
    assert windows[0] == windows[1] and [r.sample_id for r in windows[0].refs] == ["a", "b"]
    assert ray.wait([waiting], timeout=0.5)[0] == []  # dispatched is still in flight
    assert ray.get(broker.release.remote(["a", "b"]), timeout=30) == 2
    assert ray.get(waiting, timeout=30) is True
    stats = ray.get(broker.stats.remote(), timeout=30)
    assert stats["inflight"] == 4 and stats["peak_inflight"] == 4
    # One call at a time, as a rank asks: an async actor does not keep the order of concurrent calls.
    assert [r.sample_id for r in ray.get(broker.next_window.remote(0, 2, timeout=5), timeout=60).refs] == ["c", "d"]
    with pytest.raises(TimeoutError, match="no window for attempt 0 step 3"):
        ray.get(broker.next_window.remote(0, 3, timeout=0.2), timeout=60)
    ray.kill(broker)


@pytest.mark.ray
def test_actor_reports_a_deadlock_instead_of_hanging(ray_cluster):
    import ray

    # Q = 4 but the byte bound holds only three 100-byte features: no window can ever fill.
    broker = start_sample_broker(4, max_inflight=8, max_inflight_bytes=300)
    ray.get(broker.rewind.remote(0, quantum=4, world_size=1, step=0), timeout=60)
    assert ray.get(broker.reserve.remote(3, num_bytes=300, timeout=0), timeout=30)
    ray.get(broker.offer.remote([_ref(i) for i in "abc"], reserved_bytes=300), timeout=30)
    window = broker.next_window.remote(0, 1, timeout=60)
    assert ray.wait([window], timeout=0.5)[0] == []
    with pytest.raises(BrokerStalledError, match="deadlock: all 1 ranks wait for window step 1 .*3 of Q=4"):
        ray.get(broker.reserve.remote(1, num_bytes=100, timeout=60), timeout=30)
    with pytest.raises(BrokerStalledError):
        ray.get(window, timeout=30)
    ray.kill(broker)


def test_recapture_requests_need_a_producer_and_must_match_what_was_dispatched():
    queue = WindowQueue(2, max_inflight=8)
    queue.rewind(0, quantum=2, world_size=1, step=0)
    _offer(queue, "a", "b")
    assert queue.report_lost([_ref("a")]) is False  # nobody can capture again: the rank must fail
    queue.recapture_enabled = True
    assert queue.report_lost([_ref("a"), _ref("b")]) is True
    assert queue.report_lost([_ref("a")]) is True  # a second rank asking for the same sample: one request
    assert queue.awaiting_recapture(["a"]) and not queue.awaiting_recapture(["c"])
    assert [r.sample_id for r in queue.take_lost()] == ["a", "b"] and queue.take_lost() == []
    assert queue.report_lost([_ref("a")]) is True and queue.take_lost() == []  # already being captured
    queue.mark_recaptured([_ref("a")])
    assert not queue.awaiting_recapture(["a"]) and queue.awaiting_recapture(["a", "b"])
    changed = SampleRef("b", "features/b.safetensors", (TensorMeta("input_ids", (4,), "int64"),), 4, 100,
                        "sha256:" + "1" * 64, "c0ffee")
    with pytest.raises(ValueError, match="capture is not deterministic here"):
        queue.mark_recaptured([changed])
    with pytest.raises(ValueError, match="nobody asked for it"):
        queue.mark_recaptured([_ref("z")])
    stats = queue.stats()
    assert stats["recaptured_total"] == 1 and stats["inflight"] == 2  # re-captured samples keep their room


@pytest.mark.ray
def test_actor_wakes_a_rank_waiting_for_a_recapture(ray_cluster):
    import ray

    broker = start_sample_broker(1, max_inflight=4)
    ray.get(broker.rewind.remote(0, quantum=1, world_size=1, step=0), timeout=60)
    assert ray.get(broker.report_lost.remote([_ref("a")]), timeout=30) is False
    ray.get(broker.enable_recapture.remote(), timeout=30)
    assert ray.get(broker.describe.remote(), timeout=30)["recapture"] is True
    assert ray.get(broker.take_lost.remote(timeout=0.2), timeout=30) == []
    assert ray.get(broker.report_lost.remote([_ref("a")]), timeout=30) is True
    waiting = broker.wait_recaptured.remote(["a"], timeout=60)
    assert [r.sample_id for r in ray.get(broker.take_lost.remote(timeout=5), timeout=30)] == ["a"]
    assert ray.wait([waiting], timeout=0.5)[0] == []  # taken, not captured yet
    ray.get(broker.recaptured.remote([_ref("a")]), timeout=30)
    assert ray.get(waiting, timeout=30) is True
    assert ray.get(broker.wait_recaptured.remote(["b"], timeout=0), timeout=30) is True  # nothing asked
    ray.kill(broker)


def test_hold_counts_a_resumed_streams_leftovers_until_rewind_sorts_them():
    queue = WindowQueue(2, max_inflight=4)
    assert queue.hold([_ref("a"), _ref("b"), _ref("c")]) == 3  # left in the store by a killed run
    assert queue.hold([_ref("a")]) == 0
    assert queue.fits(1, 0) and not queue.fits(2, 0)  # producers wait for that room too
    # the gang resumes from a checkpoint holding "a": "b", "c" are re-dispatched, "a" is released
    queue.rewind(1, quantum=2, world_size=1, step=4, redispatch=[_ref("b"), _ref("c")], history=["a"])
    assert queue.stats()["inflight"] == 2 and queue.peak_samples == 3
    ready, window = queue.try_window(1, 5)
    assert ready and _ids(window) == ["b", "c"]


def test_a_sample_offered_again_after_it_was_acknowledged_is_refused():
    queue = WindowQueue(2, max_inflight=8)
    queue.rewind(0, quantum=2, world_size=1, step=0)
    _offer(queue, "a", "b")
    window = queue.try_window(0, 1)[1]
    queue.release(_ids(window))  # trained, checkpointed, deleted: no longer in flight
    assert queue.try_reserve(2, 200)
    with pytest.raises(ValueError, match="sample id 'a' was offered already in this stream"):
        queue.offer([_ref("c"), _ref("a")], reserved_bytes=200)
    with pytest.raises(ValueError, match="sample id 'c' appears twice in one offer"):
        queue.offer([_ref("c"), _ref("c")], reserved_bytes=200)
    assert queue.stats()["pending"] == 0 and queue.stats()["reserved"] == 2  # nothing half-offered

    resumed = WindowQueue(2, max_inflight=8)  # a resumed stream knows its history from the ledger
    resumed.rewind(1, quantum=2, world_size=1, step=3, redispatch=[_ref("y")], history=["x"])
    assert resumed.try_reserve(1, 100)
    with pytest.raises(ValueError, match="sample id 'x' was offered already in this stream and acknowledged"):
        resumed.offer([_ref("x")], reserved_bytes=100)  # trained under the resumed checkpoint
    with pytest.raises(ValueError, match="sample id 'y' is already in flight"):
        resumed.offer([_ref("y")], reserved_bytes=100)  # re-dispatched from the ledger


@pytest.mark.parametrize("field, value, error", [
    ("num_tokens", "tensor", r"sample 'a': SampleRef.num_tokens must be int, got Tensor"),
    ("checksum", None, r"sample 'a': SampleRef.checksum must be str, got NoneType"),
    ("tensors", "bad-shape", r"sample 'a': SampleRef.tensors\[0\].shape\[0\] must be int, got Tensor"),
], ids=["tensor-count", "no-checksum", "tensor-in-shape"])
def test_a_ref_whose_metadata_is_not_plain_json_is_refused(field, value, error):
    import dataclasses

    import torch

    if value == "tensor":
        value = torch.tensor(4)
    elif value == "bad-shape":
        value = (TensorMeta("input_ids", (torch.tensor(4),), "int64"),)
    queue = WindowQueue(2, max_inflight=8)
    queue.rewind(0, quantum=2, world_size=1, step=0)
    assert queue.try_reserve(2, 200)
    with pytest.raises(TypeError, match=error):
        queue.offer([_ref("b"), dataclasses.replace(_ref("a"), **{field: value})], reserved_bytes=200)
    assert queue.stats()["pending"] == 0 and queue.stats()["reserved"] == 2


def test_a_producer_failure_beats_a_close_and_reaches_every_new_window_request():
    queue = WindowQueue(2, max_inflight=8)
    queue.rewind(0, quantum=2, world_size=2, step=0)
    _offer(queue, "a", "b", "c")
    first = queue.try_window(0, 1)[1]
    assert queue.try_reserve(1, 100)  # a batch the producer was capturing when it failed
    queue.close()
    queue.fail("capture batch 'batch-000003' lost its actor 3 times")
    queue.close()  # a close after the failure does not end the stream either
    assert queue.try_window(0, 1) == (True, first)  # a window cut before the failure is the same for every rank
    for _ in range(2):  # every rank asking for the next window learns why, not "end of stream"
        with pytest.raises(StreamFailedError, match="the feature stream failed: capture batch 'batch-000003' lost"):
            queue.try_window(0, 2)
    with pytest.raises(StreamFailedError):
        queue.try_reserve(1, 100)
    queue.cancel(1, 100)  # the failed producer gives its room back
    assert queue.stats()["reserved"] == 0 and queue.stats()["failed"].startswith("capture batch")
    queue.fail("a later, unrelated error")
    assert queue.stats()["failed"].startswith("capture batch")  # the first failure is the cause


@pytest.mark.ray
def test_actor_fail_wakes_every_rank_waiting_for_a_window_or_a_recapture(ray_cluster):
    import ray

    broker = start_sample_broker(2, max_inflight=8)
    ray.get(broker.rewind.remote(0, quantum=2, world_size=2, step=0), timeout=60)
    ray.get(broker.enable_recapture.remote(), timeout=30)
    assert ray.get(broker.reserve.remote(3, num_bytes=300, timeout=0), timeout=30)
    ray.get(broker.offer.remote([_ref("a")], reserved_bytes=100), timeout=30)
    ray.get(broker.close.remote(), timeout=30)  # closed, but 2 reserved features never come: no final window
    assert ray.get(broker.report_lost.remote([_ref("a")]), timeout=30)
    waiting = [broker.next_window.remote(0, 1) for _ in range(2)]  # no timeout: the gang's own calls
    waiting.append(broker.wait_recaptured.remote(["a"]))
    assert ray.wait(waiting, num_returns=3, timeout=1.0)[0] == []  # what hung the run forever
    started = time.monotonic()
    ray.get(broker.fail.remote("RuntimeError: batch 'batch-000001' kills its actor"), timeout=30)
    for request in waiting:
        with pytest.raises(StreamFailedError, match="batch 'batch-000001' kills its actor"):
            ray.get(request, timeout=30)
    assert time.monotonic() - started < 10
    ray.kill(broker)


def test_two_samples_on_one_store_key_are_refused():
    """The second blob written under a key replaces the first: the broker refuses to carry both refs."""
    queue = WindowQueue(2, max_inflight=8)
    queue.rewind(0, quantum=2, world_size=1, step=0)
    first = _ref("conv/1")
    clash = SampleRef("conv_1", first.key, first.tensors, 4, 100, first.checksum, first.contract)
    assert queue.try_reserve(2, 200)
    with pytest.raises(ValueError, match=r"samples 'conv/1' and 'conv_1' name one store key"):
        queue.offer([first, clash], reserved_bytes=200)  # in one offer
    queue.offer([first], reserved_bytes=100)
    with pytest.raises(ValueError, match=r"samples 'conv/1' and 'conv_1' name one store key"):
        queue.offer([clash], reserved_bytes=100)  # against a ref in flight
    ready, window = queue.try_window(0, 1)
    assert not ready
    queue.offer([_ref("b")], reserved_bytes=100)
    ready, window = queue.try_window(0, 1)
    assert ready and _ids(window) == ["conv/1", "b"]
    queue.release(["conv/1", "b"])  # trained and deleted: the key still names conv/1's blob in the ledger
    assert queue.try_reserve(1, 100)
    with pytest.raises(ValueError, match=r"name one store key"):
        queue.offer([clash], reserved_bytes=100)
