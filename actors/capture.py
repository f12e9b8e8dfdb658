"""Capture on Ray: ``CaptureActor`` (one frozen target per process) and ``CapturePool``.

``CaptureActor`` wraps ``capture.server.CaptureServer``: the target is loaded once, in the
constructor, and ``capture(batch_id, samples)`` runs one padded forward and writes one blob
per sample. An actor asks Ray for ``num_gpus_per_actor`` GPUs; ``target_device`` (``auto | cpu |
cuda``) is resolved against what Ray granted it (``ray.get_gpu_ids()``), and with more than one
GPU the target is placed across them (``capture/target.py::target_placement``). ``CapturePool`` is the driver side: N actors fed from an iterable of
``(batch_id, samples)`` batches, each batch's SampleRefs handed to a sink::

    pool = CapturePool("debug", contract, "file:///tmp/features", num_actors=2)
    stats = pool.run(batches, on_refs=lambda batch_id, refs: ..., admit=None)
    pool.close()

Backpressure: at most ``max_inflight_batches`` batches are outstanding per actor (one
computing, the rest queued so the actor never idles on a round trip), and ``admit(batch)``
is called before a batch is dispatched. It may block (the online pipeline reserves broker
capacity there): it runs on a helper thread while the calling thread keeps delivering
finished batches to ``on_refs``, so an ``admit`` that waits for the consumer to drain those
cannot deadlock. A batch re-sent after a failure is not admitted again.

Failures: an actor that dies (``ActorDiedError``, ``ActorUnavailableError``) loses its
unfinished batches; they are dispatched again, to any actor. The dead actor is probed with
``ready()``: Ray restarts it up to ``max_restarts`` times (the constructor loads the target
again), after that the pool replaces it with a fresh one. Every batch reaches ``on_refs``
exactly once, deduplicated by batch id, and a batch that keeps killing its actor
(``max_batch_attempts``, e.g. out of memory) fails the run instead of looping. A batch is
always re-sent with the same samples in the same order, so its features (and checksums)
are the same as the first attempt's would have been: the padded forward is a pure function
of the batch, and the store key is a function of the sample id and contract. With a
``ray://`` store the features of batches already delivered die with their actor as well;
capturing those again is the durable layer's job (see ``actors/object_store.py``): it calls
``recapture(batch, only=sample_ids)`` from any thread, and the pool (inside ``run``) sends
the original batch again — same samples, same order, same padding, so the same bytes — with
only those samples written, ahead of new batches and without ``admit`` (their room in the
stream is still held). ``run(..., until=event)`` keeps serving re-captures after the source
is exhausted, until ``event`` is set.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, RayActorError
from tqdm import tqdm

import specray.actors.object_store  # noqa: F401  (registers ray:// in the driver)
from specray.actors.cluster import check_cluster_gpus
from specray.capture.contract import CaptureContract
from specray.capture.data import RenderedSample
from specray.capture.server import CaptureServer
from specray.capture.store import SampleRef, open_store
from specray.capture.devices import resolve_device
from specray.capture.target import load_target, target_placement

Batch = tuple[str, list[RenderedSample]]  # (batch_id, samples)


@ray.remote
class CaptureActor:
    """A CaptureServer in its own process; ``capture`` is deterministic per batch."""

    def __init__(self, target: str, contract: CaptureContract, store_uri: str, *,
                 endpoint_url: str | None = None, target_dtype: str = "float32", target_device: str = "cpu",
                 chat_template: str | None = None):
        # Ray ships this class by value, so this module's imports do not run in the actor.
        import specray.actors.object_store  # noqa: F401  (registers ray://)

        gpus = len(ray.get_gpu_ids())
        device = resolve_device(target_device, field="target.device", gpus=gpus,
                                fix="set capture.num_gpus_per_actor=1 (or more) so that Ray grants each capture actor "
                                    "a GPU, or target.device=auto")
        store = open_store(store_uri, endpoint_url=endpoint_url)
        placed = load_target(target, dtype=target_dtype, chat_template=chat_template,  # the plan's chat template
                             **target_placement(device, gpus))
        self.server = CaptureServer(placed, contract, store)

    def ready(self) -> int:
        """Health probe: answers once the target is loaded; returns the process id."""
        return os.getpid()

    def capture(self, batch_id: str, samples: list[RenderedSample], only: list[str] | None = None) -> list[SampleRef]:
        """Capture the batch; with ``only``, write just those samples (a re-capture, same bytes)."""
        if not samples:
            raise ValueError(f"batch {batch_id!r} has no samples")
        return self.server.capture(samples, only=only)


def actor_options(num_cpus: float, num_gpus: float, max_restarts: int) -> dict:
    """Ray options of a capture actor: its CPUs and GPUs (``capture.num_cpus_per_actor`` /
    ``num_gpus_per_actor``), restarts by Ray, and no task retries (the pool re-sends lost batches)."""
    if num_gpus < 0:
        raise ValueError(f"capture.num_gpus_per_actor must be >= 0, got {num_gpus}")
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts, "max_task_retries": 0}


@dataclass(frozen=True)
class PoolStats:
    batches: int
    samples: int
    tokens: int
    seconds: float  # first dispatch to last delivery
    restarts: int  # actor failures recovered: restarted by Ray or replaced by the pool
    redispatched: int  # batch attempts lost with their actor and sent again
    max_inflight: int  # most batches dispatched and not yet delivered at one time
    recaptured: int = 0  # samples captured again on request (not in batches/samples/tokens)


@dataclass
class _Slot:
    actor: ActorHandle
    generation: int = 0  # bumped per failure: failures of older attempts are not new deaths
    inflight: int = 0
    probe: ray.ObjectRef | None = None  # ready() while (re)starting; no batches until it answers
    probe_deadline: float = 0.0


@dataclass
class _Attempt:
    job: _Job
    slot: int
    generation: int


@dataclass(frozen=True)
class _Job:
    batch: Batch
    only: tuple[str, ...] | None = None  # write only these samples of the batch (same forward, same bytes)
    recapture: bool = False  # asked for with recapture(): not counted as new samples


@dataclass
class _RunState:
    on_refs: Callable[[str, list[SampleRef]], None]
    bar: tqdm
    pending: dict[ray.ObjectRef, _Attempt] = field(default_factory=dict)
    retry: deque[_Job] = field(default_factory=deque)
    seen: set[str] = field(default_factory=set)
    recapture_ids: set[str] = field(default_factory=set)
    delivered: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    restarts: int = 0
    redispatched: int = 0
    max_inflight: int = 0
    recaptured: int = 0
    started: float | None = None  # perf_counter at the first dispatch (actor start-up is not capture time)
    last_progress: float = field(default_factory=time.monotonic)


class CapturePool:
    """N ``CaptureActor``\\ s behind one ``run(batches, on_refs)``; see the module docstring."""

    def __init__(self, target: str, contract: CaptureContract, store_uri: str, *, endpoint_url: str | None = None,
                 num_actors: int = 1, num_cpus_per_actor: float = 1.0, max_restarts: int = 3,
                 max_inflight_batches: int = 2, target_dtype: str = "float32", max_batch_attempts: int = 3,
                 start_timeout_s: float = 300.0, stall_timeout_s: float = 600.0, num_gpus_per_actor: float = 0.0,
                 target_device: str = "cpu", chat_template: str | None = None):
        """``chat_template``: the template text the plan rendered with (``Target.chat_template``; None =
        the tokenizer's own), so every actor's target has the contract's template fingerprint."""
        if not ray.is_initialized():
            raise RuntimeError("CapturePool needs a Ray connection: call ray.init(...) first "
                               "(specray pipeline run connects for you)")
        for name, value in (("num_actors", num_actors), ("max_inflight_batches", max_inflight_batches),
                            ("max_batch_attempts", max_batch_attempts)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        check_cluster_gpus(num_actors * num_gpus_per_actor, gpus_field="capture.num_gpus_per_actor", who="capture actors")
        # Opened here first: a ray:// store's directory then lives as long as this driver.
        self.store = open_store(store_uri, endpoint_url=endpoint_url)
        self._actor_cls = CaptureActor.options(**actor_options(num_cpus_per_actor, num_gpus_per_actor, max_restarts))
        self._actor_args = (target, contract, store_uri)
        self._actor_kwargs = {"endpoint_url": endpoint_url, "target_dtype": target_dtype, "target_device": target_device,
                              "chat_template": chat_template}
        self.num_cpus_per_actor, self.num_gpus_per_actor = num_cpus_per_actor, num_gpus_per_actor
        self.max_inflight_batches = max_inflight_batches
        self.max_batch_attempts = max_batch_attempts
        self.start_timeout_s = start_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._probes: dict[ray.ObjectRef, int] = {}
        self._recaptures: deque[_Job] = deque()  # appended from other threads (deque ops are atomic)
        self._slots = [_Slot(self._actor_cls.remote(*self._actor_args, **self._actor_kwargs)) for _ in range(num_actors)]
        for index in range(num_actors):
            self._probe(index)
        self._closed = False

    @property
    def actors(self) -> list[ActorHandle]:
        """The current actor handles (a replaced actor's slot holds its successor)."""
        return [slot.actor for slot in self._slots]

    def wait_ready(self) -> None:
        """Block until every actor has loaded its target (``run`` starts on the first ready one)."""
        deadline = time.monotonic() + self.start_timeout_s
        while self._probes:
            for ref in ray.wait(list(self._probes), num_returns=1, timeout=1.0)[0]:
                self._probed(ref)
            if time.monotonic() > deadline:
                raise TimeoutError(self._start_timeout_message())

    def __enter__(self) -> CapturePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every actor; features a ray:// store holds from them are lost with them."""
        if not self._closed:
            for slot in self._slots:
                ray.kill(slot.actor, no_restart=True)
            self._closed = True

    # -- run --------------------------------------------------------------------------------

    def recapture(self, batch: Batch, only: Iterable[str]) -> None:
        """Queue a re-capture of ``only`` (sample ids of ``batch``); thread-safe, served by ``run``.

        ``batch`` must be the batch exactly as first captured (same samples, same order), and
        its id unique within the run that serves it (e.g. ``"recapture-3/batch-000007"``);
        the refs go to that run's ``on_refs`` under this id.
        """
        only = tuple(only)
        if not only:
            raise ValueError(f"recapture of batch {batch[0]!r} names no samples")
        self._recaptures.append(_Job((batch[0], list(batch[1])), only, recapture=True))

    def run(self, batches: Iterable[Batch | tuple[str, list[RenderedSample], Iterable[str] | None]],
            on_refs: Callable[[str, list[SampleRef]], None], *,
            admit: Callable[[Batch], None] | None = None, progress: bool = False,
            until: threading.Event | None = None) -> PoolStats:
        """Capture every batch; ``on_refs(batch_id, refs)`` once per batch, in completion order.

        A batch may come as ``(batch_id, samples, only)``: the forward runs over all
        ``samples`` (so each sample's bytes are those of that batch) and only the ``only``
        sample ids are written, admitted and delivered.

        Queued re-captures go first. With ``until``, the run keeps serving re-captures after
        the last batch until the event is set (and nothing is outstanding).
        """
        if self._closed:
            raise RuntimeError("this CapturePool is closed; create a new one")
        for slot in self._slots:
            slot.inflight = 0  # attempts left over from an aborted run are not waited for
        source = iter(batches)
        exhausted = False
        with tqdm(unit="tok", desc="capture", disable=not progress) as bar:
            st = _RunState(on_refs, bar)
            while True:
                job = self._urgent(st)
                if job is None and not exhausted:
                    job = self._next(source, admit, st)
                    exhausted = job is None
                if job is None:
                    if not st.pending and (until is None or until.is_set()):
                        break
                    if st.pending or self._probes:
                        self._poll(st, timeout=0.2 if until is not None else 1.0)
                    else:
                        until.wait(0.2)
                    continue
                while (index := self._free_slot()) is None:
                    self._poll(st)
                self._dispatch(job, index, st)
        seconds = time.perf_counter() - st.started if st.started is not None else 0.0
        batches = len(st.delivered) - sum(1 for job_id in st.delivered if job_id in st.recapture_ids)
        return PoolStats(batches, st.samples, st.tokens, seconds, st.restarts, st.redispatched, st.max_inflight,
                         st.recaptured)

    def _urgent(self, st: _RunState) -> _Job | None:
        """A lost attempt to re-send, else a queued re-capture (its id checked like a new batch's)."""
        if st.retry:
            return st.retry.popleft()
        if not self._recaptures:
            return None
        job = self._recaptures.popleft()
        if job.batch[0] in st.seen:
            raise ValueError(f"batch id {job.batch[0]!r} appears twice; batch ids must be unique within a run")
        st.seen.add(job.batch[0])
        st.recapture_ids.add(job.batch[0])
        return job

    def _next(self, source: Iterator[Batch], admit: Callable[[Batch], None] | None, st: _RunState) -> _Job | None:
        item = next(source, None)
        if item is None:
            return None
        batch_id, samples, *rest = item
        only = tuple(rest[0]) if rest and rest[0] is not None else None
        if batch_id in st.seen:
            raise ValueError(f"batch id {batch_id!r} appears twice; batch ids must be unique within a run")
        if not samples:
            raise ValueError(f"batch {batch_id!r} has no samples")
        st.seen.add(batch_id)
        batch = (batch_id, list(samples))
        if admit is not None:  # admits what will be written
            written = [s for s in batch[1] if only is None or s.sample_id in only]
            self._while_polling(admit, (batch_id, written), st)
        return _Job(batch, only)

    def _while_polling(self, fn: Callable[[Batch], None], batch: Batch, st: _RunState) -> None:
        """Call ``fn(batch)`` on a helper thread and keep delivering finished batches until it returns."""
        done = threading.Event()
        error: list[BaseException] = []

        def call() -> None:
            try:
                fn(batch)
            except BaseException as e:  # noqa: BLE001 - re-raised on the driver thread below
                error.append(e)
            finally:
                done.set()

        threading.Thread(target=call, name="specray-admit", daemon=True).start()
        while not done.is_set():
            # Re-send lost batches and serve re-captures meanwhile: they hold their room
            # already, and the room ``fn`` waits for may only come once they are delivered.
            while (st.retry or self._recaptures) and (index := self._free_slot()) is not None:
                self._dispatch(self._urgent(st), index, st)
            if st.pending or self._probes:
                self._poll(st, timeout=0.05)
            else:
                done.wait(0.05)
        if error:
            raise error[0]

    def _free_slot(self) -> int | None:
        ready = [i for i, s in enumerate(self._slots) if s.probe is None and s.inflight < self.max_inflight_batches]
        return min(ready, key=lambda i: self._slots[i].inflight) if ready else None

    def _dispatch(self, job: _Job, index: int, st: _RunState) -> None:
        slot = self._slots[index]
        if st.started is None:
            st.started = time.perf_counter()
        only = list(job.only) if job.only is not None else None
        st.pending[slot.actor.capture.remote(*job.batch, only)] = _Attempt(job, index, slot.generation)
        slot.inflight += 1
        st.last_progress = time.monotonic()
        st.max_inflight = max(st.max_inflight, len(st.pending))

    def _poll(self, st: _RunState, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` for finished batches and probes, and handle all that are ready."""
        waiting = [*st.pending, *self._probes]
        ready, _ = ray.wait(waiting, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
            st.last_progress = time.monotonic()
        for ref in ready:
            if ref in st.pending:
                self._complete(ref, st)
            else:
                self._probed(ref)
        now = time.monotonic()
        if any(slot.probe is not None and now > slot.probe_deadline for slot in self._slots):
            raise TimeoutError(self._start_timeout_message())
        if st.pending and now - st.last_progress > self.stall_timeout_s:
            raise TimeoutError(f"no capture batch finished for {self.stall_timeout_s:.0f} s "
                               f"({len(st.pending)} outstanding); an actor is hung")

    def _start_timeout_message(self) -> str:
        gpus = f" and {self.num_gpus_per_actor:g} free GPUs" if self.num_gpus_per_actor else ""
        return (f"a capture actor did not start within {self.start_timeout_s:.0f} s; the cluster may lack "
                f"{self.num_cpus_per_actor:g} free CPUs{gpus} per actor (lower capture.num_actors, "
                f"capture.num_cpus_per_actor or capture.num_gpus_per_actor)")

    def _complete(self, ref: ray.ObjectRef, st: _RunState) -> None:
        attempt = st.pending.pop(ref)
        self._slots[attempt.slot].inflight -= 1
        try:
            refs: list[SampleRef] = ray.get(ref, timeout=self.stall_timeout_s)  # ready: returns at once
        except RayActorError as e:
            if e.actor_init_failed:
                raise RuntimeError(f"capture actor {attempt.slot} failed in its constructor: {e}") from e
            self._lost(attempt, e, st)
            return
        batch_id = attempt.job.batch[0]
        if batch_id in st.delivered:  # only one attempt is ever outstanding; guards the exactly-once promise
            return
        st.delivered.add(batch_id)
        if attempt.job.recapture:
            st.recaptured += len(refs)
            st.on_refs(batch_id, refs)
            return
        st.samples += len(refs)
        tokens = sum(r.num_tokens for r in refs)
        st.tokens += tokens
        st.on_refs(batch_id, refs)
        st.bar.update(tokens)

    def _lost(self, attempt: _Attempt, error: RayActorError, st: _RunState) -> None:
        """The attempt died with its actor: send the batch again and probe (or replace) the actor."""
        batch_id = attempt.job.batch[0]
        st.attempts[batch_id] = st.attempts.get(batch_id, 1) + 1
        if st.attempts[batch_id] > self.max_batch_attempts:
            raise RuntimeError(
                f"batch {batch_id!r} lost its actor {self.max_batch_attempts} times (last: {error}); it probably "
                "kills the actor (out of memory?): lower capture.max_batch_tokens or give actors more memory"
            )
        st.retry.append(attempt.job)
        st.redispatched += 1
        slot = self._slots[attempt.slot]
        if attempt.generation == slot.generation:  # first news of this death
            slot.generation += 1
            st.restarts += 1
            self._probe(attempt.slot)

    def _probe(self, index: int, *, deadline: float | None = None) -> None:
        slot = self._slots[index]
        # Retried by Ray across restarts: it fails only once Ray gives the actor up for dead.
        slot.probe = slot.actor.ready.options(max_task_retries=-1).remote()
        slot.probe_deadline = deadline if deadline is not None else time.monotonic() + self.start_timeout_s
        self._probes[slot.probe] = index

    def _probed(self, ref: ray.ObjectRef) -> None:
        index = self._probes.pop(ref)
        slot = self._slots[index]
        try:
            ray.get(ref, timeout=self.start_timeout_s)  # ready: returns at once
            slot.probe = None  # up: it takes batches again
        except ActorUnavailableError:
            self._probe(index, deadline=slot.probe_deadline)  # restarting or unreachable for now: ask again
        except RayActorError as e:
            if e.actor_init_failed:
                raise RuntimeError(f"capture actor {index} failed in its constructor: {e}") from e
            # Ray will not bring it back (restarts used up, or killed for good): a fresh actor.
            ray.kill(slot.actor, no_restart=True)
            slot.actor = self._actor_cls.remote(*self._actor_args, **self._actor_kwargs)
            slot.generation += 1
            self._probe(index)
