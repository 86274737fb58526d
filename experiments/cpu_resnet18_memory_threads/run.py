"""Do fresh pages or the round's threads cost the CPU ResNet-18 round its time?

The FedRCL ResNet-18 round of ``tools/bench_round.py`` (5 clients one after another, 2 local
steps of batch 50, synthetic CIFAR-shaped images, fp32) timed in one process per setting,
settings in rotation, against PyTorch's eager round (``fedjax_rcl.bench.torch_reference``), with
the process's minor page faults per timed round:

* ``default``: as shipped.
* ``no-fresh-pages``: glibc keeps what it frees (one arena, no ``mmap`` for large blocks, no
  trimming), so from the second round on XLA:CPU's working memory is reused, not mapped anew.
* ``huge-pages``: glibc asks for transparent huge pages (``glibc.malloc.hugetlb=1``): the
  same memory mapped anew each round, in 2 MB pages, so about 500x fewer faults.
* ``torch``: PyTorch 2.13 eager, as shipped.

    python experiments/cpu_resnet18_memory_threads/run.py [--passes 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENVS = {
    "default": {},
    "no-fresh-pages": {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                       "MALLOC_TRIM_THRESHOLD_": str(64 << 30)},
    "huge-pages": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "torch": {},
}
CLIENTS, STEPS, BATCH, WARM, TIMED = 5, 2, 50, 2, 3


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(setting: str) -> dict:
    sys.path.insert(0, str(HERE.parents[1] / "tools"))
    from bench_round import fake_cifar  # the benchmark's synthetic CIFAR-shaped images

    data = fake_cifar(100 * 100)
    if setting == "torch":
        from fedjax_rcl.bench import torch_reference
        r = torch_reference.round_seconds("resnet18", "fedrcl", clients=CLIENTS, steps=STEPS,
                                          batch=BATCH, data=data, epochs=1,
                                          repeats=WARM + TIMED)
        times, faults = r["round_s_all"][WARM:], r["minor_faults_all"][WARM:]
    else:
        import jax

        from fedjax_rcl.config import Config
        from fedjax_rcl.experiment import build
        cfg = Config(dataset="fake", model="resnet18", algorithm="fedrcl", num_clients=100,
                     participation=CLIENTS / 100, partition="iid", local_epochs=1,
                     batch_size=BATCH, clients_in_parallel=1)
        exp = build(cfg, data)
        step, state = exp.compile_rounds(1), exp.state
        times, faults = [], []
        for r in range(WARM + TIMED):
            f, t = _faults(), time.perf_counter()
            state, _ = step(state, 1)
            jax.block_until_ready(state)
            if r >= WARM:
                times.append(time.perf_counter() - t)
                faults.append(_faults() - f)
    return {"setting": setting, "round_s": times, "minor_faults": faults}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--settings", nargs="+", default=list(ENVS))
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker)))
        return
    rows = []
    for k in range(a.passes):
        for s in a.settings:
            env = {**os.environ, **ENVS[s]}
            out = subprocess.run([sys.executable, __file__, "--worker", s], env=env, text=True,
                                 capture_output=True, check=True).stdout.strip().splitlines()[-1]
            row = {"pass": k, **json.loads(out)}
            rows.append(row)
            print(f"pass {k} {s:15s} rounds {' '.join(f'{t:.3f}' for t in row['round_s'])} s, "
                  f"faults {statistics.median(row['minor_faults']):.0f} a round", flush=True)
    summary = {}
    for s in a.settings:
        med = [statistics.median(r["round_s"]) for r in rows if r["setting"] == s]
        summary[s] = {"round_s_per_pass": med, "round_s": statistics.median(med),
                      "minor_faults": statistics.median(
                          f for r in rows if r["setting"] == s for f in r["minor_faults"])}
    for s, v in summary.items():
        passes = ", ".join(f"{m:.3f}" for m in v["round_s_per_pass"])
        print(f"{s:15s} {v['round_s']:.3f} s (passes {passes}), "
              f"{v['minor_faults']:.0f} faults a round")
    info = dict(ln.split(":", 1) for ln in open("/proc/cpuinfo").read().split("\n\n")[0]
                .splitlines() if ":" in ln)
    info = {k.strip(): v.strip() for k, v in info.items()}
    cpu = (f"{info.get('model name', platform.processor())}, family {info.get('cpu family')} "
           f"model {info.get('model')}, "
           + " ".join(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx"))))
    import jax
    Path(a.out).write_text(json.dumps({
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                    "jax": jax.__version__},
        "settings": {s: ENVS[s] for s in a.settings}, "summary": summary, "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()
