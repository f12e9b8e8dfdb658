"""Requests as the engine keeps them and as callers see them: prompt encoding and checks,
``RequestHandle`` (stream, result, abort), ``StreamDelta``, ``GenerationOutput``, stop
handling (``Request.append``) and per-token logprobs (``TokenLogprob``).

Stops — EOS, ``stop_token_ids``, ``stop`` strings, ``max_tokens`` — cut the output at the exact
token even inside an accepted block; later tokens of that block are discarded. A stop string is
looked for in the decoded text of a window of the last tokens that always holds the longest
stop string (``stop_hit``), so a stop string of any allowed length stops generation. Streamed
text holds back what could still become a stop string or is an incomplete UTF-8 sequence, so the
deltas always add up to the final text.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

import torch

from specray.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from specray.serving.versions import DrafterVersion

Decode = Callable[[list[int]], str]  # token ids -> text (special tokens kept)
STOP_WINDOW = 64  # tokens decoded at least to look for a stop string after each new token
MIN_LOGPROB = -9999.0  # a token the target gives no mass (JSON has no -inf), as OpenAI reports it


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target's raw distribution (its logits' log
    softmax: before temperature, top-k and top-p) at the position it was emitted, and the
    ``top`` most likely tokens there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``tokens[i]`` in target logits ``rows[i]`` ([len(tokens), V])."""
    logp = rows[: len(tokens)].float().log_softmax(-1).clamp(min=MIN_LOGPROB)  # [n, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop token / stop string), "length", or "abort"
    rounds: int  # worker steps after prefill
    emitted_per_round: list[int] = field(default_factory=list)  # r + 1 per round, up to a stop (see Request.append)
    seconds: float = 0.0
    drafter_version: int | None = None  # the version that served it (None = autoregressive)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for them

    @property
    def tau(self) -> float:
        """Mean tokens per round (accepted drafts + 1); 1.0 for AR."""
        return sum(self.emitted_per_round) / max(1, len(self.emitted_per_round))


@dataclass(frozen=True)
class StreamDelta:
    token_ids: list[int]  # tokens new since the previous delta
    text: str  # text new since the previous delta
    finish_reason: str | None = None  # set on a request's last delta: "stop", "length" or "abort"
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for them


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the earliest stop string."""
    for s in stops:
        if s in text:
            text = text[: text.index(s)]
    return text


def streamable_text(decode: Decode, tokens: list[int], stops: tuple[str, ...]) -> str:
    """The text of a running request's tokens that may be shown (see ``RequestHandle``)."""
    text = decode(tokens).rstrip("\ufffd")
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold]


def stop_hit(decode: Decode, tokens: list[int], stops: tuple[str, ...]) -> bool:
    """Whether a stop string ends in the text of ``tokens``' last token.

    Decodes a tail window of at least ``STOP_WINDOW`` tokens, doubled until its text holds the
    longest stop string before the last token's text (a few characters more: a window's first
    token may decode differently alone) or the window is every token. Earlier text was checked
    when its own tokens arrived."""
    need = max(len(s) for s in stops) + len(decode(tokens[-1:])) + 4
    window = STOP_WINDOW
    while True:
        text = decode(tokens[-window:])
        if any(s in text for s in stops):
            return True
        if len(text) >= need or window >= len(tokens):
            return False
        window *= 2


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A string (rendered as one user turn), a chat message list, or token ids -> token ids."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("a prompt is a string, a list of chat messages, or a list of token ids")


def check_prompt(ids: list[int], params: SamplingParams, *, max_len: int, vocab_size: int, verify_rows: int) -> None:
    """Refuse (ValueError) an empty prompt, ids outside the vocabulary, or a request whose prompt +
    ``max_tokens`` + one round's ``verify_rows`` does not fit ``max_len`` KV positions."""
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) + params.max_tokens + verify_rows > max_len:
        raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} does not fit the engine's "
                         f"context of {max_len} tokens; shorten the prompt or lower max_tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


