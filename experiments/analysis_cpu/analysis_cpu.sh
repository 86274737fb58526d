#!/usr/bin/env bash
# Representation collapse over rounds on the fidelity setting (RESULTS.md, claim 3): FedAvg,
# FedRCL with the reference loss, FedRCL in the paper's form; the global model's and the next
# round's first client's local model's penultimate features on 1,000 class-balanced test
# images every 5 rounds (effective rank, VCI). Then the report:
# experiments/analysis_cpu/report_r20 (report.md, collapse.png).
set -u
cd "$(dirname "$0")/../.."
for spec in "fedavg algorithm=fedavg" "fedrcl algorithm=fedrcl" \
            "fedrcl-paper algorithm=fedrcl fedrcl.mining=none"; do
  set -- $spec
  name=$1; shift
  python -m fedjax_rcl train experiments/cifar10_resnet10w16.yaml "$@" alpha=0.3 rounds=20 \
      analysis_every=5 checkpoint_every=5 run_dir=experiments/runs/analysis_cpu/$name --no-progress
done
fedjax-rcl report experiments/runs/analysis_cpu/{fedavg,fedrcl,fedrcl-paper} \
  --out experiments/analysis_cpu/report_r20 --at 10 20
