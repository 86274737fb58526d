"""One prepared accelerator call of about five minutes: ours against pfl-research on its own
workload, where the GPU time goes, many small runs filling one GPU, and clients side by side.

Parts, each a process of its own with its own share of the time (a part that runs out starts
no new configuration; each writes its JSON after every measurement, so a part stopped at its
limit keeps what it measured), the most telling first:

1. ``pfl.json``: pfl-research's CIFAR-10 workload (``experiments/pfl_cifar10.yaml``: 50 clients
   of 50 images a round, 5 steps of batch 10, pfl's CNN) timed by ``tools/bench_pfl.py`` for
   ours (the default, which on a GPU trains clients side by side with the patch convolutions;
   ``precision=bf16``; ``conv_impl=native``, XLA's grouped convolutions) and, in the same
   process's passes, pfl 0.6.0 itself at 8 processes sharing the GPU (its fastest count
   measured before). ``PFL_PYTHON`` names an interpreter with pfl and torch (default: this
   one, if it imports pfl; otherwise ours only).
2. ``profile.json``: the same workload on fake CIFAR-shaped data. One fused round of the
   default under the JAX profiler, summarised by ``fedjax_rcl.bench.trace_summary`` as shares
   of convolutions, matrix products, element-wise work, copies and idle time; then the other
   formulations, each compiled in this process, timed in rotation with the default (same
   process, so every ratio is a same-run ratio) and profiled too: the patch convolutions with
   their earlier input gradient (``input_grad=flipped``), bf16, XLA's convolutions. Seconds
   per training round,
   GFLOP/s and % of the fp32 matmul peak measured in the same process.
3. ``runs.json``: K runs of one program (``fedjax_rcl.grid``'s compiled program, as
   ``seeds=[0..K-1]`` runs it, with K copies of seed 0's run: the same shapes and work) side
   by side (``runs_in_parallel=K``): aggregate rounds per second at K = 1, 8 (and 8 with
   ``conv_impl=native``), 16, 4, 2 for MOON's CNN (CIFAR shape, 10 clients a round, 50 steps
   of batch 50 each) and for pfl's workload, then K = 8 one after another; each row with the
   choice ``runs_in_parallel=0`` makes there (the layout cost model on the runs' step work).
4. ``clients.json``: client-steps per second of the compiled round with 1, 50, 200 and 10
   clients side by side for MOON's CNN and pfl's CNN (50 steps of batch 50 per client,
   ``tools/bench_round.py``'s worker), and 50 with ``conv_impl=native`` beside them; then,
   if time is left, ResNet-18's 5 clients one at a time and side by side (patches).

Besides: ``env.json`` (the card from ``nvidia-smi``, driver, CUDA, the versions of JAX, jaxlib
and its CUDA plugin, the processor), ``gpu_fill.md`` (the tables), ``gpu_fill.log``
(everything printed) and ``gpu_check.log`` (the wheels' install): 9 files with the parts', one
over the device tool's 8, so a call runs it with ``OUT`` elsewhere and packs the folder
(``experiments/paper_resnet18_gpu/device_lease.sh`` does). Traces stay in
``/tmp/gpu_fill_trace`` and are copied, each under 4 MB (tens of kilobytes for a round), to
``traces/`` (not with ``KEEP_TRACE=0``).

On the device (carry ``.whl``, the wheels ``tools/gpu_check.py``'s docstring downloads; this
script needs only omegaconf of them; timeout_s 300)::

    OUT=/tmp/fill python3 experiments/paper_resnet18_gpu/gpu_fill.py  # 270 s
    tar czf $OUT/fill.tar.gz -C /tmp fill                               # + 10 s

Dry run on a CPU at tiny sizes (every part, every code path; about 5-10 minutes on 2 cores)::

    JAX_PLATFORMS=cpu TINY=1 OUT=/tmp/gpu_fill \
        python experiments/paper_resnet18_gpu/gpu_fill.py --budget-s 900
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("pfl", "profile", "runs", "clients")
# Each part's share of the time left after the environment (the rest goes to the last part).
SHARES = {"pfl": 0.45, "profile": 0.13, "runs": 0.23, "clients": 0.19}
TRACE_KEEP_BYTES = 4 * 2**20

# The pfl workload's formulations, the default ("current") first (key=value overrides). The
# 2026-11-28 lease measured XLA's grouped convolutions, patches, bf16 and the client layouts;
# the default now resolves to the patch convolutions there, so this checks that it does.
# "input_grad=flipped": the patch convolutions with their earlier input gradient (not a config
# key: nn.conv.INPUT_GRAD_RULE while this formulation compiles), against the default's col2im
# for pfl's widening conv2 (less than half the values written).
FORMULATIONS = ("", "input_grad=flipped", "precision=bf16", "conv_impl=native",
                "conv_impl=native,precision=bf16")
# ours beside pfl (tools/bench_pfl.py --variants) and pfl's process counts.
PFL_VARIANTS = ("precision=bf16", "conv_impl=native")
PFL_WORKERS = (8,)
# (model, K, runs_in_parallel, overrides) in order: the target's K = 1 and 8 first.
RUNS = ([(m, k, k, "") for k in (1, 8) for m in ("cnn", "pfl")]
        + [(m, 8, 8, "conv_impl=native") for m in ("cnn", "pfl")]
        + [(m, k, k, "") for k in (16, 4, 2) for m in ("cnn", "pfl")]
        + [("cnn", 8, 1, ""), ("pfl", 8, 1, "")])
# (model, clients, bench_round mode): the default side by side, and XLA's grouped convolutions
# at 50 beside it.
CLIENTS = ([(m, c, "side-by-side") for c in (1, 50) for m in ("cnn", "pfl_cnn")]
           + [(m, 50, "side-by-side-native") for m in ("cnn", "pfl_cnn")]
           + [(m, c, "side-by-side") for c in (200, 10) for m in ("cnn", "pfl_cnn")]
           # Last, if time is left: the GPU's layout threshold was fitted with grouped
           # convolutions; does ResNet-18 (the paper runs' model) now gain side by side?
           + [("resnet18", 5, "one-at-a-time"), ("resnet18", 5, "side-by-side")])


def tiny() -> bool:
    return os.environ.get("TINY") == "1"


def _log(out: Path, text: str) -> None:
    print(text, flush=True)
    with open(out / "gpu_fill.log", "a") as f:
        f.write(text + "\n")


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


# --- the environment -------------------------------------------------------------------------

_PROBE = r"""
import importlib.metadata as m, json, jax, jaxlib
d = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
     "devices": [x.device_kind for x in jax.devices()]}
