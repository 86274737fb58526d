"""One short GPU window, prepared: what a lent accelerator should measure first, in one call.

Phases, each with its own share of the time budget (a phase that runs out stops starting new
configurations and the next phase begins):

1. ``env.json``: the GPU (nvidia-smi), the processor, the versions of JAX, jaxlib, Flax, optax,
   PyTorch and pfl, the device JAX sees.
2. ``layouts.json``: client-steps per second of the compiled round for ``pfl_cnn``,
   ``resnet18``, ``resnet10`` at width 16 and ``cnn`` with the paper's local work (5 epochs of
   10 steps of batch 50), in stages, most telling first: the two layouts the default chooses
   between (every client side by side, ``vmap``, grouped convolutions; one client after
   another inside the program) at 10 clients, then at 5 and 50, then the other layouts at 5
   (``vmap`` as such, side by side with the patch convolutions, where the client axis becomes
   the batch of a ``dot_general``, and a Python loop over the jitted client update)
   (``tools/bench_round.py``); ``gpu_check.md`` adds the default's ratio to the best layout
   and the cost model's threshold fitted to the table (``tools/fit_layout.py``), to be copied
   into ``fedjax_rcl/engine/layout.py``.
3. ``precision.json``: the FedRCL ResNet-18 round of 5 clients in fp32, bf16 and fp16
   (``precision=``), one client after another.
4. ``grid.json``: three seeds of the digits job (MOON's small CNN side: ``model=cnn``) as one
   compiled program, runs one after another inside it and all side by side (``vmap``), against
   three separate processes (``tools/bench_grid.py``): whether a small model's runs fill the
   GPU better together.
5. ``pfl.json``: pfl-research's CIFAR-10 workload, ours against pfl 0.6.0's own simulation
   with PyTorch on the same GPU (``tools/bench_pfl.py``): in its default single process and
   as its guide to fast simulations recommends for one GPU, 2, 3 and 4 processes sharing it
   (pfl's ``PFL_WORKER_ADDRESSES``, over gloo: NCCL refuses processes that share a device), so
   the ratio is taken against pfl's fastest count.
6. ``gpu_check.md``: the tables of all phases, and ``gpu_check.log``: everything printed.

Seven files in ``$OUT``, within the device tool's eight. Packages the device image lacks travel
as wheels in ``.whl`` (1.1 MB; keep the folder out of git); the script installs them into
``/tmp/site`` first. Here, once::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
        omegaconf==2.4.0 pfl==0.6.0 dp-accounting==0.5.1 dm-tree==0.1.10 \
        multiprocess==0.70.19 dill==0.4.1 prv-accountant==0.2.0

On the device (carry ``.whl``)::

    python3 tools/gpu_check.py            # OUT is set by the device tool; about 9 minutes

Dry run on a CPU with tiny sizes, every phase, so a GPU window is not spent on typos::

    DRY=1 OUT=/tmp/gpu_check python tools/gpu_check.py --pfl-python /tmp/pflvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package, for the stages' merge and the summary's fit


def _log(out: Path, text: str) -> None:
    print(text, flush=True)
    with open(out / "gpu_check.log", "a") as f:
        f.write(text + "\n")


def _run(out: Path, cmd: list[str], budget: float, env: dict) -> int:
    """Runs one phase's command with a hard time limit, its output into the log."""
    _log(out, f"$ {' '.join(cmd)}  (limit {budget:.0f} s)")
    with open(out / "gpu_check.log", "a") as log:
        try:
            return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(budget, 1)).returncode
        except subprocess.TimeoutExpired:
            _log(out, f"  stopped at its limit of {budget:.0f} s")
            return 124


def _install_wheels(out: Path, env: dict) -> None:
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return
    site = Path("/tmp/site")
    code = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                           "--target", str(site), *map(str, wheels)]).returncode
    _log(out, f"installed {len(wheels)} carried wheels into {site} (exit {code})")
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(site))  # the summary's fit (tools/fit_layout.py) imports the package


