"""The pfl-research workload: seconds per round of pfl-research's CIFAR-10 benchmark for this
project's compiled round and, in the same run, for pfl 0.6.0 itself (Granqvist et al. 2024,
arXiv 2404.06430; the workload as ``experiments/pfl_cifar10.yaml``).

Workload: 1000 clients of 50 images, 50 clients per round, one local epoch at batch 10 (5 SGD
steps at lr 0.1), FedAvg with server lr 1, pfl's CIFAR-10 CNN (``model=pfl_cnn``: conv 3x3 32,
conv 3x3 64, max-pool, dropout 0.25, dense 128, dropout 0.5, dense 10; 1,626,442 parameters), no
augmentation; evaluation of 10,000 test images at batch 500. Both sides train on the same kind
of synthetic CIFAR-10-shaped data (speed only; accuracy is ``experiments/pfl_cifar10.yaml``'s
job).

    python tools/bench_pfl.py                                  # ours only
    python tools/bench_pfl.py --pfl-python /tmp/pflvenv/bin/python --passes 3

pfl runs in its own interpreter (``--pfl-python``: a venv with ``pip install pfl==0.6.0
torch==2.13.0``, kept apart because pfl pins its own dependencies) as a worker process
(``tools/pfl_side.py``) that stays alive between passes; the two sides alternate ``--rounds``
training rounds and one evaluation per pass, so every ratio is taken under the same machine
conditions (medians over passes). Our rounds run as the CLI runs them: ``--rounds`` rounds fused
into one compiled call (``eval_every``), then the evaluation.

FLOP/s: pfl's CNN costs 16.84 M multiply-adds per image forward (analytic: conv1 27x32x30x30,
conv2 288x64x28x28, dense 12544x128, dense 128x10), so a training round (2,500 images, forward +
backward = 3 forwards) is 253 GFLOP and an evaluation 337 GFLOP; the fraction of the machine's
float32 matmul peak (measured in the same run) says how far each side is from the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MACS_PER_IMAGE = 27 * 32 * 30 * 30 + 288 * 64 * 28 * 28 + 12544 * 128 + 128 * 10
TRAIN_GFLOP = 2 * MACS_PER_IMAGE * 3 * 50 * 50 / 1e9  # 50 clients x 50 images, fwd + bwd
EVAL_GFLOP = 2 * MACS_PER_IMAGE * 10_000 / 1e9


class Ours:
    """This project's compiled rounds on the workload."""

    def __init__(self, rounds: int, overrides: tuple[str, ...] = ()):
        import jax
        from bench_round import fake_cifar

        from fedjax_rcl.config import load_config
        from fedjax_rcl.experiment import build

        # dataset=digits only to pass validation without the CIFAR-10 zip; the data are passed.
        cfg = load_config(str(ROOT / "experiments" / "pfl_cifar10.yaml"),
                          ["dataset=digits", f"eval_every={rounds}", "eval_batch_size=500",
                           "checkpoint_every=0", *overrides])
        self.exp, self.rounds, self.jax = build(cfg, fake_cifar(50_000, 10_000)), rounds, jax
        self.params = sum(x.size for x in jax.tree.leaves(self.exp.state.params))
        t = time.perf_counter()
        self.step = self.exp.compile_rounds(rounds)
        self.compile_s = time.perf_counter() - t
        self.state = self.exp.state
        self.train(), self.evaluate()  # warm-up

    def train(self) -> float:
        t = time.perf_counter()
        self.state, _ = self.step(self.state, self.rounds)
        self.jax.block_until_ready(self.state)
        return (time.perf_counter() - t) / self.rounds

    def evaluate(self) -> float:
        t = time.perf_counter()
        self.jax.block_until_ready(self.exp.evaluate(self.state.params, self.state.model_state,
                                                     self.exp.test))
        return time.perf_counter() - t


