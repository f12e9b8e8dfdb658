"""``backend: vllm`` without vLLM: the config's refusals, what a replica asks Ray for, and the
rollout's choice of version, its retreat from a version whose replicas fail, and its backoff
(actors/serve.py ``application``, ``wanted_version``, ``VersionRollout``). The end-to-end run
with vLLM is tests/serving/test_vllm_backend.py."""


import shutil

import pytest
from serve_support import random_dflash_export

from specray.actors.serve import VersionRollout, application, rollout_room, wanted_version
from specray.pipeline.config import ConfigError, PipelineConfig, ServeJobConfig, load_config
from specray.serving.registry import OPERATOR, DrafterRegistry

SCOPE = "target-0123456789abcdef"


def _vllm(*overrides: str) -> ServeJobConfig:
    return load_config(ServeJobConfig, "manifests/serve.yaml", ["backend=vllm", "engine.speculation=static",
                                                                *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["vllm.max_num_seqz=4"], "vllm.max_num_seqz: unknown key"),
    (["vllm.gpu_memory_utilization=1.5"], "vllm.gpu_memory_utilization"),
    (["engine.tree=true"], "engine.tree does not apply to backend=vllm"),
    (["engine.cost_table=cost.json"], "engine.cost_table does not apply to backend=vllm"),
    (["engine.max_speculative_batch=2"], "engine.max_speculative_batch does not apply"),
    (["vllm.tensor_parallel_size=2"], "set num_gpus_per_replica=2"),
    (["vllm.tensor_parallel_size=2", "num_gpus_per_replica=1"], "set num_gpus_per_replica=2"),
])
def test_what_the_vllm_backend_cannot_do_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _vllm(*overrides)


def test_vllm_arguments_on_the_specray_backend_are_refused():
    with pytest.raises(ConfigError, match=r"vllm.enforce_eager is a vLLM engine argument, but backend=specray"):
        load_config(ServeJobConfig, "manifests/serve.yaml", ["vllm.enforce_eager=true"])
    with pytest.raises(ConfigError, match=r"serve.engine.tree does not apply to serve.backend=vllm"):
        load_config(PipelineConfig, "manifests/quickstart.yaml", ["serve.backend=vllm", "serve.engine.tree=true"])


def test_the_pipelines_serve_section_reaches_the_replicas():
    """The quickstart's automatic speculation is accepted (vLLM's rounds are its own, fixed) and
    the section's backend, vLLM arguments and GPUs reach the serve job."""
    cfg = load_config(PipelineConfig, "manifests/quickstart.yaml", [
        "serve.backend=vllm", "serve.vllm.tensor_parallel_size=2", "serve.num_gpus_per_replica=2",
        "serve.vllm.max_model_len=4096"])
    job = cfg.serve_job()
    assert (job.backend, job.num_gpus_per_replica, job.vllm.tensor_parallel_size) == ("vllm", 2, 2)
    assert job.vllm.model_dump(exclude_defaults=True) == {"tensor_parallel_size": 2, "max_model_len": 4096}


def _deployment(app):
    """The deployment an application binds (its options and its replica spec)."""
    return app._bound_deployment


def test_a_vllm_replica_asks_ray_for_its_gpus_and_rolls_with_surge():
    cfg = _vllm("vllm.tensor_parallel_size=2", "num_gpus_per_replica=2", "replica.num_cpus=4", "vllm.enforce_eager=true")
    d = _deployment(application(cfg, None, drafter_version=3))
    assert d.name == "VllmReplica"
    assert d.ray_actor_options["num_gpus"] == 2 and d.ray_actor_options["num_cpus"] == 4
    config = d._deployment_config
    assert config.max_surge_percent == 100  # new replicas start before old ones stop
    spec = d.init_args[0]
    assert (spec.backend, spec.drafter_version, spec.num_gpus) == ("vllm", 3, 2)
    assert spec.vllm_args == {"tensor_parallel_size": 2, "enforce_eager": True}
    ours = _deployment(application(load_config(ServeJobConfig, "manifests/serve.yaml", ["num_gpus_per_replica=1",
                                                                                          "target.device=cuda"]), None))
    assert ours.name == "SpecrayReplica" and ours.ray_actor_options["num_gpus"] == 1


def test_a_cluster_without_room_for_a_rollout_is_named():
    cfg = _vllm("registry.uri=/tmp/registry", "autoscaling.max_replicas=2", "replica.num_cpus=1")
    message = rollout_room(cfg, {"CPU": 2.0})
    assert "4 replicas (2 x autoscaling.max_replicas=2) x replica.num_cpus=1 = 4 CPUs" in message
    assert "the Ray cluster has 2" in message and "lower replica.num_cpus" in message
    assert rollout_room(cfg, {"CPU": 4.0}) is None
    gpus = _vllm("registry.uri=/tmp/registry", "num_gpus_per_replica=1", "replica.num_cpus=1")
    assert "num_gpus_per_replica=1 = 4 GPUs, and the Ray cluster has 1" in rollout_room(gpus, {"CPU": 8, "GPU": 1})
    assert rollout_room(_vllm("registry.uri=null"), {"CPU": 0.5}) is None  # a fixed drafter never rolls
    specray = load_config(ServeJobConfig, "manifests/serve.yaml", ["registry.uri=/tmp/registry"])
    assert rollout_room(specray, {"CPU": 1.0}) is None  # our replicas hot-load in place


