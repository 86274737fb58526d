"""Plots of a run's metrics (matplotlib, Agg backend: no screen needed)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """Reads ``metrics.jsonl`` (one JSON object per line)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str | Path, out_path: str | Path, *, title: str = "") -> Path:
    """Test accuracy (raw and EMA) and train loss against rounds, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    rounds = [r["round"] for r in rows]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_acc.plot(rounds, [r["test_accuracy"] for r in rows], lw=1, alpha=0.5, label="test accuracy")
    ax_acc.plot(rounds, [r["test_accuracy_ema"] for r in rows], lw=2, label="EMA 0.9")
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    ax_loss.plot(rounds, [r["train_loss"] for r in rows], label="train (local) loss")
    ax_loss.plot(rounds, [r["test_loss"] for r in rows], label="test loss")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
