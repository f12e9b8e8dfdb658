"""The stage records ``--resume`` reads: a finished stage is kept while its config sections and the
stages before it are unchanged, and runs again, with every stage after it, once they change."""

from specray.pipeline.config import PipelineConfig, load_config
from specray.pipeline.jobs.pipeline import PipelineReport
from specray.pipeline.jobs.stages import StageLog

STAGES = [("capture", ("target", "data", "capture", "store")), ("train", ("train",)), ("bench", ("bench", "serve"))]


def _run(tmp_path, overrides, *, resume):
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", overrides)
    report = PipelineReport("q", "offline", str(tmp_path))
    log, ran = StageLog(tmp_path, cfg, report, resume=resume, progress=False), []

    def stage(name):
        def fn():
            ran.append(name)
            setattr(report, name, {"from": name, "overrides": overrides})
            return f"{name}-output"
        return fn

    outputs = [log.run(name, sections, (name,), stage(name)) for name, sections in STAGES]
    assert outputs == ["capture-output", "train-output", "bench-output"]
    return ran, report


def test_finished_stages_are_kept_until_their_config_changes(tmp_path):
    assert _run(tmp_path, [], resume=False)[0] == ["capture", "train", "bench"]
    ran, report = _run(tmp_path, [], resume=True)
    assert ran == [] and report.stages_reused == ["capture", "train", "bench"]
    assert report.train == {"from": "train", "overrides": []}  # restored from the record
    assert set(report.stage_seconds) == {"capture", "train", "bench"}
    assert _run(tmp_path, ["bench.num_prompts=3"], resume=True)[0] == ["bench"]
    assert _run(tmp_path, ["bench.num_prompts=3", "serve.engine.speculation=static"], resume=True)[0] == ["bench"]
    changed = ["bench.num_prompts=3", "serve.engine.speculation=static", "data.max_samples=5"]
    assert _run(tmp_path, changed, resume=True)[0] == ["capture", "train", "bench"]  # the first stage's input
    assert _run(tmp_path, changed, resume=True)[0] == []
    assert _run(tmp_path, changed, resume=False)[0] == ["capture", "train", "bench"]  # a fresh run reads no record


def test_a_stage_killed_before_its_record_runs_again(tmp_path):
    _run(tmp_path, [], resume=False)
    (tmp_path / "stages" / "train.json").unlink()  # killed after its work, before the record
    assert _run(tmp_path, [], resume=True)[0] == ["train"]
