"""The export directory's checks (drafters/format.py): an export is refused before anything it
claims is allocated; every field is bounded; files are readable by other users; every export
has a model card.

The memory tests run ``load_drafter`` in a fresh process and compare its peak RSS before and
after: a 230 KB DFlash export whose config.json claims ``intermediate_size = 2**21`` would make
the drafter's MLP 3 · 64 · 2**21 fp32 weights (1.6 GB)."""

import json
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from specray.capture.contract import build_contract
from specray.drafters import DRAFTERS
from specray.drafters.format import InvalidDrafterError, _sha256, load_drafter, save_drafter

CLAIMED = 2**21  # intermediate_size: 3 · 64 · 2**21 · 4 bytes = 1.6 GB of MLP weights


def _export(tmp_path, target, algorithm="dflash", name="export"):
    spec = DRAFTERS[algorithm]
    cfg = spec.debug_config(target)
    model = spec.model(cfg, embed_tokens=target.model.get_input_embeddings(), lm_head=target.model.get_output_embeddings())
    contract = build_contract(algorithm, target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=cfg.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / name, model, contract=json.loads(contract.to_json()),
                        provenance={"run": "test", "target": "debug"})


def _edit_architecture(export: Path, **changes) -> None:
    config = json.loads((export / "config.json").read_text())
    config["architecture"].update(changes)
    (export / "config.json").write_text(json.dumps(config))


def _load(export, target):
    return load_drafter(export, embed_tokens=target.model.get_input_embeddings(),
                        lm_head=target.model.get_output_embeddings(), target_fingerprint=target.target_fingerprint,
                        template_fingerprint=target.template_fingerprint)


PEAK_SCRIPT = """
import json, resource, sys
from specray.capture.target import load_target
from specray.drafters import common
from specray.drafters.format import InvalidDrafterError, load_drafter
if sys.argv[2] == "unbounded":  # lift the width bound: the header check alone must refuse the claim
    common.MAX_WIDTH_MULTIPLE = 1 << 20
target = load_target("debug")
shared = dict(embed_tokens=target.model.get_input_embeddings(), lm_head=target.model.get_output_embeddings(),
              target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_drafter(sys.argv[1], **shared)
    error = None
except InvalidDrafterError as e:
    error = str(e)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"error": error, "peak_growth_bytes": (after - before) * 1024}))
"""


@pytest.mark.parametrize("bounds", ["bounded", "unbounded"])
def test_a_claimed_size_is_refused_before_it_is_allocated(debug_target, tmp_path, bounds):
    export = _export(tmp_path, debug_target)
    assert (export / "model.safetensors").stat().st_size < 240_000
    _edit_architecture(export, intermediate_size=CLAIMED)
    claimed = 3 * debug_target.hidden_size * CLAIMED * 4
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(export), bounds], capture_output=True, text=True,
                         timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and "intermediate_size" in result["error"], result
    assert result["peak_growth_bytes"] < claimed / 20, result  # 80 MB: nothing of the claimed 1.6 GB


@pytest.mark.parametrize("field, value", [
    ("num_kv_heads", 0), ("intermediate_size", -5), ("num_layers", 10**9), ("num_heads", "8"), ("head_dim", 2.5),
    ("hidden_size", 128), ("vocab_size", 10**6), ("block_size", 1), ("mask_token_id", 10**6),
    ("rms_norm_eps", float("nan")), ("target_layer_ids", []), ("target_layer_ids", [1, -2]), ("num_heads", True),
])
def test_each_field_out_of_bounds_names_the_field(debug_target, tmp_path, field, value):
    export = _export(tmp_path, debug_target)
    _edit_architecture(export, **{field: value})
    with pytest.raises(InvalidDrafterError, match=rf"architecture\.{field}"):
        _load(export, debug_target)


@pytest.mark.parametrize("algorithm, field, value", [
    ("dspark", "markov_rank", 0), ("dspark", "markov_rank", 10**7), ("dflash2", "selector_top_k", 10**6),
    ("dflash2", "selector_rank", -1), ("dflash2", "conv_group_size", 0), ("eagle3", "num_kv_heads", 0),
])
def test_algorithm_fields_are_bounded(debug_target, tmp_path, algorithm, field, value):
    export = _export(tmp_path, debug_target, algorithm)
    _edit_architecture(export, **{field: value})
    with pytest.raises(InvalidDrafterError, match=rf"architecture\.{field}"):
        _load(export, debug_target)


def test_every_integer_field_of_every_drafter_has_bounds():
    """A field without bounds would let an export claim any size of it (check_architecture refuses it)."""
    for algorithm, spec in DRAFTERS.items():
        limits = spec.config.limits(64, 300)
        unbounded = [f.name for f in fields(spec.config) if str(f.type).startswith(("int", "tuple[int"))
                     and f.name not in limits]
        assert not unbounded, (algorithm, unbounded)


def _rewrite_weights(export: Path, data: bytes) -> None:
    (export / "model.safetensors").write_bytes(data)
    provenance = json.loads((export / "export.json").read_text())
    provenance["weights_sha256"] = _sha256(export / "model.safetensors")
    (export / "export.json").write_text(json.dumps(provenance))


def test_a_header_that_lies_is_refused(debug_target, tmp_path):
    export = _export(tmp_path, debug_target)
    data = (export / "model.safetensors").read_bytes()
    _rewrite_weights(export, data[:-100])  # truncated: the last tensor's bytes are not in the file
    with pytest.raises(InvalidDrafterError, match="truncated or corrupt"):
        _load(export, debug_target)
    _rewrite_weights(export, struct.pack("<Q", 1 << 40) + data[8:])  # a header longer than the file
    with pytest.raises(InvalidDrafterError, match="header claims"):
        _load(export, debug_target)


def test_weights_that_do_not_fit_the_config_are_refused_by_name(debug_target, tmp_path):
    export = _export(tmp_path, debug_target)
    _edit_architecture(export, intermediate_size=96)  # within bounds, but the weights are 128 wide
    with pytest.raises(InvalidDrafterError, match=r"wrong shape \['layers\.0\.down_proj\.weight \[64, 128\]"):
        _load(export, debug_target)
    other = _export(tmp_path, debug_target, name="other")
    from safetensors.torch import load_file, save_file

    state = load_file(other / "model.safetensors")
    save_file({**state, "extra.weight": torch.zeros(2)}, other / "model.safetensors")
    _rewrite_weights(other, (other / "model.safetensors").read_bytes())
    with pytest.raises(InvalidDrafterError, match=r"extra \['extra\.weight'\]"):
        _load(other, debug_target)


def test_a_huge_config_file_is_refused(debug_target, tmp_path):
    export = _export(tmp_path, debug_target)
    config = json.loads((export / "config.json").read_text())
    config["padding"] = "x" * (2 << 20)
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidDrafterError, match="more than the"):
        _load(export, debug_target)


def test_export_files_are_readable_by_others_and_carry_a_card(debug_target, tmp_path):
    export = _export(tmp_path, debug_target, "eagle3")
    assert export.stat().st_mode & 0o777 == 0o755
    names = sorted(p.name for p in export.iterdir())
    assert names == ["README.md", "config.json", "export.json", "model.safetensors"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in export.iterdir()), names  # safetensors writes 0600
    card = (export / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: specray") and "EAGLE-3 drafter for `debug`" in card
    assert debug_target.target_fingerprint in card and "layers [1, 3, 4]" in card
    assert _load(export, debug_target).algorithm == "eagle3"
