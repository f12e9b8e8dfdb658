"""Plain autoregressive decoding: the engine with no drafter. Each step runs the anchor row
(the last emitted token), commits it, and samples the next token from the target."""

from __future__ import annotations

import time

import torch

from specray.serving.runner import LlamaRunner, RunnerOutput
from specray.serving.sampling import NonFiniteLogitsError, sample_each
from specray.serving.workers.base import StepOutput


def ar_step(runner: LlamaRunner, slots: list[int], anchors: list[int], params, generators
            ) -> tuple[list[list[int]], list[NonFiniteLogitsError | None], RunnerOutput]:
    """One target row per request (its anchor), committed; returns (next token per request, its
    error if its logits were not finite, the runner's output). The AR worker's step, and a
    speculative worker's plain step."""
    out = runner.forward(torch.tensor(anchors, device=runner.device)[:, None], torch.tensor(slots, device="cpu"),
                         torch.ones(len(slots), dtype=torch.long, device="cpu"))
    for slot in slots:
        runner.cache.commit(slot, 1)
    tokens, errors = sample_each(out.logits[:, 0], params, generators)
    return tokens, errors, out


def prefill_target(runner: LlamaRunner, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, RunnerOutput]:
    """Run and commit the prompts in the target's KV (packed, ``LlamaRunner.prefill``); returns
    (last-row logits [B, V], the output: its ``hidden`` [B, T_max, D] right-padded)."""
    out = runner.prefill(prompts, torch.tensor(slots, device="cpu"))
    for slot, prompt in zip(slots, prompts):
        runner.cache.commit(slot, len(prompt))
    return out.logits[:, 0], out


class ARWorker:
    """The worker protocol (``serving/workers/base.py``) without a drafter: every step is a round
    with no drafts (one token, tau 1)."""

    max_verify_rows = 1
    verify_sizes: tuple[int, ...] = ()
    verify_layout = "chain"

    def __init__(self, runner: LlamaRunner):
        self.runner = runner
        self.steps, self.seconds = 0, 0.0

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        return prefill_target(self.runner, slots, prompts)[0]

    def step(self, slots: list[int], anchors: list[int], params, generators, size: int = 0) -> StepOutput:
        if size:
            raise ValueError(f"the AR worker runs no speculative rounds (size {size})")
        start = time.perf_counter()
        tokens, errors, out = ar_step(self.runner, slots, anchors, params, generators)
        self.steps, self.seconds = self.steps + 1, self.seconds + time.perf_counter() - start
        return StepOutput(tokens, [0] * len(slots), [0] * len(slots), True, errors, target_logits=out.logits)

    def release(self, slot: int) -> None:
        """Nothing to drop: the target's KV slot is the engine's."""

    def stats(self) -> dict:
        return {"steps": self.steps, "phase_seconds": {"step": self.seconds}}
