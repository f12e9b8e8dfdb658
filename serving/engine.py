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

Continuous batching: up to ``max_batch`` requests run at once, each in its own KV slot; a
finished request frees its slot and the next waiting one is prefilled. Every step runs one
round of the worker for all running requests (AR: one token; DFlash: propose → verify →
accept → commit). Stops — EOS, ``stop_token_ids``, ``stop`` strings, ``max_tokens`` — cut the
output at the exact token even inside an accepted block; later tokens of that block are
discarded. Streamed text holds back what could still become a stop string or is an incomplete
UTF-8 sequence, so the deltas always add up to the final text. The KV capacity is checked up
front: a prompt that cannot fit ``max_tokens`` plus one verify block is refused with a clear
error and the engine keeps serving.

Hot-load (DESIGN.md §7): ``load_drafter(dir, version)`` validates and builds a drafter in a
background thread; the next ``step`` makes it the active version. A request keeps the version
that was active when it was submitted: running requests are grouped by version and each group
runs its own round over the one target runner and KV cache; a version without requests that is
no longer active is dropped. The runner captures the union of the target layers the live
drafters read. A load that fails (``InvalidDrafterError``: another target, a checksum mismatch,
weights that do not fit) is recorded in ``stats()["rejected_versions"]`` and the active version
keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch
from torch import nn

from specray.capture.target import Target
from specray.drafters.format import InvalidDrafterError, load_drafter, read_drafter_config
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
from specray.serving.workers import WORKERS, ARWorker
from specray.serving.workers.ar import sample_next

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 60.0  # tokens/s is measured over the steps of the last minute


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop token / stop string), "length", or "abort"
    rounds: int  # worker steps after prefill
    emitted_per_round: list[int] = field(default_factory=list)  # r + 1 per round
    seconds: float = 0.0
    drafter_version: int | None = None  # the version that served it (None = autoregressive)

    @property
    def tau(self) -> float:
        """Mean tokens per round (accepted drafts + 1); 1.0 for AR."""
        return sum(self.emitted_per_round) / max(1, len(self.emitted_per_round))


@dataclass(frozen=True)
class StreamDelta:
    token_ids: list[int]  # tokens new since the previous delta
    text: str  # text new since the previous delta
    finish_reason: str | None = None  # set on a request's last delta: "stop", "length" or "abort"


class RequestHandle:
    """A submitted request. Iterate it for its ``StreamDelta``s (``for`` in a thread, ``async for``
    in asyncio; each iteration starts from the beginning), wait for its ``GenerationOutput`` with
    ``result()`` / ``await aresult()``, or ``abort()`` it. If the engine fails the request,
    iteration and ``result`` raise that error.

    The engine only appends tokens; text is decoded on the reader's side, when it reads, so
    ``generate`` pays nothing for streaming and a slow reader gets larger deltas, not a backlog.
    While running, the text shown stops before a trailing incomplete UTF-8 sequence and holds
    back the last ``len(stop) - 1`` characters, which could still become a stop string; the
    last delta completes it to the output's text."""

    def __init__(self, engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 drafter_version: int | None):
        self._engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.drafter_version = drafter_version
        self._cond = threading.Condition()
        self._tokens: list[int] = []  # emitted so far
        self._output: GenerationOutput | None = None
        self._error: BaseException | None = None
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def done(self) -> bool:
        return self._output is not None or self._error is not None

    def abort(self) -> None:
        self._engine.abort(self.request_id)

    def _next(self, seen_tokens: int, seen_text: int) -> tuple[StreamDelta, int] | None:
        """The delta after what a reader has seen, and its new text length; None if nothing is new."""
        with self._cond:
            tokens, output, error = list(self._tokens), self._output, self._error
        if output is not None:
            return StreamDelta(tokens[seen_tokens:], output.text[seen_text:], output.finish_reason), len(output.text)
        if len(tokens) == seen_tokens:
            if error is not None:
                raise error
            return None
        text = self._engine.streamable_text(tokens, self.params.stop)
        return StreamDelta(tokens[seen_tokens:], text[seen_text:]), max(seen_text, len(text))

    def __iter__(self) -> Iterator[StreamDelta]:
        seen_tokens = seen_text = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._tokens) > seen_tokens or self.done)
            delta, seen_text = self._next(seen_tokens, seen_text)
            seen_tokens += len(delta.token_ids)
            yield delta
            if delta.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._waiters.add(waiter)
        try:
            seen_tokens = seen_text = 0
            while True:
                waiter[1].clear()  # before reading: tokens appended after the read set it again
                new = self._next(seen_tokens, seen_text)
                if new is None:
                    await waiter[1].wait()
                    continue
                delta, seen_text = new
                seen_tokens += len(delta.token_ids)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            with self._cond:
                self._waiters.discard(waiter)

    def result(self, timeout: float | None = None) -> GenerationOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._output

    async def aresult(self) -> GenerationOutput:
        async for _ in self:
            pass
        return self._output

    def _push(self, tokens: list[int], output: GenerationOutput | None = None, error: BaseException | None = None):
        """The engine side: append tokens, and finish with an output or an error."""
        with self._cond:
            self._tokens.extend(tokens)
            self._output, self._error = output, error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


