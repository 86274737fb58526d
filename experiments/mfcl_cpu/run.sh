#!/usr/bin/env bash
# MFCL at CPU scale (issue 15): TN, GN and BN client modules (BN also with batch statistics
# in phase 2) on CIFAR-10 as JPEGs (M = 10, xi = 0.01; experiments/mfcl/cpu_cifar10.yaml),
# for seeds 0, 1 and 2 (the seed draws the 1,000-image subset, the split, the initialisation
# and the augmentations), then the table of linear-probe accuracies. Resumes a stopped run
# instead of starting it again.
#   SEEDS="0" bash experiments/mfcl_cpu/run.sh   # one seed only
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-"0 1 2"}
for seed in $SEEDS; do
  # batch-bnbatch: BN whose phase-2 representations use each client's batch statistics.
  for variant in twin group batch batch-bnbatch; do
    case $variant in
      batch-bnbatch) args=(norm=batch mfcl.bn_statistics=batch) ;;
      *) args=(norm=$variant) ;;
    esac
    dir=experiments/runs/mfcl_cpu/$variant
    [ "$seed" = 0 ] || dir="$dir-seed$seed"
    if [ -f "$dir/config.yaml" ]; then
      fedjax-rcl resume "$dir"
    else
      fedjax-rcl mfcl experiments/mfcl/cpu_cifar10.yaml "${args[@]}" seed=$seed run_dir="$dir"
    fi
  done
done
python experiments/mfcl_cpu/table.py