d["jax_plugins"] = {x.metadata["Name"]: x.version for x in m.distributions()
                    if x.metadata["Name"] and x.metadata["Name"].lower().replace("_", "-")
                    .startswith(("jax-cuda", "jax-rocm", "libtpu", "nvidia-cudnn",
                                 "nvidia-cublas", "nvidia-cuda-runtime"))}
d["cuda"] = {}
try:
    from jax._src.lib import cuda_versions as v
except Exception as e:
    v, d["cuda"] = None, f"not read: {type(e).__name__}"
for name in ("cuda_runtime", "cuda_driver", "cudnn", "cublas", "cupti"):
    try:
        d["cuda"][name] = getattr(v, name + "_get_version")()
    except Exception:
        pass
try:
    d["jax_environment_info"] = jax.print_environment_info(return_string=True)
except Exception as e:
    d["jax_environment_info"] = f"not read: {type(e).__name__}"
for name in ("flax", "optax", "xprof", "tensorboard_plugin_profile"):
    try:
        d[name] = m.version(name.replace("_", "-"))
    except Exception:
        pass
print(json.dumps(d))
"""


def environment(env: dict) -> dict:
    info: dict = {"cpu_count": os.cpu_count()}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv"], capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip()
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        info["nvidia_smi_cuda"] = next((ln.split("CUDA Version:")[1].strip(" |")
                                        for ln in full.splitlines() if "CUDA Version" in ln),
                                       None)
    got = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    info.update(json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0
                else {"probe_error": got.stderr[-2000:]})
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine

    try:
        info["machine"] = machine()
    except Exception as e:  # noqa: BLE001 - the environment file must still be written
        info["machine"] = f"not read: {e!r}"
    return info


# --- shared pieces ---------------------------------------------------------------------------

def _fake(n: int, test_n: int):
    from bench_round import fake_cifar

    return fake_cifar(n, test_n)


def pfl_config(overrides=(), eval_every: int = 1):
    """pfl-research's workload as ``experiments/pfl_cifar10.yaml`` (tiny: 5 clients of 50)."""
    from fedjax_rcl.config import load_config

    small = ["num_clients=100"] if tiny() else []
    # dataset=digits only to pass validation without the CIFAR-10 zip; the data are passed.
    return load_config(str(ROOT / "experiments" / "pfl_cifar10.yaml"),
                       ["dataset=digits", "checkpoint_every=0", f"eval_every={eval_every}",
                        "eval_batch_size=500", *small, *overrides])


