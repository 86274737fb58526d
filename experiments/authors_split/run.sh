#!/usr/bin/env bash
# The authors' own client split (skynbe/FedRCL @378beb4, client_data/CIFAR10/balanced/
# dirichlet0.3_clients100.txt) against our draw of the same law, at CPU scale: FedAvg and FedRCL
# (the released loss), ResNet-10 width 16, 100 rounds evaluated every round, seeds 0-2, each
# seed's initial weights and client sampling as its run with our split
# (experiments/runs/fidelity_cpu for seed 0, seeds_cpu for 1-2), so that per seed the two runs
# differ in the split alone. Chunks of 25 rounds, seed 0 first, the algorithms in turn; every
# call resumes where the last one stopped.
# The runs on our draw were made with earlier package code on another EPYC class, so a run on
# our draw made here now (OURS_AGAIN=1: <algo>-a0.3-s<seed>-our-draw, same seed and settings)
# measures what that alone moves: the float path, not the split.
#   AUTHORS_CHECKOUT=PATH/FedRCL LABELS=PATH bash experiments/authors_split/run.sh [SEED ...]
# LABELS: the binary release's training labels (a .npy, or a folder of data_batch_1..5, whole
# or prefixes); the mapped split is written to runs/authors_split/ (tools/authors_split.py map).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${CIFAR10_JPEG_ZIP:=data/cifar10-jpeg.zip}"
export CIFAR10_JPEG_ZIP
SPLIT=runs/authors_split/dirichlet0.3_clients100.txt
if [ ! -f "$SPLIT" ]; then
  : "${AUTHORS_CHECKOUT:?a checkout of skynbe/FedRCL}"
  : "${LABELS:?the release training labels}"
  python tools/authors_split.py map --labels "$LABELS" --archive "$CIFAR10_JPEG_ZIP" \
    --split "$AUTHORS_CHECKOUT/client_data/CIFAR10/balanced/dirichlet0.3_clients100.txt" \
    --out "$SPLIT"
fi
SEEDS=("${@:-0 1 2}")
if [ "${OURS_AGAIN:-0}" = 1 ]; then SUFFIX=-our-draw; SPLIT_ARGS="partition=dirichlet"
else SUFFIX=; SPLIT_ARGS="partition=file split_file=$SPLIT"; fi
for s in ${SEEDS[@]}; do
  init=$([ "$s" = 0 ] && echo false || echo true)  # as the seed's run with our split
  for rounds in 25 50 75 100; do
    for algo in fedavg fedrcl; do
      dir=experiments/runs/authors_split_cpu/$algo-a0.3-s$s$SUFFIX
      if [ -f "$dir/config.yaml" ]; then
        done_rounds=$(tail -1 "$dir/metrics.jsonl" 2>/dev/null | python -c \
          "import json,sys; print(json.loads(sys.stdin.read() or '{\"round\": 0}')['round'])")
        [ "$done_rounds" -ge "$rounds" ] && continue
        fedjax-rcl resume "$dir" rounds=$rounds --no-progress
      else
        fedjax-rcl train experiments/cifar10_resnet10w16.yaml algorithm=$algo seed=$s \
          init_threefry_partitionable=$init $SPLIT_ARGS rounds=$rounds \
          run_dir=$dir --no-progress
      fi
    done
  done
done
