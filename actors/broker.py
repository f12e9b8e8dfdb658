"""SampleBroker: the control plane between feature producers and the trainer gang (DESIGN.md §4).

Producers (capture actors) and the gang never exchange tensors through the broker, only
``SampleRef`` metadata. The broker enforces the two rules of seed §7.4:

- **Whole windows.** Refs are released to the gang only as windows of
  ``Q = DP × micro_batch × accumulation`` refs, one per optimizer step. At end of stream the
  last, partial window (``0 < n < Q`` refs) is released too — never dropped; the gang deals
  its ``n`` refs over the ``DP × accumulation`` micro-batch slots as evenly as possible
  (``actors/trainer.py::split_window``).
- **Bounded in-flight features.** A feature is *in flight* from the moment a producer
  reserves room for it until the gang ``release``s it after deleting its blob (stored but not
  deleted). Both the count and the bytes are bounded: a producer calls ``reserve`` *before*
  writing and waits (or gets False) at the bound; that is the backpressure. The bound must
  hold at least one window (``max_inflight >= Q``, checked at construction and on every
  rewind); since features are deleted only after a checkpoint covers them, the gang checks the
  stronger ``max_inflight >= Q × checkpoint_every`` before it starts.

**One blob per key.** Every ref names its own store key: an offer whose key already holds another
sample of the stream (in flight or acknowledged) is refused, since the second write replaced the
first blob and one of the two samples could never be read.

Windows are keyed by ``(attempt, step)``: ``next_window(attempt, step)`` is idempotent, so every
rank of the gang asks for the same window and gets the same refs (it then trains its slice).
A worker-group start calls ``rewind``: it frees the samples already in the model's history,
puts every other dispatched sample back at the front of the queue in original order, and
sets the new attempt's Q, so windows after the resumed checkpoint are re-split for a possibly
different world size. A request of an older attempt (a straggler of a dead group) is refused.

Usage (producer side)::

    broker = start_sample_broker(quantum=4, max_inflight=16, contract=contract, store_uri=uri)
    if ray.get(broker.reserve.remote(len(batch), num_bytes=estimate, timeout=60)):
        refs = server.capture(batch)
        ray.get(broker.offer.remote(refs, reserved_bytes=estimate))
    ray.get(broker.close.remote())   # end of stream: the last partial window is released

**Failure.** A producer that fails gives back what it reserved (``cancel``) and calls
``fail(message)``. That is not end of stream: every rank waiting for a window it has not got
yet, or for a re-capture, raises ``StreamFailedError`` with the producer's message, at once
and even after a ``close`` — instead of waiting for reserved features that never come, or
finishing and checkpointing as if the stream were complete.

**Re-capture.** Features are a cache; the ledger and the sample source are the truth. A
producer that can capture a sample again calls ``enable_recapture()``. A rank that finds a
dispatched feature gone (a ``ray://`` blob lost with its capture actor, or a blob deleted under
a later checkpoint than the one resumed) calls ``report_lost(refs)`` and then
``wait_recaptured(ids)``; the producer takes the requests with ``take_lost()``, captures those
samples again (same batch, same bytes, same key) and calls ``recaptured(refs)``. A re-captured
sample keeps its place in its window and its room in the bound (it never left the stream).
Without a producer that enabled it, ``report_lost`` returns False and the rank fails the run
with ``FeaturesLostError``, as it must: nothing could bring the features back.

``WindowQueue`` is the plain bookkeeping (tested without Ray); ``SampleBroker`` is the async
Ray actor that adds waiting and timeouts on top of it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import ray

from specray.capture.contract import CaptureContract
from specray.capture.store import SampleRef, check_ref


def window_id(attempt: int, step: int) -> str:
    return f"a{attempt:03d}-s{step:08d}"


@dataclass(frozen=True)
class Window:
    """The refs of one optimizer step: ``quantum`` of them, or fewer in the final window."""

    window_id: str
    attempt: int
    step: int  # the step count after training this window (1-based)
    quantum: int  # Q the window was cut for
    refs: tuple[SampleRef, ...]

    @property
    def partial(self) -> bool:
        return len(self.refs) < self.quantum


class StaleAttemptError(RuntimeError):
    """A worker of an attempt the broker has been rewound past asked for a window."""


class StreamFailedError(RuntimeError):
    """The producer failed (``fail``): the stream will not end, and what it holds may not be complete."""


class BrokerStalledError(RuntimeError):
    """Every rank waits for a window that can only fill once capacity frees: the bound is too small."""


def _check_bound(quantum: int, max_inflight: int, max_inflight_bytes: int | None) -> None:
    if quantum < 1:
        raise ValueError(f"quantum Q must be >= 1 (DP × micro_batch × accumulation), got {quantum}")
    if max_inflight < quantum:
        raise ValueError(
            f"max_inflight={max_inflight} features is below the window quantum Q={quantum} "
            "(= DP × micro_batch_size × accumulation_steps): producers could never fill one optimizer "
            f"window. Raise max_inflight to at least {quantum}, or lower the world size, "
            "optim.micro_batch_size or optim.accumulation_steps"
        )
    if max_inflight_bytes is not None and max_inflight_bytes < 1:
        raise ValueError(f"max_inflight_bytes must be a positive number of bytes or None, got {max_inflight_bytes}")


class WindowQueue:
    """The broker's bookkeeping: capacity, pending refs, dispatched windows (no waiting, no Ray)."""

    def __init__(self, quantum: int, *, max_inflight: int, max_inflight_bytes: int | None = None,
                 contract_id: str | None = None):
        _check_bound(quantum, max_inflight, max_inflight_bytes)
        self.quantum = quantum
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.contract_id = contract_id
        self.attempt: int | None = None  # set by the first rewind
        self.world_size = 1
        self.closed = False
        self.failed: str | None = None  # the producer's error (fail): beats close, ends every wait
        self.reserved_samples = 0
        self.reserved_bytes = 0
        self.inflight: dict[str, SampleRef] = {}  # stored, not yet released (pending or dispatched)
        self.seen: set[str] = set()  # every sample id of the stream: offered, held, re-dispatched, or trained
        self.keys: dict[str, str] = {}  # store key -> the sample id whose blob it holds, every ref the stream carried
        self.inflight_bytes = 0
        self.pending: deque[SampleRef] = deque()  # offered, not yet in a window
        self.windows: dict[int, Window | None] = {}  # step -> window (None = end of stream), this attempt
        self.next_step = 1
        self.peak_samples = 0
        self.peak_bytes = 0
        self.offered_total = 0
        self.released_total = 0
        self.recapture_enabled = False
        self.lost: dict[str, SampleRef] = {}  # reported lost, not yet taken by the producer
        self.recapturing: dict[str, SampleRef] = {}  # taken, not yet captured again
        self.recaptured_total = 0

    # -- capacity --------------------------------------------------------------------------

    @property
    def used_samples(self) -> int:
        return self.reserved_samples + len(self.inflight)

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.inflight_bytes

    def _track_peak(self) -> None:
        self.peak_samples = max(self.peak_samples, self.used_samples)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def check_reservation(self, num_samples: int, num_bytes: int) -> None:
        """Raise for a reservation that can never fit (or comes after close or a failure)."""
        self.check_failed()
        if self.closed:
            raise ValueError("the stream is closed (close() was called); a new producer pass needs a new broker")
        if num_samples < 1 or num_bytes < 0:
            raise ValueError(f"reserve needs num_samples >= 1 and num_bytes >= 0, got {num_samples}, {num_bytes}")
        if num_samples > self.max_inflight:
            raise ValueError(f"cannot reserve {num_samples} features at once: max_inflight is {self.max_inflight}; "
                             "reserve in smaller batches")
        if self.max_inflight_bytes is not None and num_bytes > self.max_inflight_bytes:
            raise ValueError(f"cannot reserve {num_bytes} bytes at once: max_inflight_bytes is {self.max_inflight_bytes}; "
                             "reserve in smaller batches or raise max_inflight_bytes")

    def fits(self, num_samples: int, num_bytes: int) -> bool:
        if self.used_samples + num_samples > self.max_inflight:
            return False
        return self.max_inflight_bytes is None or self.used_bytes + num_bytes <= self.max_inflight_bytes

    def try_reserve(self, num_samples: int, num_bytes: int) -> bool:
        self.check_reservation(num_samples, num_bytes)
        if not self.fits(num_samples, num_bytes):
            return False
        self.reserved_samples += num_samples
        self.reserved_bytes += num_bytes
        self._track_peak()
        return True

    def cancel(self, num_samples: int, num_bytes: int) -> None:
        """Give back (part of) a reservation that was not written (a failed capture)."""
        if num_samples > self.reserved_samples or num_bytes > self.reserved_bytes:
            raise ValueError(f"cancel of {num_samples} features / {num_bytes} bytes exceeds what is reserved "
                             f"({self.reserved_samples} / {self.reserved_bytes})")
        self.reserved_samples -= num_samples
        self.reserved_bytes -= num_bytes

    def offer(self, refs: Iterable[SampleRef], *, reserved_bytes: int) -> None:
        """Turn a reservation of ``len(refs)`` features and ``reserved_bytes`` into pending refs."""
        self.check_failed()
        refs = list(refs)
        if len(refs) > self.reserved_samples or reserved_bytes > self.reserved_bytes:
            raise ValueError(f"offer of {len(refs)} refs / {reserved_bytes} bytes without a matching reservation "
                             f"({self.reserved_samples} / {self.reserved_bytes} reserved); call reserve() before writing")
        self._check_new(refs)
        self.reserved_samples -= len(refs)
        self.reserved_bytes -= reserved_bytes
        for ref in refs:
            self.inflight[ref.sample_id] = ref
            self.inflight_bytes += ref.num_bytes
            self.pending.append(ref)
            self.seen.add(ref.sample_id)
            self.keys[ref.key] = ref.sample_id
        self.offered_total += len(refs)
        self._track_peak()

    def _check_new(self, refs: list[SampleRef]) -> None:
        """Refuse refs the ledger could not record, of another contract, of a sample the stream carried,
        or whose store key holds another sample's blob (two samples on one key: one of them is lost)."""
        offered: set[str] = set()
        keys: dict[str, str] = {}
        for ref in refs:
            check_ref(ref)
            if self.contract_id is not None and ref.contract != self.contract_id:
                raise ValueError(f"sample {ref.sample_id!r} was captured under contract {ref.contract}, this stream "
                                 f"carries {self.contract_id}; capture with the stream's contract")
            if ref.sample_id in offered:
                raise ValueError(f"sample id {ref.sample_id!r} appears twice in one offer; sample ids must be unique "
                                 "within a stream")
            if ref.sample_id in self.seen:
                state = ("is already in flight" if ref.sample_id in self.inflight else
                         "was offered already in this stream and acknowledged; offering it again would train it twice")
                raise ValueError(f"sample id {ref.sample_id!r} {state}. Sample ids must be unique within a stream "
                                 "(prefix a new producer pass, e.g. 'epoch1/<id>')")
            owner = keys.get(ref.key, self.keys.get(ref.key))
            if owner is not None and owner != ref.sample_id:
                raise ValueError(f"samples {owner!r} and {ref.sample_id!r} name one store key {ref.key!r}: the "
                                 "second write replaces the first blob, so one sample could never be read; give "
                                 "each sample its own key (capture/store.py feature_key)")
            offered.add(ref.sample_id)
            keys[ref.key] = ref.sample_id

    def close(self) -> None:
        self.closed = True

    def fail(self, message: str) -> None:
        """The producer failed: every new window request and every wait raises ``StreamFailedError``.

        Unlike ``close`` this is not end of stream: the gang must not finish (and checkpoint) as if
        the stream were complete. Windows cut before the failure are still answered (every rank
        gets the same one); the first failure is kept as the cause.
        """
        self.failed = self.failed or message

    def check_failed(self) -> None:
        if self.failed is not None:
            raise StreamFailedError(f"the feature stream failed: {self.failed}")

    def hold(self, refs: Iterable[SampleRef]) -> int:
        """Count features an earlier run left in the store as in flight (a resumed stream).

        Called before producers start, so they wait for this room too; the gang's ``rewind``
        then re-queues the ones it re-dispatches and releases the ones its checkpoint holds.
        """
        held = 0
        for ref in refs:
            self.seen.add(ref.sample_id)
            self.keys[ref.key] = ref.sample_id
            if ref.sample_id not in self.inflight:
                self.inflight[ref.sample_id] = ref
                self.inflight_bytes += ref.num_bytes
                held += 1
        self._track_peak()
        return held

    def release(self, sample_ids: Iterable[str]) -> int:
        """Free the capacity of deleted features; unknown or already released ids are ignored."""
        freed = 0
        for sid in sample_ids:
            ref = self.inflight.pop(sid, None)
            if ref is not None:
                self.inflight_bytes -= ref.num_bytes
                freed += 1
        self.released_total += freed
        for step, window in list(self.windows.items()):
            if window is not None and not any(r.sample_id in self.inflight for r in window.refs):
                del self.windows[step]  # fully trained and deleted: no rank will ask for it again
        return freed

    # -- windows ---------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self.closed and self.reserved_samples == 0 and not self.pending

    def try_window(self, attempt: int, step: int) -> tuple[bool, Window | None]:
        """(ready, window): the window of (attempt, step), cut now if enough refs are pending.

        ``(True, None)`` means end of stream. The same (attempt, step) always gets the same answer.
        """
        if self.attempt is None or attempt < self.attempt:
            raise StaleAttemptError(f"window request of attempt {attempt}, but the broker serves attempt "
                                    f"{self.attempt}: this worker belongs to a group that was replaced; stop it")
        if attempt > self.attempt:
            raise ValueError(f"window request of attempt {attempt} before rewind(attempt={attempt}) was called")
        if step in self.windows:
            return True, self.windows[step]
        self.check_failed()
        if step != self.next_step:
            raise ValueError(f"attempt {attempt} asked for step {step}, but the next window is step {self.next_step}; "
                             "ranks must ask for consecutive steps")
        if len(self.pending) >= self.quantum:
            count = self.quantum
        elif self.closed and self.reserved_samples == 0:
            count = len(self.pending)  # the final partial window, or end of stream when 0
        else:
            return False, None
        window = Window(window_id(attempt, step), attempt, step, self.quantum,
                        tuple(self.pending.popleft() for _ in range(count))) if count else None
        self.windows[step] = window
        self.next_step = step + 1
        return True, window

    def rewind(self, attempt: int, *, quantum: int, world_size: int, step: int,
               redispatch: Iterable[SampleRef] = (), history: Iterable[str] = ()) -> int:
        """Start attempt ``attempt`` resuming after ``step``; returns how many refs were requeued.

        Samples in ``history`` (trained under the resumed checkpoint, features deleted) are
        released. Every other dispatched sample — ``redispatch`` from the ledger first, then
        windows this broker released and nobody finished — goes back to the front of the
        queue in original order, ahead of refs never dispatched; windows are cut anew with
        ``quantum``.
        """
        if self.attempt is not None and attempt <= self.attempt:
            raise StaleAttemptError(f"rewind to attempt {attempt}, but the broker already serves attempt {self.attempt}")
        _check_bound(quantum, self.max_inflight, self.max_inflight_bytes)
        history = set(history)
        self.release(history)
        self.seen |= history
        requeue: dict[str, SampleRef] = {}
        outstanding = [r for w in self.windows.values() if w is not None for r in w.refs]
        for ref in [*redispatch, *outstanding]:
            if ref.sample_id in history or ref.sample_id in requeue:
                continue
            requeue[ref.sample_id] = ref
            self.seen.add(ref.sample_id)
            self.keys[ref.key] = ref.sample_id
            if ref.sample_id not in self.inflight:  # known from the ledger only (e.g. a new broker)
                self.inflight[ref.sample_id] = ref
                self.inflight_bytes += ref.num_bytes
        self.pending = deque([*requeue.values(), *(r for r in self.pending if r.sample_id not in requeue)])
        self._track_peak()
        self.windows = {}
        self.attempt, self.quantum, self.world_size, self.next_step = attempt, quantum, world_size, step + 1
        return len(requeue)

    # -- re-capture ------------------------------------------------------------------------

    def report_lost(self, refs: Iterable[SampleRef]) -> bool:
        """Ask for these samples to be captured again; False when no producer can (see module docstring)."""
        if not self.recapture_enabled:
            return False
        for ref in refs:
            if ref.sample_id not in self.recapturing:
                self.lost.setdefault(ref.sample_id, ref)
        return True

    def take_lost(self) -> list[SampleRef]:
        taken, self.lost = list(self.lost.values()), {}
        self.recapturing.update((r.sample_id, r) for r in taken)
        return taken

    def mark_recaptured(self, refs: Iterable[SampleRef]) -> None:
        for ref in refs:
            asked = self.recapturing.pop(ref.sample_id, None)
            if asked is None:
                raise ValueError(f"sample {ref.sample_id!r} was re-captured but nobody asked for it")
            if (ref.key, ref.checksum) != (asked.key, asked.checksum):
                raise ValueError(
                    f"sample {ref.sample_id!r} re-captured as {ref.key} (checksum {ref.checksum}), but the stream "
                    f"dispatched {asked.key} (checksum {asked.checksum}): capture is not deterministic here "
                    "(a different target, dtype or batch?); the window cannot be trained as dispatched"
                )
            self.recaptured_total += 1

    def awaiting_recapture(self, sample_ids: Iterable[str]) -> bool:
        return any(sid in self.lost or sid in self.recapturing for sid in sample_ids)

    def stall_reason(self, window_waiters: int, reserve_waiters: int) -> str | None:
        """Why waiting cannot end: every rank waits for a window that cannot be cut, and producers wait for room.

        A waiter woken by an offer may look before the ranks it woke took their window: while
        ``pending`` holds a window's refs (or the stream ended), the ranks are about to return.
        """
        if window_waiters < self.world_size or reserve_waiters == 0 or self.reserved_samples:
            return None
        if len(self.pending) >= self.quantum or self.closed:
            return None
        return (f"deadlock: all {self.world_size} ranks wait for window step {self.next_step} "
                f"({len(self.pending)} of Q={self.quantum} refs pending) while producers wait for room "
                f"({self.used_samples}/{self.max_inflight} features, {self.used_bytes}/{self.max_inflight_bytes} bytes in "
                "flight), and features are freed only after a checkpoint covers them. Raise max_inflight / "
                "max_inflight_bytes to hold Q × trainer.checkpoint_every features, or checkpoint more often")

    def stats(self) -> dict:
        return {
            "attempt": self.attempt, "quantum": self.quantum, "closed": self.closed, "ended": self.ended,
            "failed": self.failed,
            "inflight": self.used_samples, "inflight_bytes": self.used_bytes,
            "peak_inflight": self.peak_samples, "peak_inflight_bytes": self.peak_bytes,
            "max_inflight": self.max_inflight, "max_inflight_bytes": self.max_inflight_bytes,
            "reserved": self.reserved_samples, "pending": len(self.pending),
            "dispatched_windows": sum(w is not None for w in self.windows.values()),
            "offered_total": self.offered_total, "released_total": self.released_total,
            "recaptured_total": self.recaptured_total,
        }


