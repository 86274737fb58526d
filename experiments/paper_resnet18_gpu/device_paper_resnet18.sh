#!/bin/bash
# FedRCL at the paper's scale on a lent GPU (issue 12, item 2): GroupNorm ResNet-18 (width 64),
# CIFAR-10 (the team's JPEG zip, a JPEG re-encoding), Dirichlet 0.3, 100 clients, 5 % per round,
# 5 local epochs of batch 50 -- experiments/paper/cifar10_resnet18.yaml unchanged but for the data
# path.
# FedAvg, FedRCL (the authors' released loss) and FedRCL (the paper's form, mining=none) run side
# by side on the one GPU for SECONDS each, then stop with SIGINT (a clean stop: exit 130, every
# evaluated round already in metrics.jsonl). Written for the device tool's 15-minute lease:
#
#   # here, once: the zip re-packed as a solid tar.xz (18 MB; the zip's 60,000 JPEG headers
#   # compress away), and the one package the device image lacks
#   unzip -q "${CIFAR10_JPEG_ZIP:-data/cifar10-jpeg.zip}" -d /tmp/c10
#   tar cf - -C /tmp/c10 --sort=name train test | xz -9e > .devdata/cifar10.tar.xz
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl omegaconf==2.4.0
#   # there (carry .devdata and .whl):
#   SECONDS_PER_RUN=400 bash experiments/paper_resnet18_gpu/device_paper_resnet18.sh
#   # one run a call (500 rounds in bf16, one client at a time), evaluated every round as the
#   # config says, so that its EMA is the paper's per-round EMA (issue 28's runs evaluated every
#   # 10th round took 306-314 s with compiling on an H200; every round adds 450 evaluations,
#   # not yet timed):
#   ONLY=fedavg SECONDS_PER_RUN=480 EXTRA="precision=bf16 rounds=500" \
#     bash experiments/paper_resnet18_gpu/device_paper_resnet18.sh
#   # A run stopped by the call's end (SIGINT: it saves the round it reached) resumes when the
#   # same command runs again on the same warm machine; another EXTRA (seed=1, alpha=0.1) is
#   # another run directory, so it starts anew.
#
# The data: the team's CIFAR-10 zip, a JPEG re-encoding of CIFAR-10 (32x32 JPEG files, quality
# 75 with 4:2:0 chroma subsampling), not the lossless binary release. The tar.xz holds the
# zip's JPEG files unchanged: decoded from the folder they give arrays equal to those decoded
# from the zip (checked: every array equal, and the named CIFAR-10 mean/std recognised from the
# folder as from the zip). Results: $OUT/<run>.jsonl, $OUT/<run>.log and $OUT/records.tar.gz
# (the run directories without checkpoints); on the host,
#   python experiments/paper_resnet18_gpu/import_records.py CALL_DIR [CALL_DIR ...]
# files them under experiments/runs/paper_gpu_h200_every_round/ (the calls of one run in
# order); experiments/paper_resnet18_gpu/README.md records what came back.
set -u
OUT=${OUT:-/tmp/out}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-400}
EXTRA=${EXTRA:-}  # more overrides, e.g. a CPU smoke test: EXTRA="model=resnet10 width=8"
ONLY=${ONLY:-fedavg fedrcl fedrcl-paper}  # which of the three runs (they share the GPU)
declare -A RUNS=(
  [fedavg]="algorithm=fedavg"
  [fedrcl]="algorithm=fedrcl"
  [fedrcl-paper]="algorithm=fedrcl fedrcl.mining=none"
)
for name in $ONLY; do
  [ -n "${RUNS[$name]:-}" ] || { echo "ONLY: unknown run $name (${!RUNS[*]})"; exit 2; }
done
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # three processes share the GPU
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc
python3 -c "import jax, flax, optax, orbax.checkpoint, chex, numpy; \
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, \
'numpy', numpy.__version__, jax.devices())" || exit 1
mkdir -p /tmp/cifar10 && tar xJf .devdata/cifar10.tar.xz -C /tmp/cifar10 || exit 1
DATA=imagefolder:/tmp/cifar10
# Decode once into the cache, so the three runs start from the cached arrays.
python3 -c "from fedjax_rcl.data.sources import load_dataset as l; d = l('$DATA'); \
print(d.train_images.shape, d.mean, d.std)" || exit 1

# Each run's directory is named by the run and EXTRA, so that another seed or alpha on the same
# machine is a new run, never the resumption of an earlier one.
run_dir() { echo "/tmp/runs/$1$(printf '%s' "${EXTRA:+ $EXTRA}" | tr ' /' '_-')"; }
pids=()
for name in $ONLY; do
  dir=$(run_dir "$name")
  # A run stopped at the end of an earlier call (SIGINT saves the round it reached) resumes
  # here on the same warm machine; a fresh machine has no /tmp/runs and starts it anew.
  if [ -d "$dir/checkpoints" ]; then
    echo "$name: resuming $dir"
    timeout -s INT -k 30 "$SECONDS_PER_RUN" python3 -m fedjax_rcl resume "$dir" \
      --no-progress >> "$OUT/$name.log" 2>&1 &
  else
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "$SECONDS_PER_RUN" python3 -m fedjax_rcl train \
      experiments/paper/cifar10_resnet18.yaml dataset=$DATA ${RUNS[$name]} \
      checkpoint_every=1000 run_dir="$dir" $EXTRA --no-progress > "$OUT/$name.log" 2>&1 &
  fi
  pids+=($!)
done
wait "${pids[@]}"  # (a bare `wait` would also wait for the tee above, forever)
dirs=()
for name in $ONLY; do
  cp "$(run_dir "$name")/metrics.jsonl" "$OUT/$name.jsonl"
  tail -n 3 "$OUT/$name.log"
  dirs+=("$(basename "$(run_dir "$name")")")
done
# The runs' own records (config.yaml, commands.txt, environment.jsonl, metrics.jsonl), without
# checkpoints, for import_records.py: one file, so that with device.log, the logs and the
# metrics copies three runs are 8 files.
tar czf "$OUT/records.tar.gz" -C /tmp/runs --exclude=checkpoints "${dirs[@]}"
python3 - "$OUT" <<'EOF'
import json, pathlib, statistics, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    rows = [json.loads(l) for l in p.open() if '"test_accuracy"' in l]
    if not rows:
        print(p.stem, "no evaluated round"); continue
    last, best = rows[-1], max(rows, key=lambda r: r["test_accuracy"])
    s = statistics.median(r["round_s"] for r in rows[5:] or rows)
    print(f"{p.stem}: rounds {last['round']}, acc {last['test_accuracy']:.4f}, "
          f"EMA {last['test_accuracy_ema']:.4f}, best {best['test_accuracy']:.4f}@{best['round']}, "
          f"median {s:.3f} s/round")
EOF