class Pfl:
    """pfl 0.6.0 in its own interpreter (tools/pfl_side.py), driven line by line; with
    ``workers`` > 1, that many pfl processes on one machine (pfl's ``PFL_WORKER_ADDRESSES``
    and ``PFL_WORKER_RANK``), each sent the same commands, splitting every cohort between
    them; the times are rank 0's (the ranks meet in every round's all-reduce)."""

    def __init__(self, python: str, rounds: int, threads: int | None, device: str = "cpu",
                 workers: int = 1, backend: str | None = None, timeout_s: float = 600):
        self.rounds, self.timeout_s = rounds, timeout_s
        env = dict(os.environ, PFL_BENCH_THREADS=str(threads or 0), PFL_PYTORCH_DEVICE=device)
        if backend:
            env["PFL_BENCH_DIST_BACKEND"] = backend
        if workers > 1:
            env["PFL_WORKER_ADDRESSES"] = ",".join(f"localhost:{p}"
                                                   for p in _free_ports(workers))
        self.procs = []
        try:
            for rank in range(workers):
                self.procs.append(subprocess.Popen(
                    [python, str(ROOT / "tools" / "pfl_side.py")],
                    env=dict(env, PFL_WORKER_RANK=str(rank)) if workers > 1 else env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            self.info = self._read_all()
            self.train(), self.evaluate()  # warm-up
        except BaseException:
            self.close(kill=True)
            raise

    def _read_all(self) -> dict:
        """Every worker's next line (rank 0's answer), or an error once one exits or none
        answers within ``timeout_s`` (a process group that cannot form hangs)."""
        deadline, replies = time.monotonic() + self.timeout_s, []
        for proc in self.procs:
            ready, _, _ = select.select([proc.stdout], [], [], max(0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(
                    f"pfl worker {len(replies)} of {len(self.procs)} "
                    + ("exited" if proc.poll() is not None else
                       f"gave no answer in {self.timeout_s:.0f} s")
                    + " (see its stderr above)")
            replies.append(json.loads(line))
        return replies[0]

    def _ask(self, command: str) -> dict:
        for proc in self.procs:
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return self._read_all()

    def train(self) -> float:
        return statistics.median(self._ask(f"train {self.rounds}")["round_seconds"])

    def evaluate(self) -> float:
        return self._ask("eval")["seconds"]

    def close(self, kill: bool = False) -> None:
        for proc in self.procs:
            if kill:
                proc.kill()
            else:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _start_timeout(budget_s: float, elapsed_s: float) -> float:
    """How long pfl's processes may take to answer: up to 10 minutes, within what is left of
    the budget (less 20 s for the passes), so that a short budget ends with ours measured and
    pfl reported as not started rather than the whole command stopped from outside."""
    return min(600.0, max(30.0, budget_s - elapsed_s - 20))


def _free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on this machine now (bound, noted, released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pfl-python", help="an interpreter with pfl==0.6.0 and torch installed")
    ap.add_argument("--pfl-threads", type=int, nargs="+", default=[0],
                    help="torch threads for pfl, one worker each (0: every core, pfl's default;"
                         " 1 is faster at batch 10 on some machines)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="more of our configurations to time beside the default, each "
                         "'key=value[,key=value]', e.g. conv_impl=native clients_in_parallel=10")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10, help="training rounds per pass")
    ap.add_argument("--no-append", action="store_true",
                    help="write nothing into the checkout (no JSON, no HISTORY.md entry); "
                         "--json keeps the results elsewhere")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the results to PATH")
    ap.add_argument("--pfl-device", default="cpu",
                    help="where pfl's PyTorch runs (cpu, cuda): on a GPU both sides use it")
    ap.add_argument("--pfl-workers", type=int, nargs="+", default=[1],
                    help="pfl processes sharing the machine, one side per count (pfl's guide "
                         "to fast simulations: try 1, 2, 3, ... per GPU); with 0 threads, "
                         "each process gets an equal share of the cores")
    ap.add_argument("--pfl-backend", choices=["pfl", "gloo", "auto"], default="auto",
                    help="torch.distributed backend of several pfl processes: pfl's own choice "
                         "(NCCL on a GPU), gloo, or auto: gloo on a GPU (NCCL refuses several "
                         "processes on one device: 'Duplicate GPU detected'), elsewhere pfl's "
                         "and gloo where that fails")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no side and no pass that would end past this many seconds; "
                         "the results so far are still written")
    args = ap.parse_args()
    start = time.perf_counter()

    from bench_round import machine, matmul_peak_gflops

    peak = matmul_peak_gflops()
    sides = {"fedjax-rcl": Ours(args.rounds)}
    for v in args.variants:
        sides[f"fedjax-rcl {v}"] = Ours(args.rounds, tuple(v.split(",")))
    failed: dict[str, str] = {}
    for threads in args.pfl_threads if args.pfl_python else ():
        for workers in args.pfl_workers:
            if time.perf_counter() - start > 0.5 * args.budget_s:
                failed[f"pfl ({workers} processes)"] = "not started: out of time"
                continue
            per = threads or max(1, (os.cpu_count() or 1) // workers)
            name = (f"pfl 0.6.0 ({threads or os.cpu_count()} threads)" if workers == 1 else
                    f"pfl 0.6.0 ({workers} processes x {per} threads)")
            # NCCL refuses processes that share one GPU ("Duplicate GPU detected", NCCL 2.28.9
            # on an H200), and a refused worker only shows as a timeout: go to gloo at once.
            auto = ["gloo"] if args.pfl_device.startswith("cuda") else [None, "gloo"]
            backends = {"pfl": [None], "gloo": ["gloo"], "auto": auto}
            for backend in backends[args.pfl_backend] if workers > 1 else [None]:
                label = name + (f", {backend}" if backend else "")
                try:
                    sides[label] = Pfl(args.pfl_python, args.rounds, per, args.pfl_device,
                                       workers, backend,
                                       timeout_s=_start_timeout(args.budget_s,
                                                                time.perf_counter() - start))
                    break
                except RuntimeError as e:
                    failed[label] = str(e)
                    print(f"{label}: {e}", flush=True)
    times = {name: {"train": [], "eval": []} for name in sides}
    for p in range(args.passes):
        if p and (time.perf_counter() - start) * (p + 1) / p > args.budget_s:
            print(f"stopping after {p} passes: out of time", flush=True)
            break
        for name, side in sides.items():
            times[name]["train"].append(side.train())
            times[name]["eval"].append(side.evaluate())
            print(f"pass {p + 1}: {name} {times[name]['train'][-1]:.2f} s/round, eval "
                  f"{times[name]['eval'][-1]:.2f} s", flush=True)
    for side in sides.values():
        if isinstance(side, Pfl):
            side.close()

    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    lines = ["| system | s / training round | GFLOP/s (% of peak) | eval 10k s | GFLOP/s "
             "(% of peak) | s / round, eval every 10 |", "|---|---|---|---|---|---|"]
    for n, m in med.items():
        tr, ev = TRAIN_GFLOP / m["train"], EVAL_GFLOP / m["eval"]
        lines.append(f"| {n} | {m['train']:.2f} | {tr:.0f} ({100 * tr / peak:.0f} %) | "
                     f"{m['eval']:.2f} | {ev:.0f} ({100 * ev / peak:.0f} %) | "
                     f"{m['train'] + m['eval'] / 10:.2f} |")
    a = med["fedjax-rcl"]
    target = 10 if args.pfl_device.startswith("cuda") else 1.3
    for n, b in med.items():
        if n.startswith("pfl"):
            lines.append(f"\nSpeed vs {n} (its time / ours): training "
                         f"{b['train'] / a['train']:.2f}x, evaluation {b['eval'] / a['eval']:.2f}x,"
                         f" with evaluation every 10 rounds "
                         f"{(b['train'] + b['eval'] / 10) / (a['train'] + a['eval'] / 10):.2f}x; "
                         f"target >= {target}x.")
    pfls = {n: b for n, b in med.items() if n.startswith("pfl")}
    if len(pfls) > 1:
        best = min(pfls, key=lambda n: pfls[n]["train"])
        lines.append(f"\npfl's fastest training round: {best}, {pfls[best]['train']:.3f} s; "
                     f"ours {pfls[best]['train'] / a['train']:.2f}x faster.")
    lines += [f"\n{n}: failed: {e}" for n, e in failed.items()]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    header = (f"\n## The pfl-research workload ({time.strftime('%Y-%m-%d')}; {machine()})\n\n"
              f"`python tools/bench_pfl.py {' '.join(sys.argv[1:])}`; medians of {args.passes} "
              f"passes of {args.rounds} rounds + one evaluation, alternating; matmul peak "
              f"{peak:.0f} GFLOP/s; training {TRAIN_GFLOP:.0f} GFLOP / round, evaluation "
              f"{EVAL_GFLOP:.0f} GFLOP; ours compiled in {sides['fedjax-rcl'].compile_s:.1f} s"
              + ("" if args.no_append else f"; `benchmarks/pfl-{stamp}.json`") + ".\n\n")
    text = header + "\n".join(lines) + "\n"
    print(text)
    info = {n: side.info for n, side in sides.items() if isinstance(side, Pfl)}
    result = json.dumps(
        {"machine": machine(), "peak_gflops": peak, "train_gflop": TRAIN_GFLOP,
         "eval_gflop": EVAL_GFLOP, "times": times, "medians": med, "pfl": info,
         "pfl_failed": failed,
         "ours_parameters": sides["fedjax-rcl"].params}, indent=1)
    if args.json:
        args.json.write_text(result)
    if not args.no_append:
        (ROOT / "benchmarks" / f"pfl-{stamp}.json").write_text(result)
        with open(ROOT / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
