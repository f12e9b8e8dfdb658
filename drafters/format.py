"""The exported-drafter directory: what serving loads, and the checks that guard it.

    <dir>/config.json        format_version, algorithm, architecture (the algorithm's model
                             config: its ``to_dict()``, every algorithm-specific field lives
                             there), capture_contract, target_fingerprint, template_fingerprint
    <dir>/model.safetensors  the drafter's own weights (never the target's embedding/LM head)
    <dir>/export.json        provenance: run, steps, tokens, metrics, sha256 of model.safetensors
    <dir>/README.md          the model card, rendered from the two JSON files (drafters/card.py)

Every file is written readable by other users (0644, the directory 0755), so an export serves
from another account or a shared directory.

``load_drafter`` refuses an export (``InvalidDrafterError``, naming the field and the fix)
before it allocates anything the export claims:

1. ``config.json`` (at most ``MAX_CONFIG_BYTES``): format version, a registered algorithm;
2. fingerprints of the target and template, and the capture contract when one is expected;
3. every architecture field's type and bounds (the config class's ``limits``: ``hidden_size``
   and ``vocab_size`` equal to the target's, sizes positive and at most a documented multiple of
   the target's width, see ``drafters/common.py``);
4. the sha256 of ``model.safetensors`` recorded in ``export.json``;
5. the safetensors header (at most ``MAX_HEADER_BYTES``, every tensor's bytes inside the file)
   against the shapes the architecture implies, computed on the meta device (no memory);

and only then builds the drafter and reads its weights, whose size the file itself bounds.
Nothing is loaded half-way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specray.drafters import DRAFTERS, get_drafter
from specray.drafters.common import MAX_DRAFT_LAYERS

FORMAT_VERSION = 1
MAX_CONFIG_BYTES = 1 << 20  # config.json / export.json: a few KB in practice
MAX_HEADER_BYTES = 100 << 20  # the safetensors header (its own reader's limit)
FILE_MODE, DIR_MODE = 0o644, 0o755  # readable by other users (safetensors writes 0600)
CARD_FILE = "README.md"

# safetensors dtype names -> bytes per element and kind (float / int / bool)
_ST_DTYPES = {"F64": (8, "float"), "F32": (4, "float"), "F16": (2, "float"), "BF16": (2, "float"),
              "F8_E4M3": (1, "float"), "F8_E5M2": (1, "float"), "I64": (8, "int"), "I32": (4, "int"),
              "I16": (2, "int"), "I8": (1, "int"), "U8": (1, "int"), "U16": (2, "int"), "U32": (4, "int"),
              "U64": (8, "int"), "BOOL": (1, "bool")}


class InvalidDrafterError(ValueError):
    """An export is incomplete, corrupt, or made for another target / template / contract."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def publish_directory(tmp: Path, out: Path) -> Path:
    """Make the files of ``tmp`` readable by other users and rename it to ``out`` (atomic)."""
    for path in tmp.rglob("*"):
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)
    os.chmod(tmp, DIR_MODE)
    os.rename(tmp, out)
    return out


def save_drafter(out_dir: str | Path, model: nn.Module, *, contract: dict, provenance: dict) -> Path:
    """Write an export directory atomically (a temporary sibling renamed into place)."""
    from specray.drafters.card import render_card

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
        (tmp / CARD_FILE).write_text(render_card(tmp))
        publish_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_json(path: Path, what: str) -> dict:
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InvalidDrafterError(f"{path} is {size} bytes, more than the {MAX_CONFIG_BYTES} a drafter's {what} "
                                  "may have; this is not an export specray wrote")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidDrafterError(f"{path} is not valid JSON ({e}); re-export the drafter") from None
    if not isinstance(data, dict):
        raise InvalidDrafterError(f"{path} holds a {type(data).__name__}, not a JSON object; re-export the drafter")
    return data


def read_drafter_config(export_dir: str | Path) -> dict:
    path = Path(export_dir)
    for name in ("config.json", "model.safetensors", "export.json"):
        if not (path / name).is_file():
            raise InvalidDrafterError(f"{path} is not a drafter export: {name} is missing")
    config = _read_json(path / "config.json", "config")
    if config.get("format_version") != FORMAT_VERSION:
        raise InvalidDrafterError(
            f"{path}: export format {config.get('format_version')!r}, this specray reads {FORMAT_VERSION}; re-export it"
        )
    if config.get("algorithm") not in DRAFTERS:
        raise InvalidDrafterError(f"{path}: algorithm {config.get('algorithm')!r} has no drafter here; "
                                  f"implemented: {sorted(DRAFTERS)}")
    for key in ("architecture", "capture_contract"):
        if not isinstance(config.get(key), dict):
            raise InvalidDrafterError(f"{path}/config.json: {key} must be an object; re-export the drafter")
    return config


