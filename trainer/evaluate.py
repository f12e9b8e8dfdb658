"""Teacher-forced evaluation of a drafter on held-out features (no gradient, seeded draws).

The strategy's metrics per draft position (top-1 accuracy, CE) and ``tau_tf`` — the accepted
length a draft would get if every token were checked against the data tokens. This is the
training-side metric; the free-running ``tau`` comes from the serving engine. ``specray
evaluate`` runs it over a manifest.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from specray.trainer.loader import FeatureLoader, TrainBatch


@torch.no_grad()
def evaluate_batches(model: nn.Module, model_config, strategy, batches: Iterable[TrainBatch]) -> dict:
    """Mean loss and the strategy's summary over ``batches`` (batch ``i`` draws with ``generator(0, i)``)."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    losses = []
    for i, batch in enumerate(batches):
        batch_loss, metric = strategy.forward_loss(model, model_config, batch, strategy.generator(0, i))
        losses.append(float(batch_loss))
        for name, value in metric.items():
            sums[name] = sums.get(name, 0) + value
    if not losses:
        return {}
    return {"loss": sum(loss / len(losses) for loss in losses), **strategy.summarize(sums)}


def evaluate(model: nn.Module, model_config, strategy, loader: FeatureLoader, num_batches: int) -> dict:
    """``evaluate_batches`` over the loader's next ``num_batches`` batches."""
    return evaluate_batches(model, model_config, strategy, (loader.next_batch() for _ in range(num_batches)))
