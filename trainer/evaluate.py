"""Teacher-forced evaluation of a drafter on a manifest (no gradient, fixed anchors).

Per block position: top-1 accuracy and CE, and ``tau_tf`` — the accepted length a block would
get if every draft were checked against the data tokens (1 + leading correct positions).
This is the training-side metric; the free-running ``tau`` comes from the serving engine.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.trainer.loader import FeatureLoader


@torch.no_grad()
def evaluate(model: nn.Module, model_config, strategy, loader: FeatureLoader, num_batches: int) -> dict:
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    loss = 0.0
    for i in range(num_batches):
        batch_loss, metric = strategy.forward_loss(model, model_config, loader.next_batch(), strategy.generator(0, i))
        loss += float(batch_loss) / num_batches
        for name, value in metric.items():
            sums[name] = sums.get(name, 0) + value
    return {"loss": loss, **strategy.summarize(sums)}
