"""The worker protocol: everything the engine asks of an algorithm (DESIGN.md §5, the algorithm seam).

The engine (``serving/engine.py``) owns requests, KV slots, stops, streaming and drafter
versions; a worker owns one algorithm's drafter, its draft caches and its round
(propose → verify → accept → commit). The engine reads nothing of a worker but this protocol.

A speculative worker is registered in ``serving/workers/__init__.py`` under its algorithm (a
tree worker in ``TREE_WORKERS``) and built by the engine with one signature (it clamps and
validates ``num_speculative_tokens`` itself, e.g. to its drafter's block; ``None`` means its own
default):

    worker = WORKERS[drafter.algorithm](runner, drafter, num_speculative_tokens=k)

The worker says which round sizes it can run (``verify_sizes``: drafts per request for a chain,
node budgets for a tree) and the engine's chooser (``serving/chooser.py``) picks one per round
from the measured cost table and acceptance; size 0 is a plain step. How the engine drives it,
for two requests in KV slots 0 and 1 (``serving/engine.py``):

    logits = worker.prefill([0, 1], [prompt_a, prompt_b])   # [2, V]: each prompt's last row
    anchors = [sample_next(logits[0], params_a, gen_a), sample_next(logits[1], params_b, gen_b)]
    size = chooser.choose(2)                                 # 0 or one of worker.verify_sizes
    out = worker.step([0, 1], anchors, [params_a, params_b], [gen_a, gen_b], size)
    out.tokens[0]      # [d1 .. dr, x*] emitted for request 0; x* is its next anchor (no KV yet)
    out.accepted[0]    # r, of out.num_drafts[0] drafts verified
    worker.release(0)  # request 0 finished: forget its draft state (the engine frees the target slot)

The runner handed to a worker is the engine's shared target runner (one KV cache, slots
allocated by the engine) seen with the drafter's ``capture_layer_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class StepOutput:
    """One ``step`` over B requests, in the order of its ``slots``.

    A *speculative* step is a round of the worker's algorithm: ``accepted[b] = r`` of
    ``num_drafts[b]`` draft positions verified, and ``tokens[b] = [d1 .. dr, x*]`` (``r + 1``
    tokens, x* the correction or bonus); the engine counts it in tau and acceptance by position.
    A *plain* step (``speculative=False``) is one a speculative worker takes instead of a round
    (``size`` 0: the chooser found no round that pays): one target row and one token per request, no drafts;
    the engine counts it apart. The AR worker's steps are its rounds, with no drafts (tau 1).
    For a tree, ``num_drafts`` is the tree's depth (the most drafts one path can accept) and
    ``accepted`` the accepted path's length. A request that failed alone (non-finite logits,
    ``serving/sampling.py``) has an error, no tokens, and must not be stepped again: the engine
    fails it and releases its slot; the other requests' state is intact.

    ``deferred_seconds``: the part of the step's wall time spent on drafter work earlier plain
    steps deferred (``serving/workers/deferred.py``), which the chooser does not charge to this
    step's size.

    ``target_logits`` is the step's target forward as it came out (no copy): request b's emitted
    token i was drawn from row ``target_rows[b][i]`` of ``target_logits[b]`` (``target_rows`` None:
    row i, a chain or a plain step; a tree gives its accepted path's rows). The engine reads it
    only for requests that ask for logprobs.
    """

    tokens: list[list[int]]  # [B][r_b + 1] emitted tokens per request ([] when it failed)
    num_drafts: list[int]  # [B] draft positions verified (0: no drafts)
    accepted: list[int]  # [B] r: drafts accepted, 0 <= r <= num_drafts
    speculative: bool  # a round of the algorithm (False: a plain step taken instead)
    errors: list[BaseException | None] = field(default_factory=list)  # [B]; [] = none failed
    deferred_seconds: float = 0.0
    target_logits: torch.Tensor | None = None  # [B, M, V] float32 (None: not kept)
    target_rows: list[list[int]] | None = None  # [B][r_b + 1] rows of target_logits (None: 0 .. r_b)

    def __post_init__(self) -> None:
        self.errors = self.errors or [None] * len(self.tokens)
        assert len(self.num_drafts) == len(self.accepted) == len(self.errors) == len(self.tokens)

    @classmethod
    def plain(cls, tokens: list[list[int]], errors: list[BaseException | None] | None = None,
              deferred_seconds: float = 0.0, target_logits: torch.Tensor | None = None) -> StepOutput:
        """A plain step: one target row per request (``target_logits`` [B, 1, V]), no drafts."""
        return cls(tokens, [0] * len(tokens), [0] * len(tokens), False, errors or [], deferred_seconds, target_logits)


@runtime_checkable
class Worker(Protocol):
    """What a worker gives the engine. Slots come from the engine; a worker keeps per-slot state
    (its draft caches) from ``prefill`` until ``release``. Chain workers verify with
    ``serving/verify.py::accept_chains`` (one ``rejection_sample`` call for the batch)."""

    verify_sizes: tuple[int, ...]
    """The round sizes ``step`` runs, ascending, each >= 1: drafts verified per request (a chain)
    or draft-tree nodes besides the anchor (a tree); () for AR."""

    verify_layout: str
    """"chain" or "tree": how the chooser models acceptance (per position, or per node budget)."""

    @property
    def max_verify_rows(self) -> int:
        """Target rows one round may write per request (``1 + verify_sizes[-1]``; 1 for AR). The
        engine admits a request only if prompt + max_tokens + this fits its KV (capacity planning)."""
        ...

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run each prompt in its (fresh) slot and commit it in the target KV and the worker's own
        caches — which may owe the prompt's rows (``serving/workers/deferred.py``) until the
        slot's first round of size >= 1 runs them; returns the last row's logits [B, V]
        (float32), from which the engine samples the first token — the first anchor."""
        ...

    def step(self, slots: list[int], anchors: list[int], params: list, generators: list, size: int) -> StepOutput:
        """One round of ``size`` for every request (0: a plain step): ``anchors[b]`` is request
        b's last emitted token (no KV yet), ``params[b]`` its ``SamplingParams``, ``generators[b]``
        its ``torch.Generator``. Commits the rows of the emitted prefix (``[a, d1 .. dr]``) in
        the target cache and in the worker's caches — a plain step may defer its drafter-side
        rows (``serving/workers/deferred.py``) to the next round of size >= 1, which runs them
        before it drafts."""
        ...

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished or failed: drop the worker's state for it."""
        ...

    def stats(self) -> dict:
        """Counters since the worker was built: ``{"steps": speculative rounds, "phase_seconds":
        {phase: wall seconds summed over those rounds}}`` (what ``bench serve`` reports)."""
        ...
