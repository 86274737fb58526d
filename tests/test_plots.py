"""The accuracy plot of a run: loss terms come from every metrics line, never the analysis."""

import json
import math

import pytest

from fedjax_rcl.metrics.lines import loss_terms
from fedjax_rcl.plots import plot_metrics


def _line(r, analysis=False, **terms):
    row = {"round": r, "test_accuracy": 0.1 * r, "test_accuracy_ema": 0.05 * r,
           "test_loss": 2.0 / r, "train_loss": 1.0 / r, **terms, "round_s": 0.1,
           "elapsed_s": 0.1 * r, "total_s": 0.1 * r}
    if analysis:
        row.update(global_effective_rank=3.0, global_vci=0.5, local_effective_rank=2.0,
                   local_vci=0.4, local_client=3, participation=[1, 0, 2])
    return row


# Analysis on the first lines only (switched off on resume), a term that appears late.
ROWS = [_line(1, True, ce=1.0), _line(2, True, ce=0.9), _line(3, ce=0.8, scl=0.2),
        _line(4, ce=0.7, scl=0.1)]


def test_loss_terms_are_taken_from_every_line_and_exclude_the_analysis():
    assert loss_terms(ROWS) == ["ce", "scl"]
    assert loss_terms([]) == []


def test_plot_of_a_run_whose_analysis_was_switched_off(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    figures = []
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    out = plot_metrics(path, tmp_path / "accuracy.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loss_panel = figures[0].axes[2]
    assert [line.get_label() for line in loss_panel.lines] == ["local objective", "ce", "scl"]
    scl = loss_panel.lines[2].get_ydata()
    assert math.isnan(scl[0]) and math.isnan(scl[1])  # not written before round 3: a gap
    assert list(scl[2:]) == [0.2, 0.1]
