"""The serving engine: requests in, tokens out, with or without a drafter.

    engine = Engine(load_target(), drafter_dir="runs/train-dflash/exports/step-00002000")
    outputs = engine.generate(["Write a haiku about CPUs."], SamplingParams(max_tokens=64))

Incremental use (a server): ``submit`` (any thread) queues a request and returns its
``RequestHandle``; an ``EngineLoop`` thread calls ``step`` while there is work; each step appends
the request's new tokens to its handle, which reads as ``StreamDelta``s of tokens and text
(``for delta in handle`` in a thread, ``async for delta in handle`` in asyncio). ``generate``
is ``submit`` + ``step`` until done.

    loop = EngineLoop(engine).start()
    handle = engine.submit("Hi", SamplingParams(max_tokens=32))
    text = "".join(delta.text for delta in handle)

Continuous batching (this module): up to ``max_batch`` requests run at once, each in its own KV
slot; a finished request frees its slot and the next waiting one is prefilled. Every step runs
one round of the worker (``serving/workers/base.py``) for all running requests of a drafter
version. At most ``max_waiting`` requests wait for a slot; ``submit`` beyond that raises
``QueueFullError`` (a server answers 503 / 429, the client retries later). The KV capacity is
checked up front: a prompt that cannot fit ``max_tokens`` plus one round's verify rows is
refused with a clear error and the engine keeps serving.

Failures stay with their requests: a request whose logits are not finite fails alone
(``NonFiniteLogitsError``); a worker round or prefill that raises fails the requests it ran
(their state is unknown) and the others go on; in every case the slot is freed and later
requests are served. Stops and streaming: ``serving/requests.py``; drafter versions and
hot-load: ``serving/versions.py``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from specray.capture.target import Target
from specray.serving.cost_table import CostTable, describe_machine
from specray.serving.requests import (GenerationOutput, Request, RequestHandle, StreamDelta, TokenizerSurface,
                                      check_prompt)
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams, sample_each
from specray.serving.versions import DrafterVersion, DrafterVersions

__all__ = ["Engine", "EngineLoop", "GenerationOutput", "QueueFullError", "RequestHandle", "StreamDelta"]

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 60.0  # tokens/s is measured over the steps of the last minute


class TokenRate:
    """Tokens generated, and tokens per second of stepping over the steps of the last minute (what
    ``stats()`` reports). Not thread-safe: its engine calls it under its lock."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S):
        self.window_s, self.total = window_s, 0
        self._steps: deque[tuple[float, int, float]] = deque()  # (end time, tokens, seconds) per step

    def add(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        self.total += tokens
        if tokens:
            self._steps.append((now, tokens, seconds))
        while self._steps and now - self._steps[0][0] > self.window_s:
            self._steps.popleft()

    def per_second(self) -> float:
        busy = sum(s for _, _, s in self._steps)
        return sum(n for _, n, _ in self._steps) / busy if busy else 0.0


class QueueFullError(RuntimeError):
    """``submit`` found ``max_waiting`` requests already waiting for a slot: retry later (HTTP 503
    with Retry-After, or 429), or serve with a larger ``max_waiting`` or more replicas."""


class Engine(TokenizerSurface):
    def __init__(self, target: Target, drafter_dir: str | None = None, *, max_batch: int = 4, max_len: int = 2048,
                 drafter_version: int = 0, num_speculative_tokens: int | None = None,
                 max_speculative_batch: int | None = None, speculation: str = "auto", tree: bool = False,
                 cost_table: str | Path | CostTable | None = None, max_waiting: int | None = 256):
        """``num_speculative_tokens``: the largest round — at most this many drafts (a chain) or
        tree nodes (a tree) per round (None = the worker's default, e.g. DFlash's whole block;
        each worker clamps it to what its drafter can propose). ``speculation``: "auto" (each
        round's size is chosen from the cost table and measured acceptance, ``serving/chooser.py``;
        0 = a plain step when no round pays) or "static" (always the largest). ``max_speculative_batch``:
        an upper bound — a group of more requests of one drafter version takes plain steps (None =
        no bound). ``tree``: draft trees with the algorithm's tree worker. ``cost_table``: a table
        from ``specray profile`` (a path or a ``CostTable``; checked against this machine), or None
        to measure one when the first drafter is loaded ("static" needs none: it chooses nothing).
        All apply to every drafter version this
        engine loads. ``max_waiting``: requests that may wait for a slot (None = unbounded, for
        offline batch jobs that queue everything)."""
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 (or None for the drafter's block), "
                             f"got {num_speculative_tokens}")
        if max_speculative_batch is not None and max_speculative_batch < 0:
            raise ValueError(f"max_speculative_batch must be >= 0 (0 = never speculate; None = no bound), "
                             f"got {max_speculative_batch}")
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for an unbounded queue), got {max_waiting}")
        if isinstance(cost_table, (str, Path)):
            source, cost_table = str(cost_table), CostTable.load(cost_table)
            cost_table.check_machine(describe_machine(target), source)
        self.target = target
        self.tokenizer = target.tokenizer
        self.max_len, self.max_waiting = max_len, max_waiting
        self.eos_ids = {target.tokenizer.eos_token_id}
        self.runner = LlamaRunner(target.model, num_slots=max_batch, max_len=max_len)
        self._lock = threading.RLock()  # guards the queue, the versions and the counters
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._rate = TokenRate()
        self._served = self._aborted = self._failed = 0
        self.versions = DrafterVersions(target, self.runner, self._lock, self._work.notify_all,
                                        num_speculative_tokens=num_speculative_tokens,
                                        max_speculative_batch=max_speculative_batch, speculation=speculation,
                                        tree=tree, cost_table=cost_table)
        self.versions.install(self.versions.build_ar() if drafter_dir is None
                              else self.versions.build(drafter_dir, drafter_version))

    # -- versions -------------------------------------------------------------------------

    @property
    def worker(self):
        """The active version's worker (what new requests run on)."""
        return self.versions.active.worker

    @worker.setter
    def worker(self, worker) -> None:
        self.versions.active.worker = worker

    @property
    def drafter(self) -> nn.Module | None:
        return self.versions.active.drafter

    @property
    def active_version(self) -> int | None:
        return self.versions.active.version

    @property
    def live_versions(self) -> list[int | None]:
        with self._lock:
            return [v.version for v in self.versions.live]

    def load_drafter(self, drafter_dir: str | Path, version: int) -> Future:
        """Validate and build ``version`` in a background thread; the next ``step`` activates it.
        The future resolves to ``version`` once it is ready, or raises why it was rejected."""
        return self.versions.load(drafter_dir, version)

    # -- requests -------------------------------------------------------------------------

    def _check(self, ids: list[int], params: SamplingParams, version: DrafterVersion) -> None:
        check_prompt(ids, params, max_len=self.max_len, vocab_size=self.target.vocab_size,
                     verify_rows=version.worker.max_verify_rows)

    def submit(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> RequestHandle:
        """Queue one request (thread-safe). A bad prompt or one that does not fit raises ValueError;
        a full wait queue raises ``QueueFullError``."""
        ids, params = self.encode(prompt), params or SamplingParams()
        with self._lock:
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"the engine's wait queue is full (max_waiting={self.max_waiting} requests "
                                     f"waiting for {self.runner.cache.num_slots} slots); retry later")
            self._check(ids, params, self.versions.active)
            return self._enqueue(ids, params, request_id)

    def _enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None) -> RequestHandle:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        version = self.versions.active
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        handle = RequestHandle(request_id, ids, params, version.version, decode=self.decode, abort=self.abort)
        # on the runner's device: every draw of the request (drafts, verification, sampling) runs there
        request = Request(handle, ids, params, torch.Generator(device=self.runner.device).manual_seed(seed), version)
        version.live += 1
        self._requests[request_id] = request
        self._waiting.append(request)
        self._work.notify_all()
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request: at once if it is still queued, else at the next step (either way its
        last delta says ``abort``). Unknown ids are ignored: the request has already finished."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            request.aborted = True
            if request in self._waiting:
                self._waiting.remove(request)
                request.finish_reason = "abort"
                self._finish(request)
            self._work.notify_all()

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Run ``prompts`` to the end (the whole batch is queued at once, whatever ``max_waiting``).
        If a request failed, raises its error once every request of the batch has finished."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prepared = [(self.encode(p), sp) for p, sp in zip(prompts, params_list, strict=True)]
        with self._lock:  # all checked before any is queued: one bad prompt refuses the batch
            for ids, sp in prepared:
                self._check(ids, sp, self.versions.active)
            handles = [self._enqueue(ids, sp, None) for ids, sp in prepared]
        while not all(h.done for h in handles):
            self.serve_step()
        return [h.result() for h in handles]

    # -- scheduling -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self.versions.staged)

    def wait_for_work(self, timeout: float) -> bool:
        with self._work:
            return self._work.wait_for(self.has_work, timeout)

    def wake(self) -> None:
        """Wake whoever waits in ``wait_for_work`` (e.g. a loop that is asked to stop)."""
        with self._work:
            self._work.notify_all()

    def serve_step(self) -> int:
        """``step``, and if it raises (the engine's own failure: a worker's fails its requests
        inside ``step``), fail every running request with that error so the next step starts clean."""
        try:
            return self.step()
        except Exception as e:  # noqa: BLE001 - the running requests get the error; the engine keeps serving
            log.exception("engine step failed; failing its requests")
            self.fail_running(e)
            return 0

    def step(self) -> int:
        """One scheduling round: activate a staged drafter, admit and prefill waiting requests,
        run one worker round per version group, retire finished and failed requests. Returns
        tokens emitted."""
        with self._step_lock:
            start = time.perf_counter()
            self.versions.activate_staged()
            emitted = self._admit()
            self._retire()
            for version, group in self._groups(self._running):
                emitted += self._round(version, group)
            self._publish(self._running)
            self._retire()
            self.versions.drop_idle()
            self._account(emitted, time.perf_counter() - start)
            return emitted

    @staticmethod
    def _groups(requests: list[Request]) -> list[tuple[DrafterVersion, list[Request]]]:
        groups: dict[int, tuple[DrafterVersion, list[Request]]] = {}
        for r in requests:
            groups.setdefault(id(r.version), (r.version, []))[1].append(r)
        return list(groups.values())

    def _admit(self) -> int:
        """Move waiting requests into free slots and prefill them; returns the tokens emitted."""
        admitted, emitted = [], 0
        with self._lock:
            while self._waiting and len(self._running) + len(admitted) < self.runner.cache.num_slots:
                admitted.append(self._waiting.popleft())
        for request in admitted:
            request.slot = self.runner.cache.allocate()
            request.start = time.perf_counter()
        self._running += admitted  # before the prefill: a failed request is retired from there
        for version, group in self._groups(admitted):
            try:
                logits = version.worker.prefill([r.slot for r in group], [r.prompt_ids for r in group])  # [B, V]
            except Exception as e:  # noqa: BLE001 - the group's caches are unknown: fail its requests alone
                log.exception("prefill failed; failing its %d requests", len(group))
                self._fail(group, e)
                continue
            tokens, errors = sample_each(logits, [r.params for r in group], [r.generator for r in group])
            for b, (r, first, error) in enumerate(zip(group, tokens, errors)):
                r.error = error
                r.append(first, self.eos_ids, self.decode)
                r.record_logprobs(logits[b : b + 1], 0)
                emitted += len(r.tokens)
        return emitted

    def _round(self, version: DrafterVersion, group: list[Request]) -> int:
        """One worker step for ``group``, sized by the version's chooser; counts each request's
        round up to its stop. Returns tokens emitted."""
        size = version.chooser.choose(len(group)) if version.chooser else 0
        start = time.perf_counter()
        try:
            out = version.worker.step([r.slot for r in group], [r.anchor for r in group],
                                      [r.params for r in group], [r.generator for r in group], size)
        except Exception as e:  # noqa: BLE001 - the group's state is unknown: fail its requests, serve the rest
            log.exception("worker round failed; failing its %d requests", len(group))
            self._fail(group, e)
            return 0
        seconds = time.perf_counter() - start
        emitted, drafts, accepted_ok = 0, [], []
        for b, r in enumerate(group):
            if out.errors[b] is not None:
                r.error = out.errors[b]
                continue
            before = len(r.tokens)
            used = r.append(out.tokens[b], self.eos_ids, self.decode)
            if r.logprobs is not None:
                assert out.target_logits is not None, f"the {version.algorithm} worker keeps no target logits"
                rows = out.target_logits[b] if out.target_rows is None else out.target_logits[b, out.target_rows[b]]
                r.record_logprobs(rows, before)
            emitted += len(r.tokens) - before
            accepted = min(out.accepted[b], used - 1)  # the round as if it had ended at the stop
            r.emitted.append(accepted + 1)
            drafts.append(out.num_drafts[b])
            accepted_ok.append(out.accepted[b])
            if out.speculative:
                version.stats.add(out.num_drafts[b], accepted)
            else:
                version.stats.plain_steps += 1
        if version.chooser:
            version.chooser.record(len(group), size, seconds, drafts, accepted_ok, emitted,
                                   deferred_seconds=out.deferred_seconds)
        return emitted

    @staticmethod
    def _fail(group: list[Request], error: BaseException) -> None:
        for r in group:
            r.error = error

    def _publish(self, requests: list[Request]) -> None:
        for r in requests:
            if r.finish_reason is None and r.error is None and len(r.tokens) > r.sent_tokens:
                r.handle._push(r.tokens[r.sent_tokens:], logprobs=r.logprobs and r.logprobs[r.sent_tokens:])
                r.sent_tokens = len(r.tokens)

    def _retire(self) -> None:
        """Free the slots of finished, aborted and failed requests and hand them their end."""
        still = []
        for r in self._running:
            if r.aborted and r.finish_reason is None and r.error is None:
                r.finish_reason = "abort"
            if r.finish_reason is None and r.error is None:
                still.append(r)
                continue
            self._free(r)
            r.seconds = time.perf_counter() - r.start
            self._finish(r)
        self._running = still

    def _free(self, r: Request) -> None:
        self.runner.cache.release(r.slot)
        r.version.worker.release(r.slot)

    def _finish(self, r: Request) -> None:
        if r.error is not None:
            r.handle._push([], error=r.error)
        else:
            r.handle._push(r.tokens[r.sent_tokens:], output=r.output(self.decode),
                           logprobs=r.logprobs and r.logprobs[r.sent_tokens:])
        with self._lock:
            del self._requests[r.handle.request_id]
            r.version.live -= 1
            if r.error is not None:
                self._failed += 1
            elif r.finish_reason == "abort":
                self._aborted += 1
            else:
                self._served += 1

    def fail_running(self, error: BaseException) -> None:
        """Fail every running request with ``error`` and free its slot (after a step raised: their
        state is unknown). Queued requests stay queued; the engine keeps serving."""
        with self._lock:
            requests, self._running = self._running, []
        for r in requests:
            r.error = error
            self._free(r)
            self._finish(r)
        self.versions.drop_idle()

    # -- stats ----------------------------------------------------------------------------

    def _account(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._rate.add(tokens, seconds)

    def stats(self) -> dict:
        """Serving metrics: throughput over the last minute of steps, and for the active version
        tau and the acceptance rate per draft position (fraction of rounds whose draft at that
        position was accepted), its worker's counters; per-version history and rejected versions
        with the reason."""
        with self._lock:
            return {
                **self.versions.summary(),
                "requests_served": self._served,
                "requests_aborted": self._aborted,
                "requests_failed": self._failed,
                "requests_running": len(self._running),
                "requests_waiting": len(self._waiting),
                "tokens_generated": self._rate.total,
                "tokens_per_second": self._rate.per_second(),
            }


class EngineLoop:
    """Steps an engine on a daemon thread while it has work, and sleeps on its condition otherwise.

    A step that raises fails the requests it was running (each handle raises the error) and the
    loop goes on serving: one bad round must not take a replica down."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> EngineLoop:
        if self.alive:
            raise RuntimeError("the engine loop is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="specray-engine-loop")
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.engine.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.engine.wait_for_work(timeout=0.5):
                self.engine.serve_step()
