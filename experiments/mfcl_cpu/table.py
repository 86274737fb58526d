"""The table of experiments/mfcl_cpu/run.sh: linear-probe top-1 of MFCL with TN, GN and
BN client modules, per seed, with mean and standard deviation over the seeds present."""
import json
import statistics
from pathlib import Path

RUNS = Path("experiments/runs/mfcl_cpu")
NORMS = (("twin", "TN"), ("group", "GN"), ("batch", "BN"),
         ("batch-bnbatch", "BN, batch statistics in phase 2"))


def last(rows, phase):
    return [r for r in rows if r["phase"] == phase][-1]


def main():
    seeds = sorted({0} | {int(p.name.rsplit("-seed", 1)[1]) for p in RUNS.glob("*-seed*")})
    result = {}
    for norm, _ in NORMS:
        for seed in seeds:
            run = RUNS / (norm if seed == 0 else f"{norm}-seed{seed}")
            path = run / "metrics.jsonl"
            if not path.is_file():
                continue
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            if not any(r["phase"] == "probe" for r in rows):
                continue
            result[norm, seed] = (last(rows, 1), last(rows, 2), last(rows, "probe"))
    lines = ["| client module norm | seed | phase-1 test BCE | last NT-Xent | linear probe top-1 "
             "| probe train top-1 |", "|---|---|---|---|---|---|"]
    for norm, label in NORMS:
        for seed in seeds:
            if (norm, seed) in result:
                p1, p2, pr = result[norm, seed]
                lines.append(f"| {label} | {seed} | {p1['test_bce']:.4f} | "
                             f"{p2['server_loss']:.4f} | {pr['linear_probe_accuracy']:.4f} | "
                             f"{pr['linear_probe_train_accuracy']:.4f} |")
    lines += ["", "| client module norm | seeds | linear probe top-1, mean | sd |",
              "|---|---|---|---|"]
    for norm, label in NORMS:
        accs = [result[norm, s][2]["linear_probe_accuracy"] for s in seeds if (norm, s) in result]
        sd = f"{statistics.stdev(accs):.4f}" if len(accs) > 1 else "—"
        lines.append(f"| {label} | {len(accs)} | {statistics.mean(accs):.4f} | {sd} |"
                     if accs else f"| {label} | 0 | — | — |")
    text = "\n".join(lines) + "\n"
    Path("experiments/mfcl_cpu/table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
