"""End-to-end DFlash training on captured debug features: export, fine-tuning, evaluation, draft vocabulary,
bad input. The golden loss, resume and DDP tests of every algorithm are in tests/conformance."""

import json
from pathlib import Path

import pytest
import torch

from specray.capture.contract import ContractMismatchError
from specray.capture.store import FeatureNotFoundError, FeatureStore, read_manifest
from specray.capture.target import load_target
from specray.drafters.format import InvalidDrafterError, load_drafter
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.config import CaptureJobConfig, ConfigError, TrainJobConfig, load_config
from specray.pipeline.jobs.train import build_trainer, run_training
from specray.trainer.export import export_checkpoint


def _capture(root: Path, algorithm="dflash", name="cap", samples=16):
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        f"name={name}", "target.name=debug", f"data.max_samples={samples}", "data.max_length=192",
        f"capture.algorithm={algorithm}", f"output.run_dir={root / name}", "capture.dtype=float32",
    ])
    run_capture(cfg, progress=False)
    return root / name / "manifest.parquet"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return _capture(tmp_path_factory.mktemp("features"))


def _cfg(manifest, run_dir, *overrides):
    return load_config(TrainJobConfig, "manifests/train-dflash-quickstart.yaml", [
        "target.name=debug", f"data.manifest={manifest}", f"output.run_dir={run_dir}", "optim.total_steps=8",
        "optim.warmup_steps=2", "trainer.checkpoint_every=4", "trainer.log_every=1", "trainer.keep_last=null",
        "objective.num_anchors=4", "live_eval.enabled=false", *overrides,
    ])


def test_export_round_trip_and_fingerprint_check(manifest, tmp_path):
    cfg = _cfg(manifest, tmp_path / "run", "optim.total_steps=4")
    trainer = build_trainer(cfg)
    trainer.fit(progress=False)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    target = load_target("debug")
    shared = dict(embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    contract = json.loads(read_manifest(str(manifest)).contract.to_json())
    loaded = load_drafter(out, target_fingerprint=target.target_fingerprint,
                          template_fingerprint=target.template_fingerprint, contract=contract, **shared)
    batch = trainer.loader.next_batch()
    anchors = torch.tensor([[3, 10]] * batch.input_ids.shape[0])
    ids = torch.gather(batch.input_ids, 1, anchors)
    trained = trainer.core.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch.hidden_states, batch.attention_mask, ids, anchors),
                                   trained(batch.hidden_states, batch.attention_mask, ids, anchors), rtol=0, atol=0)
    other = load_target("debug:1")
    with pytest.raises(InvalidDrafterError, match="trained for another target"):
        load_drafter(out, target_fingerprint=other.target_fingerprint,
                     template_fingerprint=other.template_fingerprint, **shared)
    with pytest.raises(InvalidDrafterError, match="capture contract differs in \\['layer_ids'\\]"):
        load_drafter(out, target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint,
                     contract=dict(contract, layer_ids=[1, 2]), **shared)
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-8] + b"\0" * 8)
    with pytest.raises(InvalidDrafterError, match="does not match the sha256"):
        load_drafter(out, target_fingerprint=target.target_fingerprint,
                     template_fingerprint=target.template_fingerprint, **shared)
    with pytest.raises(FileExistsError, match="immutable"):
        export_checkpoint(tmp_path / "run", out)
    trainer.loader.close()


def test_init_from_an_export_starts_a_fine_tune_from_its_weights(manifest, tmp_path):
    first = build_trainer(_cfg(manifest, tmp_path / "first", "optim.total_steps=3"))
    first.fit(progress=False)
    first.loader.close()
    export = export_checkpoint(tmp_path / "first", tmp_path / "export")
    tuned = build_trainer(_cfg(manifest, tmp_path / "tuned", f"drafter.init_from={export}"))
    torch.testing.assert_close(tuned.core.model.state_dict(), first.core.model.state_dict(), rtol=0, atol=0)
    assert tuned.core.scheduler.last_epoch == 0  # a fresh schedule: a fine-tune, not a resume
    tuned.loader.close()
    with pytest.raises(ValueError, match=r"another architecture \(num_layers: export 1 vs config 2\)"):
        build_trainer(_cfg(manifest, tmp_path / "deeper", f"drafter.init_from={export}", "drafter.num_layers=2"))


