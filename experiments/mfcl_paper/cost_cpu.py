"""Each phase of an MFCL run in the paper's setting (experiments/paper/mfcl_table2_cifar10.yaml),
timed on this machine at reduced sizes and extrapolated to the paper's size (issue 53, item 2).

The config is run unchanged but for ``mfcl.train_samples`` (each size in ``--sizes``, a random
subset drawn by the seed), ``rounds`` and ``mfcl.server_epochs`` (few), in fp32. From each
run's log and metrics:

- phase 1: the compile, and the last round's wall time (``round_s``: the clients' steps and
  the test-set reconstruction BCE on all 10,000 test images);
- phase 2: the representations (computed once, compile included), the epoch's compile, and
  the last epoch's wall time (``epoch_s``) per view pair trained (``steps * batch``);
- the probe: everything after phase 2 (features of the training and test images through
  the trained and the random server, the L-BFGS fits with their lambda selection, the
  pixels).

Extrapolation, linear in images x epochs: with two sizes n1 < n2 each per-round (per-run)
time t is fitted as ``t(n) = a + b n`` (``a``: what does not grow with the training set, the
test-set evaluation and the probe's test features); the paper's run is

    T = compile_1 + R (a_1 + b_1 N) + (a_r + b_r N) + compile_2
        + E (N // B) B c_2 + (a_p + b_p N)

with N = 50,000 images, R = 15 rounds, E = 150 epochs, B = 512 pairs a step, ``c_2`` the
measured seconds per trained pair (the largest size's), ``r`` the representations and ``p``
the probe. The probe's L-BFGS iterations need not be linear in N: its line is the roughest.

    python experiments/mfcl_paper/cost_cpu.py --sizes 500 1500 --out experiments/mfcl_paper
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

CONFIG = "experiments/paper/mfcl_table2_cifar10.yaml"
PAPER = {"images": 50_000, "rounds": 15, "epochs": 150, "batch": 512}


def machine() -> dict:
    """The CPU as lscpu names it, its AVX2 / AVX-512F flags and the cores this process sees."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    field = dict(re.findall(r"^([^:\n]+):\s*(.*)$", out, re.M))
    flags = set(field.get("Flags", "").split())
    return {"model_name": field.get("Model name"), "family": field.get("CPU family"),
            "model": field.get("Model"), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "cores": os.cpu_count(), "load_average": os.getloadavg()}


def timed_run(n: int, rounds: int, epochs: int, norm: str, run_dir: Path) -> dict:
    """One reduced run; the seconds of each phase."""
    from fedjax_rcl.config import load_config
    from fedjax_rcl.mfcl.run import MFCL_DEFAULTS, run_mfcl

    cfg = load_config(CONFIG, [f"mfcl.train_samples={n}", f"rounds={rounds}",
                               f"mfcl.server_epochs={epochs}", f"norm={norm}",
                               f"run_dir={run_dir}"], defaults=MFCL_DEFAULTS)
    lines: list[tuple[float, str]] = []

    def log(s: str) -> None:
        lines.append((time.perf_counter(), s))
        print(f"[n={n}] {s}", flush=True)

    t0 = time.perf_counter()
    run_mfcl(cfg, log=log)
    t_end = time.perf_counter()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    p1 = [r for r in rows if r.get("phase") == 1]
    p2 = [r for r in rows if r.get("phase") == 2]

    def at(prefix: str) -> float:
        return next(t for t, s in lines if s.startswith(prefix))

    compiled = [float(m.group(1)) for _, s in lines
                if (m := re.match(r"compiled in ([\d.]+) s", s))]
    reps = next(float(m.group(1)) for _, s in lines
                if (m := re.search(r"representations .* in ([\d.]+) s", s)))
    pairs = next(int(m.group(1)) for _, s in lines
                 if (m := re.search(r": (\d+) representation pairs", s)))
    batch = min(cfg.mfcl.server_batch_size, pairs)
    return {"images": n, "rounds": rounds, "epochs": epochs, "norm": norm,
            "load_s": at("run_dir:") - t0,
            "phase1_compile_s": compiled[0], "phase1_round_s": p1[-1]["round_s"],
            "representations_s": reps, "phase2_compile_s": compiled[1],
            "phase2_epoch_s": p2[-1]["epoch_s"], "phase2_pairs_per_epoch": (pairs // batch) * batch,
            "probe_s": t_end - at("linear probe on the frozen features"),
            "total_s": t_end - t0}


def extrapolate(small: dict, large: dict) -> dict:
    """The paper-size seconds of each phase (module docstring's formula)."""
    n1, n2, n = small["images"], large["images"], PAPER["images"]

    def line(key: str) -> float:
        b = (large[key] - small[key]) / (n2 - n1)
        return small[key] + b * (n - n1)

    pairs = (n // PAPER["batch"]) * PAPER["batch"]
    per_pair = large["phase2_epoch_s"] / large["phase2_pairs_per_epoch"]
    out = {"phase1_compile_s": large["phase1_compile_s"],
           "phase1_s": PAPER["rounds"] * line("phase1_round_s"),
           "representations_s": line("representations_s"),
           "phase2_compile_s": large["phase2_compile_s"],
           "phase2_s": PAPER["epochs"] * pairs * per_pair,
           "probe_s": line("probe_s")}
    out["total_s"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs=2, default=[500, 1500])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--norm", default="twin")
    ap.add_argument("--out", type=Path, default=Path("experiments/mfcl_paper"))
    args = ap.parse_args()
    info = {"machine": machine(), "config": CONFIG, "paper": PAPER, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(args.sizes):
            info["runs"].append(timed_run(n, args.rounds, args.epochs, args.norm,
                                          Path(tmp) / f"n{n}"))
    info["machine"]["load_average_after"] = os.getloadavg()
    info["extrapolated"] = extrapolate(*info["runs"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_cpu.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
