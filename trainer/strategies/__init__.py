"""Train strategies, one per algorithm, behind one registry (never ``if algorithm == …`` chains).

A strategy builds its drafter from a config and the target's shared modules, and turns a
``TrainBatch`` into ``(loss, metric sums)``; ``summarize`` turns accumulated sums into metrics.
"""

from __future__ import annotations

from specray.trainer.strategies.dflash import DFlashStrategy

STRATEGIES = {"dflash": DFlashStrategy}


def get_strategy(algorithm: str):
    try:
        return STRATEGIES[algorithm]
    except KeyError:
        raise ValueError(f"no train strategy for algorithm {algorithm!r}; implemented: {sorted(STRATEGIES)}") from None
