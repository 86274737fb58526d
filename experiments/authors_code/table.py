"""The authors' code beside ours, same images and split: the comparison table (issue 48 item 2).

Reads the authors'-code runs (experiments/runs/authors_code/<algo>-a0.3-s<seed>, written by
authors_reference.py beside this script) and ours (experiments/runs/fidelity_cpu for seed 0,
experiments/runs/seeds_cpu for seeds 1 and 2), and writes table.md and table.json beside this
script. For each algorithm, seed and checkpoint round r it takes, from each side's per-round
test accuracy:

* raw: the accuracy at round r;
* EMA: the paper's exponential moving average over rounds, decay 0.9, started at round 1's
  accuracy, recomputed here from the raw accuracies of rounds 1..r (the same formula for both
  sides; the authors' code records no EMA);
* last-10: the mean raw accuracy over rounds r-9..r.

Then the paired difference theirs - ours per seed, and over the seeds that reached r its mean
and sd (n - 1). "Same within noise" means |mean| <= 2 sd of the paired differences, as the issue
defines it; with fewer than two seeds no verdict is given.

    python experiments/authors_code/table.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ROUNDS = (10, 25, 50, 75, 100)
SEEDS = (0, 1, 2)
ALGOS = {"fedavg": "FedAvg", "fedrcl": "FedRCL (released loss)"}
DECAY = 0.9


def ours_dir(algo: str, seed: int) -> Path:
    if seed == 0:
        return ROOT / "experiments/runs/fidelity_cpu" / f"{algo}-a0.3"
    return ROOT / "experiments/runs/seeds_cpu" / f"{algo}-a0.3-s{seed}"


def theirs_dir(algo: str, seed: int) -> Path:
    return ROOT / "experiments/runs/authors_code" / f"{algo}-a0.3-s{seed}"


def accuracies(run: Path) -> list[float]:
    """Per-round raw test accuracy, rounds 1.. in order (a run evaluated every round)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    by_round = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "test_accuracy" in rec:
                by_round[int(rec["round"])] = float(rec["test_accuracy"])
    acc = []
    for r in range(1, max(by_round, default=0) + 1):
        if r not in by_round:  # only a run evaluated at every round is compared
            raise SystemExit(f"{run}: round {r} was not evaluated")
        acc.append(by_round[r])
    return acc


def figures(acc: list[float], r: int) -> dict | None:
    if len(acc) < r:
        return None
    ema = acc[0]
    for a in acc[1:r]:
        ema = DECAY * ema + (1 - DECAY) * a
    return {"raw": acc[r - 1], "ema": ema, "last10": sum(acc[r - 10:r]) / 10}


def mean_sd(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def paired_rows(a_dir, b_dir, sides=("theirs", "ours"), same="same within 2 sd",
                rounds=ROUNDS):
    """Table rows and their data for side ``a_dir(algo, seed)`` against ``b_dir(algo, seed)``:
    per algorithm and round, each side's mean ± sd over the seeds both reached and the paired
    difference a - b, with the verdict on the last-10 difference."""
    rows, out = [], {}
    fmt = (lambda ms: f"{ms[0]:.3f}" if ms[1] is None else f"{ms[0]:.3f} ± {ms[1]:.3f}")
    for algo, name in ALGOS.items():
        for r in rounds:
            per_seed = {}
            for s in SEEDS:
                a = figures(accuracies(a_dir(algo, s)), r)
                b = figures(accuracies(b_dir(algo, s)), r)
                if a and b:
                    per_seed[s] = {sides[0]: a, sides[1]: b,
                                   "diff": {k: a[k] - b[k] for k in a}}
            if not per_seed:
                continue
            out.setdefault(algo, {})[r] = per_seed
            cells = [tuple(mean_sd([v[side][k] for v in per_seed.values()])
                           for side in (*sides, "diff")) for k in ("raw", "ema", "last10")]
            d_last = cells[2][2]
            if d_last[1] is None:
                verdict = "n = 1: no verdict"
            elif abs(d_last[0]) <= 2 * d_last[1]:
                verdict = same
            else:
                verdict = "**differs** (> 2 sd)"
            seeds = ",".join(str(s) for s in per_seed)
            rows.append(f"| {name} | {r} | {seeds} | " + " | ".join(
                f"{fmt(t)} | {fmt(o)} | {fmt(d)}" for t, o, d in cells) + f" | {verdict} |")
    return rows, out


def main() -> None:
    rows, out = paired_rows(theirs_dir, ours_dir)
    header = (
        "| method | round | seeds | raw theirs | raw ours | raw diff | EMA theirs | EMA ours | "
        "EMA diff | last-10 theirs | last-10 ours | last-10 diff | last-10 diff vs noise |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    text = header + "\n" + "\n".join(rows) + "\n"
    (HERE / "table.md").write_text(text)
    (HERE / "table.json").write_text(json.dumps(out, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
