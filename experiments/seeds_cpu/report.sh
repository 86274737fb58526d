#!/usr/bin/env bash
# Issue 29's seed table: seed 0 (experiments/runs/fidelity_cpu) beside seeds 1 and 2
# (experiments/runs/seeds_cpu), FedAvg, both FedRCLs, FedSCL and MOON at alpha 0.3 and 0.1:
# EMA accuracy mean ± sd over seeds, each method's paired per-seed difference from FedAvg and
# the within-run count of rounds (of the 25 up to each reported round) in which its raw
# accuracy is above FedAvg's. Runs not yet at a round are left out of that round's cells
# (n says how many seeds a cell holds). Writes experiments/seeds_cpu/report.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
dirs=()
for m in fedavg fedrcl fedrcl-paper fedscl moon; do
  for a in 0.3 0.1; do
    for d in "experiments/runs/fidelity_cpu/$m-a$a" experiments/runs/seeds_cpu/"$m-a$a"-s[12]; do
      [ -f "$d/metrics.jsonl" ] && dirs+=("$d")
    done
  done
done
fedjax-rcl report "${dirs[@]}" --at 50 75 100 --baseline fedavg --window 25 \
  --out experiments/seeds_cpu
