"""``specray export``: trained weights → an exported drafter directory (drafters/format.py).

One export path for every way of training: ``export_checkpoint`` turns a training checkpoint
(``specray train``'s or the Ray gang's, on any device) into an export through ``drafter_from_state``
and ``export_drafter``.

A checkpoint's ``extra`` holds what the export needs besides weights: the algorithm, the
drafter config, the capture contract and the run's provenance. No target weights are needed:
the shared embedding and LM head are stood in for by meta-device modules of the same shape.
A checkpoint on ``s3://`` (the gang's storage on a cluster) is fetched to a temporary
directory first (fsspec; endpoint from ``endpoint_url`` or ``$SPECRAY_S3_ENDPOINT``).

``write_peer_format`` writes an export in a peer format (``PEER_FORMATS``: ``speculators`` for
vLLM, drafters/peer.py; ``sglang``, drafters/sglang.py), naming the verifier the user gives;
``trainer/hub.py`` pushes either kind to the Hub.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from specray.capture.store import open_fs
from specray.drafters import get_drafter
from specray.drafters.format import save_drafter
from specray.trainer.checkpoint import latest_checkpoint, load_checkpoint


def drafter_from_state(algorithm: str, config: dict, state: dict[str, torch.Tensor], *,
                       embed_tokens: nn.Embedding | None = None, lm_head: nn.Linear | None = None) -> nn.Module:
    """The registered drafter of ``algorithm`` with model config ``config`` (its ``to_dict()``) and
    weights ``state``; without the target's modules, meta-device stand-ins of the same shape."""
    spec = get_drafter(algorithm)
    cfg = spec.config.from_dict(config)
    if embed_tokens is None or lm_head is None:
        embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
    model = spec.model(cfg, embed_tokens=embed_tokens, lm_head=lm_head)
    model.load_state_dict(state)
    return model


def export_drafter(model: nn.Module, out_dir: str | Path, *, contract: dict, provenance: dict) -> Path:
    """Write ``model`` as an export, its provenance stamped with the time and the specray version."""
    provenance = dict(provenance, exported_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      specray_version=importlib.metadata.version("specray"))
    return save_drafter(out_dir, model, contract=contract, provenance=provenance)


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A step dir from a step dir, a checkpoints dir (its latest) or a run dir (its latest)."""
    path = Path(checkpoint)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.is_dir() and not (path / "state.pt").exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint under {checkpoint}; train first (specray train)")
        path = latest
    return path


def _is_remote(checkpoint: str | Path) -> bool:
    return "://" in str(checkpoint) and not str(checkpoint).startswith("file://")


@contextmanager
def local_checkpoint(checkpoint: str | Path, *, endpoint_url: str | None = None) -> Iterator[Path]:
    """``checkpoint`` as a local path: a path or ``file://`` URI as is, an ``s3://`` one fetched to a temp dir."""
    if not _is_remote(checkpoint):
        yield Path(str(checkpoint).removeprefix("file://"))
        return
    fs, root, _ = open_fs(str(checkpoint), endpoint_url=endpoint_url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"no checkpoint at {checkpoint}: give a checkpoint directory the trainer wrote")
    with tempfile.TemporaryDirectory(prefix="specray-checkpoint-") as tmp:
        fs.get(f"{root}/", f"{tmp}/", recursive=True)
        yield Path(tmp)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path | None = None, *,
                      endpoint_url: str | None = None) -> Path:
    """Export ``checkpoint`` (a step dir, or a run's checkpoints dir = its latest step; a path or an s3:// URI)."""
    with local_checkpoint(checkpoint, endpoint_url=endpoint_url) as local:
        path = resolve_checkpoint(local)
        ckpt = load_checkpoint(path)
    extra = ckpt.extra
    for key in ("algorithm", "drafter_config", "contract", "provenance"):
        if key not in extra:
            raise ValueError(f"{checkpoint} is not a specray training checkpoint (no {key!r} in its state)")
    model = drafter_from_state(extra["algorithm"], extra["drafter_config"], ckpt.model)
    if out_dir is None:  # under the training run's dir (a fetched copy's parent is a temp dir)
        if _is_remote(checkpoint) and "run_dir" not in extra["provenance"]:
            raise ValueError(f"{checkpoint} records no run_dir to export under; give out_dir")
        out_dir = Path(extra["provenance"].get("run_dir", path.parent.parent)) / "exports" / f"step-{ckpt.step:08d}"
    source = str(checkpoint) if _is_remote(checkpoint) else str(path.resolve())
    provenance = dict(extra["provenance"], step=ckpt.step, tokens_seen=extra.get("tokens_seen"), checkpoint=source,
                      last_metrics=extra.get("last_metrics"))
    return export_drafter(model, out_dir, contract=extra["contract"], provenance=provenance)



# `specray export --format`: the writer of each peer format, (module, function); each takes
# (export_dir, out_dir, target=, verifier_name_or_path=) and writes specray_export.json beside the weights
PEER_FORMATS = {"speculators": ("specray.drafters.peer", "write_peer_export"),
                "sglang": ("specray.drafters.sglang", "write_sglang_export")}


def write_peer_format(fmt: str, export_dir: str | Path, out_dir: str | Path, *, target=None,
                      verifier: str | None = None) -> tuple[Path, dict]:
    """Write the export ``export_dir`` in the peer format ``fmt`` (``PEER_FORMATS``) at ``out_dir``;
    returns the directory and its ``specray_export.json`` record (format, verifier, serve commands)."""
    import importlib
    import json

    if fmt not in PEER_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; peer formats: {sorted(PEER_FORMATS)}")
    module, function = PEER_FORMATS[fmt]
    out = getattr(importlib.import_module(module), function)(export_dir, out_dir, target=target,
                                                              verifier_name_or_path=verifier)
    return out, json.loads((out / "specray_export.json").read_text())
