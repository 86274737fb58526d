#!/usr/bin/env bash
# MOON's Table 1 (CIFAR-10) on this machine's CPU, in resumable chunks: the runs live under
# ~/.cache (their checkpoints never enter the repository); their records (config, metrics,
# commands, environment) are copied into experiments/runs/moon_table1_cifar10 after each pass.
#   CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip bash experiments/moon_table1/run.sh [--only RUN ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
SUITE=experiments/paper/moon_table1_cifar10.yaml
CACHE=${MOON_TABLE1_RUNS:-$HOME/.cache/fedjax-rcl/runs/moon_table1_cifar10}
RECORDS=experiments/runs/moon_table1_cifar10
sync_records() {
  for d in "$CACHE"/*/; do
    [ -f "$d/config.yaml" ] || continue
    mkdir -p "$RECORDS/$(basename "$d")"
    for f in config.yaml metrics.jsonl commands.txt environment.jsonl; do
      [ -f "$d/$f" ] && cp "$d/$f" "$RECORDS/$(basename "$d")/$f"
    done
  done
}
(while sleep 300; do sync_records; done) &
SYNC=$!
trap 'kill $SYNC 2>/dev/null || true; sync_records' EXIT
# Stop with a SIGTERM to the process group (kill -TERM -PGID): the suite saves the round in
# progress and stops; this script waits for it, so the records are copied after, not before.
fedjax-rcl suite run "$SUITE" --chunk "${CHUNK:-10}" --runs-dir "$CACHE" "$@" &
RUN=$!
trap 'wait $RUN; exit 143' TERM INT
wait $RUN
