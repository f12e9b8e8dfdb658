"""``specray pipeline run`` end to end on the debug target, on the shared local Ray cluster.

- ``ray job submit`` of manifests/quickstart.yaml with a tiny override (debug target, a few
  steps): capture actors → trainer gang → export → registry + Ray Serve (OpenAI smoke
  requests) → bench, and a report.json with what the issue promises.
- Online mode with a capture actor killed mid-stream: the ledger audit shows every sample
  trained exactly once, the store held at most the in-flight bound, and no feature is left.
"""

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from specray.pipeline.config import ConfigError, PipelineConfig, load_config

pytestmark = pytest.mark.ray

TINY = [
    "target.name=debug", "data.max_samples=10", "data.max_length=256", "capture.max_batch_size=2",
    "capture.num_cpus_per_actor=0.5", "train.optim.total_steps=4", "train.optim.warmup_steps=1",
    "train.checkpoint_every=2", "bench.num_prompts=2", "bench.max_tokens=8", "serve.smoke_requests=2",
    "train.live_eval.num_prompts=2", "train.live_eval.max_tokens=8",
]


def test_ray_job_submit_quickstart_with_tiny_override(ray_cluster, tmp_path):
    from ports import free_port

    run_dir = tmp_path / "quickstart"
    entrypoint = " ".join(["specray", "pipeline", "run", "-q", "manifests/quickstart.yaml", *TINY,
                           "train.drafter.draft_vocab_size=128",  # the debug target has 259 tokens
                           f"output.run_dir={run_dir}", f"serve.http.port={free_port()}"])
    job = subprocess.run(["ray", "job", "submit", "--address", ray_cluster.dashboard_url, "--working-dir", ".",
                          "--", *entrypoint.split()], capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["mode"] == "offline"
    assert set(report["stage_seconds"]) == {"capture", "train", "export", "serve", "bench"}
    assert report["tau"] >= 1.0 and report["speedup_vs_ar"] > 0
    assert report["train"]["steps"] == 4
    assert report["train"]["tau_live"] >= 1.0 and len(report["train"]["live_accept_by_pos"]) == 7  # train.live_eval
    assert (run_dir / "train" / "metrics.jsonl").exists() and os.path.exists(report["train"]["curves"])
    assert report["serve"]["version"] == 1 and report["serve"]["smoke_requests"] == 2
    assert report["serve"]["backend"] == "specray" and "acceptance_by_position" in report["serve"]  # the replica's /metrics
    assert (run_dir / "exports" / "final" / "model.safetensors").exists()
    architecture = json.loads((run_dir / "exports" / "final" / "config.json").read_text())["architecture"]
    assert architecture["draft_vocab_size"] == 128  # counted by the gang from the capture's manifest
    assert report["bench"]["speculation"] == "auto"  # the manifest's serve.engine setting
    assert report["bench"]["max_speculative_batch"] is None and report["bench"]["rounds"]  # rounds by chosen size
    assert report["drafter_dir"] == str((run_dir / "exports" / "final").resolve())
    assert "tau" in job.stdout and "report" in job.stdout  # the job log ends with the report table


def _kill_one_capture_actor(address: str, done: threading.Event, killed: list) -> None:
    """SIGKILL the process of the first live CaptureActor once it has started (Ray restarts it)."""
    from ray.util.state import list_actors

    while not done.is_set():
        alive = list_actors(address=address, filters=[("class_name", "=", "CaptureActor"), ("state", "=", "ALIVE")])
        if alive and alive[0].pid:
            os.kill(alive[0].pid, signal.SIGKILL)
            killed.append(alive[0].pid)
            return
        time.sleep(0.2)


def _run_while_killing(cfg, kill, *args):
    """run_pipeline(cfg) while ``kill(*args, done, killed)`` runs on a thread; (report, handle, killed pids)."""
    from specray.pipeline.jobs.pipeline import run_pipeline

    done, killed = threading.Event(), []
    killer = threading.Thread(target=kill, args=(*args, done, killed), daemon=True)
    killer.start()
    try:
        report, handle = run_pipeline(cfg, progress=False)
    finally:
        done.set()
        killer.join(timeout=30)
    assert killed, "no capture actor was killed: the test did not test anything"
    return report, handle


def _assert_exactly_once(online: dict) -> None:
    assert online["audit"] == {"ok": True, "trained": online["audit"]["trained"], "duplicates": 0, "missing": 0,
                               "leftover_features": 0}


def test_online_pipeline_survives_a_killed_capture_actor(ray_cluster, tmp_path):
    cfg = load_config(PipelineConfig, "manifests/online.yaml", [
        *TINY, "data.max_samples=16", "capture.num_actors=2", "online.max_inflight_samples=6",
        "serve.enabled=false", "bench.enabled=false", f"output.run_dir={tmp_path / 'online'}",
        f"train.tracking.tensorboard={tmp_path / 'tensorboard'}",
    ])
    report, handle = _run_while_killing(cfg, _kill_one_capture_actor, ray_cluster.dashboard_url)
    assert handle is None
    online = report.online
    _assert_exactly_once(online)
    assert online["audit"]["trained"] == online["capture"]["samples"] > 0
    assert online["peak_inflight_samples"] <= 6
    # Whether the kill caught a batch in flight (re-dispatched, counted in restarts) or an idle
    # actor (restarted by Ray before its next batch) depends on timing; either way nothing may
    # be lost or duplicated, which the audit above checks. tests/actors covers the in-flight case.
    assert not any((tmp_path / "online" / "features").rglob("*.safetensors"))
    assert set(report.stage_seconds) == {"capture+train", "export"}
    from tracking_support import tensorboard_scalars  # the gang's rank 0 logged to train.tracking's TensorBoard

    logged = tensorboard_scalars(tmp_path / "tensorboard")
    records = [json.loads(line) for line in (tmp_path / "online" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert logged["loss"] == pytest.approx({r["step"]: r["loss"] for r in records})  # every record, at its step
    assert logged["tau_live"] == pytest.approx({r["step"]: r["tau_live"] for r in records if "tau_live" in r})


def _kill_capture_actor_once_it_owns(store_name: str, keys: int, address: str, done: threading.Event,
                                     killed: list) -> None:
    """SIGKILL the capture actor once the ray:// store's directory names ``keys`` blobs (all its own)."""
    import ray

    from specray.actors.object_store import DIRECTORY_PREFIX

    while not done.is_set():
        try:
            size = ray.get(ray.get_actor(DIRECTORY_PREFIX + store_name).size.remote(), timeout=10)
        except ValueError:  # the directory does not exist yet
            size = 0
        if size >= keys:
            _kill_one_capture_actor(address, done, killed)
            return
        time.sleep(0.05)


def test_online_ray_store_captures_features_lost_with_their_actor_again(ray_cluster, tmp_path):
    """A ray:// blob dies with the actor that owns it: the gang asks, the producer captures it again."""
    import uuid

    name = f"online-{uuid.uuid4().hex[:8]}"
    cfg = load_config(PipelineConfig, "manifests/online.yaml", [
        *TINY, "data.max_samples=16", "capture.num_actors=1", "online.max_inflight_samples=6",
        f"store.uri=ray://{name}", "serve.enabled=false", "bench.enabled=false",
        f"output.run_dir={tmp_path / 'online'}",
    ])
    # The bound lets the one actor write 6 blobs before the gang (seconds to start) trains any.
    report, _ = _run_while_killing(cfg, _kill_capture_actor_once_it_owns, name, 4, ray_cluster.dashboard_url)
    online = report.online
    _assert_exactly_once(online)
    assert online["audit"]["trained"] == online["capture"]["samples"] > 0
    assert online["capture"]["recaptured_samples"] > 0  # what the kill took was captured again
    assert online["peak_inflight_samples"] <= 6


def _kill_driver_after_a_checkpoint(ray_cluster, manifest: str, overrides: list[str], ledger_dir, run_dir) -> None:
    """Run ``specray pipeline run`` and SIGKILL it once the ledger in ``ledger_dir`` names a checkpoint.

    Returns once every actor the killed driver started is dead: until Ray reaps them, its gang's
    rank 0 may still write to the ledger, and the test would read a ledger that is still moving.
    """
    from ray.util.state import list_actors

    from specray.trainer.ledger import Ledger

    def alive() -> set[tuple[str, str]]:  # Ray's own detached singletons (``_Autoscaling…``) outlive any job
        return {(a.actor_id, a.class_name) for a in list_actors(address=ray_cluster.dashboard_url,
                                                                filters=[("state", "=", "ALIVE")], limit=10_000)
                if not a.class_name.startswith("_")}

    others = alive()
    driver = subprocess.Popen(["specray", "pipeline", "run", "-q", manifest, *overrides,
                               f"ray.address={ray_cluster.address}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while not (ledger_dir.exists() and Ledger(str(ledger_dir)).replay().checkpoints):
            assert driver.poll() is None, driver.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait(timeout=60)
    assert not (run_dir / "report.json").exists(), "the driver finished before it was killed: nothing was tested"
    deadline = time.monotonic() + 120
    while alive() - others:
        assert time.monotonic() < deadline, f"the killed driver's actors still live after 120 s: {alive() - others}"
        time.sleep(0.5)


@pytest.mark.parametrize("resume_overrides, bound", [
    pytest.param([], 6, id="same-gang"),
    # Q = 2 -> 4: one pass is 10 windows of 4, but the resumed gang is at step >= 2 already; its
    # target counts the samples left (2 + 9 or more steps), not the pass at the new Q.
    pytest.param(["train.optim.micro_batch_size=4", "online.max_inflight_samples=8"], 8, id="larger-gang"),
])
def test_online_pipeline_resumes_after_its_driver_is_killed(ray_cluster, tmp_path, resume_overrides, bound):
    """SIGKILL the driver after the first checkpoint; ``--resume`` finishes the stream exactly once."""
    from specray.pipeline.jobs.pipeline import run_pipeline
    from specray.trainer.ledger import Ledger

    run_dir = tmp_path / "online"
    overrides = [*TINY, "data.max_samples=40", "online.max_inflight_samples=6", "serve.enabled=false",
                 "bench.enabled=false", f"output.run_dir={run_dir}"]
    ledger_dir = run_dir / "ray-train" / "online-train" / "ledger"  # made by the driver, read here
    _kill_driver_after_a_checkpoint(ray_cluster, "manifests/online.yaml", overrides, ledger_dir, run_dir)
    before = Ledger(str(ledger_dir)).replay()
    # Other datasets' blobs sharing the store root: not this stream's, so never deleted
    stream_dir = next((run_dir / "features" / "features").iterdir())  # features/<contract id>/
    foreign = [run_dir / "features" / "other-dataset" / "x.safetensors", stream_dir / "another-dataset-0.safetensors"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"another dataset's features")

    cfg = load_config(PipelineConfig, "manifests/online.yaml", [*overrides, *resume_overrides])
    report, _ = run_pipeline(cfg, progress=False, resume=True)
    online = report.online
    _assert_exactly_once(online)  # none missing: the resumed gang trained every sample left
    assert all(path.read_bytes() == b"another dataset's features" for path in foreign)
    dispatched_before = {r.sample_id for refs in before.windows.values() for r in refs}
    assert online["resumed_dispatched"] == len(dispatched_before) > 0
    # the resumed producer captured only what the first driver never dispatched
    assert online["capture"]["samples"] == online["audit"]["trained"] - len(dispatched_before)
    attempts = Ledger(online["ledger"]).replay().attempts
    assert len(attempts) >= 2  # the killed run's attempt and the resumed one
    assert attempts[max(attempts)]["quantum"] == (4 if resume_overrides else 2)
    assert online["peak_inflight_samples"] <= bound


def test_offline_pipeline_resumes_after_its_driver_is_killed(ray_cluster, tmp_path):
    """SIGKILL the driver after the gang's first checkpoint; ``--resume`` reuses the capture and trains to the end."""
    from specray.pipeline.jobs.pipeline import manifest_uri, run_pipeline
    from specray.trainer.ledger import Ledger

    run_dir = tmp_path / "offline"
    overrides = [*TINY, "train.optim.total_steps=12", "train.drafter.draft_vocab_size=128", "serve.enabled=false",
                 "bench.enabled=false", f"output.run_dir={run_dir}"]
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", overrides)
    ledger_dir = run_dir / "ray-train" / cfg.train_job(None).name / "ledger"  # made by the driver, read here
    _kill_driver_after_a_checkpoint(ray_cluster, "manifests/quickstart.yaml", overrides, ledger_dir, run_dir)
    killed_at = max(c["step"] for c in Ledger(str(ledger_dir)).replay().checkpoints)
    assert killed_at < 12

    report, _ = run_pipeline(cfg, progress=False, resume=True)
    assert report.stages_reused == ["capture"]  # finished before the kill: its record is kept, it does not run
    assert report.capture["manifest"] == manifest_uri(cfg)
    assert report.train["steps"] == 12  # the same final step count as an uninterrupted run
    attempts = Ledger(str(ledger_dir)).replay().attempts
    assert len(attempts) == report.train["attempts"] >= 2  # the killed driver's gang and the resumed one
    assert attempts[max(attempts)]["parent"]["step"] >= killed_at
    assert (run_dir / "exports" / "final" / "model.safetensors").exists()


def test_online_bound_below_a_checkpoint_interval_is_a_config_error():
    with pytest.raises(ConfigError, match=r"online.max_inflight_samples=3 cannot hold one checkpoint interval.*>= 4"):
        load_config(PipelineConfig, "manifests/online.yaml", ["online.max_inflight_samples=3",
                                                               "train.checkpoint_every=2", "train.num_workers=1",
                                                               "train.optim.micro_batch_size=2"])


def test_the_ray_object_store_is_refused_for_offline_runs():
    with pytest.raises(ConfigError, match=r"store.uri=ray://x is the Ray object store, a cache.*use a file:// or s3://"):
        load_config(PipelineConfig, "manifests/quickstart.yaml", ["store.uri=ray://x"])


@pytest.mark.parametrize("override, message", [
    ("train.drafter.num_heads=3", r"drafter.num_heads=3 differs from the target's num_attention_heads=9"),
    ("train.drafter.num_layers=31", r"drafter.num_layers=31 decoder layers, and the target has num_hidden_layers=30"),
])
def test_a_drafter_the_targets_layers_cannot_start_is_refused_before_any_stage(tmp_path, monkeypatch, override,
                                                                               message):
    """The recipe starts its layers from the target's: a drafter they do not fit is refused before regenerate
    (no run dir, no Ray), not after hours of regenerate and capture."""
    from specray.pipeline.jobs import pipeline

    monkeypatch.setattr("specray.actors.cluster.connect", lambda *a: pytest.fail("Ray was started"))
    cfg = load_config(PipelineConfig, "manifests/recipe.yaml", [override, f"output.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=message):
        pipeline.run_pipeline(cfg, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_dir_not_made_by_a_pipeline_is_never_replaced(tmp_path):
    from specray.pipeline.jobs.pipeline import run_pipeline

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", [*TINY, "train.drafter.draft_vocab_size=128",
                                                                     f"output.run_dir={precious}"])
    with pytest.raises(FileExistsError, match="not made by specray pipeline"):
        run_pipeline(cfg, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_online_capture_failure_ends_the_run_promptly_with_its_error(ray_cluster, tmp_path, monkeypatch):
    """The producer fails with reserved room outstanding: the gang must not wait for it forever."""
    import ray

    from specray.actors import broker as broker_module
    from specray.pipeline.jobs import pipeline as pipeline_job
    from specray.pipeline.jobs.pipeline import run_pipeline

    deliver, start_broker = pipeline_job._Producer._deliver, broker_module.start_sample_broker
    delivered, brokers = [], []

    def offer_fails_on_the_second_batch(self, batch_id, refs):
        delivered.append(batch_id)
        if len(delivered) == 2:
            raise RuntimeError("injected: the broker refused an offer")
        deliver(self, batch_id, refs)

    def recorded_broker(*args, **kwargs):
        brokers.append(start_broker(*args, **kwargs))
        return brokers[-1]

    monkeypatch.setattr(pipeline_job._Producer, "_deliver", offer_fails_on_the_second_batch)
    monkeypatch.setattr(broker_module, "start_sample_broker", recorded_broker)
    cfg = load_config(PipelineConfig, "manifests/online.yaml", [
        *TINY, "data.max_samples=16", "online.max_inflight_samples=8", "serve.enabled=false", "bench.enabled=false",
        f"output.run_dir={tmp_path / 'online'}",
    ])
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(run_pipeline(cfg, progress=False))
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=240)
    hung = runner.is_alive()
    if hung:  # free the cluster for the next tests: without its broker the gang fails and the run ends
        for broker in brokers:
            ray.kill(broker)
        runner.join(timeout=300)
    assert not hung, "the run waited for the failed producer instead of ending"
    assert len(delivered) >= 2, "the injected failure never happened: nothing was tested"
    assert isinstance(outcome[0], RuntimeError), outcome[0]
    assert "online capture failed: RuntimeError: injected: the broker refused an offer" in str(outcome[0])


class _Started(Exception):
    """Raised by a stubbed cluster connect: the run got past its checks."""


@pytest.mark.parametrize("mode, left, storage", [
    ("online", "ledger", "file"), ("offline", "checkpoint", "file"),
    pytest.param("online", "checkpoint", "s3", marks=pytest.mark.s3),
])
def test_a_fresh_run_on_storage_holding_an_earlier_run_is_refused(request, tmp_path, monkeypatch, mode, left, storage):
    """train.storage outside the run dir (a RayJob's S3): without --resume the run would silently continue."""
    import uuid

    from specray.actors import cluster
    from specray.capture.store import open_fs
    from specray.pipeline.jobs.pipeline import run_pipeline
    from specray.pipeline.jobs.rundir import MARKER
    from specray.trainer.ledger import Ledger

    def connect(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(cluster, "connect", connect)
    if storage == "s3":
        storage = request.getfixturevalue("seaweedfs").uri(f"storage-{uuid.uuid4().hex[:8]}")
    else:
        storage = str(tmp_path / "storage")
    vocab = [] if mode == "online" else ["train.drafter.draft_vocab_size=128"]  # the debug target has 259 tokens
    cfg = load_config(PipelineConfig, f"manifests/{'online' if mode == 'online' else 'quickstart'}.yaml",
                      [*TINY, *vocab, f"train.storage={storage}", f"output.run_dir={tmp_path / 'run'}"])
    run = f"{storage}/{cfg.train_job(None).name}"
    if left == "ledger":
        Ledger(f"{run}/ledger").attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run=run)
    else:
        fs, root, _ = open_fs(f"{run}/checkpoint-a000-s00000002")
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(f"{root}/state", b"")  # a checkpoint directory (a prefix on S3)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MARKER).write_text("")
    (tmp_path / "run" / "report.json").write_text("{}")
    with pytest.raises(FileExistsError, match=rf"{left}.*outside the run dir.*--resume.*new name"):
        run_pipeline(cfg, progress=False)
    assert (tmp_path / "run" / "report.json").exists(), "the refused run deleted the earlier run dir"
    with pytest.raises(_Started):
        run_pipeline(cfg, progress=False, resume=True)  # what the error says to do

    inside = load_config(PipelineConfig, "manifests/online.yaml", [*TINY, f"output.run_dir={tmp_path / 'run'}"])
    ledger = Ledger(str(tmp_path / "run" / "ray-train" / inside.train_job(None).name / "ledger"))
    ledger.attempt(0, parent=None, world_size=1, quantum=2, checkpoint=None, run="r")
    with pytest.raises(_Started):  # inside the run dir: a rerun replaces it, as always
        run_pipeline(inside, progress=False)
    assert not (tmp_path / "run" / "ray-train").exists()


class _Killed(Exception):
    pass


def test_the_recipe_resumes_from_a_kill_in_each_stage_and_redoes_no_finished_stage(ray_cluster, tmp_path, monkeypatch):
    """manifests/recipe.yaml, tiny: killed at the end of each stage in turn (its work done, its record
    not yet written), ``--resume`` runs that stage again, reuses every stage before it, and goes on."""
    from specray.pipeline.jobs import pipeline
    from specray.pipeline.jobs.pipeline import run_pipeline

    run_dir = tmp_path / "recipe"
    cfg = load_config(PipelineConfig, "manifests/recipe.yaml", [
        *TINY, "data.max_samples=6", "regenerate.max_tokens=12", "regenerate.batch_size=4", "data.max_length=128",
        "train.drafter.draft_vocab_size=128", "train.drafter.num_layers=1", "train.cpus_per_worker=1",
        "capture.num_cpus_per_actor=1", "train.live_eval.enabled=false", "bench.batch_sizes=[1]",
        f"output.run_dir={run_dir}"])
    order = ["regenerate", "capture", "train", "export", "bench"]
    functions = dict(zip(order, ["_regenerate", "_capture", "_train_offline", "_export", "_bench"]))
    calls = {stage: 0 for stage in order}
    kill_in = None

    def counted(stage, real):
        def run(*args, **kwargs):
            calls[stage] += 1
            output = real(*args, **kwargs)
            if stage == kill_in:
                raise _Killed(stage)
            return output
        return run

    for stage, name in functions.items():
        monkeypatch.setattr(pipeline, name, counted(stage, getattr(pipeline, name)))
    for k, stage in enumerate([*order, None]):
        kill_in, before = stage, dict(calls)
        if stage is None:
            report, _ = run_pipeline(cfg, progress=False, resume=True)
        else:
            with pytest.raises(_Killed):
                run_pipeline(cfg, progress=False, resume=k > 0)
        done = order[:k - 1] if k else []  # finished and recorded before this run
        assert all(calls[s] == before[s] for s in done), (stage, calls)
        if k:
            assert calls[order[k - 1]] == before[order[k - 1]] + 1  # the stage killed last time runs again
    assert report.stages_reused == order[:-1]  # bench was killed last; everything before it was recorded
    assert report.tau >= 1.0 and report.train["steps"] == 4 and report.capture["samples"] > 0
    regenerated = [json.loads(line) for line in (run_dir / "regenerate" / "answers.jsonl").read_text().splitlines()]
    assert len(regenerated) == len({r["id"] for r in regenerated}) == report.regenerate["answers"]["conversations"]
    assert report.regenerate["selection"]["eval_prompts_checked"] == 324
    assert json.loads((run_dir / "report.json").read_text())["stages_reused"] == order[:-1]
