#!/usr/bin/env bash
# MFCL's Table 2, CIFAR-10 columns, at the paper's own scale on one GPU (issue 53, item 3):
# experiments/paper/mfcl_table2_cifar10.yaml (all 50,000 images, M = 10, full-width server,
# 150 server epochs, the probe on the projection and on the embedding, both controls) with
# TN, GN and BN client modules, in this order: xi = 0.01 seed 0; xi = 0.01 seeds 1 and 2;
# xi = 200 seed 0. Run directories: $RUNS_DIR/<norm>-xi<xi>-s<seed>.
#
# Resumable across device calls: a finished run is skipped, a started one continues with
# `fedjax-rcl resume` (either phase, identical to an uninterrupted run), and the script stops
# itself BUDGET_S seconds after it began (SIGTERM: the run ends at its last complete checkpoint,
# phase-1 rounds and phase-2 epochs every 5), so the device call returns inside its 10 minutes;
# the next call on the same warm machine carries on. Each call records the card and the
# versions ($RUNS_DIR/machine.txt), writes the table (experiments/mfcl_paper/table.py)
# and, with OUT set, puts in $OUT: runs.tar.gz (every run without checkpoints), table.md,
# machine.txt and table2_gpu.log.
#
# Device tool, prepared here once (as experiments/paper_resnet18_gpu/device_paper_resnet18.sh; both folders ignored via
# .git/info/exclude):
#   unzip -q "${CIFAR10_JPEG_ZIP:-data/cifar10-jpeg.zip}" -d /tmp/c10
#   tar cf - -C /tmp/c10 --sort=name train test | xz -9e > .devdata/cifar10.tar.xz
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#     omegaconf==2.4.0
# then each call (carry [".devdata", ".whl"], timeout_s 600):
#   BUDGET_S=540 bash experiments/mfcl_paper/table2_gpu.sh
# CPU dry run at a tiny size (200 of the built-in digits, batches of 8, 1 round, 1 server
# epoch, a width-8 server, a probe penalty from 2 values; every run of the list):
#   TINY=1 RUNS_DIR=/tmp/mfcl_paper_tiny bash experiments/mfcl_paper/table2_gpu.sh
# Other knobs: RUNS="twin-xi0.01-s0 ..." (a subset, in order), PHASE1_LR=0.05 (Table 12's
# phase-1 learning rate, which diverged on the CPU; the config runs 0.001), EXTRA="..." (more
# overrides for new runs); give those their own RUNS_DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
RUNS_DIR=${RUNS_DIR:-/tmp/mfcl_paper}
BUDGET_S=${BUDGET_S:-540}
MIN_S=${MIN_S:-45}  # a run is not started or resumed with less than this left
CONFIG=experiments/paper/mfcl_table2_cifar10.yaml
ALL="twin-xi0.01-s0 group-xi0.01-s0 batch-xi0.01-s0
     twin-xi0.01-s1 group-xi0.01-s1 batch-xi0.01-s1
     twin-xi0.01-s2 group-xi0.01-s2 batch-xi0.01-s2
     twin-xi200-s0 group-xi200-s0 batch-xi200-s0"
OVERRIDES=(${PHASE1_LR:+lr=$PHASE1_LR} ${EXTRA:-})
if [ -n "${TINY:-}" ]; then
  # The built-in digits by default (TINY_DATASET=imagefolder:... for the JPEGs): CIFAR-10's
  # 10,000 test images alone take minutes a run through phase 1's evaluation and the probe
  # on two CPU cores, and the dry run checks the script, not the data.
  OVERRIDES+=(dataset="${TINY_DATASET:-digits}" mfcl.train_samples=200 batch_size=8 rounds=1
              mfcl.server_epochs=1 mfcl.server_width=8 mfcl.server_batch_size=64
              "mfcl.probe_l2_grid=[0.01,1.0]" checkpoint_every=1)
fi
mkdir -p "$RUNS_DIR"
LOG=$RUNS_DIR/table2_gpu.log
exec > >(tee -a "$LOG") 2>&1

# The device image lacks omegaconf: wheels carried in .whl. The package runs from the tree.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# The data: the carried tar.xz on the device, else the config's (CIFAR10_JPEG_ZIP).
if [ -f .devdata/cifar10.tar.xz ] && [ -z "${TINY:-}" ]; then
  [ -d /tmp/cifar10/test ] || { mkdir -p /tmp/cifar10 \
    && tar xJf .devdata/cifar10.tar.xz -C /tmp/cifar10; } || exit 1
  OVERRIDES+=(dataset=imagefolder:/tmp/cifar10)
fi

{
  echo "== $(date -u +%FT%TZ) table2_gpu.sh ${TINY:+TINY} budget ${BUDGET_S}s"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  else
    lscpu | grep -E '^(Model name|CPU family|Model):'
    echo "avx2/avx512f: $(grep -o -w -E 'avx2|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  fi
  $PY -c "import sys, jax, jaxlib, flax, optax, numpy; print('python', sys.version.split()[0], \
'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', \
optax.__version__, 'numpy', numpy.__version__, jax.devices())"
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
} | tee -a "$RUNS_DIR/machine.txt"

finished() { [ -f "$1/metrics.jsonl" ] && grep -q '"phase": "probe"' "$1/metrics.jsonl"; }
stopped=""
for name in ${RUNS:-$ALL}; do
  norm=${name%%-xi*}; rest=${name#*-xi}; xi=${rest%-s*}; seed=${rest##*-s}
  dir=$RUNS_DIR/$name
  finished "$dir" && continue
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt "$MIN_S" ]; then stopped=$name; break; fi
  echo "== $name: ${left}s left in this call"
  if [ -f "$dir/config.yaml" ]; then
    timeout -s TERM -k 30 "$left" $PY -m fedjax_rcl resume "$dir" --no-progress
  else
    timeout -s TERM -k 30 "$left" $PY -m fedjax_rcl mfcl "$CONFIG" norm="$norm" alpha="$xi" \
      seed="$seed" "${OVERRIDES[@]}" run_dir="$dir" --no-progress
  fi
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then stopped=$name; break; fi
  # Exit 2: the configuration was refused (every run would be): stop. Others (a non-finite
  # loss, say) end that run only.
  if [ "$rc" -eq 2 ]; then echo "== $name: configuration refused (exit 2); stopping"; exit 2; fi
  [ "$rc" -eq 0 ] || echo "== $name: exit $rc (see above); going on with the next run"
done
if [ -n "$stopped" ]; then
  echo "== UNFINISHED at $stopped: call again on the same machine to continue"
else
  echo "== ALL RUNS FINISHED"
fi
$PY experiments/mfcl_paper/table.py --runs "$RUNS_DIR" --out "$RUNS_DIR/table.md"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  runs=$(cd "$RUNS_DIR" && ls -d ./*-xi*-s* 2> /dev/null)
  # shellcheck disable=SC2086
  [ -z "$runs" ] || tar czf "$OUT/runs.tar.gz" -C "$RUNS_DIR" --exclude=checkpoints \
    --exclude='*.lock' $runs
  cp "$RUNS_DIR/table.md" "$RUNS_DIR/machine.txt" "$LOG" "$OUT/"
fi
