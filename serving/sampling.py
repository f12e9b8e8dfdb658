"""Sampling parameters and the logits → probabilities processing shared by target and drafter.

The same ``process`` is applied to the target's logits (giving ``p``) and to the drafter's
(giving ``q``, the distribution the drafts are actually sampled from), so rejection sampling
preserves the *processed* target distribution — the one plain decoding would sample from.
``temperature == 0`` means greedy: no probabilities, argmax everywhere.

Logits that are not finite (NaN or +inf, from a broken model or an overflow) never yield a
token: every path that reads target logits (prefill, AR and plain steps, verification) checks
the rows it reads and fails that request with ``NonFiniteLogitsError``; the others go on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-2  # below it logits / temperature overflows float32 or rounds to greedy
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # most likely alternatives reported per token, at most


class NonFiniteLogitsError(RuntimeError):
    """A request's target logits (or their probabilities after temperature, top-k and top-p) hold
    NaN or +inf: no token can be drawn from them, so the request fails and emits nothing more."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()  # at most MAX_STOP_STRINGS, each of at most MAX_STOP_CHARS characters
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # the same tokens under fixed rounds (AR, speculation "static"); else the same distribution
    logprobs: int | None = None  # per output token its target log-probability and this many alternatives (None: off)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE} (smaller ones "
                             f"overflow logits / temperature), got {self.temperature}; use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be 0 … {MAX_LOGPROBS} alternatives per token (or None: off), "
                             f"got {self.logprobs}")
        self._check_stop()

    def _check_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings per request, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"stop: each stop string holds at most {MAX_STOP_CHARS} characters, got one of "
                             f"{len(longest)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (sampling params only)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def check_finite(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a request samples from, once its rows are known to be finite: ``logits`` [..., V] as
    they are (greedy: only their argmax is read) or ``process``-ed to probabilities.

    Raises ``NonFiniteLogitsError`` for NaN or +inf in ``logits`` or a row of only −inf (a −inf
    alone is a token ruled out), or for probabilities that are not finite (an overflow)."""
    # One pass in the common case: a finite sum means every entry is finite. Otherwise look closer
    # (the sum may be -inf from ruled-out tokens alone, or overflow).
    if not bool(torch.isfinite(logits.sum())) and bool(
            torch.isnan(logits).any() or torch.isposinf(logits).any() or torch.isneginf(logits).all(-1).any()):
        raise NonFiniteLogitsError("the target's logits for this request are not finite (NaN, +inf, or -inf for "
                                   "every token); no token was drawn from them and the request is failed (check "
                                   "the model's weights and dtype)")
    if params.greedy:
        return logits
    probs = process(logits, params)
    if not bool(torch.isfinite(probs.sum())):
        raise NonFiniteLogitsError(f"the target's probabilities for this request are not finite after temperature "
                                   f"{params.temperature}, top_k {params.top_k}, top_p {params.top_p} "
                                   f"(logits / temperature overflowed); the request is failed")
    return probs


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [V] under ``params`` (argmax when greedy); ``NonFiniteLogitsError``
    if they are not finite."""
    rows = check_finite(logits, params)
    if params.greedy:
        return int(rows.argmax())
    return int(torch.multinomial(rows, 1, generator=generator))


def sample_each(logits: torch.Tensor, params: list[SamplingParams], generators: list
                ) -> tuple[list[list[int]], list[NonFiniteLogitsError | None]]:
    """One token per request from logits [B, V]: ``([[token]] or [] per request, error or None)``.
    A request whose row is not finite gets no token and its error; the others are unaffected.
    An all-greedy batch whose logits are all finite (one sum tells) takes one argmax over the rows."""
    greedy = all(p.greedy for p in params) and len(logits) == len(params) == len(generators)
    if greedy and bool(torch.isfinite(logits.sum())):
        return [[t] for t in logits.argmax(-1).tolist()], [None] * len(params)
    tokens, errors = [], []
    for row, p, g in zip(logits, params, generators, strict=True):
        try:
            tokens.append([sample_next(row, p, g)])
            errors.append(None)
        except NonFiniteLogitsError as e:
            tokens.append([])
            errors.append(e)
    return tokens, errors
