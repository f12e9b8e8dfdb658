"""``specray export``: trained weights → an exported drafter directory (drafters/format.py).

One export path for every way of training: ``export_checkpoint`` turns a training checkpoint
(``specray train``'s or the Ray gang's) into an export; ``pipeline/onegpu.py`` turns its variant
files into one through the same ``drafter_from_state`` and ``export_drafter``.

A checkpoint's ``extra`` holds what the export needs besides weights: the algorithm, the
drafter config, the capture contract and the run's provenance. No target weights are needed:
the shared embedding and LM head are stood in for by meta-device modules of the same shape.
"""

from __future__ import annotations

import datetime
import importlib.metadata
from pathlib import Path

import torch
from torch import nn

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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path | None = None) -> Path:
    """Export ``checkpoint`` (a step dir, or a run's checkpoints dir = its latest step)."""
    path = resolve_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    extra = ckpt.extra
    for key in ("algorithm", "drafter_config", "contract", "provenance"):
        if key not in extra:
            raise ValueError(f"{path} is not a specray training checkpoint (no {key!r} in its state)")
    model = drafter_from_state(extra["algorithm"], extra["drafter_config"], ckpt.model)
    if out_dir is None:
        out_dir = Path(extra["provenance"].get("run_dir", path.parent.parent)) / "exports" / f"step-{ckpt.step:08d}"
    provenance = dict(extra["provenance"], step=ckpt.step, tokens_seen=extra.get("tokens_seen"),
                      checkpoint=str(path.resolve()), last_metrics=extra.get("last_metrics"))
    return export_drafter(model, out_dir, contract=extra["contract"], provenance=provenance)
