"""A short DFlash run on features captured from the embedded SmolLM2 target (slow marker)."""

import pytest
import torch

from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.train import build_trainer
from specray.trainer.strategies.dflash import DFlashObjective, DFlashStrategy


def _evaluate(trainer, batches):
    """Teacher-forced metrics of the current drafter on fixed batches, up to 128 anchors each."""
    strategy, model = DFlashStrategy(DFlashObjective(num_anchors=128)), trainer.core.model.eval()
    sums = {}
    with torch.no_grad():
        for i, batch in enumerate(batches):
            loss, metric = strategy.forward_loss(model, trainer.core.model_config, batch, strategy.generator(10_000, i))
            sums["loss"] = sums.get("loss", 0.0) + float(loss) / len(batches)
            for k, v in metric.items():
                sums[k] = sums.get(k, 0) + v
    out = strategy.summarize(sums)
    out["loss"] = sums["loss"]
    return out


@pytest.mark.slow
def test_short_run_on_smollm2_features_learns(tmp_path):
    """80 steps on 24 captured ShareGPT samples: the loss falls and position-1 accuracy rises.

    The bar is what this much data can buy: 24 samples cannot pin down a 49,152-token
    next-token map, so the drafter first learns the marginal; a drafter that does not learn
    (a broken mask, detached loss, frozen weights) fails both checks.
    """
    capture = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=smol", "data.max_samples=24", "data.max_length=384", f"output.run_dir={tmp_path / 'cap'}",
    ])
    run_capture(capture, progress=False)
    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        f"data.manifest={tmp_path / 'cap' / 'manifest.parquet'}", f"output.run_dir={tmp_path / 'run'}",
        "optim.total_steps=80", "trainer.checkpoint_every=1000", "trainer.log_every=10",
    ])
    trainer = build_trainer(cfg)
    held = [trainer.loader.next_batch() for _ in range(4)]
    trainer.loader.load_state_dict({**trainer.loader.state_dict(), "epoch": 0, "position": 0})
    before = _evaluate(trainer, held)
    trainer.fit(progress=False)
    after = _evaluate(trainer, held)
    trainer.loader.close()
    print("before", before, "after", after)
    assert after["loss"] < before["loss"] - 1.5, (before, after)
    assert after["acc_by_pos"][0] >= before["acc_by_pos"][0] + 0.02, (before, after)
    assert after["tau_tf"] > before["tau_tf"], (before, after)
