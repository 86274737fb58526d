#!/usr/bin/env bash
# Issue 17's reproductions, re-run as a user would at the terminal: interrupts during
# compilation, train into an interrupted run, two trains in the same second, resume while the
# train still runs, bad inputs, the plot's EMA label. Each prints what happened and the exit
# status. Offline (the embedded digits); about 3 minutes on 2 cores. Needs `fedjax-rcl` on
# PATH and, for the truncated-zip check, a CIFAR-10 JPEG zip ($CIFAR10_JPEG_ZIP, default
# data/cifar10-jpeg.zip; skipped without it).
#   bash experiments/terminal_checks/terminal_checks.sh > experiments/terminal_checks/terminal_checks.txt 2>&1
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d)
cd "$W"
J=(rounds=20 eval_every=5 checkpoint_every=5)
strip() {  # metrics.jsonl without wall times, for comparing results
  python - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print({k: v for k, v in r.items() if not k.endswith("_s")})
EOF
}
wait_for() {  # wait_for FILE PATTERN: until the pattern appears in the log (at most 60 s)
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
resume_and_compare() {  # resume_and_compare DIR: resume it, compare with the reference run
  fedjax-rcl resume "$1" > "$1.resume.log" 2>&1
  local rc=$? same="identical to the reference"
  diff <(strip ref/metrics.jsonl) <(strip "$1/metrics.jsonl") > /dev/null \
    || same="DIFFERS from the reference"
  echo "  resume $1: exit $rc; metrics $same"
}
interrupt() {  # interrupt SIGNAL DIR PATTERN DELAY: train into DIR, signal it DELAY s after
  fedjax-rcl train run_dir="$2" "${J[@]}" > "$2.log" 2>&1 &  # PATTERN appears in its log
  local pid=$!
  wait_for "$2.log" "$3"
  sleep "$4"
  kill "-$1" $pid
  wait $pid
}
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)   code: $(git -C "$ROOT" rev-parse --short HEAD)"

echo
echo "== 0. the uninterrupted reference run"
fedjax-rcl train run_dir=ref "${J[@]}" > ref.log 2>&1
echo "  exit $?; $(grep -c . ref/metrics.jsonl) evaluations"

echo
echo "== 1. SIGINT while compiling, 4 tries at different moments; then resume each"
for i in 1 2 3 4; do
  interrupt INT int$i "compiling" "0.$((i * 2))"
  echo "  try $i: exit $?; stderr/stdout ends: $(tail -2 int$i.log | tr '\n' ' ')"
done
for i in 1 2 3 4; do resume_and_compare int$i; done

echo
echo "== 2. SIGTERM during training, then resume"
interrupt TERM term "round 5/" 0
echo "  exit $?; ends: $(tail -1 term.log)"
resume_and_compare term

echo
echo "== 3. train into a run interrupted before its first evaluation"
interrupt INT early "compiling" 0
echo "  interrupted: exit $?"
cp early/config.yaml early.config.before
fedjax-rcl train run_dir=early "${J[@]}" lr=0.5 > early.again.log 2>&1
echo "  train again into it: exit $?: $(cat early.again.log | tr '\n' ' ')"
cmp -s early/config.yaml early.config.before && echo "  config.yaml unchanged" \
  || echo "  config.yaml CHANGED"
resume_and_compare early

echo
echo "== 4. two trains started in the same second, default run directories"
mkdir same && cd same
fedjax-rcl train rounds=1 > a.log 2>&1 &
a=$!
fedjax-rcl train rounds=1 > b.log 2>&1 &
b=$!
wait $a; ra=$?
wait $b; rb=$?
echo "  exits $ra and $rb; run directories: $(ls runs | tr '\n' ' ')"
cd ..

echo
echo "== 5. resume while the train of the same directory still runs"
fedjax-rcl train run_dir=busy rounds=40 eval_every=1 > busy.log 2>&1 &
pid=$!
wait_for busy.log "round 2/"
fedjax-rcl resume busy > busy.resume.log 2>&1
echo "  resume: exit $?: $(cat busy.resume.log | tr '\n' ' ')"
wait $pid
echo "  train: exit $?; metrics rounds in order: $(python -c "
import json
r = [json.loads(l)['round'] for l in open('busy/metrics.jsonl')]
print(r == list(range(1, 41)))")"

echo
echo "== 6. bad inputs (each: one line per problem, exit 2, no traceback)"
bad() {
  "$@" > bad.log 2>&1
  rc=$?
  tb=$(grep -c Traceback bad.log)
  echo "  \$ $*"
  echo "    exit $rc, tracebacks $tb: $(tail -4 bad.log | tr '\n' ' ' | cut -c1-400)"
}
bad fedjax-rcl partition --plot missing/dir/plot.png
bad fedjax-rcl train dataset=imagefolder: run_dir=b1
ZIP="${CIFAR10_JPEG_ZIP:-$ROOT/data/cifar10-jpeg.zip}"
if [ -f "$ZIP" ]; then
  head -c 300000 "$ZIP" > truncated.zip
  bad fedjax-rcl train dataset=imagefolder:truncated.zip run_dir=b2
else
  echo "  (truncated zip skipped: $ZIP absent)"
fi
bad fedjax-rcl train batch_size=100000 run_dir=b3
bad fedjax-rcl train lr=nan rounds=1.5 seed=-1 run_dir=b4
echo "  run directories created by the bad inputs: $(ls -d b1 b2 b3 b4 2>/dev/null | wc -l)"

echo
echo "== 7. the plot's EMA label and the EMA's definition with eval_every > 1"
fedjax-rcl train run_dir=ema rounds=10 eval_every=2 ema_decay=0.5 > ema.log 2>&1
echo "  exit $?; the run says: $(grep -i -m2 'ema' ema.log | tr '\n' ' ' | cut -c1-300)"
echo "  plot: $(ls ema/*.png) (its legend names the EMA as computed; look at it)"
echo
echo "work directory: $W"
