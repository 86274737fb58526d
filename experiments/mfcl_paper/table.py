"""The table of experiments/mfcl_paper/table2_gpu.sh (issue 53): MFCL's linear evaluation with TN,
GN and BN client modules at Dirichlet xi = 0.01 (seeds 0, 1, 2) and xi = 200 (seed 0), in the
paper's setting (experiments/paper/mfcl_table2_cifar10.yaml), beside MFCL's Table 2.

Two figures per run: the probe on the projection head's output (``projection_probe_*``,
where the paper puts its linear layer: the paper's figure) and on the embedding before the
head (``linear_probe_*``, SimCLR's choice and the CPU pages' figure); with both controls (a
randomly initialised server over the same client module, on each of the two; the raw
pixels), mean ± sd where n >= 2, the order each column shows, and the paired per-seed
differences TN - GN, TN - BN and GN - BN (called shown only where |mean| > 2 sd). The helpers
are experiments/mfcl_xi/table.py's (the CPU-scale table of the same claim).

    python experiments/mfcl_paper/table.py --runs /tmp/mfcl_paper --out table.md

Reads ``<runs>/<norm>-xi<xi>-s<seed>``; runs without a probe record are listed as not finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "mfcl_xi_table", Path(__file__).resolve().parents[1] / "mfcl_xi" / "table.py")
xi_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xi_table)
MAIN, PAPER, XIS = xi_table.MAIN, xi_table.PAPER, xi_table.XIS
mean_sd, order, paired_row = xi_table.mean_sd, xi_table.order, xi_table.paired_row
# The two figures: (record prefix, its random-server control's prefix, label).
FIGURES = (("projection_probe_", "control_random_server_projection_",
            "on the projection (the paper's)"),
           ("linear_probe_", "control_random_server_", "on the embedding"))


def load(runs: Path) -> tuple[dict, list]:
    """``{(norm, xi, seed): {"p1": [phase-1 rows], "p2": last phase-2 row, "probe": record}}``
    of the finished runs, and the names of the others."""
    done, pending = {}, []
    for run in sorted(runs.glob("*-xi*-s*")):
        norm, rest = run.name.split("-xi")
        xi, seed = rest.split("-s")
        path = run / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a stopped run
                continue
        probe = [r for r in rows if r.get("phase") == "probe"]
        if not probe:
            pending.append(run.name)
            continue
        done[norm, xi, int(seed)] = dict(p1=[r for r in rows if r.get("phase") == 1],
                                         p2=[r for r in rows if r.get("phase") == 2][-1],
                                         probe=probe[-1])
    return done, pending


def _cell(p: dict, prefix: str) -> str:
    """'test (train)' of one probe, '—' if absent; flags a probe that did not converge."""
    if f"{prefix}accuracy" not in p:
        return "—"
    flag = "" if p.get(f"{prefix}converged", True) else ", NOT CONVERGED"
    return f"{p[f'{prefix}accuracy']:.4f} ({p[f'{prefix}train_accuracy']:.4f}{flag})"


def table(done: dict, pending: list) -> str:
    seeds = sorted({s for (_, _, s) in done})
    labels = dict(MAIN)
    lines = ["Per run (probe: L-BFGS logistic regression, lambda chosen on 10 % held-out "
             "training rows, refitted on all; test top-1 on the test images (train "
             "top-1); phase-1 test BCE at round 1 and at the last round):", "",
             "| norm | xi | seed | test BCE first → last | last NT-Xent | projection "
             "(paper's) | lambda, iterations, max abs grad | embedding | random server: "
             "projection | random server: embedding | pixels |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (norm, label), xi, seed in itertools.product(MAIN, XIS, seeds):
        r = done.get((norm, xi, seed))
        if r is None:
            continue
        p, p1 = r["probe"], r["p1"]
        conv = (f"{p['projection_probe_l2']}, {p['projection_probe_iterations']}, "
                f"{p['projection_probe_grad_max_abs']:.1e}"
                if "projection_probe_grad_max_abs" in p else "—")
        lines.append(
            f"| {label} | {xi} | {seed} | {p1[0]['test_bce']:.4f} → {p1[-1]['test_bce']:.4f} "
            f"| {r['p2']['server_loss']:.4f} | {_cell(p, 'projection_probe_')} | {conv} | "
            f"{_cell(p, 'linear_probe_')} | {_cell(p, 'control_random_server_projection_')} | "
            f"{_cell(p, 'control_random_server_')} | {_cell(p, 'control_pixels_')} |")
    for prefix, control, what in FIGURES:
        lines += ["", f"Beside MFCL's Table 2 (CIFAR-10, M = 10), the probe {what}: the "
                  "paper's values in %, ours as fractions, mean ± sd over the seeds present:",
                  "", "| norm | paper xi=0.01 | ours xi=0.01 | its random server | pixels | "
                  "paper xi=200 | ours xi=200 | its random server |", "|---" * 8 + "|"]
        for norm, label in MAIN:
            cells = [label]
            for xi in XIS:
                hit = [done[norm, xi, s]["probe"] for s in seeds if (norm, xi, s) in done]
                acc = [p[f"{prefix}accuracy"] for p in hit if f"{prefix}accuracy" in p]
                cells += [f"{PAPER[norm, xi]}",
                          mean_sd(acc) + (f" (n={len(acc)})" if acc else ""),
                          mean_sd([p[f"{control}accuracy"] for p in hit
                                   if f"{control}accuracy" in p])]
                if xi == XIS[0]:
                    cells.append(mean_sd([p["control_pixels_accuracy"] for p in hit
                                          if "control_pixels_accuracy" in p]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for xi in XIS:
            paper = {label: PAPER[norm, xi] for norm, label in MAIN}
            full = [s for s in seeds if all((n, xi, s) in done for n, _ in MAIN)]
            ours = ({labels[n]: statistics.mean(done[n, xi, s]["probe"][f"{prefix}accuracy"]
                                                for s in full) for n, _ in MAIN}
                    if full and all(f"{prefix}accuracy" in done[n, xi, s]["probe"]
                                    for n, _ in MAIN for s in full) else {})
            lines.append(f"- Order at xi = {xi}: paper {order(paper)}; ours "
                         + (f"{order(ours)} (mean over seeds {', '.join(map(str, full))})"
                            if ours else "incomplete") + ".")
        lines += ["", f"Paired differences at xi = 0.01, the probe {what}, seed by seed, "
                  "mean ± sd; shown only where |mean| > 2 sd:", "",
                  "| difference | per seed | mean ± sd | shown |", "|---|---|---|---|"]
        for (a, la), (b, lb) in itertools.combinations(MAIN, 2):
            d = [done[a, "0.01", s]["probe"][f"{prefix}accuracy"]
                 - done[b, "0.01", s]["probe"][f"{prefix}accuracy"]
                 for s in seeds if (a, "0.01", s) in done and (b, "0.01", s) in done
                 and f"{prefix}accuracy" in done[a, "0.01", s]["probe"]
                 and f"{prefix}accuracy" in done[b, "0.01", s]["probe"]]
            if d:
                lines.append(paired_row(f"{la} − {lb}", d))
        for norm, label in MAIN:
            d = [p[f"{prefix}accuracy"] - p[f"{control}accuracy"]
                 for p in (done[norm, "0.01", s]["probe"] for s in seeds
                           if (norm, "0.01", s) in done)
                 if f"{prefix}accuracy" in p and f"{control}accuracy" in p]
            if d:
                lines.append(paired_row(f"{label} − its random server", d))
    if pending:
        lines += ["", "Not finished (left out): " + ", ".join(pending)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("experiments/runs/mfcl_paper"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "table.md")
    args = ap.parse_args()
    text = table(*load(args.runs))
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
