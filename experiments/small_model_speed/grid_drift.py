"""Why a FedRCL sweep member drifts from its run alone when the CNN's YNNPACK fusions are off.

test_grid's sweep test trains FedRCL (beta 0.5 and 3, seeds 0 and 1) in one program, where
beta is a traced value, and the member (beta 3, seed 1) alone, where beta is a constant; the
two programs may associate float sums differently, so the test allows rel 1e-4 / abs 1e-5.
With XLA's YNNPACK fusions off (the CNNs' candidate `cpu_xla_options`) the member and the run
alone differed past that (penalty 2.2e-4 relative). Two explanations: the two programs compute
something different (a bug), or the training is that sensitive to a rounding-level difference
(FedRCL's penalty gates each classmate pair on `similarity > threshold` and hard mining takes
a min and a top-k: a pair that crosses the gate changes the loss by a finite amount).

This separates them: under each XLA setting it measures (a) member vs alone, and (b) the run
alone against itself with lr moved by 2^-22 relative (about two float32 ulps: a difference of
the size reassociation makes, in one place, in one program). If (b) is as large as (a), the
drift is the training's sensitivity, not the sweep. FedAvg (no gate, no mining) is the
control; `--variants` then nudges FedRCL without the gate (beta 0, FedSCL) and without the
mining (`mining=none`) to find which of the two amplifies. It also reports the member with
the other beta (0.5, seed 1) against the run alone: how far a wrong beta lands. Each case runs
in a fresh process at the tests' XLA flags (tests/conftest.py).

    python experiments/small_model_speed/grid_drift.py --json grid_drift.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRID = ["num_clients=5", "participation=0.6", "local_epochs=1", "partition=dirichlet",
        "alpha=0.5", "balanced=false", "batch_size=32", "eval_every=1", "rounds=2"]
TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
XLA = {"ynn-default": "", "ynn-off": "--xla_cpu_experimental_ynn_fusion_type="}
LR = 0.01
LR_NUDGED = LR * (1 + 2.0 ** -22)
# FedRCL's run alone, nudged, without one or both of its discontinuities.
VARIANTS = {"fedscl-hard": ("fedscl", ()), "fedrcl-none": ("fedrcl", ("fedrcl.mining=none",)),
            "fedscl-none": ("fedscl", ("fedrcl.mining=none",))}
KEYS = ("train_loss", "penalty", "test_loss", "test_accuracy")


def worker(spec: dict) -> None:
    """Trains the member's grid or the run alone; prints its rows and final parameters."""
    import jax
    import numpy as np

    import fedjax_rcl
    from fedjax_rcl.training import restore_run

    out = Path(spec["out"])
    args = [f"algorithm={spec['algorithm']}", *GRID, f"lr={spec['lr']!r}", *spec["extra"]]
    if spec["kind"] == "grid":
        beta = ["fedrcl.beta=[0.5,3]"] if spec["algorithm"] == "fedrcl" else ["lr=[0.01,0.02]"]
        run = fedjax_rcl.train(None, *args, *beta, "seeds=[0,1]", f"run_dir={out}")
        # FedRCL's member beta 3, seed 1 is the fourth (beta 0.5, seed 1 the second); FedAvg's
        # lr 0.01, seed 1 the second.
        member = (3 if spec.get("other") is None else spec["other"]) \
            if spec["algorithm"] == "fedrcl" else 1
        run_dir = run.members[member].run_dir
    else:
        extra = ["fedrcl.beta=3"] if spec["algorithm"] == "fedrcl" else []
        run_dir = fedjax_rcl.train(None, *args, *extra, "seed=1", f"run_dir={out}").run_dir
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    exp, restored = restore_run(run_dir)
    leaves = jax.tree.leaves(exp.table.restore(restored.state).params)
    np.savez(f"{out}.npz", *[np.asarray(x) for x in leaves])
    print(json.dumps([{k: r.get(k) for k in KEYS if k in r} for r in rows]))


def case(algorithm: str, kind: str, lr: float, xla: str, tmp: Path, extra=(),
         other=None) -> tuple[list, Path]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{TEST_FLAGS} {XLA[xla]}".strip()
    out = tmp / f"{algorithm}-{kind}-{lr!r}-{xla}-{'-'.join(extra)}-{other}"
    spec = {"algorithm": algorithm, "kind": kind, "lr": lr, "out": str(out),
            "extra": list(extra), "other": other}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), Path(f"{out}.npz")


def differences(a: tuple[list, Path], b: tuple[list, Path]) -> dict:
    import numpy as np
    rows = {}
    for k in KEYS:
        pairs = [(x[k], y[k]) for x, y in zip(a[0], b[0], strict=True) if k in x]
        if pairs:
            rows[k + "_max_rel"] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)
    pa, pb = np.load(a[1]), np.load(b[1])
    rows["param_max_abs"] = max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa.files)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--algorithms", nargs="+", default=["fedrcl", "fedavg"])
    ap.add_argument("--xla", nargs="+", default=list(XLA), choices=list(XLA))
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    result = {"test_flags": TEST_FLAGS, "lr": LR, "lr_nudged": LR_NUDGED, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for xla in args.xla:
            for algorithm in args.algorithms:
                alone = case(algorithm, "alone", LR, xla, Path(tmp))
                grid = case(algorithm, "grid", LR, xla, Path(tmp))
                nudged = case(algorithm, "alone", LR_NUDGED, xla, Path(tmp))
                row = {"xla": xla, "algorithm": algorithm,
                       "member_vs_alone": differences(grid, alone),
                       "alone_lr_nudged_vs_alone": differences(nudged, alone)}
                if algorithm == "fedrcl":
                    other = case(algorithm, "grid", LR, xla, Path(tmp), other=1)
                    row["other_beta_member_vs_alone"] = differences(other, alone)
                print(json.dumps(row), flush=True)
                result["cases"].append(row)
            for name in args.variants:
                algorithm, extra = VARIANTS[name]
                alone = case(algorithm, "alone", LR, xla, Path(tmp), extra)
                nudged = case(algorithm, "alone", LR_NUDGED, xla, Path(tmp), extra)
                row = {"xla": xla, "variant": name, "overrides": list(extra),
                       "alone_lr_nudged_vs_alone": differences(nudged, alone)}
                print(json.dumps(row), flush=True)
                result["cases"].append(row)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