# -- the checks before anything is built ----------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_bounds(field: str, value, bounds: tuple[float, float], where: str) -> None:
    lo, hi = bounds
    if not lo <= value <= hi:
        raise InvalidDrafterError(f"{where}: architecture.{field} = {value} is outside [{lo}, {hi}] for this "
                                  "target (drafters/common.py size_limits); this export was not made for it or "
                                  "is corrupt: re-export it from its training run")


def check_architecture(arch: dict, config_cls: type, *, hidden_size: int, vocab_size: int, where: str) -> None:
    """Each field of ``arch`` has its config field's type, and every numeric field lies within the
    class's ``limits(hidden_size, vocab_size)`` (an integer field without bounds is refused: every
    size an export claims is bounded). ``InvalidDrafterError`` names the first field that does not."""
    limits = config_cls.limits(hidden_size, vocab_size)
    for f in fields(config_cls):
        if f.name not in arch:
            if f.default is MISSING and f.default_factory is MISSING:
                raise InvalidDrafterError(f"{where}: architecture.{f.name} is missing; re-export the drafter")
            continue
        value, kind = arch[f.name], f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if value is None and "None" in kind:
            continue
        if kind.startswith("tuple[int"):
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise InvalidDrafterError(f"{where}: architecture.{f.name} must be a list of integers, got {value!r}")
            if not 1 <= len(value) <= MAX_DRAFT_LAYERS:
                raise InvalidDrafterError(f"{where}: architecture.{f.name} has {len(value)} entries, "
                                          f"1 to {MAX_DRAFT_LAYERS} allowed")
            for v in value:
                _in_bounds(f.name, v, limits[f.name], where)
        elif kind.startswith("int"):
            if not _is_int(value):
                raise InvalidDrafterError(f"{where}: architecture.{f.name} must be an integer, got {value!r}")
            if f.name not in limits:
                raise InvalidDrafterError(f"{where}: architecture.{f.name} has no bounds in "
                                          f"{config_cls.__name__}.limits; it cannot be loaded")
            _in_bounds(f.name, value, limits[f.name], where)
        elif kind.startswith("float"):
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise InvalidDrafterError(f"{where}: architecture.{f.name} must be a finite number, got {value!r}")
            if f.name in limits:
                _in_bounds(f.name, value, limits[f.name], where)
        elif kind == "bool" and not isinstance(value, bool):
            raise InvalidDrafterError(f"{where}: architecture.{f.name} must be true or false, got {value!r}")
        elif kind.startswith(("str", "Literal")) and not isinstance(value, str):
            raise InvalidDrafterError(f"{where}: architecture.{f.name} must be a string, got {value!r}")


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a safetensors file declares, {name: (dtype, shape)}, read from its header only;
    ``InvalidDrafterError`` unless the header is bounded and every tensor's bytes lie in the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InvalidDrafterError(f"{path} is {size} bytes, too short for a safetensors file; re-export it")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise InvalidDrafterError(f"{path}: its header claims {length} bytes (file {size} bytes, at most "
                                      f"{MAX_HEADER_BYTES}); a corrupt or foreign file: re-export it")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidDrafterError(f"{path}: its header is not valid JSON ({e}); re-export it") from None
    if not isinstance(header, dict):
        raise InvalidDrafterError(f"{path}: its header is not a JSON object; re-export it")
    data_bytes, tensors = size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and entry.get("dtype") in _ST_DTYPES and isinstance(entry.get("shape"), list) \
            and all(_is_int(d) and d >= 0 for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list) \
            and len(entry["data_offsets"]) == 2 and all(_is_int(o) for o in entry["data_offsets"])
        if not ok:
            raise InvalidDrafterError(f"{path}: tensor {name!r} has a malformed header entry; re-export it")
        begin, end = entry["data_offsets"]
        nbytes = math.prod(entry["shape"]) * _ST_DTYPES[entry["dtype"]][0]
        if not 0 <= begin <= end <= data_bytes or end - begin != nbytes:
            raise InvalidDrafterError(f"{path}: tensor {name!r} {entry['dtype']}{entry['shape']} claims bytes "
                                      f"{begin}..{end} of {data_bytes}: truncated or corrupt; re-export it")
        tensors[name] = (entry["dtype"], tuple(entry["shape"]))
    return tensors


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else ("float" if dtype.is_floating_point else "int")


def _suspects(arch: dict, want: tuple[int, ...], got: tuple[int, ...]) -> list[str]:
    """The architecture fields whose value is a dimension the weights do not have: a claim to blame."""
    dims = {w for w, g in zip(want, got) if w != g} if len(want) == len(got) else set(want) - set(got)
    return [f"architecture.{k} = {v}" for k, v in arch.items() if _is_int(v) and v in dims]