def cnn_config(overrides=(), eval_every: int = 1):
    """MOON's CNN on CIFAR-shaped data, 10 clients a round, 5 epochs of 10 steps of batch 50
    (tiny: 2 clients, one epoch of 2 steps)."""
    from fedjax_rcl.config import load_config

    size = (["num_clients=20", "local_epochs=1"] if tiny() else
            ["num_clients=100", "local_epochs=5"])
    return load_config(None, ["dataset=digits", "model=cnn", "algorithm=fedavg",
                              "participation=0.1", "partition=iid", "batch_size=50",
                              "checkpoint_every=0", f"eval_every={eval_every}",
                              "eval_batch_size=500", *size, *overrides])


def round_gflop(exp) -> tuple[float, float]:
    """(one client's training step, one round of training) in GFLOP, counted from the model's
    program as the layout cost model counts it."""
    from fedjax_rcl import registry
    from fedjax_rcl.engine.round import clients_per_round
    from fedjax_rcl.experiment import training_step_gflop

    cfg = exp.cfg
    step = training_step_gflop(exp.model, exp.state.params, exp.state.model_state,
                               exp.dataset.image_shape, cfg.batch_size,
                               registry.algorithm(cfg.algorithm).num_views)
    steps = exp.settings.local_epochs * exp.settings.steps_per_epoch
    return step, step * steps * clients_per_round(cfg.num_clients, cfg.participation)


class Deadline:
    def __init__(self, at: float, per_config_s: float):
        self.at, self.per_config_s = at, per_config_s

    def left(self) -> float:
        return self.at - time.time()

    def room(self) -> bool:
        """Whether one more configuration (build, compile, time) can start."""
        return self.left() > self.per_config_s


# --- part 1: ours against pfl-research --------------------------------------------------------

def _pfl_python() -> str | None:
    """An interpreter with pfl and torch: ``PFL_PYTHON``, else this one if it imports pfl."""
    if os.environ.get("PFL_PYTHON"):
        return os.environ["PFL_PYTHON"]
    probe = subprocess.run([sys.executable, "-c", "import pfl, torch"], capture_output=True)
    return sys.executable if probe.returncode == 0 else None


def part_pfl(out: Path, deadline: Deadline, args) -> None:
    """``tools/bench_pfl.py`` in a process of its own, bounded by the part's time: ours (the
    default and ``PFL_VARIANTS``) and pfl at ``PFL_WORKERS`` processes, alternating passes."""
    import jax

    gpu = jax.default_backend() == "gpu"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_pfl.py"), "--no-append", "--json",
           str(out / "pfl.json"), "--rounds", "1" if tiny() else "5", "--passes",
           "1" if tiny() else "2", "--budget-s", f"{max(deadline.left() - 10, 10):.0f}",
           "--variants", *PFL_VARIANTS]
    python = _pfl_python()
    if python:
        cmd += ["--pfl-python", python, "--pfl-device", "cuda" if gpu else "cpu",
                "--pfl-workers", *map(str, (1,) if tiny() else PFL_WORKERS)]
    else:
        print("pfl: no interpreter with pfl and torch (PFL_PYTHON): ours only", flush=True)
    print(f"pfl: $ {' '.join(cmd)}", flush=True)
    try:
        code = subprocess.run(cmd, cwd=ROOT, timeout=max(deadline.left(), 1)).returncode
    except subprocess.TimeoutExpired:
        code = 124
    print(f"pfl: bench_pfl exit {code}", flush=True)


# --- part 2: the profile and the formulations ------------------------------------------------

