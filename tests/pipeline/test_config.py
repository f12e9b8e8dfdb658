import pytest

from specray.pipeline.cli import main
from specray.pipeline.config import CaptureJobConfig, ConfigError, load_config


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_quickstart_manifest_validates():
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml")
    assert cfg.target.name == "embedded:smollm2-135m-instruct"
    assert cfg.data.dataset == "sharegpt" and cfg.data.truncation == "truncate"


def test_overrides_are_parsed_as_yaml(tmp_path):
    cfg = load_config(CaptureJobConfig, _yaml(tmp_path, "name: x\n"),
                      ["capture.layer_ids=[3, 1]", "data.max_samples=8", "store.uri=null", "name=y"])
    assert cfg.capture.layer_ids == [3, 1] and cfg.data.max_samples == 8 and cfg.store.uri is None
    assert cfg.name == "y" and cfg.store_uri.startswith("file://") and cfg.store_uri.endswith("runs/y/features")


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("capture:\n  layer_idz: [1]\n", [], r"capture\.layer_idz: unknown key\. Fix: did you mean 'layer_ids'\?"),
        ("colour: red\n", [], r"colour: unknown key.*valid keys here are \['capture', 'data', 'name'"),
        ("", ["data.max_length=0"], r"data\.max_length: Input should be greater than 0 \(got 0\)"),
        ("", ["data.dataset=sharegtp"], r"data\.dataset: unknown dataset 'sharegtp'; use one of \["),
        ("", ["data.dataset=mtbench"], r"data\.dataset: 'mtbench' is held out for evaluation"),
        ("", ["data.truncation=middle"], r"data\.truncation: Input should be 'truncate' or 'drop'"),
        ("", ["capture.algorithm=medusa"], r"capture\.algorithm: unknown algorithm 'medusa'"),
        ("", ["store.uri=gs://b/x"], r"store\.uri: store URI 'gs://b/x': use file://PATH, s3://BUCKET/PREFIX or \(online\) ray://NAME"),
        ("", ["data=3"], r"data: Input should be a valid dictionary"),
        ("", ["novalue"], r"must look like section\.field=value"),
        ("- a\n- b\n", [], r"top level must be a mapping"),
    ],
)
def test_bad_config_names_field_and_fix(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CaptureJobConfig, _yaml(tmp_path, text), overrides)


def test_cli_reports_config_errors_with_status_2(tmp_path, capsys):
    path = _yaml(tmp_path, "capture:\n  layer_idz: [1]\n")
    assert main(["capture", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "capture.layer_idz: unknown key" in err and "Traceback" not in err
    assert main(["capture", "-c", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_online_pipeline_refuses_a_draft_vocabulary_it_cannot_count():
    from specray.pipeline.config import PipelineConfig

    with pytest.raises(ConfigError, match=r"draft_vocab_size=64 is counted from a finished capture's manifest.*"
                                          r"use mode=offline"):
        load_config(PipelineConfig, "manifests/online.yaml", ["train.drafter.draft_vocab_size=64"])
    cfg = load_config(PipelineConfig, "manifests/online.yaml",
                      ["train.drafter.draft_vocab_size=64", "train.drafter.init_from=runs/x/exports/final"])
    assert cfg.train.drafter.draft_vocab_size == 64
    with pytest.raises(ConfigError, match=r"draft_vocab_size: Input should be greater than 0"):
        load_config(PipelineConfig, "manifests/quickstart.yaml", ["train.drafter.draft_vocab_size=0"])