class _SampleBroker:
    """Async Ray actor around ``WindowQueue``: waiting ``reserve`` / ``next_window`` with timeouts."""

    def __init__(self, quantum: int, *, max_inflight: int, max_inflight_bytes: int | None = None,
                 contract: CaptureContract | None = None, store_uri: str | None = None, endpoint_url: str | None = None):
        self._queue = WindowQueue(quantum, max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes,
                                  contract_id=contract.contract_id if contract else None)
        self._contract = contract
        self._store_uri = store_uri
        self._endpoint_url = endpoint_url
        self._changed = asyncio.Condition()
        self._waiting = {"window": 0, "reserve": 0, "recapture": 0}
        self._stalled: str | None = None

    async def _wait_until(self, ready, timeout: float | None, kind: str) -> bool:
        """Wait (holding the condition) until ``ready()``; False on timeout. ``kind``: who waits."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._waiting[kind] += 1
        try:
            while not ready():
                self._queue.check_failed()
                reason = self._stalled or self._queue.stall_reason(self._waiting["window"], self._waiting["reserve"])
                if reason:
                    self._stalled = reason
                    self._changed.notify_all()
                    raise BrokerStalledError(reason)
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            self._waiting[kind] -= 1

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def reserve(self, num_samples: int = 1, num_bytes: int = 0, timeout: float | None = None) -> bool:
        """Reserve room for features about to be written; waits up to ``timeout`` (0 = just try)."""
        self._queue.check_reservation(num_samples, num_bytes)
        async with self._changed:
            if not await self._wait_until(lambda: self._queue.fits(num_samples, num_bytes), timeout, "reserve"):
                return False
            return self._queue.try_reserve(num_samples, num_bytes)

    async def offer(self, refs: list[SampleRef], *, reserved_bytes: int) -> None:
        self._queue.offer(refs, reserved_bytes=reserved_bytes)
        await self._notify()

    async def hold(self, refs: list[SampleRef]) -> int:
        return self._queue.hold(refs)

    async def cancel(self, num_samples: int, num_bytes: int = 0) -> None:
        self._queue.cancel(num_samples, num_bytes)
        await self._notify()

    async def close(self) -> None:
        """End of stream: no more reservations; the final partial window will be released."""
        self._queue.close()
        await self._notify()

    async def fail(self, message: str) -> None:
        """The producer failed with ``message``: wake every waiter with ``StreamFailedError`` (it beats a close)."""
        self._queue.fail(message)
        await self._notify()

    async def next_window(self, attempt: int, step: int, timeout: float | None = None) -> Window | None:
        """The window of (attempt, step), the same for every rank; None at end of stream."""
        result: list[Window | None] = []

        def ready() -> bool:
            done, window = self._queue.try_window(attempt, step)
            if done:
                result.append(window)
            return done

        async with self._changed:
            if not await self._wait_until(ready, timeout, "window"):
                raise TimeoutError(f"no window for attempt {attempt} step {step} within {timeout} s "
                                   f"({len(self._queue.pending)} of Q={self._queue.quantum} refs pending); "
                                   "are the producers running?")
            self._changed.notify_all()  # a window was cut: other ranks asking for it can return
        return result[0]

    async def release(self, sample_ids: list[str]) -> int:
        freed = self._queue.release(sample_ids)
        await self._notify()
        return freed

    async def rewind(self, attempt: int, *, quantum: int, world_size: int, step: int,
                     redispatch: list[SampleRef] = (), history: list[str] = ()) -> int:
        requeued = self._queue.rewind(attempt, quantum=quantum, world_size=world_size, step=step,
                                      redispatch=redispatch, history=history)
        self._stalled = None
        await self._notify()
        return requeued

    async def enable_recapture(self) -> None:
        """The producer can capture samples again from their source (see the module docstring)."""
        self._queue.recapture_enabled = True

    async def report_lost(self, refs: list[SampleRef]) -> bool:
        asked = self._queue.report_lost(refs)
        await self._notify()
        return asked

    async def take_lost(self, timeout: float | None = None) -> list[SampleRef]:
        """Producer side: the samples to capture again ([] after ``timeout`` with none)."""
        async with self._changed:
            await self._wait_until(lambda: bool(self._queue.lost), timeout, "recapture")
            return self._queue.take_lost()

    async def recaptured(self, refs: list[SampleRef]) -> None:
        self._queue.mark_recaptured(refs)
        await self._notify()

    async def wait_recaptured(self, sample_ids: list[str], timeout: float | None = None) -> bool:
        """Rank side: True once none of ``sample_ids`` awaits re-capture; False on timeout."""
        async with self._changed:
            return await self._wait_until(lambda: not self._queue.awaiting_recapture(sample_ids), timeout, "recapture")

    async def stats(self) -> dict:
        return self._queue.stats()

    async def describe(self) -> dict:
        """What the gang needs to read the stream: contract, store and the bound."""
        return {
            "contract": self._contract.to_json() if self._contract else None,
            "store_uri": self._store_uri, "endpoint_url": self._endpoint_url,
            "max_inflight": self._queue.max_inflight, "max_inflight_bytes": self._queue.max_inflight_bytes,
            "recapture": self._queue.recapture_enabled,
        }


SampleBroker = ray.remote(num_cpus=0)(_SampleBroker)


def start_sample_broker(quantum: int, *, max_inflight: int, max_inflight_bytes: int | None = None,
                        contract: CaptureContract | None = None, store_uri: str | None = None,
                        endpoint_url: str | None = None, name: str | None = None):
    """Create the broker actor; bound errors raise ``ValueError`` here, in the caller."""
    _check_bound(quantum, max_inflight, max_inflight_bytes)
    options = {"name": name} if name else {}
    return SampleBroker.options(**options).remote(
        quantum, max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes, contract=contract,
        store_uri=store_uri, endpoint_url=endpoint_url,
    )
