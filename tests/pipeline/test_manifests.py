"""Every shipped YAML manifest validates against the config model of the command it names.

Each manifest's first line is its command (``# specray capture -c …``, ``# specray pipeline run …``);
that is how a reader, and this test, know which config it is.
"""

from pathlib import Path

import pytest

from specray.pipeline.config import (CaptureJobConfig, ConfigError, PipelineConfig, ServeJobConfig, TrainJobConfig,
                                     load_config)

MANIFESTS = sorted(Path("manifests").glob("*.yaml"))
MODELS = {"capture": CaptureJobConfig, "train": TrainJobConfig, "serve": ServeJobConfig, "pipeline": PipelineConfig}


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path):
    first = path.read_text().splitlines()[0].split()
    assert first[:2] == ["#", "specray"] and first[2] in MODELS, f"{path}: first line must be '# specray <command> …'"
    cfg = load_config(MODELS[first[2]], path)
    assert cfg.name == path.stem


def test_the_quickstart_pipelines_capture_what_they_train():
    """DFlash's and EAGLE-3's quickstarts capture the contract of the drafter they train, on one budget."""
    names = {p.name for p in MANIFESTS}
    assert {"quickstart.yaml", "quickstart-eagle3.yaml"} <= names
    for path, algorithm in (("manifests/quickstart.yaml", "dflash"), ("manifests/quickstart-eagle3.yaml", "eagle3")):
        cfg = load_config(PipelineConfig, path)
        assert cfg.capture.algorithm == cfg.train.drafter.algorithm == algorithm, path
        assert cfg.data.max_samples == 64 and cfg.train.optim.total_steps == 120, path


def test_switching_the_quickstart_to_eagle3_by_one_override_names_its_manifest():
    """The DFlash quickstart's leftover block_size is refused (never dropped silently); the fix names
    the full-section override and the manifest written for eagle3, and both load."""
    with pytest.raises(ConfigError, match=r"train\.drafter\.block_size: unknown key\. .*train\.drafter=\{algorithm: "
                                          r"eagle3\}; or run manifests/quickstart-eagle3\.yaml, written for eagle3"):
        load_config(PipelineConfig, "manifests/quickstart.yaml", ["train.drafter.algorithm=eagle3"])
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml",
                      ["train.drafter={algorithm: eagle3, draft_vocab_size: 8192}", "capture.algorithm=eagle3"])
    assert cfg.train.drafter.algorithm == "eagle3" and cfg.train.drafter.draft_vocab_size == 8192