def _merge_layouts(paths: list[Path], dest: Path) -> None:
    """One ``layouts.json`` from the stages' files (each stage is one ``bench_round.py`` run;
    a stage stopped at its limit wrote nothing and adds nothing)."""
    from fedjax_rcl.engine.layout import merge_tables

    merged = merge_tables([json.loads(p.read_text()) for p in paths], [int(p.stem) for p in paths])
    if merged is not None:
        dest.write_text(json.dumps(merged, indent=1))


def environment(env: dict) -> dict:
    info = {"python": platform.python_version(), "cpu_count": os.cpu_count()}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                            "clocks.max.sm", "--format=csv,noheader"], capture_output=True,
                           text=True)
        info["nvidia_smi"] = q.stdout.strip()
    probe = ("import json, jax, jaxlib, flax, optax; d = {'jax': jax.__version__, 'jaxlib': "
             "jaxlib.__version__, 'flax': flax.__version__, 'optax': optax.__version__, "
             "'backend': jax.default_backend(), 'devices': [x.device_kind for x in "
             "jax.devices()]}\ntry:\n import torch; d['torch'] = torch.__version__; "
             "d['torch_cuda'] = torch.cuda.is_available()\nexcept ImportError: pass\n"
             "try:\n import importlib.metadata as m; d['pfl'] = m.version('pfl')\n"
             "except Exception: pass\nprint(json.dumps(d))")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    info.update(json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0
                else {"probe_error": got.stderr[-2000:]})
    sys.path.insert(0, str(ROOT / "tools"))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", 540)),
                    help="the whole script's time (default 540 s: 9 minutes)")
    ap.add_argument("--pfl-python", default=sys.executable,
                    help="the interpreter with pfl 0.6.0 and PyTorch (default: this one)")
    args = ap.parse_args()
    dry = os.environ.get("DRY") == "1"
    out = Path(os.environ.get("OUT") or "/tmp/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}:{ROOT / 'tools'}:{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # processes share the GPU
    _install_wheels(out, env)
    info = environment(env)
    (out / "env.json").write_text(json.dumps(info, indent=1))
    _log(out, f"environment: {json.dumps(info)}")
    on_gpu = info.get("backend") == "gpu"
    device = "cuda" if on_gpu else "cpu"

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    bench = [sys.executable, str(ROOT / "tools" / "bench_round.py"), "--no-append"]
    if dry:  # every phase, at sizes a CPU does in a few minutes
        stages = [["--models", "cnn", "resnet10:8", "--clients", "2", "--modes", "side-by-side",
                   "one-at-a-time"],
                  ["--models", "cnn", "--clients", "1", "--modes", "vmap",
                   "side-by-side-patches", "sequential"]]
        layouts = [*bench, "--algorithms", "fedavg"]
        precision = [*bench, "--models", "resnet10:8", "--algorithms", "fedrcl", "--clients",
                     "2", "--modes", "one-at-a-time", "--precisions", "fp32", "bf16", "fp16"]
        pfl_rounds, pfl_passes, pfl_workers = 2, 1, ["1", "2"]
        grid_rounds, grid_seeds = 2, ["0", "1"]
    else:
        # Most telling first: the two layouts the default chooses between, at 10 clients for
        # every model (pfl's CNN was never measured on a GPU), then at 5 and 50, then the
        # other layouts. Compiling takes 8-33 s a configuration on an H200.
        models = ["pfl_cnn", "resnet18", "resnet10:16", "cnn"]
        stages = [["--models", *models, "--clients", "10", "--modes", "side-by-side",
                   "one-at-a-time"],
                  ["--models", *models, "--clients", "5", "50", "--modes", "side-by-side",
                   "one-at-a-time"],
                  ["--models", "resnet18", "cnn", "--clients", "5", "--modes",
                   "side-by-side-patches", "vmap", "sequential"]]
        layouts = [*bench, "--paper-local-work", "--algorithms", "fedavg", "--timeout", "90"]
        precision = [*bench, "--paper-local-work", "--models", "resnet18", "--algorithms",
                     "fedrcl", "--clients", "5", "--modes", "one-at-a-time", "--precisions",
                     "fp32", "bf16", "fp16", "--timeout", "90"]
        pfl_rounds, pfl_passes, pfl_workers = 5, 3, ["1", "2", "3", "4"]
        grid_rounds, grid_seeds = 10, ["0", "1", "2"]
    # Shares of the whole budget: layouts 42 %, precision 22 %, the grid 12 %, pfl the rest.
    total = args.budget_s
    layouts_end = time.perf_counter() + 0.42 * total
    parts = Path("/tmp/gpu_check_layouts")
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(parents=True)
    for i, stage in enumerate(stages):
        budget = layouts_end - time.perf_counter()
        if budget < 30:
            _log(out, f"layouts: stage {i + 1} not started: out of time")
            continue
        _run(out, [*layouts, *stage, "--json", str(parts / f"{i}.json"), "--budget-s",
                   f"{budget - 25:.0f}"], budget, env)
        _merge_layouts(sorted(parts.glob("*.json")), out / "layouts.json")
    _run(out, [*precision, "--json", str(out / "precision.json"), "--budget-s",
               f"{0.22 * total - 30:.0f}"], 0.22 * total, env)
    _run(out, [sys.executable, str(ROOT / "tools" / "bench_grid.py"), "--rounds",
               str(grid_rounds), "--seeds", *grid_seeds, "--runs-in-parallel", "1", "0", "--json",
               str(out / "grid.json")], 0.12 * total, env)
    _run(out, [sys.executable, str(ROOT / "tools" / "bench_pfl.py"), "--no-append", "--json",
               str(out / "pfl.json"), "--pfl-python", args.pfl_python, "--pfl-device", device,
               "--rounds", str(pfl_rounds), "--passes", str(pfl_passes), "--pfl-workers",
               *pfl_workers, "--budget-s", f"{left() - 45:.0f}"], left() - 15, env)
    write_summary(out, info, time.perf_counter() - start)


def write_summary(out: Path, info: dict, seconds: float) -> None:
    """``gpu_check.md``: the phases' tables from their JSON files."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import ratios, table

    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M')} UTC, {seconds:.0f} s)", "",
             f"Environment: `{json.dumps(info)}`", ""]
    for name in ("layouts", "precision"):
        path = out / f"{name}.json"
        if not path.exists():
            lines += [f"## {name}: no results (see gpu_check.log)", ""]
            continue
        d = json.loads(path.read_text())
        lines += [f"## {name} ({d['machine']}; fp32 matmul peak "
                  f"{d['matmul_peak_gflops']:.0f} GFLOP/s)", "",
                  table(d["rows"], d["matmul_peak_gflops"]), "", *ratios(d["rows"]), ""]
        if name == "layouts":  # the default's ratio to the best layout, the threshold's fit
            try:
                from fit_layout import analyse, markdown
                lines += ["### The default layout and the cost model", "",
                          markdown(analyse(d)), ""]
            except Exception as e:  # noqa: BLE001 - the summary must still be written
                lines += [f"(fit_layout failed: {e!r})", ""]
    path = out / "grid.json"
    if path.exists():
        d = json.loads(path.read_text())
        lines += [f"## {len(d['seeds'])} seeds of the digits job, {d['rounds']} rounds (wall s "
                  "of the whole command; one program vs separate processes)", ""]
        sep = d["medians"].get("separate")
        for way, m in d["medians"].items():
            ratio = (f"; separate / this: {sep['wall_s'] / m['wall_s']:.2f}x"
                     if sep and way != "separate" else "")
            lines.append(f"- {way}: {m['wall_s']:.1f} s, peak RSS {m['peak_rss_gb']:.2f} GB"
                         f"{ratio}")
        lines.append("")
    else:
        lines += ["## Grid: no results (see gpu_check.log)", ""]
    path = out / "pfl.json"
    if path.exists():
        d = json.loads(path.read_text())
        lines += ["## pfl-research workload (s per training round / per evaluation, medians)",
                  ""]
        ours = d["medians"].get("fedjax-rcl")
        for name, m in d["medians"].items():
            ratio = (f"; pfl's time / ours: training {m['train'] / ours['train']:.2f}x"
                     if ours and name.startswith("pfl") else "")
            lines.append(f"- {name}: {m['train']:.3f} s / round, eval {m['eval']:.3f} s{ratio}")
        lines += [f"- {name}: failed: {e}" for name, e in d.get("pfl_failed", {}).items()]
    else:
        lines.append("## pfl-research workload: no results (see gpu_check.log)")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
