"""Drafter work a prefill or a plain step owes, kept per KV slot until speculation resumes.

A prefill commits a prompt's rows in the target cache, and a plain step (round size 0,
``serving/workers/base.py``) one row per request. The drafter needs those rows in its own cache
only if the engine speculates: DFlash projects each row's captured features into context K/V,
EAGLE-3 runs its draft layer on the row's fused state and next token. Done eagerly that is a
drafter pass over every prompt row and one row per request per step (weight-bound, about a
tenth of a plain step on the embedded target), paid even when the chooser never speculates.
``DeferredRows`` keeps them instead — a slot's prompt rows, then the rows its plain steps
pushed — and a worker's ``catch_up`` runs them in batched passes before its next speculative
round, or when a slot holds ``capacity`` pushed rows, which bounds that memory. The drafter's
cache is then the one eager commits build (tested against a fresh prefill and a catch-up).

Memory: a prompt's rows stay as captured features (the drafter's input width per token, e.g.
5 layers × 576 fp32 = 11.5 KB per token on the embedded target) until the slot's first round or
its release; pushed rows are bounded by ``capacity`` per slot. A push keeps its step's tensor,
and a worker catches up every slot of its group when one is full, so at most ``capacity``
steps' captured features stay alive (12 MB for 16 requests on the embedded target).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from specray.serving.runner import RunnerOutput

DEFERRED_ROWS = 64  # pushed rows a slot may owe before the worker catches up (module doc: memory)


class Owed(NamedTuple):
    """Rows owed by ``slots`` (each holds some), in the order they follow the slot's committed rows.

    ``values`` [n, T, W] and ``tokens`` [n, T] are padded to the longest ``rows[b]``; padding rows
    repeat a real row or are zeros: only each slot's first ``rows[b]`` are real."""

    slots: list[int]
    values: torch.Tensor
    tokens: torch.Tensor
    rows: list[int]


def prompt_features(out: RunnerOutput, layer_ids, lengths: list[int]) -> list[torch.Tensor]:
    """A batched prefill's captured layers ``layer_ids`` (right-padded) -> each prompt's features
    [n_b, L·D], unpadded (copies: a view would keep the whole padded batch alive)."""
    features = out.features_of(layer_ids)  # [B, T_max, L·D]
    return [features[b, :n].clone() for b, n in enumerate(lengths)]


class DeferredRows:
    """Per slot, its prompt's rows (any number, owed first) and up to ``capacity`` pushed rows of
    ``width`` values (a row's captured target features) and, per row, the token that follows it
    (for drafters whose row reads the next token).

    A push keeps references, not copies: every plain step of a speculative worker pushes, and a
    small tensor op right after a target forward costs 5–10× its cost in a tight loop
    (docs/benchmarks.md, Round cost), so a plain step does no tensor work here; ``take`` gathers
    the rows it returns in one indexing per tensor."""

    def __init__(self, *, num_slots: int, width: int, dtype: torch.dtype, capacity: int = DEFERRED_ROWS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.width, self.dtype = capacity, width, dtype
        # per slot, its pushed rows in order: (a pushed values tensor [B, W], its row b, that push's tokens [B] or None)
        self.pushed: list[list[tuple[torch.Tensor, int, torch.Tensor | None]]] = [[] for _ in range(num_slots)]
        self.prompts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (values [n, W], tokens [n])

    def owe_prompt(self, slot: int, values: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """A fresh slot's first rows: ``values`` [n, W] (kept as given: pass a tensor nothing else
        writes), ``tokens`` [n] (or None). Forgets whatever the slot held before."""
        self.release(slot)
        if values.shape[0]:
            tokens = torch.zeros(values.shape[0], dtype=torch.long, device=values.device) if tokens is None else tokens
            self.prompts[slot] = (values.to(self.dtype), tokens)

    def full(self, slots: list[int]) -> bool:
        """Whether some slot of ``slots`` holds ``capacity`` pushed rows (it must catch up before a push)."""
        return any(len(self.pushed[s]) >= self.capacity for s in slots)

    def owes(self, slot: int) -> int:
        """Pushed rows ``slot`` holds (its prompt's not counted)."""
        return len(self.pushed[slot])

    def push(self, slots: list[int], values: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Append one row per slot: row b of ``values`` [B, W] (and of ``tokens`` [B], or None) to
        ``slots[b]``. Both are kept as given (pass tensors nothing else writes: a step's fresh
        output); no tensor work."""
        if self.full(slots):
            raise RuntimeError("a slot holds `capacity` deferred rows: catch up before pushing")
        for b, s in enumerate(slots):
            self.pushed[s].append((values, b, tokens))

    def take(self, slots: list[int]) -> list[Owed]:
        """Remove every row ``slots`` owe; returns the batches to run, in order: the prompts owed
        (a slot's first rows), then the pushed rows. Slots that owe nothing are in neither."""
        batches = []
        prompts = [s for s in slots if s in self.prompts]
        if prompts:
            values, tokens = zip(*(self.prompts.pop(s) for s in prompts))
            batches.append(Owed(prompts, pad_sequence(list(values), batch_first=True),
                                pad_sequence(list(tokens), batch_first=True), [len(v) for v in values]))
        held = [s for s in slots if self.pushed[s]]
        if held:
            counts = [len(self.pushed[s]) for s in held]
            sources: dict[int, int] = {}  # id of a pushed values tensor -> its first row in the concatenation
            values, tokens, index, total = [], [], [], 0
            for s, n in zip(held, counts):
                rows = []
                for pushed, b, pushed_tokens in self.pushed[s]:
                    first = sources.get(id(pushed))  # every pushed tensor is alive here: ids are unique
                    if first is None:
                        first = sources[id(pushed)] = total
                        values.append(pushed)
                        tokens.append(torch.zeros(len(pushed), dtype=torch.long, device=pushed.device)
                                      if pushed_tokens is None else pushed_tokens)
                        total += len(pushed)
                    rows.append(first + b)
                index.append(rows + rows[-1:] * (max(counts) - n))  # padding repeats the slot's last row
                self.pushed[s] = []
            index = torch.tensor(index, device=values[0].device)  # [n, T] into the concatenated rows
            batches.append(Owed(held, torch.cat(values)[index].to(self.dtype), torch.cat(tokens)[index], counts))
        return batches

    def release(self, slot: int) -> None:
        self.pushed[slot] = []
        self.prompts.pop(slot, None)
