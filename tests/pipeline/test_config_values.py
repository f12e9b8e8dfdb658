"""Config values are taken as written: run names are one path component, types are strict, floats
finite, and every YAML problem is a ConfigError with its line and the fix (pipeline/config_loading.py)."""

import pytest

from specray.pipeline.cli import main
from specray.pipeline.config import (CaptureJobConfig, ConfigError, PipelineConfig, ServeJobConfig, TrainJobConfig,
                                     load_config)

MODELS = [CaptureJobConfig, TrainJobConfig, PipelineConfig, ServeJobConfig]
TRAIN = ["data.manifest=m.parquet"]  # the one field TrainJobConfig requires


def _load(model, overrides, tmp_path=None, text=None):
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
    return load_config(model, path, (TRAIN if model is TrainJobConfig else []) + overrides)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("name, why", [
    ('""', "is empty"), ("..", r"starts with '\.'"), (".", r"starts with '\.'"), ("../../x", "path separator"),
    ("a/b", "path separator"), ("/abs", "path separator"), (r"a\\b", "path separator"),
    ('"a\\nb"', r"control character '\\n'"), ('"x\\ty"', r"control character '\\t'"),
    ('"nul\\0"', r"control character '\\x00'"), ('"bell\\a"', r"control character '\\x07'"),
    ("-rf", "starts with '-'"), ('"a b"', "other than letters"), ("x" * 129, "longer than 128"),
])
def test_a_run_name_that_is_not_one_path_component_is_refused(model, name, why):
    with pytest.raises(ConfigError, match=rf"name: the run name [^;]*{why}[^;]*; .*runs/<name>.*e\.g\. name=quickstart-2"):
        _load(model, [f"name={name}"])


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_a_good_run_name_is_one_directory_under_runs(model):
    for name in ("quickstart", "q2.eagle3_v1-b", "A", "x" * 112):
        cfg = _load(model, [f"name={name}"])
        assert cfg.run_dir.parts == ("runs", name)


def test_a_name_in_the_manifest_is_refused_with_the_file_named(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid config in .*run\.yaml:\n  name: the run name is empty"):
        _load(PipelineConfig, [], tmp_path, 'name: ""\n')


def test_every_name_a_pipeline_derives_is_valid():
    """A pipeline's sub-runs append to its name (``<name>-capture``, the closed loop's ``<name>-initial-capture``):
    the longest pipeline name leaves room for them, and one character more is refused at load."""
    from pathlib import Path

    from specray.pipeline.jobs.closed_loop import derived_config

    loop = ["mode=closed_loop", "online.max_inflight_samples=100"]
    cfg = _load(PipelineConfig, ["name=" + "n" * 112, *loop])
    for sub_name, mode in ((f"{cfg.name}-initial", "offline"), (f"{cfg.name}-0001", "online")):
        sub = derived_config(cfg, name=sub_name, mode=mode, run_dir=Path("runs") / cfg.name / "sub")
        assert sub.capture_job().name == sub_name + "-capture" and sub.train_job(None).name == sub_name + "-train"
    with pytest.raises(ConfigError, match=r"name: with mode=closed_loop the run name has at most 112 characters \(got "
                                          r"113\): its sub-runs append up to 16 \(<name>-initial-capture\); shorten it"):
        _load(PipelineConfig, ["name=" + "n" * 113, *loop])
    offline = _load(PipelineConfig, ["name=" + "n" * 120])
    assert offline.capture_job().name == "n" * 120 + "-capture"
    with pytest.raises(ConfigError, match=r"name: with mode=offline the run name has at most 120"):
        _load(PipelineConfig, ["name=" + "n" * 121])
    assert _load(CaptureJobConfig, ["name=" + "n" * 128]).name == "n" * 128


@pytest.mark.parametrize("field, value", [
    ("train.optim.lr", ".inf"), ("train.optim.lr", ".nan"), ("train.optim.lr", "-.inf"),
    ("train.optim.weight_decay", ".inf"), ("train.optim.weight_decay", ".NaN"),
    ("serve.record.sample_rate", ".nan"), ("closed_loop.time_budget_s", ".inf"),
    ("train.drafter.block_key_bias", ".inf"),  # a drafter section (drafters/dflash.py), validated by its own model
    ("train.objective.gamma", ".nan"),  # the strategy's objective (trainer/strategies/dflash.py)
])
def test_non_finite_floats_are_refused_in_the_pipeline(field, value):
    with pytest.raises(ConfigError, match=rf"{field}: must be a finite number \(got -?(inf|nan)\)\. Fix: give a "
                                          r"finite value"):
        _load(PipelineConfig, [f"{field}={value}"])


@pytest.mark.parametrize("model, field", [
    (TrainJobConfig, "optim.lr"), (TrainJobConfig, "optim.weight_decay"), (ServeJobConfig, "registry.poll_interval_s"),
    (ServeJobConfig, "autoscaling.target_ongoing_requests"), (ServeJobConfig, "replica.num_cpus"),
])
def test_non_finite_floats_are_refused_in_every_job(model, field):
    for value in (".inf", ".nan"):
        with pytest.raises(ConfigError, match=rf"{field}: must be a finite number"):
            _load(model, [f"{field}={value}"])


def test_a_quoted_infinity_is_refused_too():
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be a valid number.*Fix: give a number"):
        _load(TrainJobConfig, ['optim.lr="inf"'])
    from pydantic import ValidationError

    from specray.pipeline.config import OptimSection

    with pytest.raises(ValidationError, match=r"should be a finite number"):  # a section built in code: its own check
        OptimSection(lr=float("inf"))


@pytest.mark.parametrize("override, message", [
    ("train.num_workers=true", r"train\.num_workers: Input should be a valid integer \(got True\)\. Fix: give a whole "
                               r"number"),
    ("train.num_workers=2.0", r"train\.num_workers: Input should be a valid integer"),
    ('train.num_workers="2"', r"train\.num_workers: Input should be a valid integer"),
    ("data.max_samples=false", r"data\.max_samples: Input should be a valid integer"),
    ("serve.enabled=1", r"serve\.enabled: Input should be a valid boolean \(got 1\)\. Fix: give true or false"),
    ('serve.enabled="yes"', r"serve\.enabled: Input should be a valid boolean"),
    ("train.optim.lr=true", r"train\.optim\.lr: Input should be a valid number"),
    ("train.drafter.num_layers=true", r"train\.drafter\.num_layers: Input should be a valid integer"),
    ("train.objective.num_anchors=1.0", r"train\.objective\.num_anchors: Input should be a valid integer"),
    ("name=7", r"name: Input should be a valid string"),
])
def test_types_are_strict(override, message):
    with pytest.raises(ConfigError, match=message):
        _load(PipelineConfig, [override])


def test_numbers_read_as_yaml_1_2(tmp_path):
    """``1e-4`` is a number (PyYAML alone reads it as a string, which strict types would refuse)."""
    cfg = _load(TrainJobConfig, ["optim.lr=1e-4", "optim.weight_decay=5E-2"])
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-4, 5e-2)
    cfg = _load(PipelineConfig, [], tmp_path, "train:\n  optim: {lr: 3e-3, min_lr_ratio: 1}\n  num_workers: 2\n")
    assert (cfg.train.optim.lr, cfg.train.optim.min_lr_ratio, cfg.train.num_workers) == (3e-3, 1.0, 2)
    assert _load(PipelineConfig, ["name=1e5x"]).name == "1e5x"  # a name that merely starts like a number


