"""``fedjax-rcl suite run|table SUITE.yaml``: a suite of runs advanced in round-robin chunks,
resumable across sessions, and its table.

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

    fedjax-rcl suite run experiments/suites/fidelity_cpu.yaml --chunk 10
    fedjax-rcl suite table experiments/suites/fidelity_cpu.yaml \
        --out experiments/results/fidelity_cpu

Each run's own commands (train, then resume) are in ``RUN_DIR/commands.txt`` (written by the
command itself, with its machine and versions in ``RUN_DIR/environment.jsonl``). Paths in the
suite file are relative to the directory the command runs in; the runs are started with the
same Python (``python -m fedjax_rcl``), each in its own process.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fedjax_rcl import interrupts
from fedjax_rcl.loop import TrainingError
from fedjax_rcl.rundir import RunDir
from fedjax_rcl.validation import ConfigError

__all__ = ["load_suite", "rounds_done", "run", "table", "with_overrides"]

_KEYS = ("base", "runs_dir", "rounds", "runs")


def load_suite(path: str) -> dict:
    """Reads and checks a suite file (``ConfigError`` naming the problem)."""
    try:
        suite = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError([f"suite file {path!r}: not found"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"suite file {path!r}: not valid YAML ({str(e).splitlines()[0]})"]
                          ) from None
    if not isinstance(suite, dict):
        raise ConfigError([f"suite file {path!r}: must be a mapping with keys "
                           f"{', '.join(_KEYS)}"])
    missing = [k for k in _KEYS if k not in suite]
    if missing:
        raise ConfigError([f"suite file {path!r}: missing keys {', '.join(missing)}"])
    if not isinstance(suite["runs"], dict) or not suite["runs"]:
        raise ConfigError([f"suite file {path!r}: runs must map run names to override lists"])
    for name, overrides in suite["runs"].items():
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o
                                                      for o in overrides):
            raise ConfigError([f"suite file {path!r}: run {name!r} must be a list of "
                               "key=value overrides"])
    problems = _table_problems(suite)
    if problems:
        raise ConfigError([f"suite file {path!r}: {p}" for p in problems])
    return suite


def with_overrides(suite: dict, overrides) -> dict:
    """The suite with ``key=value`` overrides appended to every run's (so they win, and each
    run's ``config.yaml`` records them; a resumed run is given them again, and its digest
    check refuses one that would change its results). Each run's config is loaded and checked
    first: an unknown key or a bad value is a ``ConfigError`` naming it."""
    from fedjax_rcl.config import load_config

    overrides = list(overrides)
    if not overrides:
        return suite
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError([f"suite override {bad[0]!r}: must be key=value"])
    runs = {name: [*run, *overrides] for name, run in suite["runs"].items()}
    for name, run in runs.items():
        try:
            load_config(suite["base"], run)
        except ConfigError as e:
            raise ConfigError([f"suite {name}: {e.problems[0]}" if e.problems else str(e)]
                              ) from None
    return {**suite, "runs": runs, "overrides": overrides}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _table_problems(suite: dict, *, table: bool = False) -> list[str]:
    """What is wrong with the keys the table reads: ``rounds``, ``report_rounds``, ``paper``
    (numbers for the suite's runs) and ``group_by``. With ``table``, also report rounds past
    the suite's ``rounds`` (a run may be continued to fewer rounds first, as a chunk)."""
    rounds = suite["rounds"]
    if not _is_int(rounds) or rounds < 1:
        return [f"rounds={rounds!r}: must be a whole number >= 1"]
    out = []
    report = suite.get("report_rounds")
    top = rounds if table else math.inf
    if report is not None and (not isinstance(report, list) or not report or not all(
            _is_int(r) and 1 <= r <= top for r in report)):
        out.append(f"report_rounds={report!r}: must be a list of rounds between 1 and "
                   f"rounds={rounds}")
    paper = suite.get("paper")
    if paper is not None:
        if not isinstance(paper, dict):
            out.append("paper: must map run names to {column: value}")
        else:
            for name, values in paper.items():
                if name not in suite["runs"]:
                    out.append(f"paper: {name!r} is not one of the runs "
                               f"({', '.join(suite['runs'])})")
                elif not isinstance(values, dict) or not all(
                        isinstance(v, int | float) and not isinstance(v, bool)
                        for v in values.values()):
                    out.append(f"paper: {name!r} must map columns to numbers, got {values!r}")
    group = suite.get("group_by")
    if group is not None and not isinstance(group, str):
        out.append(f"group_by={group!r}: must be a config key (e.g. alpha)")
    return out


def rounds_done(run_dir: Path) -> int:
    """Rounds a resume would start from: the round the run's newest whole checkpoint reached
    where it has one (``RunDir.round_reached``; an MFCL run's phase-1 round, even before its
    probe is written), no further than the last round its metrics record (metrics can run
    ahead of a checkpoint when a process was killed between checkpoints, and resume redoes
    those rounds), else that last recorded round (a finished run whose checkpoints were not
    kept); a grid's is its members' oldest."""
    run = RunDir(run_dir)
    members = run.members()
    if members:
        return min(rounds_done(m.path) for m in members)
    last = run.last_round()
    reached = run.round_reached(partial=True)
    return last if reached is None else min(last, reached)


def _unfinished(run_dir: Path) -> bool:
    """Whether a resume still has work at the round the run stands at: an MFCL run whose
    phase 2 or probe is not done."""
    run = RunDir(run_dir)
    return run.round_reached() is None and run.round_reached(partial=True) is not None


def _command(suite: dict, name: str, target: int) -> list[str]:
    run_dir = Path(suite["runs_dir"]) / name
    if RunDir(run_dir).config.is_file():
        return ["fedjax-rcl", "resume", str(run_dir), *suite.get("overrides", ()),
                f"rounds={target}", "--no-progress"]
    return ["fedjax-rcl", "train", suite["base"], *suite["runs"][name], f"rounds={target}",
            f"run_dir={run_dir}", "--no-progress"]


# A run stopped by one of these signals after saving exits with 128 + it.
_STOPPING = {128 + int(s): s for s in (*interrupts.SIGNALS, interrupts.HANGUP)}


def _run_child(argv: list[str]) -> int:
    """One run's command as a child process, the exit status; a signal meanwhile is passed
    on to it (``interrupts.forwarding_to``), so the run saves the round it reaches whether
    the signal went to the suite's process or to its whole process group."""
    proc = subprocess.Popen(argv)
    with interrupts.forwarding_to(proc.pid):
        return proc.wait()


def run(suite: dict, chunk: int, only: list[str] | None = None) -> None:
    """Advances every run (or those named in ``only``) by ``chunk`` rounds at a time, the
    run furthest behind first, until all reach the suite's ``rounds``. A SIGINT or SIGTERM
    (under the command line's ``interrupts``) reaches the run in progress, which saves the
    round it reaches; then the suite stops too, as it does when a signal sent to the run alone
    stopped it.

    Raises:
      ConfigError: ``only`` names a run the suite does not have.
      TrainingError: a run's command failed (its exit status is in the message).
    """
    unknown = sorted(set(only or ()) - set(suite["runs"]))
    if unknown:
        raise ConfigError([f"--only {' '.join(unknown)}: not runs of this suite (its runs: "
                           f"{', '.join(suite['runs'])})"])
    names = [n for n in suite["runs"] if not only or n in only]
    while True:
        dirs = {n: Path(suite["runs_dir"]) / n for n in names}
        pending = [(rounds_done(dirs[n]), n) for n in names]
        pending = [(d, n) for d, n in pending if d < suite["rounds"] or _unfinished(dirs[n])]
        if not pending:
            print("every run has reached its rounds", flush=True)
            return
        done, name = min(pending)  # the run furthest behind goes next
        # An unfinished run at or past the suite's rounds finishes at its own.
        target = max(done, min(done + chunk, suite["rounds"]))
        cmd = _command(suite, name, target)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {done} -> {target}: {shlex.join(cmd)}",
              flush=True)
        # The command records itself in RUN_DIR/commands.txt and environment.jsonl.
        status = _run_child([sys.executable, "-m", "fedjax_rcl", *cmd[1:]])
        # The run saved its round and stopped on a signal: ours (passed on), or one sent to
        # it alone (its exit status says which).
        stopped_by = _STOPPING.get(status)
        if interrupts.requested() is not None or stopped_by is not None:
            interrupts.stop(stopped_by)
        if status != 0:
            raise TrainingError(f"{name}: exit status {status}; stopping the suite")


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equally long sequences (SciPy's, ties given their
    average rank); NaN when either is constant."""
    import warnings

    from scipy import stats

    with warnings.catch_warnings():  # a constant input: SciPy warns and returns NaN
        warnings.simplefilter("ignore")
        return float(stats.spearmanr(list(x), list(y)).statistic)


def _paper_lines(suite: dict, ours: dict[str, float], last: int) -> list[str]:
    """The rank correlation of our EMA at ``last`` with each of the paper's columns, over the
    runs the suite gives paper values for (``paper: {run: {column: value}}``)."""
    paper = suite.get("paper") or {}
    columns = list(dict.fromkeys(c for v in paper.values() for c in v))
    lines = []
    for column in columns:
        names = [n for n in paper if column in paper[n] and n in ours]
        if len(names) < 3:
            continue
        rho = spearman([ours[n] for n in names], [paper[n][column] for n in names])
        lines.append(f"Spearman rank correlation of EMA @{last} with the paper's {column}, over "
                     f"{len(names)} runs: {rho:+.2f}")
    return lines


def _table_rows(suite: dict) -> list[tuple[str, str, RunDir]]:
    """``(row label, the suite's run name, run directory)`` of each row of the table: a run,
    or each member of a run that is a grid (``seeds``, ``sweep``; its own ``metrics.jsonl``
    is empty), labelled ``<run>/<member>``."""
    rows = []
    for name in suite["runs"]:
        run = RunDir(Path(suite["runs_dir"]) / name)
        rows += [(f"{name}/{m.path.name}", name, m) for m in run.members()] or [(name, name, run)]
    return rows


def _probe_note(label: str, rows: list[dict]) -> str:
    """An MFCL run's linear probe accuracy (its evaluation), or that it is not written yet."""
    probe = next((r for r in reversed(rows) if r.get("phase") == "probe"), None)
    if probe is None or "linear_probe_accuracy" not in probe:
        return f"{label}: probe not written yet"
    return f"{label}: linear probe accuracy {probe['linear_probe_accuracy']:.4f}"


def table(suite: dict, out: Path) -> str:
    """Writes ``out/table.md`` (EMA at the report rounds, the mean over the last ten, the
    best, and the paper's values with the rank correlation of the orderings when the suite
    gives them under ``paper``) and ``out/ema_accuracy.png``; returns the table.

    A grid's members (``seeds``, ``sweep``) are a row each (``<run>/<member>``), beside the
    paper's values only for a run of one row. An MFCL run has no test accuracy per round: its
    row gives the phase-1 rounds done, and a note under the table its linear probe accuracy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = _table_problems(suite, table=True)
    if problems:
        raise ConfigError(problems)
    report = suite.get("report_rounds") or [suite["rounds"]]
    last = report[-1]
    window = range(max(1, last - 9), last + 1)  # one seed's EMA moves with a few lucky rounds
    paper = suite.get("paper") or {}
    columns = list(dict.fromkeys(c for v in paper.values() for c in v))
    lines = ["| run | overrides | rounds done | " + " | ".join(f"EMA @{r}" for r in report)
             + f" | mean acc {window[0]}-{last} | best acc to {suite['rounds']} |"
             + "".join(f" paper {c} |" for c in columns),
             "|---|---|---|" + "---|" * len(report) + "---|---|" + "---|" * len(columns)]
    ours: dict[str, float] = {}
    marked: list[str] = []
    groups: dict[str, list[str]] = {}
    table_rows = _table_rows(suite)
    metrics: dict[str, list[dict]] = {}
    probes: list[str] = []
    for label, name, run in table_rows:
        overrides = suite["runs"][name]
        every = run.read_metrics()
        # The lines with a test accuracy (an MFCL run's phase lines have none).
        rows = metrics[label] = [r for r in every
                                 if "round" in r and "test_accuracy_ema" in r]
        if run.is_mfcl() or any("phase" in r for r in every):
            probes.append(_probe_note(label, every))
        by_round = {r["round"]: r for r in rows}
        # The paper's EMA is per round: a run evaluated less often is marked, and its EMA is
        # kept out of the comparison with the paper's values.
        evaluated = sorted(by_round)
        gaps = [b - a for a, b in zip([0, *evaluated], evaluated, strict=False)]
        mark = "†" if gaps and max(gaps) > 1 else ""
        cells = [f"{by_round[r]['test_accuracy_ema']:.4f}{mark}" if r in by_round else "—"
                 for r in report]
        mean = (f"{sum(by_round[r]['test_accuracy'] for r in window) / len(window):.4f}"
                if all(r in by_round for r in window) else "—")
        # Over the suite's rounds only: a run that went further is not compared on more rounds.
        best = max((r["test_accuracy"] for r in rows if r["round"] <= suite["rounds"]),
                   default=None)
        done = run.last_round()
        if last in by_round and not mark:
            ours[label] = by_round[last]["test_accuracy_ema"]
        marked += [label] if mark else []
        lines.append(f"| {label} | {' '.join(overrides)} | {done} | " + " | ".join(cells)
                     + f" | {mean} | {'—' if best is None else f'{best:.4f}'} |"
                     + "".join(f" {paper.get(label, {}).get(c, '—')} |" for c in columns))
        group = suite.get("group_by")
        key = next((o for o in overrides if group and o.startswith(f"{group}=")), "all")
        groups.setdefault(key, []).append(label)
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
    notes = _paper_lines(suite, ours, last)
    if marked:
        notes.insert(0, "† Not evaluated every round: the EMA is not the paper's per-round "
                     "EMA and is left out of any comparison with the paper's values: "
                     + ", ".join(marked) + ".")
    if notes:
        lines += ["", *notes, "", f"Paper values: {suite.get('paper_source', 'the paper')}."]
    if probes:
        lines += ["", "MFCL runs are evaluated by the linear probe, not test accuracy per "
                  "round: " + "; ".join(probes) + "."]
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text