def test_evaluate_cli_reports_teacher_forced_metrics(manifest, tmp_path, capsys):
    from specray.pipeline.cli import main

    run_training(_cfg(manifest, tmp_path / "run", "optim.total_steps=3"), progress=False)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    assert main(["evaluate", str(out), "--manifest", str(manifest), "--target", "debug",
                 "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["samples"] == len(read_manifest(str(manifest)).refs)
    assert len(result["acc_by_pos"]) == 7 and result["blocks"] > 0 and 1.0 <= result["tau_tf"] <= 8.0
    assert "tau_tf" in capsys.readouterr().out
    assert main(["evaluate", str(out), "--manifest", str(manifest), "--target", "debug:1"]) == 2
    assert "trained for another target" in capsys.readouterr().err


def test_bad_inputs(manifest, tmp_path):
    eagle3 = _capture(tmp_path, algorithm="eagle3", name="eagle3", samples=4)
    fix = (r"drafter\.algorithm=dflash needs features captured with capture\.algorithm=dflash \(got eagle3 in .*"
           r"eagle3/manifest\.parquet\); capture a manifest with capture\.algorithm=dflash, or train "
           r"drafter\.algorithm=eagle3")
    with pytest.raises(ContractMismatchError, match=fix):
        run_training(_cfg(eagle3, tmp_path / "x"), progress=False)
    assert not (tmp_path / "x" / "checkpoints").exists()  # refused before anything trained
    with pytest.raises(ContractMismatchError, match=fix):
        build_trainer(_cfg(eagle3, tmp_path / "x"))
    with pytest.raises(ConfigError, match="drafter.block_size: block_size must be >= 2"):
        _cfg(manifest, tmp_path / "y", "drafter.block_size=1")
    broken = _capture(tmp_path, name="broken", samples=8)
    parsed = read_manifest(str(broken))
    FeatureStore(parsed.store_uri).delete(parsed.refs[0].key)
    trainer = build_trainer(_cfg(broken, tmp_path / "z", "optim.micro_batch_size=4"))
    with pytest.raises(FeatureNotFoundError, match="no feature blob at key"):
        trainer.fit(progress=False)
    trainer.loader.close()


def test_draft_vocabulary_is_counted_once_trained_on_and_exported(manifest, tmp_path):
    from specray.trainer.vocab import DraftVocabulary

    run = tmp_path / "run"
    summary = run_training(_cfg(manifest, run, "optim.total_steps=3", "drafter.draft_vocab_size=40"), progress=False)
    vocab = DraftVocabulary.load(run / "draft_vocab.json")
    assert len(vocab.token_ids) == 40 and 0 < vocab.coverage <= 1 and vocab.source == str(manifest)
    assert summary.final["coverage"] <= 1 and len(summary.final["acc_by_pos"]) == 7
    out = export_checkpoint(run, tmp_path / "export")
    target = load_target("debug")
    shared = dict(embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                  target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint)
    loaded = load_drafter(out, **shared)
    assert loaded.draft_vocab.tolist() == vocab.token_ids and loaded.config.draft_vocab_size == 40
    assert json.loads((out / "export.json").read_text())["draft_vocab"]["coverage"] == vocab.coverage
    # A fine-tune keeps its export's vocabulary (nothing is counted) ...
    tuned = build_trainer(_cfg(manifest, tmp_path / "tuned", f"drafter.init_from={out}", "drafter.draft_vocab_size=40"))
    assert tuned.core.model.draft_vocab.tolist() == vocab.token_ids
    assert not (tmp_path / "tuned" / "draft_vocab.json").exists()
    tuned.loader.close()
    # A full-vocabulary export converts: same weights, the head restricted to a counted vocabulary.
    run_training(_cfg(manifest, tmp_path / "full", "optim.total_steps=2"), progress=False)
    full = export_checkpoint(tmp_path / "full", tmp_path / "full-export")
    converted = build_trainer(_cfg(manifest, tmp_path / "conv", f"drafter.init_from={full}",
                                   "drafter.draft_vocab_size=40"))
    model, source = converted.core.model.eval(), load_drafter(full, **shared)
    assert model.draft_vocab.tolist() == vocab.token_ids  # counted from the same manifest
    batch = converted.loader.next_batch()
    anchors = torch.tensor([[3, 10]] * batch.input_ids.shape[0])
    args = (batch.hidden_states, batch.attention_mask, torch.gather(batch.input_ids, 1, anchors), anchors)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), source(*args)[..., model.draft_vocab])
    converted.loader.close()
    # ... and an export whose vocabulary was tampered with (checksum updated) is rejected.
    from safetensors.torch import load_file, save_file

    from specray.drafters.format import _sha256

    state = load_file(out / "model.safetensors")
    state["draft_vocab"][1] = state["draft_vocab"][0]
    save_file(state, out / "model.safetensors", metadata={"format": "pt", "algorithm": "dflash"})
    export = json.loads((out / "export.json").read_text())
    (out / "export.json").write_text(json.dumps(dict(export, weights_sha256=_sha256(out / "model.safetensors"))))
    with pytest.raises(InvalidDrafterError, match="draft vocabulary ids must be distinct"):
        load_drafter(out, **shared)