class Formulation:
    """One formulation of pfl's workload, compiled as ``DeviceTable.compile`` compiles the
    rounds (so its optimised HLO is at hand for the profile's categories)."""

    def __init__(self, overrides: str, data, rounds: int):
        import jax
        import numpy as np

        from fedjax_rcl.engine.round import make_run_rounds
        from fedjax_rcl.experiment import build
        from fedjax_rcl.nn import conv

        self.name = overrides or "current"
        self.rounds, self.jax, self.np = rounds, jax, np
        items = overrides.split(",") if overrides else []
        rule = [o.split("=", 1)[1] for o in items if o.startswith("input_grad=")]
        items = [o for o in items if not o.startswith("input_grad=")]
        self.exp = build(pfl_config(tuple(items)), data)
        self.step_gflop, self.round_gflop = round_gflop(self.exp)
        from fedjax_rcl.engine.round import clients_per_round
        from fedjax_rcl.experiment import clients_in_parallel

        cfg, per_round = self.exp.cfg, clients_per_round(self.exp.cfg.num_clients,
                                                         self.exp.cfg.participation)
        self.side_by_side = min(clients_in_parallel(cfg, self.step_gflop) or per_round,
                                per_round)
        t = time.perf_counter()
        fused = jax.jit(make_run_rounds(self.exp.run_round, rounds), donate_argnums=0)
        saved = conv.INPUT_GRAD_RULE
        conv.INPUT_GRAD_RULE = rule[0] if rule else saved
        try:  # the rule is read when the gradient is traced, here
            self.compiled = fused.lower(self.exp.state, self.exp.data,
                                        jax.device_put(np.int32(rounds))).compile()
        finally:
            conv.INPUT_GRAD_RULE = saved
        self.compile_s = time.perf_counter() - t
        self.state = self.exp.state
        self.advance(rounds)  # warm-up

    def advance(self, n: int) -> float:
        """Seconds per round over ``n`` fused rounds."""
        t = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.exp.data,
                                            self.jax.device_put(self.np.int32(n)))
        self.jax.block_until_ready((self.state, metrics))
        return (time.perf_counter() - t) / n


def part_profile(out: Path, deadline: Deadline, args) -> None:
    import jax
    from bench_round import machine, matmul_peak_gflops

    from fedjax_rcl.bench.trace_summary import profile

    rounds, passes = (2, 2) if tiny() else (10, 3)
    data = _fake(5000, 500) if tiny() else _fake(50_000, 1000)
    doc = {"machine": machine(), "matmul_peak_gflops": matmul_peak_gflops(),
           "rounds_per_pass": rounds, "formulations": {}, "profiles": {}, "not_run": []}
    path = out / "profile.json"
    built: dict[str, Formulation] = {}
    chosen = ["", *(f for f in args.formulations or () if f != "current")]
    for overrides in FORMULATIONS if not args.formulations else chosen:
        if not deadline.room():
            doc["not_run"].append(overrides or "current")
            continue
        try:
            f = Formulation(overrides, data, rounds)
        except Exception as e:  # noqa: BLE001 - one formulation failing must not end the part
            doc["formulations"][overrides or "current"] = {"error": repr(e)[:2000]}
            _write(path, doc)
            continue
        built[f.name] = f
        doc["formulations"][f.name] = {"compile_s": f.compile_s, "step_gflop": f.step_gflop,
                                       "clients_side_by_side": f.side_by_side,
                                       "round_gflop": f.round_gflop, "round_s": []}
        print(f"profile: {f.name} compiled in {f.compile_s:.1f} s", flush=True)
        if f.name == "current":  # profile the current formulation at once: the main result
            _profile_one(f, doc, out, profile)
        _write(path, doc)
    for _ in range(passes):  # rotation: every formulation once per pass
        if deadline.left() < 5:
            break
        for f in built.values():
            doc["formulations"][f.name]["round_s"].append(f.advance(rounds))
        _medians(doc)
        _write(path, doc)
    for f in built.values():
        if f.name != "current" and deadline.left() > 10:
            _profile_one(f, doc, out, profile)
            _write(path, doc)
    doc["backend"] = jax.default_backend()
    _write(path, doc)


