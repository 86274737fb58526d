#!/usr/bin/env bash
# Issue 29 item 4: the representation analysis to round 100 on the fidelity setting (alpha
# 0.3, seed 0): FedAvg, FedSCL, FedRCL with the reference loss and in the paper's form; the
# global model's and the next round's first client's local model's penultimate features on
# 1,000 class-balanced test images every 5 rounds (effective rank, VCI and the measures that
# keep the mean: experiments/rank_under_collapse/README.md). Resumes a stopped run and skips a
# finished one (its checkpoints are not kept). Then the report:
# experiments/analysis_cpu/report_r100 (report.md, collapse.png).
set -eu
cd "$(dirname "$0")/../.."
for spec in "fedavg algorithm=fedavg" "fedscl algorithm=fedscl" "fedrcl algorithm=fedrcl" \
            "fedrcl-paper algorithm=fedrcl fedrcl.mining=none"; do
  set -- $spec
  name=$1; shift
  dir=experiments/runs/analysis_cpu_r100/$name
  done_rounds=$(python -c "import sys, pathlib; from fedjax_rcl.suite import rounds_done
print(rounds_done(pathlib.Path(sys.argv[1])))" "$dir")  # 0 for a run not started
  if [ "$done_rounds" -ge 100 ]; then
    echo "$dir: finished (round $done_rounds)"
  elif [ -f "$dir/config.yaml" ]; then
    python -m fedjax_rcl resume "$dir" --no-progress
  else
    python -m fedjax_rcl train experiments/cifar10_resnet10w16.yaml "$@" alpha=0.3 rounds=100 \
        analysis_every=5 checkpoint_every=5 run_dir="$dir" --no-progress
  fi
done
fedjax-rcl report experiments/runs/analysis_cpu_r100/{fedavg,fedscl,fedrcl,fedrcl-paper} \
  --out experiments/analysis_cpu/report_r100 --at 10 20 50 75 100 --baseline fedavg
