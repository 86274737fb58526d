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
    """pfl 0.6.0 in its own interpreter (tools/pfl_side.py), driven line by line."""

    def __init__(self, python: str, rounds: int, threads: int | None, device: str = "cpu"):
        self.rounds = rounds
        env = dict(os.environ, PFL_BENCH_THREADS=str(threads or 0), PFL_PYTORCH_DEVICE=device)
        self.proc = subprocess.Popen([python, str(ROOT / "tools" / "pfl_side.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()
        self.train(), self.evaluate()  # warm-up

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the pfl worker exited (see its stderr above)")
        return json.loads(line)

    def _ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def train(self) -> float:
        return statistics.median(self._ask(f"train {self.rounds}")["round_seconds"])

    def evaluate(self) -> float:
        return self._ask("eval")["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


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
    args = ap.parse_args()

    from bench_round import machine, matmul_peak_gflops

    peak = matmul_peak_gflops()
    sides = {"fedjax-rcl": Ours(args.rounds)}
    for v in args.variants:
        sides[f"fedjax-rcl {v}"] = Ours(args.rounds, tuple(v.split(",")))
    for threads in args.pfl_threads if args.pfl_python else ():
        name = f"pfl 0.6.0 ({threads or os.cpu_count()} threads)"
        sides[name] = Pfl(args.pfl_python, args.rounds, threads, args.pfl_device)
    times = {name: {"train": [], "eval": []} for name in sides}
    for p in range(args.passes):
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
    for n, b in med.items():
        if n.startswith("pfl"):
            lines.append(f"\nSpeed vs {n} (its time / ours): training "
                         f"{b['train'] / a['train']:.2f}x, evaluation {b['eval'] / a['eval']:.2f}x,"
                         f" with evaluation every 10 rounds "
                         f"{(b['train'] + b['eval'] / 10) / (a['train'] + a['eval'] / 10):.2f}x; "
                         "target >= 1.3x.")
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
         "ours_parameters": sides["fedjax-rcl"].params}, indent=1)
    if args.json:
        args.json.write_text(result)
    if not args.no_append:
        (ROOT / "benchmarks" / f"pfl-{stamp}.json").write_text(result)
        with open(ROOT / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
