#!/usr/bin/env bash
# MFCL at CPU scale (issue 15): TN, GN and BN client modules on the shared CIFAR-10 (M = 10,
# xi = 0.01; experiments/mfcl/cpu_cifar10.yaml), then the table of linear-probe accuracies.
# Resumes a stopped run instead of starting it again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
for norm in twin group batch; do
  dir=experiments/runs/mfcl_cpu/$norm
  if [ -f "$dir/config.yaml" ]; then
    fedjax-rcl resume "$dir"
  else
    fedjax-rcl mfcl experiments/mfcl/cpu_cifar10.yaml norm=$norm run_dir="$dir"
  fi
done
python - <<'PY'
import json
from pathlib import Path
rows = ["| client module norm | phase-1 test BCE | last NT-Xent | linear probe top-1 | train top-1 |",
        "|---|---|---|---|---|"]
for norm, label in (("twin", "TN"), ("group", "GN"), ("batch", "BN")):
    lines = [json.loads(x) for x in
             Path(f"experiments/runs/mfcl_cpu/{norm}/metrics.jsonl").read_text().splitlines()]
    p1 = [r for r in lines if r["phase"] == 1][-1]
    p2 = [r for r in lines if r["phase"] == 2][-1]
    pr = [r for r in lines if r["phase"] == "probe"][-1]
    rows.append(f"| {label} | {p1['test_bce']:.4f} | {p2['server_loss']:.4f} | "
                f"{pr['linear_probe_accuracy']:.4f} | {pr['linear_probe_train_accuracy']:.4f} |")
Path("experiments/results/mfcl_cpu/table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
