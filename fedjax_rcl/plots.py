"""Plots of a run's metrics (matplotlib, Agg backend: no screen needed)."""

from __future__ import annotations

import math
from pathlib import Path

from fedjax_rcl.metrics.lines import loss_terms
from fedjax_rcl.rundir import read_jsonl


def read_metrics(path: str | Path) -> list[dict]:
    """A run's ``metrics.jsonl`` at ``path``: its complete lines (a torn last line is skipped,
    as every reader of a run does: ``rundir.read_jsonl``)."""
    return read_jsonl(Path(path))


def plot_metrics(metrics_path: str | Path, out_path: str | Path, *, title: str = "",
                 ema_decay: float = 0.9, eval_every: int = 1) -> Path:
    """Test accuracy (raw and EMA) and the losses against rounds, saved as PNG.

    ``ema_decay`` and ``eval_every`` label the EMA curve as it was computed: ``ema_decay`` per
    round, applied as ``ema_decay**k`` once per evaluation every ``k`` rounds, which is exactly
    the paper's per-round EMA only when ``eval_every == 1``. The local
    training loss is the whole client objective (CE plus the algorithm's terms), so it gets its
    own panel rather than sharing an axis with the test cross-entropy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    rounds = [r["round"] for r in rows]
    fig, (ax_acc, ax_test, ax_train) = plt.subplots(1, 3, figsize=(14, 3.8))
    ax_acc.plot(rounds, [r["test_accuracy"] for r in rows], lw=1, alpha=0.5, label="test accuracy")
    per = ("per round" if eval_every == 1 else
           f"per round as {ema_decay:g}**{eval_every} every {eval_every} rounds (exact at 1)")
    ax_acc.plot(rounds, [r["test_accuracy_ema"] for r in rows], lw=2,
                label=f"EMA {ema_decay:g} {per}")
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    ax_test.plot(rounds, [r["test_loss"] for r in rows])
    ax_test.set_ylabel("test cross-entropy")
    ax_train.plot(rounds, [r["train_loss"] for r in rows], lw=2, label="local objective")
    # Terms from every line (a resumed run may switch the analysis on or off, and its fields
    # are not loss terms); a term missing from a line is a gap.
    for k in loss_terms(rows):
        ax_train.plot(rounds, [r.get(k, math.nan) for r in rows], lw=1, label=k)
    ax_train.set_ylabel("local training loss (mean over clients)")
    for ax in (ax_test, ax_train):
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    ax_train.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