def _medians(doc: dict) -> None:
    """Each timed formulation's median, GFLOP/s, % of peak and speed relative to the current
    one (same process, same passes)."""
    cur = doc["formulations"].get("current", {}).get("round_s")
    for row in doc["formulations"].values():
        if row.get("round_s"):
            row["median_round_s"] = statistics.median(row["round_s"])
            row["gflops"] = row["round_gflop"] / row["median_round_s"]
            row["pct_of_fp32_matmul_peak"] = 100 * row["gflops"] / doc["matmul_peak_gflops"]
            if cur:
                row["speed_vs_current"] = statistics.median(cur) / row["median_round_s"]


def _profile_one(f: Formulation, doc: dict, out: Path, profile) -> None:
    """One fused round of ``f`` under the profiler; keeps its trace in ``traces/`` when under
    ``TRACE_KEEP_BYTES`` (not with ``KEEP_TRACE=0``): a round's is tens of kilobytes."""
    log_dir = Path(f"/tmp/gpu_fill_trace/{f.name.replace(',', '_').replace('=', '-')}")
    shutil.rmtree(log_dir, ignore_errors=True)
    try:
        s = profile(lambda: f.advance(1), f.compiled.as_text(), log_dir)
    except Exception as e:  # noqa: BLE001 - the timings must still be written
        doc["profiles"][f.name] = {"error": repr(e)[:2000]}
        return
    if os.environ.get("KEEP_TRACE") != "0" and s["trace_bytes"] <= TRACE_KEEP_BYTES:
        kept = Path("traces") / f"{log_dir.name}.json.gz"
        (out / "traces").mkdir(exist_ok=True)
        shutil.copyfile(s["trace"], out / kept)
        s["trace_kept"] = str(kept)
    doc["profiles"][f.name] = s
    shares = ", ".join(f"{k} {100 * v:.0f} %" for k, v in s["shares"].items())
    print(f"profile: {f.name}: {shares}; idle {100 * s['idle_share_of_span']:.0f} % of "
          f"{s['span_s'] * 1e3:.1f} ms", flush=True)


# --- part 3: runs side by side ---------------------------------------------------------------

class Members:
    """One model's grid members: K copies of one run (seed 0), built once. Copies have the
    program and the per-round work of K seeds (the seeds change values, not shapes); building
    K members is start-up, which this part does not time."""

    def __init__(self, model: str, data, rounds: int, overrides: str = ""):
        self.model, self.data, self.rounds, self.exp = model, data, rounds, None
        self.overrides = tuple(overrides.split(",")) if overrides else ()

    def first(self, k: int):
        from fedjax_rcl import grid

        if self.exp is None:
            make = pfl_config if self.model == "pfl" else cnn_config
            cfg = make(("seeds=[0]", *self.overrides), eval_every=self.rounds)
            self.exp, = grid.build_members(grid.member_configs(cfg, None), self.data)
        return [self.exp] * k


def part_runs(out: Path, deadline: Deadline, args) -> None:
    import jax
    import jax.numpy as jnp
    from bench_round import machine

    from fedjax_rcl import grid
    from fedjax_rcl.engine import layout

    rounds = {"cnn": 1 if tiny() else 2, "pfl": 2 if tiny() else 5}
    data = _fake(5000, 500) if tiny() else _fake(50_000, 1000)
    ks = args.ks or ((1, 2) if tiny() else None)
    members: dict[tuple[str, str], Members] = {}
    doc = {"machine": machine(), "backend": jax.default_backend(), "rows": [], "not_run": [],
           "threshold_gflop": layout.SIDE_BY_SIDE_BELOW_GFLOP.get(jax.default_backend())}
    path = out / "runs.json"
    plan = [row for row in RUNS if ks is None or row[1] in ks]
    if tiny() and not args.ks:
        plan += [("cnn", 2, 1, ""), ("cnn", 2, 2, "conv_impl=native")]
    for model, k, together, overrides in plan:
        if not deadline.room():
            doc["not_run"].append([model, k, together, overrides])
            continue
        if (model, overrides) not in members:
            members[model, overrides] = Members(model, data, rounds[model], overrides)
        try:
            row = _time_runs(members[model, overrides], k, together, rounds[model], grid, jnp,
                             jax)
        except Exception as e:  # noqa: BLE001 - one row failing must not end the part
            row = {"model": model, "runs": k, "runs_in_parallel": together,
                   "error": repr(e)[:2000]}
        row["overrides"] = overrides
        doc["rows"].append(row)
        base = next((r for r in doc["rows"] if r["model"] == model and r["runs"] == 1
                     and not r["overrides"] and "rounds_per_s" in r), None)
        if base and "rounds_per_s" in row:
            row["throughput_vs_one_run"] = row["rounds_per_s"] / base["rounds_per_s"]
        print(f"runs: {model} K={k} runs_in_parallel={together} {overrides}: "
              f"{row.get('rounds_per_s', float('nan')):.2f} rounds/s "
              f"({row.get('throughput_vs_one_run', float('nan')):.2f}x one run); cost model "
              f"picks {row.get('cost_model_picks')}", flush=True)
        _write(path, doc)
        gc.collect()
    _write(path, doc)


