#!/usr/bin/env bash
# MFCL's Table 2 claim at CPU scale (issue 30): TN, GN and BN client modules (BN with the
# statistics the paper describes, the averaged running ones: mfcl.bn_statistics=running) at
# Dirichlet xi = 0.01 for seeds 0, 1, 2 and at xi = 200 for seed 0
# (experiments/mfcl/cpu_cifar10_xi.yaml), in the order that answers the question first, then
# the table (table.md). A stopped run resumes where it stopped (either phase); a finished one
# is skipped.
#   RUNS="batch-xi0.01-s0 twin-xi0.01-s0" bash experiments/results/mfcl_xi/run.sh   # some
set -euo pipefail
cd "$(dirname "$0")/../../.."
ALL="batch-xi0.01-s0 twin-xi0.01-s0 group-xi0.01-s0
     batch-xi0.01-s1 twin-xi0.01-s1 group-xi0.01-s1
     batch-xi0.01-s2 twin-xi0.01-s2 group-xi0.01-s2
     batch-xi200-s0 twin-xi200-s0 group-xi200-s0"
for name in ${RUNS:-$ALL}; do
  norm=${name%%-xi*}; rest=${name#*-xi}; xi=${rest%-s*}; seed=${rest##*-s}
  dir=experiments/runs/mfcl_xi/$name
  if [ -f "$dir/metrics.jsonl" ] && grep -q '"phase": "probe"' "$dir/metrics.jsonl"; then
    continue
  elif [ -f "$dir/config.yaml" ]; then
    fedjax-rcl resume "$dir" --no-progress
  else
    fedjax-rcl mfcl experiments/mfcl/cpu_cifar10_xi.yaml norm="$norm" alpha="$xi" seed="$seed" \
      run_dir="$dir" --no-progress
  fi
done
python experiments/results/mfcl_xi/table.py
