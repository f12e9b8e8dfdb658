"""Plain autoregressive decoding: the engine with no drafter. Each step runs the anchor row
(the last emitted token), commits it, and samples the next token from the target."""

from __future__ import annotations

import torch

from specray.serving.runner import LlamaRunner, pad_rows
from specray.serving.sampling import process


def sample_next(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    """One token from logits [V] under ``params`` (argmax when greedy)."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(process(logits, params), 1, generator=generator))


def ar_step(runner: LlamaRunner, slots: list[int], anchors: list[int], params, generators):
    """One target row per request (its anchor), committed; returns (next token per request, the
    runner's output). The AR worker's step, and a DFlash worker's plain step."""
    out = runner.forward(torch.tensor(anchors)[:, None], torch.tensor(slots), torch.ones(len(slots), dtype=torch.long))
    for slot in slots:
        runner.cache.commit(slot, 1)
    return [[sample_next(out.logits[b, 0], p, g)] for b, (p, g) in enumerate(zip(params, generators))], out


class ARWorker:
    rows_per_round = 1

    def __init__(self, runner: LlamaRunner):
        self.runner = runner

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        ids, lengths = pad_rows(prompts)
        out = self.runner.forward(ids, torch.tensor(slots), lengths)
        for slot, n in zip(slots, lengths.tolist()):
            self.runner.cache.commit(slot, n)
        return out.logits[torch.arange(len(slots)), lengths - 1]

    def step(self, slots: list[int], anchors: list[int], params, generators) -> list[list[int]]:
        return ar_step(self.runner, slots, anchors, params, generators)[0]
