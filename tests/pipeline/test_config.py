import pytest

from specray.pipeline.cli import main
from specray.drafters import DRAFTERS
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


def test_drafter_section_is_the_algorithms_own_and_the_objective_its_strategys():
    from specray.drafters.dflash import DFlashSection
    from specray.pipeline.config import PipelineConfig, TrainJobConfig
    from specray.trainer.strategies.dflash import DFlashObjective

    cfg = load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml",
                      ["drafter.block_size=4", "objective.gamma=2.5", "data.manifest=m.parquet"])
    assert isinstance(cfg.drafter, DFlashSection) and cfg.drafter.block_size == 4
    assert isinstance(cfg.objective, DFlashObjective) and cfg.objective.gamma == 2.5
    spec = cfg.train_spec()
    assert spec.drafter == cfg.drafter and spec.objective == cfg.objective and spec.manifest.endswith("/m.parquet")
    assert spec.config["objective"] == {"num_anchors": 16, "gamma": 2.5}
    pipeline = load_config(PipelineConfig, "manifests/quickstart.yaml", ["train.drafter.num_layers=2"])
    assert pipeline.train.drafter.algorithm == "dflash" and pipeline.train.drafter.num_layers == 2  # the default
    job = pipeline.train_job("m.parquet")
    assert job.drafter == pipeline.train.drafter and job.objective == pipeline.train.objective


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        ("train", ["drafter.algorithm=medusa"],
         r"drafter\.algorithm: unknown algorithm 'medusa'; algorithms: \['eagle3', 'dflash', 'dspark', 'dflash2'\], "
         r"implemented: \['dflash'"),
        ("train", ["objective.num_anchors=0"], r"objective\.num_anchors: Input should be greater than 0"),
        ("train", ["objective.gama=1"], r"objective\.gama: unknown key\. Fix: did you mean 'gamma'\?"),
        ("train", ["drafter.blok_size=4"], r"drafter\.blok_size: unknown key\. Fix: did you mean 'block_size'\?"),
        ("pipeline", ["train.drafter.algorithm=dspark"],
         r"train\.drafter\.algorithm=dspark needs features captured with capture\.algorithm=dspark \(got dflash\)"),
        ("pipeline", ["train.objective.gamma=-1"], r"train\.objective\.gamma: Input should be greater than 0"),
        ("pipeline", ["capture.algorithm=eagle3"],
         r"train\.drafter\.algorithm=dflash needs features captured with capture\.algorithm=dflash \(got eagle3\); "
         r"set capture\.algorithm=dflash"),
        ("pipeline", ["train.drafter={algorithm: eagle3}"],
         r"train\.drafter\.algorithm=eagle3 needs features captured with capture\.algorithm=eagle3 \(got dflash\); "
         r"set capture\.algorithm=eagle3"),
    ],
)
def test_an_algorithm_or_objective_that_does_not_fit_is_refused_at_load(model, overrides, message):
    from specray.pipeline.config import PipelineConfig, TrainJobConfig

    manifests = {"train": (TrainJobConfig, "manifests/train-dflash-quickstart.yaml"),
                 "pipeline": (PipelineConfig, "manifests/quickstart.yaml")}
    cls, path = manifests[model]
    with pytest.raises(ConfigError, match=message):
        load_config(cls, path, overrides)


def test_switching_algorithm_by_override_names_the_other_algorithms_fields():
    from specray.pipeline.config import PipelineConfig

    other = next((name for name in DRAFTERS if name != "dflash"), None)
    if other is None or "block_size" in DRAFTERS[other].section.model_fields:
        pytest.skip("needs a second registered drafter without block_size")
    with pytest.raises(ConfigError, match=rf"train\.drafter\.block_size: unknown key\. Fix: 'block_size' belongs to the "
                                          rf"dflash drafter section, not {other}'s: drop it, or give the whole section, "
                                          rf"e.g. train\.drafter=\{{algorithm: {other}\}}"):
        load_config(PipelineConfig, "manifests/quickstart.yaml", [f"train.drafter.algorithm={other}"])


def test_the_pipelines_chat_format_reaches_its_serving_replicas():
    """A drafter captured with data.chat_template(_kwargs) is refused by a replica rendering another template
    (the template fingerprint differs): the pipeline's serve stage gets the same format."""
    from specray.actors.serve import replica_spec
    from specray.capture.chat import NAMED_TEMPLATES
    from specray.pipeline.config import DataConfig, PipelineConfig, ServeJobConfig

    cfg = PipelineConfig(data=DataConfig(chat_template="chatml", chat_template_kwargs={"enable_thinking": False}))
    serve = cfg.serve_job()
    assert (serve.chat_template, serve.chat_template_kwargs) == ("chatml", {"enable_thinking": False})
    spec = replica_spec(serve, api_key=None)
    assert spec.chat_template == NAMED_TEMPLATES["chatml"] and spec.chat_template_kwargs == {"enable_thinking": False}
    assert replica_spec(ServeJobConfig(), api_key=None).chat_template is None
    with pytest.raises(ValueError, match="chat_template='nope' is neither a named template"):
        ServeJobConfig(chat_template="nope")


def test_data_section_inputs_and_their_errors(tmp_path, monkeypatch):
    from specray.pipeline.config import DataConfig

    assert DataConfig(dataset="parquet:chats.parquet", id_field="uid").id_field == "uid"
    assert DataConfig(dataset="hf:saved/train").dataset == "hf:saved/train"
    for dataset, message in (("parquet:", "parquet: needs a location"), ("hf:", "hf: needs a location"),
                             ("nope", "jsonl:PATH, parquet:PATH, hf:PATH or records:URI")):
        with pytest.raises(ValueError, match=message):
            DataConfig(dataset=dataset)
    with pytest.raises(ValueError, match="id_field='uid' names a column of jsonl:, parquet: or hf: rows"):
        DataConfig(dataset="sharegpt", id_field="uid")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    monkeypatch.chdir(tmp_path)
    assert DataConfig(chat_template="t.jinja").chat_template == str(template)  # absolute: jobs run elsewhere
    with pytest.raises(ValueError, match=r"chat_template_kwargs.x: inf is not a finite number"):
        DataConfig(chat_template_kwargs={"x": float("inf")})
