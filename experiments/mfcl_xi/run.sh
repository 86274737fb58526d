#!/usr/bin/env bash
# MFCL's Table 2 claim at CPU scale (issue 30): TN, GN and BN client modules (BN with the
# statistics the paper describes, the averaged running ones: mfcl.bn_statistics=running) at
# Dirichlet xi = 0.01 for seeds 0, 1, 2 and at xi = 200 for seed 0
# (experiments/mfcl/cpu_cifar10_xi.yaml), in the order that answers the question first (the
# table's runs first, BN's two other readings for seeds 1 and 2 last); then the table
# (table.md). A stopped run resumes where it stopped (either phase); a finished one is skipped.
#   RUNS="batch-xi0.01-s0 twin-xi0.01-s0" bash experiments/mfcl_xi/run.sh   # some
set -euo pipefail
cd "$(dirname "$0")/../.."
# bnclient / bnbatch: the two other readings of BN (mfcl.bn_statistics=client, =batch) at
# xi = 0.01. Phase 1 does not depend on the reading, so each branches from the BN run's
# finished phase 1 (a copy of the run directory without its phase-2 checkpoints, resumed with
# the reading changed) and trains only its own phase 2 and probe.
# twinviews: TN with the variance of MFCL's code listing (mfcl.tn_variance=views) instead of
# its Eq. 2's pooled one -- the authors' form, to tell TN from our reading of it.
ALL="batch-xi0.01-s0 bnclient-xi0.01-s0 bnbatch-xi0.01-s0 twin-xi0.01-s0 group-xi0.01-s0
     batch-xi0.01-s1 twin-xi0.01-s1 group-xi0.01-s1
     batch-xi0.01-s2 twin-xi0.01-s2 group-xi0.01-s2
     batch-xi200-s0 twin-xi200-s0 group-xi200-s0
     twinviews-xi0.01-s0
     bnclient-xi0.01-s1 bnbatch-xi0.01-s1 bnclient-xi0.01-s2 bnbatch-xi0.01-s2"
R=experiments/runs/mfcl_xi
finished() { [ -f "$1/metrics.jsonl" ] && grep -q '"phase": "probe"' "$1/metrics.jsonl"; }
for name in ${RUNS:-$ALL}; do
  norm=${name%%-xi*}; rest=${name#*-xi}; xi=${rest%-s*}; seed=${rest##*-s}
  dir=$R/$name
  if finished "$dir"; then
    continue
  elif [ -f "$dir/config.yaml" ]; then
    fedjax-rcl resume "$dir" --no-progress
  elif [ "$norm" = bnclient ] || [ "$norm" = bnbatch ]; then
    src=$R/batch-xi$xi-s$seed
    finished "$src" || { echo "$name: waits for $src"; continue; }
    # The branch needs the source's final phase-1 checkpoint (finished runs' checkpoints are
    # not committed): without it the copy would train phase 1 again.
    [ -d "$src/checkpoints/phase1/$(sed -n 's/^rounds: //p' "$src/config.yaml")" ] || {
      echo "$name: $src has no phase-1 checkpoint here (rerun it, or skip this reading)"
      continue; }
    cp -a "$src" "$dir" && rm -rf "$dir/checkpoints/phase2"
    echo "# branched from $src after its phase 1 (cp -a, phase-2 checkpoints removed)" \
      >> "$dir/commands.txt"
    fedjax-rcl resume "$dir" "mfcl.bn_statistics=${norm#bn}" --force --no-progress
  elif [ "$norm" = twinviews ]; then
    fedjax-rcl mfcl experiments/mfcl/cpu_cifar10_xi.yaml norm=twin mfcl.tn_variance=views \
      alpha="$xi" seed="$seed" run_dir="$dir" --no-progress
  else
    fedjax-rcl mfcl experiments/mfcl/cpu_cifar10_xi.yaml norm="$norm" alpha="$xi" seed="$seed" \
      run_dir="$dir" --no-progress
  fi
done
python experiments/mfcl_xi/table.py
