#!/usr/bin/env bash
# Issue 29 item 3: FedRCL against FedAvg across heterogeneity, CIFAR-10 fidelity setting.
# Alpha 0.05 and IID (experiments/runs/heterogeneity_cpu: seed 0, and seeds 1 and 2 where
# they have run) beside alpha 0.1 and 0.3 (seed 0 in experiments/runs/fidelity_cpu, seeds 1
# and 2 in experiments/runs/seeds_cpu); a seed still running counts at the rounds it reached:
# EMA accuracy, each FedRCL's paired difference from FedAvg and the within-run count of rounds
# (of the 25 up to each reported round) in which its raw accuracy is above FedAvg's. Writes
# experiments/heterogeneity_cpu/report/report.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
dirs=()
for m in fedavg fedrcl fedrcl-paper; do
  for a in a0.05 a0.1 a0.3 iid; do
    for d in "experiments/runs/heterogeneity_cpu/$m-$a" "experiments/runs/fidelity_cpu/$m-$a" \
             experiments/runs/{seeds_cpu,heterogeneity_cpu}/"$m-$a"-s[12]; do
      [ -f "$d/metrics.jsonl" ] && dirs+=("$d")
    done
  done
done
fedjax-rcl report "${dirs[@]}" --at 50 100 --baseline fedavg --window 25 \
  --out experiments/heterogeneity_cpu/report
