"""The Ray gang and capture actors on GPUs (skips without one; ``make gpu-check`` runs them): workers ask
Ray for a GPU, train on the device Ray Train assigned them (NCCL), and capture actors run the target
on the GPU Ray granted them."""

import pytest
import torch

from specray.actors.capture import CapturePool
from specray.actors.trainer import run_trainer_gang
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore
from specray.trainer.checkpoint import load_checkpoint

from gang_support import TIMEOUT_S, contract_of, offline_manifest, samples, train_spec

pytestmark = [pytest.mark.ray, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_gpu_gang_trains_on_its_granted_device(ray_cluster, debug_target, tmp_path):
    manifest = offline_manifest(tmp_path, debug_target)
    spec = train_spec(tmp_path, "gpu", f"data.manifest={manifest}", "optim.total_steps=2", "trainer.device=auto")
    result = run_trainer_gang(spec, num_workers=1, storage_path=str(tmp_path / "ray"), gpus_per_worker=1,
                              timeout_s=TIMEOUT_S)
    assert result.step == 2
    provenance = load_checkpoint(result.checkpoint).extra["provenance"]
    assert provenance["device"].startswith("cuda") and provenance["bf16"]


def test_a_capture_actor_runs_the_target_on_its_gpu(ray_cluster, debug_target, tmp_path):
    contract = contract_of(debug_target)
    batch = samples("g", 3, debug_target.vocab_size)
    store_uri = (tmp_path / "f").as_uri()
    refs = []
    with CapturePool("debug", contract, store_uri, num_gpus_per_actor=1, target_device="cuda",
                     target_dtype="float32") as pool:
        pool.run([("b0", batch)], lambda _, r: refs.extend(r))
    reference = CaptureServer(debug_target, contract, FeatureStore((tmp_path / "cpu").as_uri())).extract(batch)
    store = FeatureStore(store_uri)
    for ref, want in zip(sorted(refs, key=lambda r: r.sample_id), reference):
        got = store.get(ref)
        torch.testing.assert_close(got["hidden_states"].float(), want["hidden_states"].float(), rtol=2e-2, atol=2e-2)
