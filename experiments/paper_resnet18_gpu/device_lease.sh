#!/bin/bash
# One device-tool call that serves a lease in the team's order: the speed script
# (experiments/paper_resnet18_gpu/gpu_fill.py, FILL_S seconds), then the paper-scale run(s) of
# device_paper_resnet18.sh for the rest of the call (CALL_S seconds in all). The data are
# decoded in the background (one core, low priority, CPU-only JAX) while the speed script runs.
# Call it again on the same warm machine: the speed script is not repeated (its files came back
# in the first call) and a stopped run resumes.
#
#   # here: prepare .devdata/cifar10.tar.xz and .whl as device_paper_resnet18.sh says; then
#   # device tool, carry [".devdata", ".whl"], timeout_s 600:
#   CALL_S=585 bash experiments/paper_resnet18_gpu/device_lease.sh
#   # next call, at once (the machine goes back after 30 s idle), with what is left:
#   CALL_S=190 bash experiments/paper_resnet18_gpu/device_lease.sh
#
# ONLY and EXTRA are passed on (default: the released-loss FedRCL, 500 rounds in bf16,
# evaluated every round as the config says, on the authors' own split when it is carried as
# .devdata/authors_dirichlet0.3_clients100.txt -- made here, once, with
#   python tools/authors_split.py map --labels LABELS --archive "$CIFAR10_JPEG_ZIP" \
#     --split FedRCL/client_data/CIFAR10/balanced/dirichlet0.3_clients100.txt \
#     --out .devdata/authors_dirichlet0.3_clients100.txt
# (docs/reproducing.md, "The split"); SPLIT_FILE= (empty) trains on the seed's draw instead). $OUT gets fill.tar.gz (the speed script's files)
# and the run's device.log, <run>.log, <run>.jsonl and records.tar.gz: within the tool's 8 files
# for up to two runs.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
FINAL=$OUT
mkdir -p "$FINAL" /tmp/fill
if [ ! -f /tmp/fill/env.json ] && [ "${FILL_S:-270}" != 0 ]; then
  ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site2 .whl/*.whl && mkdir -p /tmp/cifar10 \
    && tar xJf .devdata/cifar10.tar.xz -C /tmp/cifar10 \
    && JAX_PLATFORMS=cpu PYTHONPATH=/tmp/site2:$PWD nice -n 19 python3 -c \
      "from fedjax_rcl.data.sources import load_dataset as l; d = l('imagefolder:/tmp/cifar10'); print('decoded', d.train_images.shape)"
  ) > /tmp/prep.log 2>&1 &
  OUT=/tmp/fill timeout $(( ${FILL_S:-270} + 40 )) \
    python3 experiments/paper_resnet18_gpu/gpu_fill.py --budget-s "${FILL_S:-270}"
  echo "gpu_fill exit $? after $(( $(date +%s) - T0 )) s"
  wait
  cat /tmp/prep.log
  tar czf "$FINAL/fill.tar.gz" -C /tmp fill
fi
SPR=$(( ${CALL_S:-590} - ($(date +%s) - T0) - 50 ))
echo "paper run: SECONDS_PER_RUN=$SPR"
SPLIT_FILE=${SPLIT_FILE-.devdata/authors_dirichlet0.3_clients100.txt}
DEFAULT_EXTRA="precision=bf16 rounds=500"
if [ -n "$SPLIT_FILE" ] && [ -f "$SPLIT_FILE" ]; then
  DEFAULT_EXTRA="$DEFAULT_EXTRA partition=file split_file=$SPLIT_FILE"
fi
OUT=$FINAL ONLY=${ONLY:-fedrcl} SECONDS_PER_RUN=$SPR EXTRA="${EXTRA:-$DEFAULT_EXTRA}" \
  bash experiments/paper_resnet18_gpu/device_paper_resnet18.sh
echo "call done after $(( $(date +%s) - T0 )) s"
