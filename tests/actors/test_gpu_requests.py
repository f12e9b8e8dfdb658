"""GPUs asked of a Ray cluster that holds none: the gang and the capture pool refuse at once, naming
the field, instead of queueing forever."""

import pytest
import ray

from specray.actors.capture import CapturePool
from specray.actors.trainer import run_trainer_gang

from gang_support import contract_of, offline_manifest, train_spec

pytestmark = pytest.mark.ray


@pytest.fixture
def no_gpus(ray_cluster):
    if ray.cluster_resources().get("GPU", 0):
        pytest.skip("this Ray cluster holds GPUs")


def test_a_gang_asking_for_gpus_on_a_cluster_without_any_is_refused(no_gpus, debug_target, tmp_path):
    manifest = offline_manifest(tmp_path, debug_target, n=2)
    spec = train_spec(tmp_path, "nogpu", f"data.manifest={manifest}", "trainer.device=auto")
    with pytest.raises(ValueError, match=r"train\.gpus_per_worker: the trainer gang workers ask Ray for GPUs, 2 in "
                                         r"all, but this Ray cluster holds 0.*set train\.gpus_per_worker=0"):
        run_trainer_gang(spec, num_workers=2, storage_path=str(tmp_path / "ray"), gpus_per_worker=1, timeout_s=60)
    assert not (tmp_path / "ray").exists()  # refused before Ray Train started


def test_capture_actors_asking_for_gpus_on_a_cluster_without_any_are_refused(no_gpus, debug_target, tmp_path):
    with pytest.raises(ValueError, match=r"capture\.num_gpus_per_actor: the capture actors ask Ray for GPUs, 1 in "
                                         r"all, but this Ray cluster holds 0"):
        CapturePool("debug", contract_of(debug_target), (tmp_path / "f").as_uri(), num_gpus_per_actor=1,
                    target_device="cuda")