@dataclass
class _RoundStats:
    """Speculative rounds of one drafter version (DESIGN.md §2: tau = E[r + 1])."""

    num_drafts: int  # m
    rounds: int = 0
    emitted: int = 0  # sum over rounds of r + 1
    plain_steps: int = 0  # request-steps that did not speculate (a batch above max_speculative_batch)
    accepted: list[int] = field(init=False)  # [m] rounds whose draft at position j + 1 was accepted

    def __post_init__(self) -> None:
        self.accepted = [0] * self.num_drafts

    def add(self, emitted: int) -> None:
        self.rounds += 1
        self.emitted += emitted
        for j in range(min(emitted - 1, self.num_drafts)):  # r = emitted - 1 drafts accepted
            self.accepted[j] += 1

    def summary(self) -> dict:
        rounds = max(1, self.rounds)
        return {"rounds": self.rounds, "tau": self.emitted / rounds if self.rounds else None,
                "acceptance_by_position": [a / rounds for a in self.accepted] if self.rounds else [],
                "plain_steps": self.plain_steps}


class _DrafterRunner:
    """The shared target runner as one drafter's worker sees it: the same forward and KV cache,
    but that drafter's own ``capture_layer_ids`` (the runner captures the union over live drafters)."""

    def __init__(self, runner: LlamaRunner, layer_ids: tuple[int, ...]):
        self._runner = runner
        self.capture_layer_ids = layer_ids

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


@dataclass(eq=False)
class _Version:
    """A drafter version (None = plain autoregressive) and the worker that runs its requests."""

    version: int | None
    worker: object  # ARWorker, or WORKERS[algorithm] over a _DrafterRunner
    drafter: nn.Module | None = None
    layer_ids: tuple[int, ...] = ()  # target layers the drafter reads
    live: int = 0  # submitted requests bound to it that have not finished

    def release(self, slot: int) -> None:
        if self.drafter is not None:
            self.worker.context.release(slot)


@dataclass(eq=False)
class _Request:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    version: _Version
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    anchor: int = -1
    finish_reason: str | None = None
    emitted: list[int] = field(default_factory=list)
    aborted: bool = False
    sent_tokens: int = 0  # tokens already pushed to the handle
    start: float = 0.0  # perf_counter at admission
    seconds: float = 0.0  # admission to finish


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    for s in stops:
        if s in text:
            text = text[: text.index(s)]
    return text


