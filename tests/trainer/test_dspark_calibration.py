"""Sequential Temperature Scaling (trainer/strategies/dspark.py) and ``specray calibrate``: the fit
lowers the calibration error of over-confident scores; the CLI writes calibration.json into a DSpark
export on debug features, loading the export reads it, and a file of another block size or another
export is refused with the file and the fix named."""

import json
import math
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
    B = drafter.config.block_size
    greedy, sampling = printed.split("greedy (argmax of q = argmax of the target)")[1].split(
        "sampling (c* = 1 - TV(p, q))")
    for section in (greedy, sampling):  # each mode prints its ECE per position, before and after
        for label in ("temperature by pos", "ECE before", "ECE after"):
            line = next(row for row in section.splitlines() if row.strip().startswith(label))
            assert len(line.split("by pos")[1].split()) == B, line
    result = json.loads((tmp_path / "cal.json").read_text())
    assert result["blocks"] > 0 and set(result["modes"]) == set(dspark.CALIBRATION_MODES)
    tables = [result["modes"][mode]["temperatures"] for mode in dspark.CALIBRATION_MODES]
    for mode in dspark.CALIBRATION_MODES:
        m = result["modes"][mode]
        assert len(m["temperatures"]) == len(m["ece_by_pos_before"]) == len(m["ece_by_pos_after"]) == B
        assert all(math.isfinite(e) for e in m["ece_by_pos_before"] + m["ece_by_pos_after"])
        assert m["ece_after"] < 0.5 * m["ece_before"], (mode, m)
    path = Path(out) / dspark.CALIBRATION_FILE
    body = json.loads(path.read_text())
    assert body["block_size"] == B and [body["modes"][m]["temperatures"] for m in dspark.CALIBRATION_MODES] == tables
    for mode in dspark.CALIBRATION_MODES:  # the file keeps each mode's ECE per position too
        assert body["modes"][mode]["ece_by_pos_after"] == result["modes"][mode]["ece_by_pos_after"]
    loaded = _load(debug_target, out)
    assert loaded.confidence_temperature.flatten().tolist() == pytest.approx(sum(tables, []))  # rows: greedy, sampling
    assert "confidence_temperature" not in loaded.state_dict()  # the weights and their sha256 are untouched

    wrong_size = {m: dict(body["modes"][m], temperatures=[1.0] * (B + 1)) for m in body["modes"]}
    path.write_text(json.dumps(dict(body, block_size=B + 1, modes=wrong_size)))
    refused = rf"calibration.json was fitted for block_size {B + 1}.*specray calibrate"
    with pytest.raises(InvalidDrafterError, match=refused):
        _load(debug_target, out)
    path.write_text(json.dumps(dict(body, weights_sha256="sha256:other")))
    with pytest.raises(InvalidDrafterError, match="another export .weights_sha256"):
        _load(debug_target, out)
    one_table = {k: v for k, v in body.items() if k != "modes"}  # one table for both modes: refused
    path.write_text(json.dumps(dict(one_table, temperatures=tables[1])))
    with pytest.raises(InvalidDrafterError, match=r"no temperature table per serving mode \['greedy', 'sampling'\]"):
        _load(debug_target, out)
    assert main(["calibrate", out, "--manifest", str(manifest), "--target", "debug"]) == 0  # refits over it
    assert _load(debug_target, out).confidence_temperature.flatten().tolist() == pytest.approx(sum(tables, []))
    registry = DrafterRegistry((tmp_path / "registry").as_uri())  # a calibrated export publishes and pulls whole
    pulled = registry.pull(registry.publish(out), tmp_path / "pulled")
    assert _load(debug_target, pulled).confidence_temperature.flatten().tolist() == pytest.approx(sum(tables, []))


def _peaked_manifest(target, root: Path, token: int, *, samples=6, T=40) -> str:
    """Features whose target predicts ``token`` at every position with probability ~1 (its last hidden
    state is the LM head's row of ``token``, scaled), written as a DSpark manifest."""
    from specray.capture.store import FeatureStore, write_manifest

    layer_ids = (1, 4, 5)
    contract = build_contract("dspark", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=layer_ids, dtype="float32")
    store = FeatureStore((root / "features").as_uri())
    head = target.model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(7)
    refs = []
    for i in range(samples):
        tensors = {"input_ids": torch.randint(3, target.vocab_size, (T,), generator=g, dtype=torch.int32),
                   "loss_mask": torch.arange(T) >= 4,
                   "hidden_states": torch.randn(T, len(layer_ids) * target.hidden_size, generator=g),
                   "last_hidden_states": (50.0 * head[token]).expand(T, -1).contiguous()}
        refs.append(store.put(f"s{i}.safetensors", tensors, sample_id=f"s{i}", num_tokens=T,
                              contract=contract.contract_id))
    return write_manifest(str(root / "manifest.parquet"), refs, contract=contract, store_uri=store.uri)