def _time_runs(members: Members, k: int, together: int, n: int, grid, jnp, jax) -> dict:
    exps = members.first(k)
    first = dataclasses.replace(exps[0], cfg=dataclasses.replace(exps[0].cfg,
                                                                 runs_in_parallel=together))
    auto = dataclasses.replace(first, cfg=dataclasses.replace(first.cfg, runs_in_parallel=0))
    picks = grid.runs_in_parallel([auto, *exps[1:]])
    step, work = round_gflop(first)
    states = jax.tree.map(lambda *xs: jnp.stack(xs), *[e.state for e in exps])
    program = grid.compile_grid([first, *exps[1:]], states, log=lambda s: None)
    states, _ = program.advance(states, n)  # warm-up
    times = []
    for _ in range(2):
        t = time.perf_counter()
        states, _ = program.advance(states, n)  # metrics come back to the host: blocks
        jax.block_until_ready(states)
        times.append(time.perf_counter() - t)
    per_round = statistics.median(times) / n
    from fedjax_rcl.engine.round import clients_per_round

    cfg = first.cfg
    return {"model": members.model, "runs": k, "runs_in_parallel": together,
            "rounds_per_call": n, "call_s": times, "compile_s": program.compile_s,
            "rounds_per_s": k / per_round, "step_gflop": step, "round_gflop": work,
            "clients_per_round": clients_per_round(cfg.num_clients, cfg.participation),
            "gflops": k * work / per_round,
            "cost_model_picks": "side by side" if picks == k and k > 1 else
            "one after another" if k > 1 else "(one run)"}


# --- part 4: clients side by side ------------------------------------------------------------

def part_clients(out: Path, deadline: Deadline, args) -> None:
    import jax
    from bench_round import machine, matmul_peak_gflops, worker

    plan = ([(m, c, "side-by-side") for c in (1, 2) for m in ("cnn", "pfl_cnn")]
            + [("cnn", 2, "side-by-side-native")]) if tiny() else CLIENTS
    if args.clients:
        plan = [row for row in plan if row[1] in args.clients]
    doc = {"machine": machine(), "backend": jax.default_backend(),
           "matmul_peak_gflops": matmul_peak_gflops(), "rows": [], "not_run": []}
    path = out / "clients.json"
    for model, clients, mode in plan:
        if not deadline.room():
            doc["not_run"].append([model, clients, mode])
            continue
        spec = {"model": model, "algorithm": "fedavg", "clients": clients,
                "mode": mode, "repeats": 2, "precision": "fp32",
                "paper_local_work": not tiny()}
        try:
            row = worker(spec)
        except Exception as e:  # noqa: BLE001 - one row failing must not end the part
            row = {**spec, "error": repr(e)[:2000]}
        if "round_s" in row:
            from fit_layout import step_gflop

            row["step_gflop"] = step_gflop(model, row["batch"])
            row["gflops"] = row["step_gflop"] * row["client_steps_per_s"]
            row["pct_of_fp32_matmul_peak"] = 100 * row["gflops"] / doc["matmul_peak_gflops"]
        doc["rows"].append(row)
        print(f"clients: {model} x {clients} ({mode}): "
              f"{row.get('client_steps_per_s', float('nan')):.1f} client-steps/s", flush=True)
        _write(path, doc)
        gc.collect()
    _write(path, doc)


# --- the summary -----------------------------------------------------------------------------

