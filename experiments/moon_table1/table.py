"""MOON's Table 1 (CIFAR-10) beside ours: per method the paper's mean +- sd over three trials,
ours over seeds 0-2 (the global model's top-1 test accuracy after the last round, as the paper
reports it, and the mean of the last 10 rounds), the differences to FedAvg paired by seed, and
a verdict. Reads the records under experiments/runs/moon_table1_cifar10; a run not finished is
shown with the round it reached.

    python experiments/moon_table1/table.py [--rounds 100]   # writes table.md and table.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE.parents[1] / "experiments" / "runs" / "moon_table1_cifar10"
# MOON (Li, He, Song, CVPR 2021), Table 1, CIFAR-10: top-1 accuracy (%), mean +- sd of 3 trials.
PAPER = {"moon": (69.1, 0.4), "fedavg": (66.3, 0.5), "fedprox": (66.9, 0.2),
         "scaffold": (66.6, 0.2)}
SEEDS = (0, 1, 2)


def _accuracies(run: Path) -> dict[int, float]:
    out = {}
    path = run / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a run still writing
            continue
        if "test_accuracy" in row:
            out[int(row["round"])] = 100 * float(row["test_accuracy"])
    return out


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return m, sd


def _fmt(ms: tuple[float, float] | None) -> str:
    if ms is None:
        return "-"
    m, sd = ms
    return f"{m:.1f}" if math.isnan(sd) else f"{m:.1f} +- {sd:.1f}"


def collect(rounds: int) -> dict:
    table = {}
    for method in PAPER:
        per_seed = {}
        for seed in SEEDS:
            acc = _accuracies(RUNS / f"{method}-s{seed}")
            if not acc:
                continue
            reached = max(acc)
            last10 = [acc[r] for r in range(reached - 9, reached + 1) if r in acc]
            per_seed[seed] = {"reached": reached, "final": acc[reached],
                              "last10": sum(last10) / len(last10),
                              "at": {r: acc[r] for r in (25, 50, 100) if r in acc}}
        table[method] = per_seed
    return table


def render(table: dict, rounds: int) -> str:
    lines = [f"| method | paper (3 trials) | ours, round {rounds} | ours, mean of rounds "
             f"{rounds - 9}-{rounds} | seeds done | vs the paper |", "|---|---|---|---|---|---|"]
    done = {m: {s: v for s, v in d.items() if v["reached"] >= rounds} for m, d in table.items()}
    for method, (pm, psd) in PAPER.items():
        finished = done[method]
        final = [v["final"] for v in finished.values()]
        last10 = [v["last10"] for v in finished.values()]
        ours = _mean_sd(final) if final else None
        if len(final) >= 2:
            d = ours[0] - pm
            se = math.sqrt(psd ** 2 / 3 + ours[1] ** 2 / len(final))
            verdict = (f"within ({d:+.1f}, 2 se {2 * se:.1f})" if abs(d) <= 2 * se
                       else f"off by {d:+.1f} (2 se {2 * se:.1f})")
        else:
            verdict = "-"
        progress = ", ".join(f"s{s}: {v['reached']}" for s, v in sorted(table[method].items()))
        lines.append(f"| {method} | {pm:.1f} +- {psd:.1f} | {_fmt(ours)} | "
                     f"{_fmt(_mean_sd(last10) if last10 else None)} | "
                     f"{len(final)} ({progress or 'none started'}) | {verdict} |")
    lines += ["", "Paired by seed, round " + str(rounds) + " (ours) against the paper's "
              "difference of means:", "",
              "| difference | paper | ours, per seed | ours, mean +- sd |", "|---|---|---|---|"]
    for method in ("moon", "fedprox", "scaffold"):
        seeds = sorted(set(done[method]) & set(done["fedavg"]))
        diffs = [done[method][s]["final"] - done["fedavg"][s]["final"] for s in seeds]
        paper = PAPER[method][0] - PAPER["fedavg"][0]
        lines.append(f"| {method} - fedavg | {paper:+.1f} | "
                     f"{', '.join(f'{d:+.1f}' for d in diffs) or '-'} | "
                     f"{_fmt(_mean_sd(diffs)) if diffs else '-'} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    table = collect(args.rounds)
    text = render(table, args.rounds)
    (HERE / "table.md").write_text(text)
    (HERE / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(text, end="")


if __name__ == "__main__":
    main()
