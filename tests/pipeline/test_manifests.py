"""Every shipped YAML manifest validates against its config model."""

from pathlib import Path

import pytest

from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config

MANIFESTS = sorted(Path("manifests").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path):
    model = TrainJobConfig if path.name.startswith("train-") else CaptureJobConfig
    cfg = load_config(model, path)
    assert cfg.name == path.stem