def summary(out: Path, info: dict, seconds: float) -> str:
    """``gpu_fill.md``: the parts' tables from their JSON files."""
    lines = [f"# GPU fill ({time.strftime('%Y-%m-%d %H:%M')} UTC, {seconds:.0f} s"
             f"{', TINY' if tiny() else ''})", "",
             f"Card: {info.get('nvidia_smi', 'no nvidia-smi')}; CUDA (driver) "
             f"{info.get('nvidia_smi_cuda')}; jax {info.get('jax')}, jaxlib "
             f"{info.get('jaxlib')}, plugins {info.get('jax_plugins')}, cuda {info.get('cuda')};"
             f" {info.get('machine')}", ""]
    p = out / "pfl.json"
    if p.exists():
        d = json.loads(p.read_text())
        med = d["medians"]
        ours = med.get("fedjax-rcl", {}).get("train")
        lines += ["## pfl's workload against pfl-research (training s/round, medians of the "
                  "passes, alternating in one process)", "",
                  "| side | s / round | eval s | its time / ours (default) |",
                  "|---|---|---|---|"]
        for name, m in med.items():
            ratio = m["train"] / ours if ours else float("nan")
            lines.append(f"| {name} | {m['train']:.4f} | {m['eval']:.4f} | {ratio:.2f} |")
        for name, e in d.get("pfl_failed", {}).items():
            lines.append(f"| {name} | {e[:80]} | | |")
        lines.append("")
    else:
        lines += ["## pfl: no results (see gpu_fill.log)", ""]
    p = out / "profile.json"
    if p.exists():
        d = json.loads(p.read_text())
        lines += ["## pfl's workload: formulations (s per training round, medians of "
                  f"{d['rounds_per_pass']}-round passes; fp32 matmul peak "
                  f"{d['matmul_peak_gflops']:.0f} GFLOP/s)", "",
                  "| formulation | s / round | speed vs current | GFLOP/s | % of peak | "
                  "compile s |", "|---|---|---|---|---|---|"]
        for name, r in d["formulations"].items():
            if "median_round_s" in r:
                lines.append(f"| {name} | {r['median_round_s']:.4f} | "
                             f"{r.get('speed_vs_current', float('nan')):.2f} | "
                             f"{r['gflops']:.0f} | {r['pct_of_fp32_matmul_peak']:.1f} | "
                             f"{r['compile_s']:.1f} |")
            else:
                lines.append(f"| {name} | {r.get('error', 'not timed')[:80]} | | | | |")
        lines += ["", "Profile of one fused round (share of summed operation time; idle: share "
                  "of the span from first to last operation):", "",
                  "| formulation | " + " | ".join(
                      ("convolution", "matmul", "elementwise", "copy", "other"))
                  + " | idle | span ms | named by HLO | where |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in d["profiles"].items():
            if "shares" not in s:
                lines.append(f"| {name} | {s.get('error', '')[:80]} |")
                continue
            lines.append(f"| {name} | " + " | ".join(f"{100 * v:.1f} %"
                                                      for v in s["shares"].values())
                         + f" | {100 * s['idle_share_of_span']:.1f} % | "
                         f"{1e3 * s['span_s']:.2f} | {100 * s['share_named_by_hlo']:.0f} % | "
                         f"{s['where']} |")
        if d.get("not_run"):
            lines.append(f"\nNot run (out of time): {d['not_run']}")
        lines.append("")
    else:
        lines += ["## profile: no results (see gpu_fill.log)", ""]
    p = out / "runs.json"
    if p.exists():
        d = json.loads(p.read_text())
        lines += [f"## Runs in one program (aggregate rounds/s; threshold "
                  f"{d['threshold_gflop']} GFLOP)", "",
                  "| model | overrides | runs | runs_in_parallel | rounds/s | x one run | "
                  "GFLOP/s | runs' step work GFLOP | cost model picks | compile s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            if "rounds_per_s" not in r:
                lines.append(f"| {r['model']} | {r.get('overrides', '')} | {r['runs']} | "
                             f"{r['runs_in_parallel']} | {r.get('error', '')[:80]} |")
                continue
            work = r["runs"] * r["clients_per_round"] * r["step_gflop"]
            lines.append(f"| {r['model']} | {r.get('overrides', '')} | {r['runs']} | "
                         f"{r['runs_in_parallel']} | "
                         f"{r['rounds_per_s']:.2f} | "
                         f"{r.get('throughput_vs_one_run', float('nan')):.2f} | "
                         f"{r['gflops']:.0f} | {work:.3g} | {r['cost_model_picks']} | "
                         f"{r['compile_s']:.1f} |")
        if d.get("not_run"):
            lines.append(f"\nNot run (out of time): {d['not_run']}")
        lines.append("")
    else:
        lines += ["## runs: no results (see gpu_fill.log)", ""]
    p = out / "clients.json"
    if p.exists():
        d = json.loads(p.read_text())
        lines += ["## Clients side by side (client-steps/s, 50 steps of batch 50 per client; "
                  f"fp32 matmul peak {d['matmul_peak_gflops']:.0f} GFLOP/s)", "",
                  "| model | clients | mode | s / round | client-steps/s | GFLOP/s | % of peak | "
                  "compile s |", "|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            if "round_s" not in r:
                lines.append(f"| {r['model']} | {r['clients']} | {r.get('mode', '')} | "
                             f"{r.get('error', '')[:80]} |")
                continue
            lines.append(f"| {r['model']} | {r['clients']} | {r.get('mode', '')} | "
                         f"{r['round_s']:.3f} | "
                         f"{r['client_steps_per_s']:.1f} | {r['gflops']:.0f} | "
                         f"{r['pct_of_fp32_matmul_peak']:.1f} | {r['compile_s']:.1f} |")
        if d.get("not_run"):
            lines.append(f"\nNot run (out of time): {d['not_run']}")
    else:
        lines.append("## clients: no results (see gpu_fill.log)")
    text = "\n".join(lines) + "\n"
    (out / "gpu_fill.md").write_text(text)
    return text


# --- the driver ------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", 270)),
                    help="the whole script's time (default 270 s)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--ks", type=int, nargs="+",
                    help="the runs part's K only (a later call finishing the table)")
    ap.add_argument("--clients", type=int, nargs="+",
                    help="the clients part's client counts only")
    ap.add_argument("--formulations", nargs="+",
                    help="the profile part's formulations only ('current' is always first)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--config-s", type=float, default=None,
                    help="start no configuration with less than this many seconds of its "
                         "part left (default 20 on an accelerator, 5 in the tiny mode)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or "/tmp/gpu_fill")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(ROOT))
    per_config = args.config_s if args.config_s is not None else (5 if tiny() else 20)
    if args.part:  # one part, in its own process
        {"pfl": part_pfl, "profile": part_profile, "runs": part_runs,
         "clients": part_clients}[args.part](
            out, Deadline(args.deadline, per_config), args)
        return
    start = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}:{ROOT / 'tools'}:{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from gpu_check import _install_wheels

    _install_wheels(out, env)  # omegaconf, which the device image lacks, into /tmp/site
    info = environment(env)
    _write(out / "env.json", info)
    _log(out, f"environment: {json.dumps(info, default=str)}")
    parts = [p for p in PARTS if p in args.parts]
    for i, part in enumerate(parts):
        left = args.budget_s - (time.time() - start) - 5
        share = sum(SHARES[p] for p in parts[i:])
        budget = left if i == len(parts) - 1 else left * SHARES[part] / share
        if budget < per_config:
            _log(out, f"{part}: not started: out of time")
            continue
        deadline = time.time() + budget
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--deadline",
               f"{deadline:.1f}", "--config-s", str(per_config)]
        for flag in ("ks", "clients", "formulations"):
            if getattr(args, flag):
                cmd += [f"--{flag}", *map(str, getattr(args, flag))]
        _log(out, f"$ {' '.join(cmd)}  ({budget:.0f} s)")
        with open(out / "gpu_fill.log", "a") as log:
            try:
                # The part stops starting configurations at its deadline; the limit ends one
                # that runs past it (its JSON holds what was measured before).
                code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=budget + 10).returncode
            except subprocess.TimeoutExpired:
                code = 124
        _log(out, f"{part}: exit {code} after {time.time() - start:.0f} s in all")
    text = summary(out, info, time.time() - start)
    _log(out, text)


if __name__ == "__main__":
    main()
