"""Training curves: loss and per-position teacher-forced accuracy from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training(metrics_path: str | Path, png_path: str | Path) -> Path:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{metrics_path} has no records to plot")
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records])
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE", title="loss")
    ax_loss.grid(alpha=0.3)
    positions = len(records[0]["acc_by_pos"])
    colours = plt.cm.viridis([i / max(1, positions - 1) for i in range(positions)])
    for j in range(positions):
        ax_acc.plot(steps, [r["acc_by_pos"][j] for r in records], color=colours[j], label=f"pos {j + 1}")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 accuracy (teacher-forced)", title="accuracy by block position", ylim=(0, 1))
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
