"""Every shipped YAML manifest validates against the config model of the command it names.

Each manifest's first line is its command (``# specray capture -c …``, ``# specray pipeline run …``);
that is how a reader, and this test, know which config it is.
"""

from pathlib import Path

import pytest

from specray.pipeline.config import CaptureJobConfig, PipelineConfig, ServeJobConfig, TrainJobConfig, load_config

MANIFESTS = sorted(Path("manifests").glob("*.yaml"))
MODELS = {"capture": CaptureJobConfig, "train": TrainJobConfig, "serve": ServeJobConfig, "pipeline": PipelineConfig}


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path):
    first = path.read_text().splitlines()[0].split()
    assert first[:2] == ["#", "specray"] and first[2] in MODELS, f"{path}: first line must be '# specray <command> …'"
    cfg = load_config(MODELS[first[2]], path)
    assert cfg.name == path.stem
