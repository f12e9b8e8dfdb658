"""The exported-drafter directory: what serving loads, and the checks that guard it.

    <dir>/config.json        format_version, algorithm, architecture (the algorithm's model
                             config: its ``to_dict()``, every algorithm-specific field lives
                             there), capture_contract, target_fingerprint, template_fingerprint
    <dir>/model.safetensors  the drafter's own weights (never the target's embedding/LM head)
    <dir>/export.json        provenance: run, steps, tokens, metrics, sha256 of model.safetensors

``load_drafter`` refuses an export whose target or template fingerprint differs from the
target it is loaded against, whose capture contract differs from an expected one, whose
weights do not match the recorded sha256, or whose tensors do not match the architecture
(``InvalidDrafterError``, naming the field and the fix). Nothing is loaded half-way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from specray.drafters import DRAFTERS, get_drafter

FORMAT_VERSION = 1


class InvalidDrafterError(ValueError):
    """An export is incomplete, corrupt, or made for another target / template / contract."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def save_drafter(out_dir: str | Path, model: nn.Module, *, contract: dict, provenance: dict) -> Path:
    """Write an export directory atomically (a temporary sibling renamed into place)."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; exports are immutable versions, choose a new directory")
    cfg = model.config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "algorithm": model.algorithm})
        config = {
            "format_version": FORMAT_VERSION,
            "algorithm": model.algorithm,
            "architecture": cfg.to_dict(),
            "capture_contract": contract,
            "target_fingerprint": contract["target_fingerprint"],
            "template_fingerprint": contract["template_fingerprint"],
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        export = dict(provenance, weights_sha256=_sha256(tmp / "model.safetensors"),
                      num_parameters=sum(t.numel() for t in state.values()))
        (tmp / "export.json").write_text(json.dumps(export, indent=2, default=str) + "\n")
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_drafter_config(export_dir: str | Path) -> dict:
    path = Path(export_dir)
    for name in ("config.json", "model.safetensors", "export.json"):
        if not (path / name).is_file():
            raise InvalidDrafterError(f"{path} is not a drafter export: {name} is missing")
    config = json.loads((path / "config.json").read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise InvalidDrafterError(
            f"{path}: export format {config.get('format_version')!r}, this specray reads {FORMAT_VERSION}; re-export it"
        )
    if config.get("algorithm") not in DRAFTERS:
        raise InvalidDrafterError(f"{path}: algorithm {config.get('algorithm')!r} has no drafter here; "
                                  f"implemented: {sorted(DRAFTERS)}")
    return config


def load_drafter(
    export_dir: str | Path, *, embed_tokens: nn.Embedding, lm_head: nn.Linear,
    target_fingerprint: str, template_fingerprint: str, contract: dict | None = None,
) -> nn.Module:
    """Validate an export against the target it will draft for, then build the drafter."""
    path = Path(export_dir)
    config = read_drafter_config(path)
    for field, expected in (("target_fingerprint", target_fingerprint), ("template_fingerprint", template_fingerprint)):
        if config[field] != expected:
            raise InvalidDrafterError(
                f"{path} was trained for another target: {field} {config[field]} != {expected}; "
                "serve it with the target it was captured from, or train a drafter for this one"
            )
    if contract is not None and config["capture_contract"] != contract:
        diffs = sorted(k for k in set(contract) | set(config["capture_contract"])
                       if contract.get(k) != config["capture_contract"].get(k))
        raise InvalidDrafterError(f"{path}: capture contract differs in {diffs}; re-capture or re-export")
    export = json.loads((path / "export.json").read_text())
    if _sha256(path / "model.safetensors") != export.get("weights_sha256"):
        raise InvalidDrafterError(f"{path}/model.safetensors does not match the sha256 in export.json (corrupt copy?)")
    spec = get_drafter(config["algorithm"])
    try:
        arch = spec.config.from_dict(config["architecture"])
    except (TypeError, ValueError) as e:
        raise InvalidDrafterError(f"{path}: bad architecture in config.json: {e}") from None
    model = spec.model(arch, embed_tokens=embed_tokens, lm_head=lm_head)
    state = load_file(path / "model.safetensors")
    expected_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got_shapes = {k: tuple(v.shape) for k, v in state.items()}
    if expected_shapes != got_shapes:
        missing = sorted(set(expected_shapes) - set(got_shapes))
        extra = sorted(set(got_shapes) - set(expected_shapes))
        wrong = sorted(k for k in set(expected_shapes) & set(got_shapes) if expected_shapes[k] != got_shapes[k])
        raise InvalidDrafterError(f"{path}: weights do not fit the architecture (missing {missing}, extra {extra}, wrong shape {wrong})")
    model.load_state_dict(state)
    try:
        model.validate_state()
        attach = getattr(model, "attach_export", None)  # files beside the weights a drafter reads (DSpark's calibration)
        if attach is not None:
            attach(path)
    except ValueError as e:
        raise InvalidDrafterError(f"{path}: {e}") from None
    return model.eval().requires_grad_(False)
