"""Training curves from ``metrics.jsonl``: loss, per-position teacher-forced accuracy and, when the
run measured it at its checkpoints (``live_eval``), live acceptance by position and ``tau_live``
next to ``tau_tf``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _by_position(ax, steps: list[int], rows: list[list[float]], *, ylabel: str, title: str) -> None:
    """One line per draft position j (viridis, position 1 darkest)."""
    positions = max(len(r) for r in rows)
    colours = plt.cm.viridis([i / max(1, positions - 1) for i in range(positions)])
    for j in range(positions):
        points = [(s, r[j]) for s, r in zip(steps, rows) if j < len(r)]
        ax.plot([s for s, _ in points], [v for _, v in points], color=colours[j], label=f"pos {j + 1}",
                marker="o" if len(points) < 8 else None)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _tau(ax, records: list[dict], live: list[dict]) -> None:
    ax.plot([r["step"] for r in records], [r["tau_tf"] for r in records], label="tau_tf (teacher-forced)")
    ax.plot([r["step"] for r in live], [r["tau_live"] for r in live], marker="o", label="tau_live (serving engine)")
    ax.set(xlabel="optimizer step", ylabel="accepted length", title="tau: teacher-forced vs live")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_training(metrics_path: str | Path, png_path: str | Path) -> Path:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{metrics_path} has no records to plot")
    live = [r for r in records if r.get("tau_live") is not None]
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2 if live else 1, 2, figsize=(11, 8 if live else 4))
    axes = axes.flatten()
    axes[0].plot(steps, [r["loss"] for r in records])
    axes[0].set(xlabel="optimizer step", ylabel="weighted CE", title="loss")
    axes[0].grid(alpha=0.3)
    _by_position(axes[1], steps, [r["acc_by_pos"] for r in records], ylabel="top-1 accuracy (teacher-forced)",
                 title="accuracy by block position")
    if live:
        _by_position(axes[2], [r["step"] for r in live], [r["live_accept_by_pos"] for r in live],
                     ylabel="P(draft j accepted), greedy", title="live acceptance by position")
        _tau(axes[3], records, live)
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