class TokenizerSurface:
    """An engine's text side, from its ``tokenizer``: what the OpenAI layer calls (both backends)."""

    tokenizer: object

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def encode(self, prompt) -> list[int]:
        """A string (rendered as one user turn), a chat message list, or token ids."""
        return encode_prompt(self.tokenizer, prompt)

    def tokenize(self, text: str) -> list[int]:
        """Raw text (no chat template) to token ids: the prompt of a plain completion."""
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]


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

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, drafter_version: int | None,
                 *, decode: Decode, abort: Callable[[str], None]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.drafter_version = drafter_version
        self._decode, self._abort = decode, abort
        self._cond = threading.Condition()
        self._tokens: list[int] = []  # emitted so far
        self._logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []  # [len(_tokens)]
        self._output: GenerationOutput | None = None
        self._error: BaseException | None = None
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def done(self) -> bool:
        return self._output is not None or self._error is not None

    def abort(self) -> None:
        self._abort(self.request_id)

    def _next(self, seen_tokens: int, seen_text: int) -> tuple[StreamDelta, int] | None:
        """The delta after what a reader has seen, and its new text length; None if nothing is new."""
        with self._cond:
            tokens, output, error = list(self._tokens), self._output, self._error
            logprobs = None if self._logprobs is None else self._logprobs[seen_tokens:]
        if output is not None:
            return (StreamDelta(tokens[seen_tokens:], output.text[seen_text:], output.finish_reason, logprobs),
                    len(output.text))
        if len(tokens) == seen_tokens:
            if error is not None:
                raise error
            return None
        text = streamable_text(self._decode, tokens, self.params.stop)
        return StreamDelta(tokens[seen_tokens:], text[seen_text:], None, logprobs), max(seen_text, len(text))

    def __iter__(self) -> Iterator[StreamDelta]:
        seen_tokens = seen_text = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._tokens) > seen_tokens or self.done)
            delta, seen_text = self._next(seen_tokens, seen_text)  # new tokens, the output, or the error raised
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

    def _push(self, tokens: list[int], output: GenerationOutput | None = None, error: BaseException | None = None,
              logprobs: list[TokenLogprob] | None = None):
        """The engine side: append tokens (and their logprobs), and finish with an output or an error."""
        with self._cond:
            self._tokens.extend(tokens)
            if self._logprobs is not None:
                self._logprobs.extend(logprobs or [])
            self._output, self._error = output, error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


@dataclass(eq=False)
class Request:
    """A request as the engine keeps it, from ``submit`` until it finishes or fails."""

    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    version: DrafterVersion
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    anchor: int = -1
    finish_reason: str | None = None
    error: BaseException | None = None  # set when the request failed; it is then retired with it
    emitted: list[int] = field(default_factory=list)  # per round: tokens it counted (see ``append``)
    aborted: bool = False
    sent_tokens: int = 0  # tokens already pushed to the handle
    start: float = 0.0  # perf_counter at admission
    seconds: float = 0.0  # admission to finish
    logprobs: list[TokenLogprob] | None = None  # [len(tokens)] when params.logprobs is set

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []

    def record_logprobs(self, rows: torch.Tensor, first: int) -> None:
        """The logprobs of ``tokens[first:]``, drawn from target logits ``rows`` ([n, V], one row each)."""
        if self.logprobs is not None and len(self.tokens) > first:
            self.logprobs += token_logprobs(rows, self.tokens[first:], self.params.logprobs)

    def append(self, tokens: list[int], eos_ids: set[int], decode: Decode) -> int:
        """Append ``tokens`` up to the first stop (the last appended token is the next anchor).

        Returns how many of ``tokens`` the request used: those appended, plus the stop token that
        ended it (EOS or a stop token, not appended). Tokens after a stop or past ``max_tokens``
        are cut: they are not output and round statistics do not count them."""
        p = self.params
        for used, token in enumerate(tokens, start=1):
            if token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos):
                self.finish_reason = "stop"
                return used
            self.tokens.append(token)
            self.anchor = token
            if p.stop and stop_hit(decode, self.tokens, p.stop):
                self.finish_reason = "stop"
                return used
            if len(self.tokens) >= p.max_tokens:
                self.finish_reason = "length"
                return used
        return len(tokens)

    def output(self, decode: Decode) -> GenerationOutput:
        text = cut_at_stop(decode(self.tokens), self.params.stop)
        return GenerationOutput(self.prompt_ids, self.tokens, text, self.finish_reason, len(self.emitted),
                                self.emitted, self.seconds, self.version.version, self.logprobs)
