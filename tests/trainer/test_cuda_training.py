"""Training on a CUDA GPU (skips without one; ``make gpu-check`` runs them): the drafter, its optimizer
state and its batches on the device, the same fp32 step as on the CPU, bf16 autocast under
``precision=auto``, the target's heads read onto the device, ``specray train`` DDP over NCCL."""

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.data import RenderedSample
from specray.capture.server import CaptureServer
from specray.capture.store import FeatureStore, write_manifest
from specray.capture.target import load_target
from specray.pipeline.config import TrainJobConfig, load_config
from specray.pipeline.jobs.train import run_training
from specray.trainer.assembly import build_trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ALGORITHMS = ["dflash", "eagle3", "dspark", "dflash2"]


@pytest.fixture(autouse=True)
def exact_matmuls():
    """fp32 matmuls without TF32, so a CUDA step is comparable with the CPU's."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _manifest(root, target, algorithm: str, n: int = 8) -> str:
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, dtype="float32")
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        length = 40 + 5 * i
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 4:] = True
        samples.append(RenderedSample(f"s{i:02d}", torch.randint(3, target.vocab_size, (length,), generator=generator),
                                      mask, False))
    store_uri = (root / "features").as_uri()
    refs = CaptureServer(target, contract, FeatureStore(store_uri)).capture(samples)
    return write_manifest(str(root / "manifest.parquet"), refs, contract=contract, store_uri=store_uri)


def _config(root, algorithm: str, manifest: str, *overrides: str) -> TrainJobConfig:
    return load_config(TrainJobConfig, f"manifests/train-{algorithm}-quickstart.yaml", [
        "target.name=debug", f"data.manifest={manifest}", f"output.run_dir={root}", "optim.total_steps=3",
        "optim.warmup_steps=1", "optim.micro_batch_size=2", "trainer.log_every=1", "trainer.checkpoint_every=3",
        "live_eval.enabled=false", "drafter.draft_vocab_size=null", *overrides,
    ])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_an_fp32_step_on_cuda_equals_the_cpu_step(tmp_path, debug_target, algorithm):
    manifest = _manifest(tmp_path, debug_target, algorithm)
    losses = {}
    for device in ("cpu", "cuda"):
        cfg = _config(tmp_path / device, algorithm, manifest, f"trainer.device={device}", "trainer.precision=fp32")
        trainer = build_trainer(cfg.train_spec())
        model = trainer.core.model
        assert {p.device.type for p in model.parameters()} == {device}
        trainer.fit(progress=False)
        state = trainer.core.optimizer.state
        assert state and all(s["exp_avg"].device.type == device for s in state.values())
        losses[device] = [r["loss"] for r in trainer.run.records]
        trainer.loader.close()
    torch.testing.assert_close(losses["cuda"], losses["cpu"], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_auto_precision_trains_in_bf16_autocast_on_cuda(tmp_path, debug_target, algorithm):
    manifest = _manifest(tmp_path, debug_target, algorithm)
    trainer = build_trainer(_config(tmp_path / "run", algorithm, manifest).train_spec())
    assert trainer.core.settings.bf16 and trainer.core.device.type == "cuda"
    assert trainer.run.extra["provenance"]["device"].startswith("cuda")
    # the heads are read in the target's dtype (auto = bfloat16 on CUDA) onto the device
    assert trainer.core.model.lm_head.weight.dtype == torch.bfloat16 and trainer.core.model.lm_head.weight.is_cuda
    records = trainer.fit(progress=False)
    trainer.loader.close()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert all(p.dtype == torch.float32 for p in trainer.core.model.parameters())  # fp32 master weights


def test_the_loader_pins_batches_for_a_cuda_rank(tmp_path, debug_target):
    manifest = _manifest(tmp_path, debug_target, "dflash")
    trainer = build_trainer(_config(tmp_path / "run", "dflash", manifest).train_spec())
    batch = trainer.loader.next_batch()
    trainer.loader.close()
    assert batch.hidden_states.is_pinned() and batch.input_ids.is_pinned()
    moved = batch.to(trainer.core.device, non_blocking=True)
    assert moved.hidden_states.is_cuda and torch.equal(moved.input_ids.cpu(), batch.input_ids)


def test_heads_on_cuda_equal_the_full_targets():
    heads = load_target("debug", weights="heads", device="cuda", dtype="auto")
    full = load_target("debug")
    assert heads.model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(heads.model.model.embed_tokens.weight.float().cpu(),
                               full.model.model.embed_tokens.weight, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_specray_train_ddp_over_nccl_equals_accumulation(tmp_path, debug_target):
    manifest = _manifest(tmp_path, debug_target, "dflash")
    one = run_training(_config(tmp_path / "one", "dflash", manifest, "optim.micro_batch_size=1",
                               "optim.accumulation_steps=2", "trainer.precision=fp32"), progress=False)
    two = run_training(_config(tmp_path / "two", "dflash", manifest, "optim.micro_batch_size=1",
                               "trainer.world_size=2", "trainer.precision=fp32"), progress=False)
    assert abs(one.final["loss"] - two.final["loss"]) < 1e-4