def check_weights(header: dict[str, tuple[str, tuple[int, ...]]], expected: dict[str, torch.Tensor],
                  arch: dict, where: str) -> None:
    """The header's tensors are exactly ``expected``'s names, with their shapes and dtype kinds; a wrong
    shape names the architecture fields that imply it."""
    got = {k: shape for k, (_, shape) in header.items()}
    want = {k: tuple(v.shape) for k, v in expected.items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    kinds = sorted(k for k in set(want) & set(got) if _ST_DTYPES[header[k][0]][1] != _kind(expected[k].dtype))
    if missing or extra or wrong or kinds:
        suspects = sorted({s for k in wrong for s in _suspects(arch, want[k], got[k])})
        shapes = [f"{k} {list(got[k])} (architecture: {list(want[k])})" for k in wrong]
        blame = f"{', '.join(suspects)} does not match the weights: " if suspects else ""
        raise InvalidDrafterError(f"{where}: {blame}weights do not fit the architecture in config.json (missing "
                                  f"{missing}, extra {extra}, wrong shape {shapes}, wrong dtype kind {kinds}); "
                                  "re-export it")


def check_export(export_dir: str | Path, *, vocab_size: int, hidden_size: int, target_fingerprint: str,
                 template_fingerprint: str) -> None:
    """Every check ``load_drafter`` makes before it builds the drafter (fingerprints, config bounds,
    sha256, the weights' header against the architecture's shapes), allocating nothing: for a
    process that has the target's config but not its weights (a serving driver)."""
    with torch.device("meta"):
        embed_tokens, lm_head = nn.Embedding(vocab_size, hidden_size), nn.Linear(hidden_size, vocab_size, bias=False)
    _checked(Path(export_dir), embed_tokens, lm_head, target_fingerprint, template_fingerprint, None)


def load_drafter(
    export_dir: str | Path, *, embed_tokens: nn.Embedding, lm_head: nn.Linear,
    target_fingerprint: str, template_fingerprint: str, contract: dict | None = None,
) -> nn.Module:
    """Validate an export against the target it will draft for, then build the drafter (module doc)."""
    path = Path(export_dir)
    spec, arch = _checked(path, embed_tokens, lm_head, target_fingerprint, template_fingerprint, contract)
    model = spec.model(arch, embed_tokens=embed_tokens, lm_head=lm_head)
    model.load_state_dict(load_file(path / "model.safetensors"))
    try:
        model.validate_state()
        attach = getattr(model, "attach_export", None)  # files beside the weights a drafter reads (DSpark's calibration)
        if attach is not None:
            attach(path)
    except ValueError as e:
        raise InvalidDrafterError(f"{path}: {e}") from None
    return model.eval().requires_grad_(False)


def _checked(path: Path, embed_tokens: nn.Module, lm_head: nn.Module, target_fingerprint: str,
             template_fingerprint: str, contract: dict | None):
    """The export's checks before anything is built; returns (its drafter's spec, its architecture)."""
    config = read_drafter_config(path)
    for field, expected in (("target_fingerprint", target_fingerprint), ("template_fingerprint", template_fingerprint)):
        if config.get(field) != expected:
            raise InvalidDrafterError(
                f"{path} was trained for another target: {field} {config.get(field)} != {expected}; "
                "serve it with the target it was captured from, or train a drafter for this one"
            )
    if contract is not None and config["capture_contract"] != contract:
        diffs = sorted(k for k in set(contract) | set(config["capture_contract"])
                       if contract.get(k) != config["capture_contract"].get(k))
        raise InvalidDrafterError(f"{path}: capture contract differs in {diffs}; re-capture or re-export")
    spec = get_drafter(config["algorithm"])
    V, D = embed_tokens.weight.shape
    check_architecture(config["architecture"], spec.config, hidden_size=D, vocab_size=V, where=str(path))
    try:
        arch = spec.config.from_dict(config["architecture"])
    except (TypeError, ValueError) as e:
        raise InvalidDrafterError(f"{path}: bad architecture in config.json: {e}") from None
    export = _read_json(path / "export.json", "provenance")
    if _sha256(path / "model.safetensors") != export.get("weights_sha256"):
        raise InvalidDrafterError(f"{path}/model.safetensors does not match the sha256 in export.json (corrupt copy?)")
    with torch.device("meta"):  # the shapes the architecture implies, without their memory
        expected = spec.model(arch, embed_tokens=embed_tokens, lm_head=lm_head).state_dict()
    check_weights(read_safetensors_header(path / "model.safetensors"), expected, config["architecture"], str(path))
    return spec, arch
