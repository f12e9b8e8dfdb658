"""Train strategies, one per algorithm, behind one registry (never ``if algorithm == …`` chains).

``STRATEGIES[<a>]`` is a class (``trainer/strategies/<a>.py``; see ``specray.drafters`` for
the whole seam) with:

- ``algorithm``: its name; ``objective``: the pydantic model of the manifest's ``objective``
  section when ``drafter.algorithm`` is ``<a>`` (the config validates the section against it);
  ``evaluation``: objective fields held-out evaluation overrides (``specray evaluate``);
- ``__init__(objective, *, seed)``;
- ``build_model(config, *, embed_tokens, lm_head, final_norm)``: a fresh drafter of the
  registered model class, the target's modules shared;
- ``generator(step, micro_index)``: the CPU generator of its random draws for that micro-batch
  (keyed so 1 rank × A accumulation steps and A ranks × 1 draw the same, and a resumed step
  draws what the uninterrupted one drew);
- ``forward_loss(model, config, batch, generator) -> (loss, metric sums)``: ``model`` may be
  DDP-wrapped; the sums are tensors that add over micro-batches, steps and ranks;
- ``summarize(sums) -> dict``: metrics, at least ``acc_by_pos`` (teacher-forced top-1
  accuracy per draft position) and ``tau_tf`` (teacher-forced accepted length).
"""

from __future__ import annotations

from specray.drafters import ALGORITHMS, DRAFTERS
from specray.trainer.strategies.dflash import DFlashStrategy
from specray.trainer.strategies.dflash2 import DFlash2Strategy
from specray.trainer.strategies.dspark import DSparkStrategy
from specray.trainer.strategies.eagle3 import Eagle3Strategy

STRATEGIES = {"dflash": DFlashStrategy, "dflash2": DFlash2Strategy, "dspark": DSparkStrategy, "eagle3": Eagle3Strategy}


def implemented() -> list[str]:
    """Algorithms with both a registered drafter and a train strategy."""
    return sorted(set(DRAFTERS) & set(STRATEGIES))


def get_strategy(algorithm: str):
    """The train strategy class of ``algorithm``; ValueError naming the implemented ones otherwise."""
    if algorithm in STRATEGIES and algorithm in DRAFTERS:
        return STRATEGIES[algorithm]
    if algorithm in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not implemented yet (it needs a drafter and a train "
                         f"strategy); implemented: {implemented()}")
    raise ValueError(f"unknown algorithm {algorithm!r}; algorithms: {list(ALGORITHMS)}, implemented: {implemented()}")
