"""The chi-square losslessness harness of the speculative workers (STYLE 8: statistical convergence
to the target's distribution).

Two tokens per request at temperature 1, top-k 3: the first sampled from the prefill's logits, the
second from one speculative round (its drafts accepted or rejected). Their joint frequency over
128 batches of 8 requests (request ``b`` of batch ``i`` seeded ``8 i + b``) is compared with the
target's exact ``p(t1) p(t2 | t1)`` over its top-3 tokens: 9 cells, 8 degrees of freedom.

    exact = exact_two_tokens(target, prompt)
    worker = make_worker(drafter_over(candidate_vocab(exact)))   # drafts are sometimes accepted
    counts, steps = sample_two_tokens(worker, prompt, size)
    assert chi_square(counts, exact) < CHI2_8_P001
"""

from __future__ import annotations

import torch

from specray.serving.sampling import SamplingParams, sample_next
from specray.serving.workers.base import StepOutput

# 9 cells, 8 degrees of freedom: p = 0.001.
CHI2_8_P001 = 26.1
PARAMS = SamplingParams(temperature=1.0, top_k=3)
BATCHES, SLOTS = 128, 8


def exact_two_tokens(target, prompt: list[int], top_k: int = 3) -> dict[tuple[int, int], float]:
    """``p(t1) p(t2 | t1)`` over the target's top-k tokens at temperature 1, keyed ``(t1, t2)``."""
    with torch.inference_mode():
        first = torch.topk(target.model(torch.tensor([prompt])).logits[0, -1], top_k)
        exact = {}
        for t1, w1 in zip(first.indices.tolist(), first.values.softmax(-1).tolist()):
            second = torch.topk(target.model(torch.tensor([prompt + [t1]])).logits[0, -1], top_k)
            for t2, w2 in zip(second.indices.tolist(), second.values.softmax(-1).tolist()):
                exact[(t1, t2)] = w1 * w2
    return exact


def candidate_vocab(exact: dict[tuple[int, int], float]) -> torch.Tensor:
    """The tokens of ``exact``'s cells, ascending: a draft vocabulary whose drafts are sometimes accepted."""
    return torch.tensor(sorted({t for pair in exact for t in pair}))


def sample_two_tokens(worker, prompt: list[int], size: int, params: SamplingParams = PARAMS
                      ) -> tuple[dict[tuple[int, int], int], list[StepOutput]]:
    """``BATCHES`` batches of ``SLOTS`` requests of ``prompt``: prefill, sample the first token, one
    ``worker.step`` of ``size``, release every slot. Returns the ``(t1, t2)`` counts and every step."""
    counts: dict[tuple[int, int], int] = {}
    steps = []
    slots = list(range(SLOTS))
    for batch in range(BATCHES):
        generators = [torch.Generator().manual_seed(batch * SLOTS + b) for b in slots]
        logits = worker.prefill(slots, [prompt] * SLOTS)
        firsts = [sample_next(logits[b], params, generators[b]) for b in slots]
        step = worker.step(slots, firsts, [params] * SLOTS, generators, size)
        steps.append(step)
        for slot, (t1, tokens) in enumerate(zip(firsts, step.tokens)):
            counts[(t1, tokens[0])] = counts.get((t1, tokens[0]), 0) + 1
            worker.runner.cache.release(slot)
            worker.release(slot)
    return counts, steps


def chi_square(counts: dict[tuple[int, int], int], exact: dict[tuple[int, int], float]) -> float:
    """Pearson's statistic of ``counts`` against ``exact``; every sampled pair must be one of its cells."""
    n = sum(counts.values())
    assert set(counts) <= set(exact), sorted(set(counts) - set(exact))
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())


def accepted_of(steps: list[StepOutput]) -> list[int]:
    """Every request's accepted drafts, over all steps."""
    return [r for step in steps for r in step.accepted]
