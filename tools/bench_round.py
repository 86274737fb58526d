"""Seconds per round and client-parallel scaling of the compiled round, against the same round
run client by client (a Python loop over the jitted local update) and against a PyTorch eager
implementation of the same client update (``fedjax_rcl.bench.torch_reference``).

    pip install -e ".[bench]"          # PyTorch 2.13 (CPU), only for this benchmark
    python tools/bench_round.py        # full table (CNN and ResNet-18) -> benchmarks/HISTORY.md
    python tools/bench_round.py --quick --no-append

Every configuration runs in a fresh subprocess, so its peak memory (max RSS) is its own. FLOP/s
come from analytic counts — every multiply-add of the network's convolution and dense layers,
times 3 for forward + backward (+2 forwards for MOON's frozen models), the same for every mode —
because XLA's cost analysis of the round counts a loop body once. The matmul peak is measured
in the same run.

Sizes: the CNN runs the paper's local work (5 epochs of 10 steps, batch 50, per client). ResNet-18
costs about 1 s per client-step on 2 CPU cores, so its round is cut to 2 local steps per client
(one epoch of 100 samples) and compared per client-step; ``--paper-local-work`` gives every model
the paper's 50 steps (for a GPU or TPU).

Modes: ``vmap`` (the compiled round, its default client layout), ``one-at-a-time`` (the compiled
round with ``clients_in_parallel=1``), ``sequential`` (a Python loop over the jitted client
update), ``torch`` (PyTorch eager).

On a noisy machine use ``--passes 3``: every configuration runs three times, in rotation with the
others, and the table reports the median.
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLIENTS = (1, 5, 10, 20, 50)
# The compiled round: its default client layout (``vmap``, the historical name), every sampled
# client side by side (``side-by-side``, with ``conv_impl=auto``'s convolutions; with the patch
# convolutions, which turn a vmap over client weights into batched matmuls instead of grouped
# convolutions: ``side-by-side-patches``, auto's choice on a GPU; with XLA's own, grouped there:
# ``side-by-side-native``), or clients one after another inside the program (``one-at-a-time``).
COMPILED_MODES = ("vmap", "side-by-side", "side-by-side-patches", "side-by-side-native",
                  "one-at-a-time")
_MODE_CONV = {"side-by-side-patches": "patches", "side-by-side-native": "native"}


def _setup(model: str, paper_local_work: bool = False):
    """Local work per client: (samples per client, local epochs). ``paper_local_work``: the
    paper's 5 epochs of 500 samples for every model (an accelerator can afford ResNet-18's)."""
    return (500, 5) if model == "cnn" or paper_local_work else (100, 1)


def fake_cifar(n: int, test_n: int = 2000):
    """Synthetic CIFAR-shaped data (speed only): ``n`` training images, the first ``test_n``
    of them again as the test set."""
    import numpy as np

    from fedjax_rcl.data import ImageDataset

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.int32)
    return ImageDataset("fake-cifar", x, y, x[:test_n], y[:test_n],
                        tuple(map(str, range(10))), (0.49, 0.48, 0.45), (0.2, 0.2, 0.2), True)


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The better of JAX's and NumPy's float32 n x n matmul throughput."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    b = np.ones((n, n), np.float32)
    best = min(best, *(_timed(lambda: b @ b) for _ in range(repeats)))
    return 2 * n**3 / best / 1e9


def copy_bandwidth_gbs(mib: float = 256, repeats: int = 5) -> float:
    """Memory bandwidth, bytes read plus bytes written per second, of an in-place ``x += 1``
    over ``mib`` MiB of float32: far beyond the caches at the default; inside them (the
    working sets of a small model's operations) at a few MiB."""
    import numpy as np

    x = np.ones(int(mib * 2**20) // 4, np.float32)
    x += 1  # pages mapped before the timing
    best = min(_timed(lambda: np.add(x, 1, out=x)) for _ in range(repeats))
    return 2 * x.nbytes / best / 1e9


def _minor_faults() -> int:
    """This process's minor page faults so far: a round's count is the memory its allocator got
    afresh from the kernel (XLA:CPU's working memory is mapped anew for every execution)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def forward_flops_per_image(model: str, algorithm: str) -> float:
    """FLOPs of one forward pass of one image (``fedjax_rcl.bench.flops``: 2 per multiply-add of
    every convolution and dense layer, padding positions included, as PyTorch's and the papers'
    counts), the same number for every mode so GFLOP/s compare across rows. (XLA's cost
    analysis skips the multiply-adds on padding: 970 vs 1111 MFLOP for ResNet-18.)"""
    from fedjax_rcl.bench.flops import forward_flops

    name, _, width = model.partition(":")  # "resnet10:16": ResNet-10 at width 16
    return float(forward_flops(name, projection_dim=256 if algorithm == "moon" else None,
                               width=int(width) if width else None))


def worker(spec: dict) -> dict:
    """Measures one configuration in this process (``spec``: model, algorithm, clients, mode)."""
    import jax
    import jax.numpy as jnp

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build

    model, algorithm, clients, mode = (spec["model"], spec["algorithm"], spec["clients"],
                                       spec["mode"])
    model, _, width = model.partition(":")  # "resnet10:16": ResNet-10 at width 16
    per_client, epochs = _setup(model, spec.get("paper_local_work", False))
    num_clients = max(clients, 100)
    batch = 50
    steps = epochs * per_client // batch
    out = {**spec, "steps": steps, "batch": batch}
    if mode == "torch":
        from fedjax_rcl.bench import torch_reference

        data = fake_cifar(num_clients * per_client)
        import torch

        autocast = {"fp32": None, "bf16": torch.bfloat16,
                    "fp16": torch.float16}[spec.get("precision", "fp32")]
        r = torch_reference.round_seconds(model, algorithm, clients=clients, steps=steps,
                                          batch=batch, data=data, epochs=epochs,
                                          repeats=spec.get("repeats", 2), autocast=autocast)
        out.update(round_s=r["round_s"], compile_s=0.0,
                   minor_faults=statistics.median(r["minor_faults_all"]))
    else:
        layout = {"one-at-a-time": 1, "side-by-side": clients, "side-by-side-patches": clients,
                  "side-by-side-native": clients}.get(mode, spec.get("chunk", 0))
        cfg = Config(dataset="fake", model=model, width=int(width) if width else None,
                     algorithm=algorithm, num_clients=num_clients,
                     participation=clients / num_clients, partition="iid", local_epochs=epochs,
                     batch_size=batch, eval_every=1, precision=spec.get("precision", "fp32"),
                     clients_in_parallel=layout,
                     conv_impl=_MODE_CONV.get(mode, "auto"))
        exp = build(cfg, fake_cifar(num_clients * per_client))
        out["layout"] = exp.layout  # the clients' layout and the convolutions it trained with
        if mode in COMPILED_MODES:
            t0 = time.perf_counter()
            step = exp.compile_rounds(1)
            out["compile_s"] = time.perf_counter() - t0
            state = exp.state
            state, _ = step(state, 1)  # warm-up
            jax.block_until_ready(state)
            times, faults = [], []
            for _ in range(spec.get("repeats", 2)):
                f = _minor_faults()
                t = time.perf_counter()
                state, _ = step(state, 1)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t)
                faults.append(_minor_faults() - f)
            out["round_s"] = statistics.median(times)
            out["minor_faults"] = statistics.median(faults)
        else:  # sequential: a Python loop over the same jitted local update
            from fedjax_rcl.engine.round import client_keys, sample_clients
            from fedjax_rcl.server import weighted_mean

            local = jax.jit(exp.local_update)
            mean = jax.jit(lambda trees, w: weighted_mean(trees, w))
            state = exp.state

            def one_round():
                ids = sample_clients(state.key, state.round, num_clients, clients)
                keys = client_keys(state.key, state.round, ids)
                trained = []
                for j in range(clients):
                    c = ids[j]
                    row = jax.tree.map(lambda t, c=c: t[c], state.client_states)
                    p, _, _, _ = local(state.params, state.model_state, row, keys[j],
                                       exp.data.client_indices[c], exp.data.client_sizes[c],
                                       state.round, exp.data)
                    trained.append(p)
                stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trained)
                return jax.block_until_ready(mean(stacked, jnp.ones((clients,))))

            t0 = time.perf_counter()
            one_round()
            out["compile_s"] = time.perf_counter() - t0  # includes one round of work
            out["round_s"] = statistics.median(
                _timed(one_round) for _ in range(spec.get("repeats", 2)))
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["client_steps_per_s"] = clients * steps / out["round_s"]
    # Counted once the measurement is done: it traces the model.
    out["fwd_flops_per_image"] = forward_flops_per_image(spec["model"], algorithm)
    return out


def merge_passes(results: list[dict]) -> dict:
    """One row from several passes of a configuration: median time, largest memory."""
    row = dict(results[-1])
    row["round_s_passes"] = [r["round_s"] for r in results]
    row["round_s"] = statistics.median(row["round_s_passes"])
    row["compile_s"] = statistics.median(r["compile_s"] for r in results)
    row["peak_rss_gb"] = max(r["peak_rss_gb"] for r in results)
    if all("minor_faults" in r for r in results):
        row["minor_faults_passes"] = [r["minor_faults"] for r in results]
        row["minor_faults"] = statistics.median(row["minor_faults_passes"])
    row["client_steps_per_s"] = row["clients"] * row["steps"] / row["round_s"]
    return row


def run_worker(spec: dict, timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out: {spec}", flush=True)
        return None
    if proc.returncode != 0:
        print(f"  failed: {spec}\n{proc.stderr[-2000:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    fields = dict(line.split(":", 1) for line in info.splitlines()[:30] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "model name" in fields:
        cpu = fields["model name"]
        if "cpu family" in fields:  # "AMD EPYC" alone does not tell Zen 3 from Zen 5
            cpu += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
        flags = set(fields.get("flags", "").split())
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        cpu += f", {isa}"
    import jax

    backend = jax.default_backend()
    if backend != "cpu":  # the accelerator by name ("NVIDIA H200")
        backend += f" ({', '.join(sorted({d.device_kind for d in jax.devices()}))})"
    return (f"{cpu}, {os.cpu_count()} cores, {backend}, jax {jax.__version__}, "
            f"Python {platform.python_version()}")


def convolutions() -> str:
    """Which CPU convolutions the compiled rounds use (``conv_impl=auto``)."""
    import jax

    from fedjax_rcl.nn import onednn

    if jax.default_backend() != "cpu":
        return "XLA's native convolutions"
    if onednn.available():
        return f"oneDNN {onednn.version()} through XLA's FFI"
    return f"matmul forms (oneDNN unavailable: {onednn.unavailable_reason()})"


def table(rows: list[dict], peak: float) -> str:
    head = ("| model | algorithm | clients | mode | precision | steps/client | s/round | "
            "client-steps/s | compile s | peak RSS GB | GFLOP/s | % of fp32 matmul peak |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        fwd = r.get("fwd_flops_per_image")
        mult = 5 if r["algorithm"] == "moon" else 3
        gflops = (fwd * mult * r["batch"] * r["steps"] * r["clients"] / r["round_s"] / 1e9
                  if fwd else float("nan"))
        lines.append(
            f"| {r['model']} | {r['algorithm']} | {r['clients']} | {r['mode']} | "
            f"{r.get('precision', 'fp32')} | {r['steps']} | "
            f"{r['round_s']:.3f} | {r['client_steps_per_s']:.1f} | {r['compile_s']:.1f} | "
            f"{r['peak_rss_gb']:.2f} | {gflops:.1f} | {100 * gflops / peak:.0f}% |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """Speed of the compiled round relative to the other modes, same model/algorithm/clients/
    precision; and bf16 against fp32 for each mode."""
    by = {(r["model"], r["algorithm"], r["clients"], r["mode"], r.get("precision", "fp32")): r
          for r in rows}
    out = []
    for (model, alg, clients, mode, prec), r in sorted(by.items()):
        if prec != "fp32" and (fp32 := by.get((model, alg, clients, mode, "fp32"))):
            out.append(f"- {model} {alg}, {clients} clients, {mode}: {prec} is "
                       f"{fp32['round_s'] / r['round_s']:.2f}x the speed of fp32")
        if mode != "vmap":
            continue
        for other in ("one-at-a-time", "sequential", "torch"):
            o = by.get((model, alg, clients, other, prec))
            if o:
                out.append(f"- {model} {alg}, {clients} clients, {prec}: compiled round is "
                           f"{o['round_s'] / r['round_s']:.2f}x the speed of {other}")
        base = by.get((model, alg, 5, "vmap", prec))
        if base and clients != 5:
            out.append(f"- {model} {alg}: client-steps/s with {clients} vmapped clients = "
                       f"{r['client_steps_per_s'] / base['client_steps_per_s']:.2f}x that with 5")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, model in zip(axes, ("cnn", "resnet18"), strict=True):
        for alg in sorted({r["algorithm"] for r in rows}):
            for mode, style in (("vmap", "-o"), ("sequential", "--s"), ("torch", ":^")):
                pts = sorted((r["clients"], r["client_steps_per_s"]) for r in rows
                             if r["model"] == model and r["algorithm"] == alg
                             and r["mode"] == mode)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"{alg} {mode}")
        ax.set_xscale("log")
        ax.set_xlabel("clients per round")
        ax.set_ylabel("client-steps / s")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet18"])
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "fedrcl", "moon"])
    ap.add_argument("--clients", nargs="+", type=int, default=None)
    ap.add_argument("--modes", nargs="+", default=["vmap", "sequential", "torch"])
    ap.add_argument("--quick", action="store_true", help="CNN only, 1 and 5 clients")
    ap.add_argument("--no-append", action="store_true",
                    help="print the table only: write nothing into the checkout (no JSON, "
                         "plot or HISTORY.md entry); --json keeps the results elsewhere")
    ap.add_argument("--json", type=Path, metavar="PATH",
                    help="also write the results as JSON to PATH")
    ap.add_argument("--passes", type=int, default=1,
                    help="run every configuration this many times, in rotation; report medians")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration after this many seconds (a short GPU window)")
    ap.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"],
                    help="the types local training computes in (PyTorch: autocast)")
    ap.add_argument("--paper-local-work", action="store_true",
                    help="every model runs the paper's 50 local steps per client (GPU/TPU)")
    ap.add_argument("--replot", nargs="+", metavar="JSON",
                    help="redraw benchmarks/round_scaling.png from saved results and exit "
                         "(later files replace earlier rows of the same configuration)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.replot:
        merged = {}
        for path in args.replot:
            for r in json.loads(Path(path).read_text())["rows"]:
                merged[(r["model"], r["algorithm"], r["clients"], r["mode"])] = r
        plot(list(merged.values()), ROOT / "benchmarks" / "round_scaling.png")
        return
    if args.quick:
        args.models, args.clients = ["cnn"], [1, 5]
    modes = [m for m in args.modes if m != "torch" or torch_available()]
    if "torch" in args.modes and "torch" not in modes:
        print("PyTorch not installed (pip install -e '.[bench]'): skipping the torch rows")
    peak = matmul_peak_gflops()
    convs = convolutions()
    print(f"matmul peak: {peak:.0f} GFLOP/s; convolutions: {convs}", flush=True)
    specs = []
    for model in args.models:
        clients_list = args.clients or (DEFAULT_CLIENTS if model == "cnn" else (1, 5, 10))
        for alg in args.algorithms:
            for clients in clients_list:
                for mode in modes:
                    if mode not in COMPILED_MODES and clients not in (1, 5):
                        continue  # the loops scale linearly; 1 and 5 clients say it all
                    for precision in args.precisions:
                        specs.append({"model": model, "algorithm": alg, "clients": clients,
                                      "mode": mode, "repeats": 2, "precision": precision,
                                      "paper_local_work": args.paper_local_work})
    runs: dict[tuple, list[dict]] = {}
    began = time.perf_counter()
    for p in range(args.passes):  # passes interleave the modes over time: drift hits all alike
        for spec in specs:
            if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
                print(f"  budget of {args.budget_s:.0f} s reached: skipping {spec}", flush=True)
                continue
            r = run_worker(spec, args.timeout)
            if r:
                runs.setdefault(tuple(spec.values()), []).append(r)
                print(f"  [{p + 1}/{args.passes}] {spec['model']} {spec['algorithm']} "
                      f"{spec['clients']} {spec['mode']}: {r['round_s']:.2f} s/round, "
                      f"{r['client_steps_per_s']:.1f} client-steps/s, "
                      f"compile {r['compile_s']:.1f} s, {r['peak_rss_gb']:.2f} GB", flush=True)
    rows = [merge_passes(rs) for rs in runs.values()]
    text = table(rows, peak)
    notes = ratios(rows)
    print(text)
    print("\n".join(notes))
    result = json.dumps({"machine": machine(), "matmul_peak_gflops": peak,
                         "convolutions": convs, "rows": rows}, indent=1)
    if args.json:
        args.json.write_text(result)
    if not args.no_append:  # the JSON and the plot go with the appended table
        (ROOT / "benchmarks").mkdir(exist_ok=True)
        plot(rows, ROOT / "benchmarks" / "round_scaling.png")
        (ROOT / "benchmarks" / f"round-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(result)
        with open(ROOT / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(f"\n## Round speed ({time.strftime('%Y-%m-%d')}; {machine()})\n\n"
                    f"`python tools/bench_round.py {' '.join(sys.argv[1:])}`; matmul peak "
                    f"{peak:.0f} GFLOP/s measured in the same run; convolutions: {convs}. Plot: "
                    "`benchmarks/round_scaling.png`. `vmap` is the compiled round with its "
                    "default client layout (on CPU the ResNets train clients one at a time). "
                    "With `--passes N`, s/round is the median over N passes run in rotation."
                    "\n\n" + text + "\n\n" + "\n".join(notes)
                    + "\n")


if __name__ == "__main__":
    main()
