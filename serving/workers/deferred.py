"""Drafter work a plain step owes, kept per KV slot until speculation resumes.

A plain step (round size 0, ``serving/workers/base.py``) commits one target row per request. The
drafter needs that row in its own cache only if the engine speculates again: DFlash projects the
row's captured features into context K/V, EAGLE-3 runs its draft layer on the row's fused state
and next token. Done step by step that is a drafter pass over one row per request (weight-bound,
about a tenth of a plain step on the embedded target), paid even when the chooser never
speculates again. ``DeferredRows`` keeps each slot's rows instead; a worker's ``catch_up`` runs
all of them in one batched pass before its next speculative round — or when a slot holds
``capacity`` rows, which bounds the memory — and the drafter's cache is then the one the
step-by-step commits build (tested against a fresh prefill).
"""

from __future__ import annotations

import torch

DEFERRED_ROWS = 64  # rows a slot may owe before the worker catches up (a few MB at 16 slots)


class DeferredRows:
    """Per slot, up to ``capacity`` rows of ``width`` values (a row's captured target features)
    and, per row, the token that follows it (for drafters whose row reads the next token)."""

    def __init__(self, *, num_slots: int, width: int, dtype: torch.dtype, capacity: int = DEFERRED_ROWS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.values = torch.zeros(num_slots, capacity, width, dtype=dtype)  # [slots, cap, W]
        self.tokens = torch.zeros(num_slots, capacity, dtype=torch.long)  # [slots, cap]
        self.count = torch.zeros(num_slots, dtype=torch.long)  # [slots] rows held

    def full(self, slots: list[int]) -> bool:
        """Whether some slot of ``slots`` holds ``capacity`` rows (it must catch up before a push)."""
        return bool((self.count[torch.tensor(slots)] >= self.capacity).any())

    def push(self, slots: list[int], values: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Append one row per slot: ``values`` [B, W], ``tokens`` [B] (or None)."""
        slot_t = torch.tensor(slots)
        at = self.count[slot_t]
        if int(at.max()) >= self.capacity:
            raise RuntimeError("a slot holds `capacity` deferred rows: catch up before pushing")
        self.values[slot_t, at] = values.to(self.values.dtype)
        if tokens is not None:
            self.tokens[slot_t, at] = tokens
        self.count[slot_t] += 1

    def take(self, slots: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor, list[int]]:
        """Remove the rows of ``slots`` that hold any: (those slots, values [n, T, W], tokens
        [n, T], rows per slot), padded to the longest T (padding rows hold stale values: only each slot's
        first rows are real)."""
        held = [s for s in slots if int(self.count[s])]
        if not held:
            return [], self.values[:0, :0], self.tokens[:0, :0], []
        slot_t = torch.tensor(held)
        counts = self.count[slot_t]
        T = int(counts.max())
        values, tokens = self.values[slot_t, :T].clone(), self.tokens[slot_t, :T].clone()
        self.count[slot_t] = 0
        return held, values, tokens, counts.tolist()

    def release(self, slot: int) -> None:
        self.count[slot] = 0
