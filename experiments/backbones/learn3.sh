#!/usr/bin/env bash
# Does each backbone learn in 3 federated rounds from the command line? (issue 14)
# Embedded digits, 4 IID clients, 2 per round, FedAvg, client SGD lr 0.01 with momentum 0.9
# (experiments/backbones/README.md: the deep GroupNorm nets from scratch need momentum,
# and MobileNetV2 ~130 steps before its loss moves, hence its 15 local epochs; the ResNets
# take 2 to keep the check short).
#   bash experiments/backbones/learn3.sh [MODEL ...]
set -u
cd "$(dirname "$0")/../.."
out=experiments/backbones/runs
common=(dataset=digits num_clients=4 participation=0.5 partition=iid algorithm=fedavg
        rounds=3 lr=0.01 momentum=0.9 batch_size=50 checkpoint_every=0 --no-progress)
for model in "${@:-cnn pfl_cnn vgg9 squeezenet shufflenet shufflenet_v2 resnet34 resnet50 mobilenet_v2}"; do
  for m in $model; do
    case "$m" in
      mobilenet_v2) epochs=15 ;;  # ~105 steps a round: it starts moving after ~130
      resnet34|resnet50) epochs=2 ;;  # 14 steps a round: the cost of a 3-round check
      *) epochs=5 ;;
    esac
    rm -rf "$out/$m"
    echo "== $m: fedjax-rcl train model=$m local_epochs=$epochs ${common[*]} run_dir=$out/$m"
    python -m fedjax_rcl train model="$m" local_epochs=$epochs "${common[@]}" run_dir="$out/$m"
  done
done
