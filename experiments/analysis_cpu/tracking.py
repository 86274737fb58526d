"""Which representation measure tracks collapse in the analysis runs to round 100 (issue 29,
item 4)? Reads experiments/runs/analysis_cpu_r100/*/metrics.jsonl and prints two Markdown
tables:

1. per run, the Spearman correlation over the analysed rounds between each measure of the global
   model and the test accuracy at that round (a measure that tracks collapse moves with
   recovery: positive for the ranks and the spread share, negative for the cosine and the VCI);
2. FedSCL against FedAvg round by round: at how many analysed rounds the measure calls FedSCL
   (at chance for most of its first 25 rounds, every feature pointing one way) the more
   collapsed model, and the smallest and largest gap between them in rounds 5-20, the
   collapsed phase.

    python experiments/analysis_cpu/tracking.py
"""

from __future__ import annotations

import json
from pathlib import Path

from scipy.stats import spearmanr

RUNS = Path(__file__).resolve().parents[1] / "runs" / "analysis_cpu_r100"
# measure, label, sign: +1 when a larger value means less collapse
MEASURES = (("effective_rank", "effective rank", +1), ("vci", "VCI", -1),
            ("effective_rank_uncentred", "uncentred rank", +1),
            ("mean_cosine", "mean cosine", -1), ("spread_share", "spread share", +1))


def rows(name: str) -> dict[int, dict]:
    path = RUNS / name / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "global_mean_cosine" in r:
            out[r["round"]] = r
    return out


def main() -> None:
    runs = {n: rows(n) for n in ("fedavg", "fedscl", "fedrcl", "fedrcl-paper")}
    print("| run | analysed rounds | " + " | ".join(m for _, m, _ in MEASURES) + " |")
    print("|---" * (len(MEASURES) + 2) + "|")
    for name, rs in runs.items():
        if len(rs) < 3:
            continue
        acc = [rs[r]["test_accuracy"] for r in sorted(rs)]
        cells = [f"{spearmanr([rs[r][f'global_{k}'] for r in sorted(rs)], acc)[0]:+.2f}"
                 for k, _, _ in MEASURES]
        print(f"| {name} | {min(rs)}-{max(rs)} ({len(rs)}) | " + " | ".join(cells) + " |")
    avg, scl = runs["fedavg"], runs["fedscl"]
    both = sorted(set(avg) & set(scl))
    early = [r for r in both if r <= 20]
    print()
    print("| measure | rounds calling FedSCL more collapsed | FedAvg, rounds 5-20 | FedSCL, "
          "rounds 5-20 |")
    print("|---|---|---|---|")
    for k, label, sign in MEASURES:
        more = sum(sign * (avg[r][f"global_{k}"] - scl[r][f"global_{k}"]) > 0 for r in both)
        a = [avg[r][f"global_{k}"] for r in early]
        s = [scl[r][f"global_{k}"] for r in early]
        print(f"| {label} | {more} of {len(both)} | {min(a):.4g}-{max(a):.4g} | "
              f"{min(s):.4g}-{max(s):.4g} |")


if __name__ == "__main__":
    main()
