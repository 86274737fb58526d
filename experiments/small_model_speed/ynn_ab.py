"""XLA:CPU's YNNPACK fusions on and off for MOON's CNN rounds, alternating in one run.

The per-kernel profile (README) has the max-pooling fusions, which XLA:CPU hands to YNNPACK
(`ynn_fusion.*`), running at 1-4 GB/s. This runs `tools/bench_round.py`'s worker (the compiled
round, its default client layout, the paper's local work: 5 epochs of 10 steps of batch 50) for
FedAvg, MOON and FedRCL at 10 clients, with XLA's defaults and with
`--xla_cpu_experimental_ynn_fusion_type=` (no YNNPACK fusion), alternating, `--passes` times,
each in a fresh process; prints the medians and the paired ratios and writes them as JSON.
ynn_choice.json was taken with the CNNs' model entries set to no YNNPACK fusions
(`cpu_xla_options`), so there `defaults` is that choice and `reduce` stands for XLA's default
(the same speed in ynn_types.json).

    python experiments/small_model_speed/ynn_ab.py --passes 3 --json ynn_ab.json
    python experiments/small_model_speed/ynn_ab.py --model resnet18 --clients 5 \
        --algorithms fedavg fedrcl --passes 2 --json ynn_ab_resnet18.json
    python experiments/small_model_speed/ynn_ab.py --algorithms moon --passes 2 \
        --settings defaults no-ynn individual-dot dot eltwise reduce --json ynn_types.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_TYPE = "--xla_cpu_experimental_ynn_fusion_type="
SETTINGS = {"defaults": "", "no-ynn": _TYPE}
# One kind of YNNPACK fusion at a time (XLA's enum names; `--settings` picks among these).
SETTINGS.update({k.lower().replace("_", "-"): _TYPE + "LIBRARY_FUSION_TYPE_" + k
                 for k in ("INDIVIDUAL_DOT", "DOT", "ELTWISE", "REDUCE")})


def run(spec: dict, flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [sys.executable, str(ROOT / "tools" / "bench_round.py"), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "moon", "fedrcl"])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--model", default="cnn", help="bench_round's local work for it (ResNet-18:"
                    " one epoch of 100 samples, 2 steps)")
    ap.add_argument("--settings", nargs="+", default=["defaults", "no-ynn"],
                    choices=sorted(SETTINGS), help="the first is the baseline of the ratios")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    settings = {s: SETTINGS[s] for s in args.settings}
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine

    times: dict = {(a, s): [] for a in args.algorithms for s in settings}
    for p in range(args.passes):
        for a in args.algorithms:
            for s, flags in settings.items():
                spec = {"model": args.model, "algorithm": a, "clients": args.clients,
                        "mode": "vmap", "repeats": 3}
                r = run(spec, flags)
                times[(a, s)].append(r["round_s"])
                print(f"pass {p} {a:7s} {s:9s} {r['round_s']:.3f} s a round", flush=True)
    rows = []
    base = args.settings[0]
    for a in args.algorithms:
        d = times[(a, base)]
        for s in args.settings[1:]:
            n = times[(a, s)]
            ratios = [y / x for x, y in zip(d, n, strict=True)]
            row = {"algorithm": a, "setting": s, "baseline": base, "baseline_s": d,
                   "setting_s": n, "median_baseline_s": statistics.median(d),
                   "median_setting_s": statistics.median(n), "paired_ratios": ratios}
            if (base, s) == ("defaults", "no-ynn"):  # the first study's field names
                row.update(defaults_s=d, no_ynn_s=n, median_defaults_s=statistics.median(d),
                           median_no_ynn_s=statistics.median(n))
            rows.append(row)
            print(f"{a:7s} {base} {statistics.median(d):.3f} s, {s} "
                  f"{statistics.median(n):.3f} s, ratio per pass "
                  + ", ".join(f"{r:.2f}" for r in ratios))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": args.model,
                                         "clients": args.clients,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