class Engine:
    def __init__(self, target: Target, drafter_dir: str | None = None, *, max_batch: int = 4, max_len: int = 2048,
                 drafter_version: int = 0, num_speculative_tokens: int | None = None,
                 max_speculative_batch: int | None = None):
        """``num_speculative_tokens``: at most this many drafts are verified per round (None = all
        of the drafter's block, B − 1). ``max_speculative_batch``: a drafter's requests speculate
        only while at most this many of them run together; a larger batch takes plain steps (one
        target row per request, the drafter's context kept up to date; None = always speculate).
        Both apply to every drafter version this engine loads."""
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 (or None for the drafter's block), "
                             f"got {num_speculative_tokens}")
        if max_speculative_batch is not None and max_speculative_batch < 0:
            raise ValueError(f"max_speculative_batch must be >= 0 (0 = never speculate; None = always), "
                             f"got {max_speculative_batch}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_speculative_batch = max_speculative_batch
        self.target = target
        self.tokenizer = target.tokenizer
        self.max_len = max_len
        self.eos_ids = {target.tokenizer.eos_token_id}
        self.runner = LlamaRunner(target.model, num_slots=max_batch, max_len=max_len)
        self._lock = threading.RLock()  # guards the queue, the versions and the counters
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._staged: list[_Version] = []
        self._rejected: dict[int, str] = {}
        self._history: dict[int | None, _RoundStats] = {}  # round stats of every version that was active
        self._versions: list[_Version] = []
        self._throughput: deque[tuple[float, int, float]] = deque()  # (end time, tokens, seconds) per step
        self._served = self._aborted = self._tokens = 0
        if drafter_dir is None:
            self._install(_Version(None, ARWorker(self.runner)))
        else:
            self._install(self._build_version(drafter_dir, drafter_version))

    # -- versions -------------------------------------------------------------------------

    @property
    def worker(self):
        """The active version's worker (what new requests run on)."""
        return self._active.worker

    @worker.setter
    def worker(self, worker) -> None:
        self._active.worker = worker

    @property
    def drafter(self) -> nn.Module | None:
        return self._active.drafter

    @property
    def active_version(self) -> int | None:
        return self._active.version

    @property
    def live_versions(self) -> list[int | None]:
        with self._lock:
            return [v.version for v in self._versions]

    def _build_version(self, drafter_dir: str, version: int) -> _Version:
        config = read_drafter_config(drafter_dir)
        drafter = load_drafter(
            drafter_dir, embed_tokens=self.target.model.model.embed_tokens, lm_head=self.target.model.lm_head,
            target_fingerprint=self.target.target_fingerprint, template_fingerprint=self.target.template_fingerprint,
        )
        layer_ids = tuple(config["architecture"]["target_layer_ids"])
        if any(not 0 <= i < self.target.num_layers for i in layer_ids):
            raise InvalidDrafterError(f"{drafter_dir}: target_layer_ids {layer_ids} outside the target's "
                                      f"0..{self.target.num_layers - 1}")
        k = self.num_speculative_tokens
        worker = WORKERS[drafter.algorithm](_DrafterRunner(self.runner, layer_ids), drafter,
                                            num_draft_tokens=None if k is None else min(k, drafter.config.block_size - 1),
                                            max_speculative_batch=self.max_speculative_batch)
        return _Version(version, worker, drafter, layer_ids)

    def load_drafter(self, drafter_dir: str | Path, version: int) -> Future:
        """Validate and build ``version`` in a background thread; the next ``step`` activates it.
        The future resolves to ``version`` once it is ready, or raises why it was rejected."""
        future: Future = Future()
        threading.Thread(target=self._load, args=(str(drafter_dir), version, future), daemon=True,
                         name=f"specray-load-v{version}").start()
        return future

    def _load(self, drafter_dir: str, version: int, future: Future) -> None:
        try:
            staged = self._build_version(drafter_dir, version)
        except Exception as e:  # noqa: BLE001 - any failure rejects the version; the caller gets it via the future
            log.warning("drafter version %s rejected: %s", version, e)
            with self._lock:
                self._rejected[version] = f"{type(e).__name__}: {e}"
            future.set_exception(e)
            return
        with self._lock:
            self._staged.append(staged)
            self._work.notify_all()
        future.set_result(version)

    def _install(self, version: _Version) -> None:
        with self._lock:
            self._history.setdefault(version.version, _RoundStats(version.worker.rows_per_round - 1))
            self._versions.append(version)
            self._active = version
            self._drop_idle_versions()

    def _drop_idle_versions(self) -> None:
        with self._lock:
            self._versions = [v for v in self._versions if v is self._active or v.live > 0]
            layers = sorted({i for v in self._versions for i in v.layer_ids})
            self.runner.capture_layer_ids = tuple(layers)  # read by every forward; changed only between steps

    # -- requests -------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A string (rendered as one user turn), a chat message list, or token ids."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt is a string, a list of chat messages, or a list of token ids")

    def tokenize(self, text: str) -> list[int]:
        """Raw text (no chat template) to token ids: the prompt of a plain completion."""
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def _check(self, ids: list[int], params: SamplingParams, version: _Version) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        need = len(ids) + params.max_tokens + version.worker.rows_per_round
        if need > self.max_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} does not fit the engine's "
                f"context of {self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")

    def submit(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> RequestHandle:
        """Queue one request (thread-safe). A bad prompt or one that does not fit raises ValueError."""
        ids, params = self.encode(prompt), params or SamplingParams()
        with self._lock:
            self._check(ids, params, self._active)
            return self._enqueue(ids, params, request_id)

    def _enqueue(self, ids: list[int], params: SamplingParams, request_id: str | None) -> RequestHandle:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        version = self._active
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        handle = RequestHandle(self, request_id, ids, params, version.version)
        request = _Request(handle, ids, params, torch.Generator().manual_seed(seed), version)
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
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prepared = [(self.encode(p), sp) for p, sp in zip(prompts, params_list, strict=True)]
        with self._lock:  # all checked before any is queued: one bad prompt refuses the batch
            for ids, sp in prepared:
                self._check(ids, sp, self._active)
            handles = [self._enqueue(ids, sp, None) for ids, sp in prepared]
        while not all(h.done for h in handles):
            self.step()
        return [h.result() for h in handles]

    # -- scheduling -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._staged)

    def wait_for_work(self, timeout: float) -> bool:
        with self._work:
            return self._work.wait_for(self.has_work, timeout)

    def wake(self) -> None:
        """Wake whoever waits in ``wait_for_work`` (e.g. a loop that is asked to stop)."""
        with self._work:
            self._work.notify_all()

    def step(self) -> int:
        """One scheduling round: activate a staged drafter, admit and prefill waiting requests,
        run one worker round per version group, retire finished requests. Returns tokens emitted."""
        with self._step_lock:
            start = time.perf_counter()
            with self._lock:
                staged, self._staged = self._staged, []
            for version in staged:
                self._install(version)
            emitted = self._admit()
            self._retire()
            for version, group in self._groups(self._running):
                new = version.worker.step([r.slot for r in group], [r.anchor for r in group],
                                          [r.params for r in group], [r.generator for r in group])
                rounds = self._history[version.version]
                speculates = getattr(version.worker, "speculates", None)  # the AR worker's steps count as rounds
                speculative = speculates is None or speculates(len(group))
                for r, tokens in zip(group, new):
                    r.emitted.append(len(tokens))
                    if speculative:
                        rounds.add(len(tokens))
                    else:
                        rounds.plain_steps += 1
                    emitted += self._emit(r, tokens)
            self._publish(self._running)
            self._retire()
            self._drop_idle_versions()
            self._account(emitted, time.perf_counter() - start)
            return emitted

    @staticmethod
    def _groups(requests: list[_Request]) -> list[tuple[_Version, list[_Request]]]:
        groups: dict[int, tuple[_Version, list[_Request]]] = {}
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
        self._running += admitted  # before the prefill: if it raises, fail_running frees their slots
        for version, group in self._groups(admitted):
            logits = version.worker.prefill([r.slot for r in group], [r.prompt_ids for r in group])
            for r, row in zip(group, logits):
                emitted += self._emit(r, [sample_next(row, r.params, r.generator)])
        return emitted

    def _emit(self, r: _Request, tokens: list[int]) -> int:
        """Append tokens up to the first stop (the last appended token is the next anchor);
        returns how many were appended."""
        p, before = r.params, len(r.tokens)
        for token in tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                r.finish_reason = "stop"
                break
            r.tokens.append(token)
            r.anchor = token
            if p.stop and any(s in self.tokenizer.decode(r.tokens[-64:]) for s in p.stop):
                r.finish_reason = "stop"
                break
            if len(r.tokens) >= p.max_tokens:
                r.finish_reason = "length"
                break
        return len(r.tokens) - before

    def streamable_text(self, tokens: list[int], stop: tuple[str, ...]) -> str:
        """The text of a running request's tokens that may be shown (see ``RequestHandle``)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=False).rstrip("\ufffd")
        hold = max((len(s) for s in stop), default=1) - 1
        return text[: len(text) - hold]

    def _publish(self, requests: list[_Request]) -> None:
        for r in requests:
            if r.finish_reason is None and len(r.tokens) > r.sent_tokens:
                r.handle._push(r.tokens[r.sent_tokens:])
                r.sent_tokens = len(r.tokens)

    def _retire(self) -> None:
        still = []
        for r in self._running:
            if r.aborted and r.finish_reason is None:
                r.finish_reason = "abort"
            if r.finish_reason is None:
                still.append(r)
                continue
            self.runner.cache.release(r.slot)
            r.version.release(r.slot)
            r.seconds = time.perf_counter() - r.start
            self._finish(r)
        self._running = still

    def _finish(self, r: _Request) -> None:
        text = _cut_at_stop(self.tokenizer.decode(r.tokens, skip_special_tokens=False), r.params.stop)
        output = GenerationOutput(r.prompt_ids, r.tokens, text, r.finish_reason, len(r.emitted), r.emitted,
                                  r.seconds, r.version.version)
        r.handle._push(r.tokens[r.sent_tokens:], output=output)
        with self._lock:
            del self._requests[r.handle.request_id]
            r.version.live -= 1
            if r.finish_reason == "abort":
                self._aborted += 1
            else:
                self._served += 1

    def fail_running(self, error: BaseException) -> None:
        """Fail every running request with ``error`` and free its slot (after a step raised: their
        state is unknown). Queued requests stay queued; the engine keeps serving."""
        with self._lock:
            requests, self._running = self._running, []
            for r in requests:
                self.runner.cache.release(r.slot)
                r.version.release(r.slot)
                del self._requests[r.handle.request_id]
                r.version.live -= 1
            self._drop_idle_versions()
        for r in requests:
            r.handle._push([], error=error)

    # -- stats ----------------------------------------------------------------------------

    def _account(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._tokens += tokens
            if tokens:
                self._throughput.append((now, tokens, seconds))
            while self._throughput and now - self._throughput[0][0] > THROUGHPUT_WINDOW_S:
                self._throughput.popleft()

    def stats(self) -> dict:
        """Serving metrics: throughput over the last minute of steps, and for the active version
        tau and the acceptance rate per draft position (fraction of rounds whose draft at that
        position was accepted); per-version history and rejected versions with the reason."""
        with self._lock:
            busy = sum(s for _, _, s in self._throughput)
            active = self._history[self._active.version].summary()
            return {
                "active_version": self._active.version,
                "algorithm": self._active.drafter.algorithm if self._active.drafter is not None else "ar",
                "live_versions": [v.version for v in self._versions],
                "rejected_versions": [{"version": v, "error": e} for v, e in sorted(self._rejected.items())],
                "requests_served": self._served,
                "requests_aborted": self._aborted,
                "requests_running": len(self._running),
                "requests_waiting": len(self._waiting),
                "tokens_generated": self._tokens,
                "tokens_per_second": sum(n for _, n, _ in self._throughput) / busy if busy else 0.0,
                "tau": active["tau"],
                "acceptance_by_position": active["acceptance_by_position"],
                "versions": [{"version": v, **s.summary()} for v, s in self._history.items()],
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
            if not self.engine.wait_for_work(timeout=0.5):
                continue
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - the failed requests get the error; the loop keeps serving
                log.exception("engine step failed; failing its requests")
                self.engine.fail_running(e)