@pytest.fixture
def export(debug_target, tmp_path):
    return random_dflash_export(debug_target, tmp_path / "export", seed=0)


@pytest.fixture
def registry(export, tmp_path) -> DrafterRegistry:
    """A registry with versions 1-3 (of one export: the rollout reads only their numbers)."""
    registry = DrafterRegistry(str(tmp_path / "registry"))
    for _ in range(3):
        registry.publish(export)
    return registry


def test_the_wanted_version_follows_the_pin_and_the_newest_good_one(registry):
    assert wanted_version(registry, SCOPE, None) == (3, None)
    registry.reject(3, SCOPE, "vLLM refused it")
    assert wanted_version(registry, SCOPE, None) == (2, None)
    assert wanted_version(registry, "target-another", None) == (3, None)  # a rejection holds in its scope
    assert wanted_version(registry, SCOPE, 2, skip={2}) == (2, None)  # never below what is served
    registry.reject(2, OPERATOR, "rolled back")
    assert wanted_version(registry, SCOPE, 2) == (1, None)  # unless it was rejected
    registry.pin(1)
    assert wanted_version(registry, "target-another", 3) == (1, None)
    registry.reject(1, SCOPE, "the export cannot be served")  # after the pin: the replicas stay where they are
    version, problem = wanted_version(registry, SCOPE, 2)
    assert version == 2 and "the pinned version 1 is rejected: the export cannot be served" in problem


def test_the_rollout_leaves_a_version_whose_replicas_fail(registry, export):
    """A version whose replicas cannot start: retried after a backoff while they cannot say why, never
    again once they rejected it. Either way the application goes back to the version it served."""
    deployed, failing, replicas_reject = [], {3}, []

    def deploy(version):
        deployed.append(version)
        if version in failing:
            if replicas_reject:  # what VllmReplica records before it raises
                registry.reject(version, SCOPE, "the export cannot be served: sha256 mismatch")
            raise RuntimeError(f"Deploying application failed: version {version}'s replicas did not start")

    rollout = VersionRollout(registry, SCOPE, 2, deploy, interval_s=1, retry_s=60)
    assert rollout.poll() is None and deployed == [3, 2]  # tried, failed, back on 2
    assert "version 3 did not start" in rollout.last_error
    assert rollout.poll() is None and deployed == [3, 2]  # waits out its backoff
    rollout._backoff[3] = (1, 0.0)  # the backoff is over
    replicas_reject.append(True)
    assert rollout.poll() is None and deployed == [3, 2, 3, 2]
    assert 3 not in rollout._backoff  # rejected for good: never retried
    assert rollout.poll() is None and deployed == [3, 2, 3, 2]
    registry.publish(export)
    failing.clear()
    assert rollout.poll() == 4 and rollout.version == 4 and deployed[-1] == 4


def test_a_version_the_check_refuses_is_rejected_without_a_rollout(registry, export, debug_target, tmp_path):
    """The driver checks each version before it redeploys (``check_export``: fingerprints, bounds, sha256,
    nothing allocated): a corrupt one is rejected at once and no replica restarts for it."""
    from specray.drafters.format import check_export

    corrupt = tmp_path / "corrupt"
    shutil.copytree(export, corrupt)
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.truncate((corrupt / "model.safetensors").stat().st_size // 2)
    assert registry.publish(corrupt) == 4
    checked, deployed = [], []

    def check(version):
        checked.append(version)
        try:
            check_export(registry.pull(version, tmp_path / "cache"), vocab_size=debug_target.vocab_size,
                         hidden_size=debug_target.hidden_size, target_fingerprint=debug_target.target_fingerprint,
                         template_fingerprint=debug_target.template_fingerprint)
        except ValueError as e:
            return f"the export cannot be served: {e}"

    rollout = VersionRollout(registry, SCOPE, 3, deployed.append, interval_s=1, check=check)
    assert rollout.poll() is None and checked == [4] and deployed == []
    assert "sha256" in registry.rejected_for(SCOPE)[4].reason and "version 4 rejected" in rollout.last_error
    assert registry.publish(export) == 5
    assert rollout.poll() == 5 and checked == [4, 5] and deployed == [5]


def test_a_check_that_cannot_read_the_version_retries_it_later(registry):
    def check(version):
        raise OSError("S3 503 SlowDown")

    deployed = []
    rollout = VersionRollout(registry, SCOPE, 2, deployed.append, interval_s=1, retry_s=60, check=check)
    assert rollout.poll() is None and deployed == [] and "could not be checked: S3 503" in rollout.last_error
    assert 3 in rollout._backoff and 3 not in registry.rejected_for(SCOPE)