def test_greedy_and_sampling_tables_differ_when_argmax_and_overlap_disagree(debug_target, tmp_path):
    """A drafter whose q puts 0.4 on the target's argmax (and the rest elsewhere): every greedy draft
    survives (argmax match 1), a sampled one only with the overlap c* ~ 0.4 per position. One table cannot
    calibrate both: the fitted tables differ, and each is calibrated for its own event."""
    from specray.pipeline.jobs.calibrate import calibrate_export

    token = 100
    manifest = _peaked_manifest(debug_target, tmp_path, token)
    cfg = dspark.debug_config(debug_target, (1, 4, 5))
    torch.manual_seed(0)
    drafter = dspark.DSparkDrafter(cfg, embed_tokens=debug_target.model.model.embed_tokens,
                                   lm_head=debug_target.model.lm_head)
    V = debug_target.vocab_size
    with torch.no_grad():  # q ~ 0.4 on `token` whatever the context: a constant bias from the sequence head
        for p in drafter.parameters():
            p.zero_()
        for layer in drafter.layers:
            layer.input_norm.weight.fill_(1.0)
            layer.post_norm.weight.fill_(1.0)
        drafter.markov_head.markov_w1.weight.fill_(1.0)
        bias = torch.zeros(V)
        bias[token] = math.log(0.4 * (V - 1) / 0.6)
        drafter.markov_head.markov_w2.weight.copy_(bias[:, None] / cfg.markov_rank)
        drafter.confidence_head.proj.bias.fill_(0.5)  # the same raw confidence everywhere: sigma(0.5) = 0.62
    out = export(drafter, debug_target, tmp_path / "export")
    result = calibrate_export(out, manifest, target_name="debug")
    greedy, sampling = result["modes"]["greedy"], result["modes"]["sampling"]
    assert greedy["observed_by_pos"] == pytest.approx([1.0] * cfg.block_size)
    assert sampling["observed_by_pos"] == pytest.approx([0.4 ** (k + 1) for k in range(cfg.block_size)], rel=0.05)
    # greedy survival is certain: its temperatures push sigma(0.5 / T) toward 1 (T at the searched minimum);
    # sampling's make sigma(0.5 / T) ~ 0.4 < 1/2 impossible for T > 0 (z > 0), so they go toward 1/2 (large T)
    assert max(greedy["temperatures"]) < 0.1 < 5.0 < min(sampling["temperatures"])
    assert greedy["ece_after"] < 0.05 and greedy["ece_after"] < greedy["ece_before"]
    assert sampling["ece_after"] < sampling["ece_before"]
    for mode in (greedy, sampling):  # the ECE per position of each mode, each lowered by its own table
        assert len(mode["ece_by_pos_before"]) == len(mode["ece_by_pos_after"]) == cfg.block_size
        assert all(a <= b + 1e-9 for a, b in zip(mode["ece_by_pos_after"], mode["ece_by_pos_before"]))
    assert all(e < 0.05 for e in greedy["ece_by_pos_after"])
    # the sampling table read for greedy requests would be far off: the reason for one table per mode
    assert survival_ece(*_rows_of(out, manifest, debug_target, "greedy"), sampling["temperatures"])[1] > 0.3


def _rows_of(export_dir, manifest_uri, target, mode):
    from specray.capture.store import open_store
    from specray.drafters.format import load_drafter
    from specray.trainer.loader import FeatureLoader
    from specray.trainer.strategies.dspark import DSparkObjective, DSparkStrategy

    manifest = read_manifest(manifest_uri)
    model = _load(target, export_dir)
    strategy = DSparkStrategy(DSparkObjective.model_validate(DSparkStrategy.evaluation))
    rows = []
    with FeatureLoader(manifest, open_store(manifest.store_uri), micro_batch_size=1, seed=0) as loader:
        for i in range(len(manifest.refs)):
            rows.append(strategy.confidence_rows(model, model.config, loader.next_batch(), strategy.generator(0, i)))
    return (torch.cat([r[0] for r in rows]), torch.cat([r[1][mode] for r in rows]), torch.cat([r[2] for r in rows]))