@pytest.mark.parametrize("text, message", [
    ("name: !!python/object/apply:os.system ['echo pwned']\n",
     r"run\.yaml, line 1, column 7: could not determine a constructor for the tag "
     r"'tag:yaml\.org,2002:python/object/apply:os\.system'\. Fix: manifests take plain YAML only: drop the tag"),
    ("train:\n  optim: !Optim {lr: 1}\n", r"line 2, column 10: could not determine a constructor for the tag '!Optim'"),
    ("train:\n  num_workers: [1,\n",
     r"line 3, column 1: while parsing a flow node expected the node content, but found '<stream end>'\. Fix: "
     r"check the indentation"),
    ("train:\n\tnum_workers: 2\n", r"line 2, column 1: while scanning for the next token found character '\\t'"),
    ("name: a\ntrain: {num_workers: 1}\nname: b\n",
     r"line 3, column 1: while reading a mapping found the key 'name' twice \(the first one at line 1\)\. Fix: keep "
     r"one of them"),
    ("train:\n  optim:\n    lr: 1.0e-3\n    lr: 2.0e-3\n", r"line 4, column 5: .*key 'lr' twice"),
    (b"name: caf\xe9\n", r"run\.yaml: not UTF-8 text \(byte 9\); save the manifest as UTF-8"),
])
def test_yaml_problems_are_config_errors_with_line_and_fix(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        _load(PipelineConfig, [], tmp_path, text)


@pytest.mark.parametrize("override, message", [
    ("name=!!python/name:os.system", r"override 'name=!!python/name:os\.system', line 1, column 1: could not "
                                     r"determine a constructor"),
    ("train.optim.lr=[1,", r"override 'train\.optim\.lr=\[1,', line 1, column 4: while parsing a flow node"),
    ("serve={a: 1, a: 2}", r"override 'serve=\{a: 1, a: 2\}'.*key 'a' twice"),
])
def test_override_yaml_problems_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        _load(PipelineConfig, [override])


def test_the_cli_answers_yaml_problems_with_status_2_and_no_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    assert main(["pipeline", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "specray pipeline: error: invalid" not in err and "line 1, column 7" in err and "Traceback" not in err
    assert main(["capture", "data.max_samples=.inf"]) == 2
    assert "data.max_samples: must be a finite number" in capsys.readouterr().err
