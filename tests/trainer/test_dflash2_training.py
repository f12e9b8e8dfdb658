"""DFlash 2 training from a DFlash export (``drafter.init_from``, trainer/assembly.py): the warm start
takes the DFlash backbone, keeps the convolutions and the selector at their identity / no-op
initialisation, so its first step's unary logits are the DFlash export's; another algorithm's export is
refused. The golden loss, resume and DDP tests are the conformance suite's."""

import json

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.target import load_target
from specray.drafters import dflash
from specray.drafters.format import save_drafter
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, TrainJobConfig, load_config
from specray.pipeline.jobs.train import build_trainer


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=cap", "target.name=debug", "data.max_samples=8", "data.max_length=192", "capture.algorithm=dflash2",
        f"output.run_dir={root / 'cap'}", "capture.dtype=float32",
    ])
    run_capture(cfg, progress=False)
    return root / "cap" / "manifest.parquet"


def _cfg(manifest, run_dir, *overrides):
    return load_config(TrainJobConfig, "manifests/train-dflash2-quickstart.yaml", [
        "target.name=debug", f"data.manifest={manifest}", f"output.run_dir={run_dir}", "optim.total_steps=2",
        "optim.warmup_steps=1", "objective.num_anchors=4", "drafter.selector_rank=16", "live_eval.enabled=false",
        *overrides,
    ])


def _dflash_export(target, out, algorithm="dflash"):
    """A DFlash export with the quickstart section's architecture on ``target``."""
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, dtype="float32")
    section = dflash.DFlashSection(num_layers=1, block_size=8)
    torch.manual_seed(3)
    model = dflash.DFlashDrafter(section.drafter_config(target, contract.layer_ids),
                                 embed_tokens=target.model.get_input_embeddings(),
                                 lm_head=target.model.get_output_embeddings())
    return model, save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": "dflash"})


def test_a_dflash_export_warm_starts_dflash2(manifest, tmp_path):
    target = load_target("debug")
    source, export = _dflash_export(target, tmp_path / "dflash")
    trainer = build_trainer(_cfg(manifest, tmp_path / "warm", f"drafter.init_from={export}"))
    model = trainer.core.model.eval()
    state = model.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(state[name], tensor), name
    g = torch.Generator().manual_seed(0)
    S, anchors = 20, torch.tensor([[4, 11]])
    hidden = torch.randn(1, S, len(source.config.target_layer_ids) * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (1, 2), generator=g)
    with torch.no_grad():
        assert torch.equal(model(hidden, torch.ones(1, S, dtype=torch.bool), ids, anchors).logits,
                           source(hidden, torch.ones(1, S, dtype=torch.bool), ids, anchors))
    trainer.loader.close()


def test_warm_start_refuses_an_unrelated_export(manifest, tmp_path):
    target = load_target("debug")
    _, export = _dflash_export(target, tmp_path / "dflash")
    with pytest.raises(ValueError, match=r"another architecture \(block_size: export 8 vs config 4\)"):
        build_trainer(_cfg(manifest, tmp_path / "small", f"drafter.init_from={export}", "drafter.block_size=4"))
