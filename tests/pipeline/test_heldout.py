"""The default held-out set (pipeline/jobs/heldout.py) and `specray evaluate EXPORT` reporting on it."""

import json

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.store import read_manifest
from specray.drafters import DRAFTERS
from specray.drafters.format import save_drafter
from specray.pipeline.jobs import heldout
from specray.pipeline.cli import main


@pytest.fixture
def small_heldout(monkeypatch, tmp_path):
    """Three prompts × 8 tokens, cached under tmp_path."""
    monkeypatch.setattr(heldout, "HELDOUT_PROMPTS", 3)
    monkeypatch.setattr(heldout, "HELDOUT_TOKENS", 8)
    monkeypatch.setattr(heldout, "heldout_root", lambda fingerprint: tmp_path / "cache" / fingerprint[-8:])
    return tmp_path / "cache"


@pytest.fixture
def debug_export(debug_target, tmp_path):
    spec = DRAFTERS["dflash"]
    torch.manual_seed(0)
    model = spec.model(spec.debug_config(debug_target), embed_tokens=debug_target.model.get_input_embeddings(),
                       lm_head=debug_target.model.get_output_embeddings())
    contract = build_contract("dflash", target_fingerprint=debug_target.target_fingerprint,
                              template_fingerprint=debug_target.template_fingerprint,
                              num_target_layers=debug_target.num_layers, hidden_size=debug_target.hidden_size,
                              layer_ids=model.config.target_layer_ids, dtype="bfloat16")
    return str(save_drafter(tmp_path / "export", model, contract=json.loads(contract.to_json()),
                            provenance={"run": "test"}))


def test_built_once_from_the_targets_own_answers_under_the_exports_contract(debug_target, debug_export, small_heldout):
    uri = heldout.heldout_manifest("debug", debug_export, progress=False)
    manifest = read_manifest(uri)
    assert len(manifest.refs) == 3
    contract = json.loads((small_heldout.parent / "export" / "config.json").read_text())["capture_contract"]
    assert json.loads(manifest.contract.to_json()) == contract
    answers = [json.loads(line) for line in next(small_heldout.rglob("answers-3x8.jsonl")).read_text().splitlines()]
    assert [m["role"] for m in answers[0]["messages"]] == ["user", "assistant"]
    built = (small_heldout.rglob("manifest.parquet").__next__()).stat().st_mtime_ns
    assert heldout.heldout_manifest("debug", debug_export, progress=False) == uri  # cached: not rebuilt
    assert next(small_heldout.rglob("manifest.parquet")).stat().st_mtime_ns == built


def test_an_interrupted_build_is_rebuilt(debug_target, debug_export, small_heldout):
    uri = heldout.heldout_manifest("debug", debug_export, progress=False)
    manifest_path = next(small_heldout.rglob("manifest.parquet"))
    manifest_path.unlink()  # a build killed before its manifest: features without a manifest
    assert heldout.heldout_manifest("debug", debug_export, progress=False) == uri
    assert len(read_manifest(uri).refs) == 3


def test_evaluate_without_a_manifest_reports_on_the_heldout_set(debug_target, debug_export, small_heldout, tmp_path,
                                                                capsys):
    out = tmp_path / "eval.json"
    assert main(["evaluate", debug_export, "--target", "debug", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["samples"] == 3 and result["manifest"].startswith(str(small_heldout))
    assert "held-out" in capsys.readouterr().out


def test_another_targets_export_is_refused(debug_export, small_heldout, monkeypatch):
    monkeypatch.setattr(heldout, "read_drafter_config",
                        lambda _: {"capture_contract": {"target_fingerprint": "sha256:other"}})
    with pytest.raises(ValueError, match="another target"):
        heldout.heldout_manifest("debug", debug_export, progress=False)
