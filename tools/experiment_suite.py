"""Runs a suite of experiments in round-robin chunks, resumable across sessions, and tabulates it.

A suite file (YAML) names a base config, a directory for the runs, and the runs as lists of
``key=value`` overrides::

    base: experiments/cifar10_resnet10w16.yaml
    runs_dir: experiments/runs/fidelity
    rounds: 200            # where every run is headed
    report_rounds: [25, 50, 100, 200]
    runs:
      fedavg-a0.3: [algorithm=fedavg, alpha=0.3]
      fedrcl-a0.3: [algorithm=fedrcl, alpha=0.3]

``run`` advances every run by ``--chunk`` rounds in turn (``fedjax-rcl train`` the first time,
``fedjax-rcl resume RUN_DIR rounds=N`` after), so all methods progress together and a session
that ends early leaves comparable curves; running the same command again continues where the
runs stand (their checkpoints are in the run directories). ``table`` writes the Markdown table
of EMA accuracy at ``report_rounds``, the mean test accuracy over the ten rounds up to the last
of them (less sensitive to a few lucky rounds of one seed than the EMA) and the accuracy curves::

    python tools/experiment_suite.py run experiments/suites/fidelity_cpu.yaml --chunk 10
    python tools/experiment_suite.py table experiments/suites/fidelity_cpu.yaml \
        --out experiments/results/fidelity_cpu

Each run's own commands (train, then resume) are in ``RUN_DIR/commands.txt`` (written by the
command itself, with its machine and versions in ``RUN_DIR/environment.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_suite(path: str) -> dict:
    suite = yaml.safe_load(Path(path).read_text())
    missing = {"base", "runs_dir", "rounds", "runs"} - set(suite)
    if missing:
        sys.exit(f"{path}: missing keys {sorted(missing)}")
    for name, overrides in suite["runs"].items():
        if not isinstance(overrides, list) or not all("=" in o for o in overrides):
            sys.exit(f"{path}: run {name!r} must be a list of key=value overrides")
    return suite


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rounds_done(run_dir: Path) -> int:
    rows = _metrics(run_dir)
    return rows[-1]["round"] if rows else 0


def _command(suite: dict, name: str, target: int) -> list[str]:
    run_dir = Path(suite["runs_dir"]) / name
    if (run_dir / "config.yaml").is_file():
        return ["fedjax-rcl", "resume", str(run_dir), f"rounds={target}", "--no-progress"]
    return ["fedjax-rcl", "train", suite["base"], *suite["runs"][name], f"rounds={target}",
            f"run_dir={run_dir}", "--no-progress"]


def run(suite: dict, chunk: int, only: list[str] | None) -> None:
    names = [n for n in suite["runs"] if not only or n in only]
    while True:
        pending = [(rounds_done(Path(suite["runs_dir"]) / n), n) for n in names]
        pending = [(d, n) for d, n in pending if d < suite["rounds"]]
        if not pending:
            print("every run has reached its rounds", flush=True)
            return
        done, name = min(pending)  # the run furthest behind goes next
        target = min(done + chunk, suite["rounds"])
        cmd = _command(suite, name, target)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {done} -> {target}: {shlex.join(cmd)}",
              flush=True)
        # The command records itself in RUN_DIR/commands.txt and environment.jsonl.
        status = subprocess.run(cmd, cwd=ROOT).returncode
        if status != 0:
            sys.exit(f"{name}: exit status {status}; stopping the suite")


def table(suite: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = suite.get("report_rounds") or [suite["rounds"]]
    last = report[-1]
    window = range(max(1, last - 9), last + 1)  # one seed's EMA moves with a few lucky rounds
    lines = ["| run | overrides | rounds done | " + " | ".join(f"EMA @{r}" for r in report)
             + f" | mean acc {window[0]}-{last} | best acc to {suite['rounds']} |",
             "|---|---|---|" + "---|" * len(report) + "---|---|"]
    groups: dict[str, list[str]] = {}
    metrics = {name: _metrics(Path(suite["runs_dir"]) / name) for name in suite["runs"]}
    for name, overrides in suite["runs"].items():
        rows = metrics[name]
        by_round = {r["round"]: r for r in rows}
        cells = [f"{by_round[r]['test_accuracy_ema']:.4f}" if r in by_round else "—"
                 for r in report]
        mean = (f"{sum(by_round[r]['test_accuracy'] for r in window) / len(window):.4f}"
                if all(r in by_round for r in window) else "—")
        # Over the suite's rounds only: a run that went further is not compared on more rounds.
        best = max((r["test_accuracy"] for r in rows if r["round"] <= suite["rounds"]),
                   default=None)
        done = rows[-1]["round"] if rows else 0
        lines.append(f"| {name} | {' '.join(overrides)} | {done} | " + " | ".join(cells)
                     + f" | {mean} | {'—' if best is None else f'{best:.4f}'} |")
        group = suite.get("group_by")
        key = next((o for o in overrides if group and o.startswith(f"{group}=")), "all")
        groups.setdefault(key, []).append(name)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, (key, names) in zip(axes[0], sorted(groups.items()), strict=True):
        for name in names:
            rows = metrics[name]
            if rows:
                ax.plot([r["round"] for r in rows], [r["test_accuracy_ema"] for r in rows],
                        label=name)
        ax.set_title(key)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy, EMA 0.9 per round")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(Path(suite["runs_dir"]).name + ": " + suite["base"])
    fig.tight_layout()
    fig.savefig(out / "ema_accuracy.png", dpi=110)
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["run", "table"])
    ap.add_argument("suite")
    ap.add_argument("--chunk", type=int, default=10, help="rounds per turn (run)")
    ap.add_argument("--only", nargs="+", help="run only these runs of the suite")
    ap.add_argument("--out", type=Path, help="table: where table.md and ema_accuracy.png go")
    args = ap.parse_args()
    suite = load_suite(args.suite)
    if args.command == "run":
        run(suite, args.chunk, args.only)
    else:
        print(table(suite, args.out or Path("experiments/results") / Path(args.suite).stem))


if __name__ == "__main__":
    main()
