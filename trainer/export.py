"""``specray export``: a training checkpoint → an exported drafter directory (drafters/format.py).

The checkpoint's ``extra`` holds what the export needs besides weights: the algorithm, the
drafter config, the capture contract and the run's provenance. No target weights are needed:
the shared embedding and LM head are stood in for by meta-device modules of the same shape.
"""

from __future__ import annotations

import datetime
import importlib.metadata
from pathlib import Path

from torch import nn

from specray.drafters import DRAFTERS
from specray.drafters.format import save_drafter
from specray.trainer.checkpoint import latest_checkpoint, load_checkpoint


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path | None = None) -> Path:
    """Export ``checkpoint`` (a step dir, or a run's checkpoints dir = its latest step)."""
    path = Path(checkpoint)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.is_dir() and not (path / "state.pt").exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint under {checkpoint}; train first (specray train)")
        path = latest
    ckpt = load_checkpoint(path)
    extra = ckpt.extra
    for key in ("algorithm", "drafter_config", "contract", "provenance"):
        if key not in extra:
            raise ValueError(f"{path} is not a specray training checkpoint (no {key!r} in its state)")
    config_cls, model_cls = DRAFTERS[extra["algorithm"]]
    config = config_cls.from_dict(extra["drafter_config"])
    embed = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
    model = model_cls(config, embed_tokens=embed, lm_head=head)
    model.load_state_dict(ckpt.model)
    if out_dir is None:
        out_dir = Path(extra["provenance"].get("run_dir", path.parent.parent)) / "exports" / f"step-{ckpt.step:08d}"
    provenance = dict(
        extra["provenance"], step=ckpt.step, tokens_seen=extra.get("tokens_seen"), checkpoint=str(path.resolve()),
        exported_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        specray_version=importlib.metadata.version("specray"), last_metrics=extra.get("last_metrics"),
    )
    return save_drafter(out_dir, model, contract=extra["contract"], provenance=provenance)
