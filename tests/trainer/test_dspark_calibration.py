"""Sequential Temperature Scaling (trainer/strategies/dspark.py) and ``specray calibrate``: the fit
lowers the calibration error of over-confident scores; the CLI writes calibration.json into a DSpark
export on debug features, loading the export reads it, and a file of another block size or another
export is refused with the file and the fix named."""

import json
from pathlib import Path

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.store import read_manifest
from specray.drafters import dspark
from specray.drafters.format import InvalidDrafterError, load_drafter, save_drafter
from specray.pipeline.jobs.capture import run_capture
from specray.pipeline.cli import main
from specray.pipeline.config import CaptureJobConfig, load_config
from specray.serving.registry import DrafterRegistry
from specray.trainer.strategies.dspark import fit_sts, survival_ece


def _over_confident(n=4000, B=4, scale=3.0, seed=0):
    """True conditional survivals c* = σ(z_true); the head reports scale · z_true (over-confident)."""
    g = torch.Generator().manual_seed(seed)
    z_true = torch.randn(n, B, generator=g) * 1.5 + 1.0
    supervised = torch.ones(n, B, dtype=torch.bool)
    supervised[: n // 4, 2:] = False  # blocks cut short by a gap: a prefix of rows
    return z_true * scale, torch.sigmoid(z_true), supervised


def test_sts_lowers_the_calibration_error_of_over_confident_scores():
    z, c_star, supervised = _over_confident()
    temperatures = fit_sts(z, c_star, supervised)
    before, after = survival_ece(z, c_star, supervised), survival_ece(z, c_star, supervised, temperatures)
    assert after[1] < 0.3 * before[1], (before, after)
    assert all(a < b for a, b in zip(after[0], before[0]))
    assert temperatures[0] == pytest.approx(3.0, rel=0.1)  # position 1 alone: the scale it was inflated by
    assert all(t > 1.5 for t in temperatures)  # every position softened
    with pytest.raises(ValueError, match="position 2"):
        fit_sts(z[:, :2], c_star[:, :2], torch.tensor([[True, False]]).expand(len(z), 2))


def _debug_manifest(root: Path) -> Path:
    cfg = load_config(CaptureJobConfig, "manifests/capture-quickstart.yaml", [
        "name=heldout", "target.name=debug", "data.max_samples=6", "data.max_length=128",
        "capture.algorithm=dspark", f"output.run_dir={root / 'heldout'}", "capture.dtype=float32",
    ])
    run_capture(cfg, progress=False)
    return root / "heldout" / "manifest.parquet"


def export(model, target, out) -> str:
    contract = build_contract("dspark", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=model.config.target_layer_ids, dtype="float32")
    return str(save_drafter(out, model, contract=json.loads(contract.to_json()), provenance={"run": "test"}))


def _load(target, path):
    return load_drafter(path, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                        target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint)


def test_calibrate_writes_the_file_serving_reads_and_refuses_a_mismatch(debug_target, tmp_path, capsys):
    manifest = _debug_manifest(tmp_path)
    torch.manual_seed(0)
    cfg = dspark.debug_config(debug_target, tuple(read_manifest(str(manifest)).contract.layer_ids))
    drafter = dspark.DSparkDrafter(cfg, embed_tokens=debug_target.model.model.embed_tokens,
                                   lm_head=debug_target.model.lm_head)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(4.0)  # σ ≈ 0.98 everywhere: far over-confident for random drafts
    out = export(drafter, debug_target, tmp_path / "export")
    assert main(["calibrate", out, "--manifest", str(manifest), "--target", "debug",
                 "--json", str(tmp_path / "cal.json")]) == 0
    printed = capsys.readouterr().out
    assert "ECE before" in printed and "ECE after" in printed
    result = json.loads((tmp_path / "cal.json").read_text())
    B = drafter.config.block_size
    assert len(result["temperatures"]) == B and result["blocks"] > 0
    assert result["ece_after"] < 0.5 * result["ece_before"], result
    path = Path(out) / dspark.CALIBRATION_FILE
    body = json.loads(path.read_text())
    assert body["block_size"] == B and body["temperatures"] == result["temperatures"]
    loaded = _load(debug_target, out)
    assert loaded.confidence_temperature.tolist() == pytest.approx(result["temperatures"])
    assert "confidence_temperature" not in loaded.state_dict()  # the weights and their sha256 are untouched

    path.write_text(json.dumps(dict(body, block_size=B + 1, temperatures=[1.0] * (B + 1))))
    refused = rf"calibration.json was fitted for block_size {B + 1}.*specray calibrate"
    with pytest.raises(InvalidDrafterError, match=refused):
        _load(debug_target, out)
    path.write_text(json.dumps(dict(body, weights_sha256="sha256:other")))
    with pytest.raises(InvalidDrafterError, match="another export .weights_sha256"):
        _load(debug_target, out)
    assert main(["calibrate", out, "--manifest", str(manifest), "--target", "debug"]) == 0  # refits over it
    assert _load(debug_target, out).confidence_temperature.tolist() == pytest.approx(result["temperatures"])
    registry = DrafterRegistry((tmp_path / "registry").as_uri())  # a calibrated export publishes and pulls whole
    pulled = registry.pull(registry.publish(out), tmp_path / "pulled")
    assert _load(debug_target, pulled).confidence_temperature.tolist() == pytest.approx(result["temperatures"])
