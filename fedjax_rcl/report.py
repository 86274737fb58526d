"""``fedjax-rcl report RUN_DIR...``: tables and figures in the FedRCL paper's layout from run
directories, with no script to write.

Each run directory contributes its ``config.yaml`` (what it is) and ``metrics.jsonl`` (how it
went). Runs are grouped by their configs: the keys whose values differ between runs are split
into the *method* (the algorithm, its own section's keys, the server optimizer) and the
*setting* (everything else that differs: alpha, partition, dataset, model, ...). Written to
``--out``:

* ``report.md``: per reported round (default: the last round every run reached), methods as
  rows and settings as columns, two tables: the EMA test accuracy as the paper's tables
  (``ema_t = d ema_{t-1} + (1 - d) acc_t`` over rounds), the best accuracy through that round
  beside it, a ``†`` on the EMA of runs not evaluated every round (their EMA is not the
  paper's; a footnote says what it is); and the raw test accuracy, the mean of the
  evaluations in the last 10 and 50 rounds, which neither lags nor depends on the cadence.
  Then the runs behind each cell. Columns and titles name the split, clients and seeds;
* ``convergence.png``: EMA (thick) and raw (thin) accuracy over rounds, one panel per setting
  (paper Fig. 1/A);
* ``collapse.png``, for runs recorded with ``analysis_every``: effective rank and variability
  collapse index of the global and local models' features over rounds (paper Figs. 2-3), and
  the measures that keep the mean where recorded; the same values at the reported rounds that
  were analysed as a table in ``report.md``;
* the spread over clients (local loss, accuracy on own data before and after local training)
  at each reported round, for runs with per-client metrics (``client_metrics``,
  ``client_eval``);
* ``beta_sweep.png`` when the FedRCL runs differ only in ``fedrcl.beta`` (and the setting;
  other methods' runs may be in the report): the last round's EMA and raw accuracy against
  beta, per value the mean ± sd over its seeds (paper Fig. 4/B).

Runs that differ only in ``seed`` share a cell: the table gives the mean ± sd over them (and
n), the curves the mean with a shaded ± sd band, and with ``baseline`` (a method's label, such
as ``fedavg``) a second table gives each method's paired difference from the baseline, seed by
seed: mean ± sd of ``method(seed) - baseline(seed)`` over the seeds both ran. A grid directory
(``train 'seeds=[...]'``) stands for its members.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Sequence
from pathlib import Path

import yaml

from fedjax_rcl.config import flat_keys, keys_declared
from fedjax_rcl.metrics import RECENT_WINDOWS
from fedjax_rcl.rundir import RunDir


def _ignored() -> set[str]:
    """Keys that say nothing about what a run is (declared ``report=False`` where they are:
    where its files go, how it is laid out on the hardware)."""
    return set(keys_declared(report=False))


class ReportError(ValueError):
    """A run directory that cannot be reported (missing or unreadable files)."""


@dataclasses.dataclass
class RunRecord:
    """What a report reads of one run directory: its flat config, its metrics lines and its
    per-client lines (``clients.jsonl``)."""

    path: Path
    config: dict  # flat
    rows: list[dict]
    clients: list[dict] = dataclasses.field(default_factory=list)  # clients.jsonl, if any

    def ema_at(self, r: int) -> float | None:
        hit = [x for x in self.rows if x["round"] == r]
        return hit[0]["test_accuracy_ema"] if hit else None

    def recent_at(self, r: int, window: int) -> float | None:
        """The mean raw test accuracy of the evaluations in rounds ``r - window + 1 .. r``
        (None: round ``r`` not evaluated): the same figure at any evaluation cadence."""
        if self.ema_at(r) is None:
            return None
        hit = [x["test_accuracy"] for x in self.rows if r - window < x["round"] <= r]
        return sum(hit) / len(hit)

    def cadence_to(self, r: int) -> int:
        """The largest number of rounds between two evaluations up to round ``r`` (from round
        0): 1 when every round was evaluated, the one case whose EMA is the paper's."""
        rounds = [0] + [x["round"] for x in self.rows if x["round"] <= r]
        return max((b - a for a, b in zip(rounds[:-1], rounds[1:], strict=True)), default=1)

    def ema_steps_per_round(self) -> bool:
        """Whether the records apply ``ema_decay**k`` for ``k`` rounds between evaluations
        (lines with ``ema_rounds``), rather than ``ema_decay`` once per evaluation (records
        without ``ema_rounds``)."""
        return any("ema_rounds" in x for x in self.rows)

    @property
    def last_round(self) -> int:
        return self.rows[-1]["round"] if self.rows else 0

    def best_to(self, r: int) -> float | None:
        """The best test accuracy of the evaluations up to round ``r`` (None: none yet)."""
        return max((x["test_accuracy"] for x in self.rows if x["round"] <= r), default=None)


def _section(algorithm) -> str:
    from fedjax_rcl import builtins, registry

    builtins.load()
    entry = registry.ALGORITHMS.get(str(algorithm))
    return (entry.section or entry.name) if entry is not None else str(algorithm)


def _result_keys(config: dict) -> dict:
    """The settings that make a run what it is: core keys, the algorithm's own section, the
    server optimizer and its section -- not the inert sections of other algorithms and
    optimizers (whose presence and defaults vary with the code that wrote the file)."""
    from fedjax_rcl import registry

    section, opt = _section(config.get("algorithm")), config.get("server.optimizer")
    ignored = _ignored()
    out = {}
    for k, v in config.items():
        if k in ignored:
            continue
        head = k.split(".")[0]
        if "." not in k or head == section or k == "server.optimizer" or (
                k.startswith(f"server.{opt}.")):
            out[k] = v
        elif k == "server.lr":
            entry = registry.SERVER_OPTIMIZERS.get(str(opt))
            out[k] = v if v is not None or entry is None else entry.default_lr
    return out


def read_runs(path: str | Path) -> list[RunRecord]:
    """A run directory's run, or a grid's member runs (``RunDir.members``)."""
    members = RunDir(path).members()
    return [read_run(m.path) for m in members] if members else [read_run(path)]


def read_run(path: str | Path) -> RunRecord:
    """A run directory's config and its complete metrics and per-client lines (a torn last
    line is skipped, as every reader of a run does: ``rundir.read_jsonl``)."""
    run = RunDir(path)
    if not run.config.is_file() or not run.metrics.is_file():
        raise ReportError(f"{run.path}: not a run directory (needs {run.config.name} and "
                          f"{run.metrics.name})")
    try:
        config = _result_keys(flat_keys(yaml.safe_load(run.config.read_text()) or {}))
    except yaml.YAMLError as e:
        raise ReportError(f"{run.path}: unreadable {run.config.name} ({e})") from None
    return RunRecord(run.path, config, run.read_metrics(), run.read_clients())


def _method_key(key: str, config: dict) -> bool:
    """Whether a differing key belongs to the method (rather than the setting)."""
    return (key == "algorithm" or key.startswith(f"{_section(config.get('algorithm'))}.")
            or key.startswith("server."))


# Variants a bare algorithm name would hide: the key whose value says which one a run is, and
# what each value means (FedRCL's loss as released, with hard-negative mining, or as the
# paper's equations write it).
VARIANTS = {"fedrcl": ("fedrcl.mining", {"hard": "released hard-mined loss",
                                          "none": "paper's equations"}),
            "fedscl": ("fedrcl.mining", {"hard": "released hard-mined loss",
                                          "none": "paper's equations"})}


def _variant(run: RunRecord) -> str:
    """`` (released hard-mined loss)`` and the like for an algorithm with variants."""
    key, names = VARIANTS.get(str(run.config.get("algorithm")), (None, {}))
    value = run.config.get(key) if key else None
    if key is None:
        return ""
    if value is None:  # records without the key: the default, the released loss
        value = "hard"
    short = key.split(".")[-1]
    return f" ({names.get(value, f'{short}={value}')})"


def _label(run: RunRecord, keys: Sequence[str]) -> str:
    parts = []
    for k in keys:
        v = run.config.get(k)
        if k == "algorithm":
            parts.append(str(v) + _variant(run))
        elif k == "server.optimizer":
            parts.append(f"+ {v}")
        elif k == VARIANTS.get(str(run.config.get("algorithm")), ("",))[0]:
            continue  # named by the variant
        elif "." in k:  # a section's key: its short name
            parts.append(f"{k.split('.')[-1]}={v}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def _split(config: dict) -> str | None:
    """A run's split as titles name it (None: its config does not say)."""
    partition = config.get("partition", "dirichlet" if "alpha" in config else None)
    if partition == "iid":
        return "IID"
    if partition == "shards":
        return f"{config.get('shards_per_client', '?')} shards a client"
    if partition == "dirichlet" and "alpha" in config:
        return f"Dirichlet alpha {config['alpha']:g}"
    return None


def describe(runs: Sequence[RunRecord]) -> str:
    """What a group of runs has in common, as titles and column heads name it: the split
    (alpha or IID), the number of clients and the seeds, as far as their configs say."""
    parts = []
    splits = {_split(r.config) for r in runs}
    if len(splits) == 1 and None not in splits:
        parts.append(splits.pop())
    clients = {r.config.get("num_clients") for r in runs}
    if len(clients) == 1 and None not in clients:
        parts.append(f"{clients.pop()} clients")
    seeds = sorted({r.config["seed"] for r in runs if "seed" in r.config}, key=str)
    if seeds:
        parts.append(("seed " if len(seeds) == 1 else "seeds ")
                     + ", ".join(str(x) for x in seeds))
    return ", ".join(parts) or "one setting"


def _replicate_keys() -> set[str]:
    """Runs that differ only in these share a cell (seeds of one setting): the keys declared
    ``replicate`` (``seed``, and the threefry bit layout of the initial weights, which changes
    which weights are drawn, not from which distribution)."""
    return set(keys_declared(replicate=True))


def _compared(key: str, value):
    """A setting's value as runs are compared: an image-folder archive by its file name, so
    that one archive reached by two paths (``data/x.zip``, ``/mnt/data/x.zip``: another
    working directory, a link) is one dataset."""
    if key == "dataset" and isinstance(value, str) and value.startswith("imagefolder:"):
        return "imagefolder:" + posixpath.basename(value.split(":", 1)[1].rstrip("/"))
    return value


# A split's parameters that only one kind of split reads (data/partitioning.py): an IID run's
# alpha is whatever its config carried and says nothing about the run.
_PARTITION_KEYS = {"alpha": "dirichlet", "balanced": "dirichlet", "shards_per_client": "shards"}


def _applies(key: str, config: dict) -> bool:
    """Whether ``key`` is one of the run's settings: present, and read by its split."""
    kind = _PARTITION_KEYS.get(key)
    return key in config and (kind is None or config.get("partition", "dirichlet") == kind)


def group(runs: Sequence[RunRecord]) -> tuple[list[str], list[str], dict]:
    """``(methods, settings, cells)``: labels in first-seen order, ``cells[(m, s)]`` runs (the
    seeds of one method and setting share a cell)."""
    keys = sorted({k for r in runs for k in r.config} - _ignored() - _replicate_keys())
    # A section's key is compared among the runs that have it (its algorithm's runs); a
    # split's parameter among the runs whose split reads it.
    differing = [k for k in keys
                 if len({json.dumps(_compared(k, r.config[k])) for r in runs
                         if _applies(k, r.config)}) > 1]
    methods, settings, cells = [], [], {}
    for r in runs:
        mk = [k for k in differing if _method_key(k, r.config) and k in r.config]
        sk = [k for k in differing
              if not _method_key(k, r.config) and "." not in k and _applies(k, r.config)]
        m, s = _label(r, ["algorithm"] + [k for k in mk if k != "algorithm"]), _label(r, sk)
        methods += [m] if m not in methods else []
        settings += [s] if s not in settings else []
        cells.setdefault((m, s), []).append(r)
    if "" in settings:  # the runs of no differing setting: named by what they share
        name = describe([x for (_, s), hit in cells.items() if s == "" for x in hit])
        settings = [name if s == "" else s for s in settings]
        cells = {(m, name if s == "" else s): hit for (m, s), hit in cells.items()}
    return methods, settings, cells


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    import statistics

    return (statistics.fmean(values),
            statistics.stdev(values) if len(values) > 1 else 0.0)


def _pm(values: Sequence[float], sign: str = "") -> str:
    """``mean ± sd`` of several values; one value alone (its sd is not defined)."""
    mean, sd = _mean_sd(values)
    return f"{mean:{sign}.4f}" + (f" ± {sd:.4f}" if len(values) > 1 else "")


# Marks an EMA of runs not evaluated every round (see ``_cadence_note``).
OTHER_CADENCE = "†"


def _mark(hit: Sequence[RunRecord], r: int) -> str:
    return OTHER_CADENCE if any(x.ema_at(r) is not None and x.cadence_to(r) > 1
                                for x in hit) else ""


def _cell(hit: Sequence[RunRecord], r: int) -> str:
    """One run: ``ema (best)``; several seeds: ``mean ± sd (best mean ± sd; n)`` over those
    that reached round ``r``; ``†`` when one was not evaluated every round."""
    vals = [(x.ema_at(r), x.best_to(r)) for x in hit]
    if len(hit) <= 1:  # a run not yet at round r: no value (nor a best "through r")
        return "; ".join(f"{_fmt(e)}{_mark(hit, r)} ({_fmt(b)})" if e is not None else "—"
                         for e, b in vals) or "—"
    reached = [(e, b) for e, b in vals if e is not None]
    if not reached:
        return "—"
    e, b = _pm([e for e, _ in reached]), _pm([b for _, b in reached])
    return f"{e}{_mark(hit, r)} ({b}; n={len(reached)})"


# The windows of the raw accuracy's means, as the metrics lines give them.
_WINDOWS = RECENT_WINDOWS


def _raw_cell(hit: Sequence[RunRecord], r: int) -> str:
    """The mean raw accuracy of the last 10 rounds (in brackets the last 50) at round ``r``;
    several seeds: mean ± sd over them, and n."""
    vals = [[x.recent_at(r, w) for w in _WINDOWS] for x in hit]
    reached = [v for v in vals if v[0] is not None]
    if not reached:
        return "—"
    short, long = _pm([v[0] for v in reached]), _pm([v[1] for v in reached])
    return f"{short} ({long}" + (f"; n={len(reached)})" if len(hit) > 1 else ")")


def _cadence_note(runs: Sequence[RunRecord], at: Sequence[int]) -> str:
    """The footnote of ``†``: which runs were evaluated at another cadence and what their EMA
    is, so that no one compares it with a per-round EMA such as the paper's."""
    odd = {}
    for x in runs:
        k = max((x.cadence_to(r) for r in at if x.ema_at(r) is not None), default=1)
        if k > 1:
            odd[x.path] = (k, x)
    if not odd:
        return ""
    lines = [f"{OTHER_CADENCE} Not evaluated every round, so not comparable with a per-round "
             "EMA such as the paper's (compare the raw means instead):"]
    for path, (k, x) in odd.items():
        d = x.config.get("ema_decay", 0.9)
        how = (f"its EMA applies {d:g}**k once per evaluation, the same time constant in rounds "
               "but exact only for k = 1" if x.ema_steps_per_round() else
               f"its EMA (records written before the decay was per round) applies {d:g} once "
               f"per evaluation: a time constant of about {k / (1 - d):.0f} rounds instead of "
               f"{1 / (1 - d):.0f}, lagging a rising curve")
        lines.append(f"- `{path}`: evaluated every {k} rounds; {how}.")
    return "\n".join(lines) + "\n"


def _seed(run: RunRecord):
    return run.config.get("seed")


def _accuracies(run: RunRecord, first: int, last: int) -> dict[int, float]:
    return {x["round"]: x["test_accuracy"] for x in run.rows if first <= x["round"] <= last}


def within_run(run: RunRecord, base: RunRecord, r: int,
               window: int) -> tuple[int, int, float] | None:
    """Rounds ``r - window + 1 .. r`` evaluated in both runs: ``(k, n, mean)``, the number
    ``k`` of the ``n`` rounds in which ``run``'s raw test accuracy is above ``base``'s and
    the mean raw difference over them (None: no round in common, or ``r`` not reached). Raw
    accuracies, not the EMA, whose values from one round to the next are not independent."""
    if run.ema_at(r) is None or base.ema_at(r) is None:
        return None
    a, b = _accuracies(run, r - window + 1, r), _accuracies(base, r - window + 1, r)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = [a[i] - b[i] for i in common]
    return sum(x > 0 for x in d), len(d), sum(d) / len(d)


def paired(runs: Sequence[RunRecord], baseline: str, at: Sequence[int], window: int = 25) -> str:
    """Each method's paired difference from ``baseline`` (a method label), seed by seed:
    ``mean ± sd (n)`` of ``EMA(method, seed) - EMA(baseline, seed)`` at each round of ``at``,
    over the seeds both reached it with; then the within-run statistic over the ``window``
    rounds up to each (``within_run``): per seed, the rounds in which the method's raw
    accuracy is higher, and the mean raw difference over the window, mean ± sd over seeds."""
    methods, settings, cells = group(runs)
    named = [m for m in methods if m.split(" (")[0] == baseline]
    if baseline not in methods and len(named) == 1:  # a bare name for its one variant
        baseline = named[0]
    if baseline not in methods:
        raise ReportError(f"--baseline {baseline!r}: not a method of these runs; methods: "
                          + ", ".join(methods))
    def block(title: str, cell) -> list[str]:
        """A table of every method but the baseline by setting; ``cell(method_runs,
        {seed: baseline_run})`` gives one entry, or None for none."""
        out = [title, "", "| method | " + " | ".join(settings) + " |",
               "|---" * (len(settings) + 1) + "|"]
        for m in methods:
            if m != baseline:
                row = [cell(cells.get((m, s), []),
                            {_seed(x): x for x in cells.get((baseline, s), [])})
                       for s in settings]
                out.append(f"| {m} | " + " | ".join(c or "—" for c in row) + " |")
        return out + [""]

    def ema_diff(hit, base, r):
        pairs = [(x, base[_seed(x)]) for x in hit
                 if x.ema_at(r) is not None and _seed(x) in base
                 and base[_seed(x)].ema_at(r) is not None]
        diffs = [x.ema_at(r) - y.ema_at(r) for x, y in pairs]
        mark = _mark([z for pair in pairs for z in pair], r)
        return f"{_pm(diffs, '+')}{mark} (n={len(diffs)})" if diffs else None

    def ahead(hit, base, r):
        found = sorted(((_seed(x), within_run(x, base[_seed(x)], r, window)) for x in hit
                        if _seed(x) in base), key=lambda kv: str(kv[0]))
        found = [(k, v) for k, v in found if v is not None]
        return (", ".join(f"s{k}: {v[0]}/{v[1]}" for k, v in found)
                + f"; {_pm([v[2] for _, v in found], '+')}") if found else None

    lines = []
    for r in at:
        lines += block(f"Paired difference from {baseline} at round {r} (EMA test accuracy, "
                       "same seed; mean ± sd over the seeds, n):",
                       lambda hit, base, r=r: ema_diff(hit, base, r))
        lines += block(f"Within the runs, rounds {max(1, r - window + 1)}-{r} (raw test "
                       f"accuracy, same seed): rounds in which the method is above {baseline}, "
                       "seed by seed (seed: rounds above / rounds compared), and the mean raw "
                       "difference over those rounds, mean ± sd over the seeds:",
                       lambda hit, base, r=r: ahead(hit, base, r))
    return "\n".join(lines)


def wall_seconds(run: RunRecord, r: int) -> float | None:
    """The wall-clock seconds the run took to round ``r``, training and evaluation (its
    records' ``total_s``, which adds up across resumes; None: not recorded or not reached)."""
    hit = [x for x in run.rows if x["round"] == r]
    return float(hit[0]["total_s"]) if hit and "total_s" in hit[0] else None


def rows(runs: Sequence[RunRecord], at: Sequence[int]) -> list[dict]:
    """The tables as data: one row per method, setting and reported round, each figure over
    the seeds that reached the round (mean, sd, n), and the wall-clock seconds to that round."""
    methods, settings, cells = group(runs)
    out = []
    for r in at:
        for m in methods:
            for s in settings:
                hit = cells.get((m, s), [])
                if not hit:
                    continue
                row = {"method": m, "setting": s, "round": r,
                       "runs": [str(x.path) for x in hit]}
                for name, values in (
                        ("ema", [x.ema_at(r) for x in hit]),
                        ("best", [x.best_to(r) if x.ema_at(r) is not None else None
                                  for x in hit]),
                        (f"last{_WINDOWS[0]}", [x.recent_at(r, _WINDOWS[0]) for x in hit]),
                        (f"last{_WINDOWS[1]}", [x.recent_at(r, _WINDOWS[1]) for x in hit]),
                        ("wall_s", [wall_seconds(x, r) for x in hit])):
                    got = [v for v in values if v is not None]
                    mean, sd = _mean_sd(got) if got else (None, None)
                    row[f"{name}_mean"], row[f"{name}_sd"] = mean, sd if len(got) > 1 else None
                    row[f"{name}_n"] = len(got)
                row["evaluated_every_round"] = all(x.cadence_to(r) == 1 for x in hit
                                                   if x.ema_at(r) is not None)
                out.append(row)
    return out


def write_data(rows_: list[dict], out: Path) -> list[Path]:
    """``report.csv`` and ``report.json``: the rows of ``rows``."""
    import csv

    (out / "report.json").write_text(json.dumps(rows_, indent=1) + "\n")
    fields = [k for k in (rows_[0] if rows_ else {}) if k != "runs"]
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows_)
    return [out / "report.csv", out / "report.json"]


def _wall(hit: Sequence[RunRecord], r: int) -> str:
    got = [v for v in (wall_seconds(x, r) for x in hit) if v is not None]
    if not got:
        return "—"
    mean, _ = _mean_sd(got)
    return f"{mean / 60:.1f} min"


def _seeds_note(runs: Sequence[RunRecord], at: Sequence[int]) -> str:
    """A visible note when a comparison rests on fewer than three seeds."""
    _, _, cells = group(runs)
    few = sorted({len([x for x in hit if x.ema_at(r) is not None])
                  for hit in cells.values() for r in at})
    if not few or few[0] >= 3:
        return ""
    return (f"**Note: some cells rest on {few[0]} seed{'s' if few[0] != 1 else ''}** (fewer "
            "than three): a difference between them is not shown to exceed the seed noise.")


def _grid(methods, settings, cells, cell, r: int) -> list[str]:
    """A methods x settings Markdown table of ``cell(runs, r)``."""
    lines = ["| method | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(cells.get((m, s), []), r)
                                             for s in settings) + " |")
    return lines


def table(runs: Sequence[RunRecord], at: Sequence[int]) -> str:
    methods, settings, cells = group(runs)
    lines = []
    several = any(len(hit) > 1 for hit in cells.values())
    seeds = "; several seeds: mean ± sd over them, n seeds" if several else ""
    decays = sorted({x.config.get("ema_decay", 0.9) for x in runs})
    for r in at:
        lines += [f"EMA test accuracy at round {r} (decay {', '.join(f'{d:g}' for d in decays)} "
                  "per round, the paper's measure as we read it; in brackets: the best "
                  f"accuracy through round {r}{seeds}):", ""]
        lines += _grid(methods, settings, cells, _cell, r)
        lines.append("")
        note = _cadence_note(runs, [r])
        lines += [note] if note else []
        lines += [f"Raw test accuracy at round {r}: the mean of the evaluations in rounds "
                  f"{max(1, r - _WINDOWS[0] + 1)}-{r} (in brackets: rounds "
                  f"{max(1, r - _WINDOWS[1] + 1)}-{r}){seeds}; "
                  "unlike the EMA it does not lag, and it means the same at any evaluation "
                  "cadence:", ""]
        lines += _grid(methods, settings, cells, _raw_cell, r)
        lines += ["", f"Wall-clock time to round {r}, training and evaluation (mean over "
                  "seeds; from the records, across resumes):", ""]
        lines += _grid(methods, settings, cells, _wall, r)
        lines.append("")
    note = _seeds_note(runs, at)
    lines += [note, ""] if note else []
    lines += ["Runs:", ""]
    for (m, s), hit in cells.items():
        for x in hit:
            lines.append(f"- {m} / {s}: `{x.path}` ({x.last_round} rounds)")
    return "\n".join(lines) + "\n"


# The representation analysis's measures (engine/analysis.py) as the table names them.
_ANALYSIS = (("effective_rank", "effective rank"), ("vci", "VCI"),
             ("effective_rank_uncentred", "uncentred rank"), ("mean_cosine", "mean cosine"),
             ("spread_share", "spread share"))


def analysis_table(runs: Sequence[RunRecord], at: Sequence[int]) -> str:
    """The representation analysis at the reported rounds that were analysed: one row per run
    and round, each measure of the global model with the local model's in brackets (empty when
    no run was analysed at those rounds)."""
    methods, settings, cells = group(runs)
    rows = []
    for (m, s), hit in cells.items():
        for x in hit:
            name = m if len(settings) == 1 else f"{m}, {s}"
            if len(hit) > 1:
                name += f" (seed {_seed(x)})"
            for r in at:
                row = next((y for y in x.rows
                            if y["round"] == r and "global_effective_rank" in y), None)
                if row is None:
                    continue
                vals = [f"{_fmt(row.get(f'global_{k}'))} ({_fmt(row.get(f'local_{k}'))})"
                        if f"global_{k}" in row else "—" for k, _ in _ANALYSIS]
                rows.append(f"| {name} | {r} | " + " | ".join(vals) + " |")
    if not rows:
        return ""
    return "\n".join(
        ["Representation analysis at the reported rounds (penultimate features of the "
         "analysis images; the global model, in brackets the next round's first client's local "
         "model; — where the run did not record a measure):", "",
         "| run | round | " + " | ".join(n for _, n in _ANALYSIS) + " |",
         "|---" * (len(_ANALYSIS) + 2) + "|", *rows]) + "\n"


# What the curves of convergence.png are: its caption in report.md and on the figure.
CONVERGENCE_CAPTION = (
    "test accuracy over rounds, one panel per setting: thick, the EMA (decay per round, the "
    "paper's measure as we read it); thin, the raw accuracy of each evaluation; with several "
    "seeds both are the mean over them, and the shaded band is the EMA's mean ± one standard "
    "deviation over the seeds (n in the legend)")


def _plots(runs: Sequence[RunRecord], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    methods, settings, cells = group(runs)
    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.8),
                             squeeze=False)
    for ax, s in zip(axes[0], settings, strict=True):
        column = [x for (_, t), hit in cells.items() if t == s for x in hit]
        for i, m in enumerate(methods):
            hit = cells.get((m, s), [])
            label = m if len(m) <= 40 else m[:37] + "..."
            if len(hit) > 1:  # seeds: the mean, and a band of ± one sd
                common = sorted(set.intersection(*({r["round"] for r in x.rows} for x in hit)))
                if common:
                    by = [{r["round"]: r for r in x.rows} for x in hit]
                    ema = np.asarray([[b[r]["test_accuracy_ema"] for r in common] for b in by],
                                     np.float64)
                    raw = np.asarray([[b[r]["test_accuracy"] for r in common] for b in by],
                                     np.float64)
                    mean, sd = ema.mean(0), ema.std(0, ddof=1)
                    ax.plot(common, raw.mean(0), color=f"C{i}", lw=0.7, alpha=0.45)
                    ax.plot(common, mean, color=f"C{i}", lw=2, label=f"{label} (n={len(hit)})")
                    ax.fill_between(common, mean - sd, mean + sd, color=f"C{i}", alpha=0.2,
                                    linewidth=0)
                continue
            for x in hit:
                rounds = [r["round"] for r in x.rows]
                ax.plot(rounds, [r["test_accuracy"] for r in x.rows], color=f"C{i}", lw=0.7,
                        alpha=0.45)
                ax.plot(rounds, [r["test_accuracy_ema"] for r in x.rows], color=f"C{i}", lw=2,
                        label=label)
        common = describe(column)
        ax.set(title=common if s == common else f"{s}\n{common}", xlabel="round",
               ylabel="test accuracy (thick: EMA; thin: raw)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Convergence: EMA (thick) and raw (thin) test accuracy"
                 + ("; band: EMA mean ± 1 sd over seeds" if any(len(h) > 1 for h in
                                                                cells.values()) else ""))
    fig.tight_layout()
    written.append(out / "convergence.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    analysed = [x for x in runs if any("global_effective_rank" in r for r in x.rows)]
    # The same names as the table and the convergence plot: method, and setting when several.
    names = {id(x): m if len(settings) == 1 else f"{m}, {s}"
             for (m, s), hit in cells.items() for x in hit}
    if analysed:
        panels = [("effective_rank", "effective rank"), ("vci", "variability collapse index")]
        # The measures that keep the mean (runs since they were added): collapse towards one
        # point, which the centred measures above do not see.
        if any("global_mean_cosine" in r for x in analysed for r in x.rows):
            panels += [("mean_cosine", "mean pairwise cosine"),
                       ("spread_share", "spread share, tr(cov) / mean |x|^2")]
        fig, axes = plt.subplots((len(panels) + 1) // 2, 2,
                                 figsize=(12, 4.2 * ((len(panels) + 1) // 2)), squeeze=False)
        for (metric, name), ax in zip(panels, axes.reshape(-1), strict=True):
            for i, x in enumerate(analysed):
                for which, style in (("global", "-"), ("local", "--")):
                    pts = [(r["round"], r[f"{which}_{metric}"]) for r in x.rows
                           if f"{which}_{metric}" in r]
                    if pts:  # a run that did not record this measure has none of it
                        ax.plot(*zip(*pts, strict=True), style, color=f"C{i}",
                                label=f"{names[id(x)]} ({which})")
            ax.set(title=name, xlabel="round", ylabel=name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("Representation collapse (penultimate features; solid global, dashed "
                     "local)")
        fig.tight_layout()
        written.append(out / "collapse.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    sweep = _beta_sweep(runs)
    if sweep:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for i, (s, pts) in enumerate(sweep.items()):
            betas = sorted(pts)
            for j, (what, style) in enumerate((("final EMA", "o-"), ("raw, last 10 rounds",
                                                                      "s--"))):
                mean = [np.mean([v[j] for v in pts[b]]) for b in betas]
                sd = [np.std([v[j] for v in pts[b]], ddof=1) if len(pts[b]) > 1 else 0.0
                      for b in betas]
                ax.errorbar(betas, mean, yerr=sd, fmt=style, color=f"C{i}", capsize=3,
                            label=f"{s}: {what}")
        n = sorted({len(v) for pts in sweep.values() for v in pts.values()})
        ax.set(title="FedRCL: accuracy at the last round against beta\n"
               + describe([x for x in runs if x.config.get("algorithm") in _SWEPT]),
               xlabel="beta (fedrcl.beta)", ylabel="test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.text(0.01, 0.01, "per value of beta: mean over its seeds (n = "
                 + "/".join(map(str, n)) + "), bars ± 1 sd", fontsize=7)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        written.append(out / "beta_sweep.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


# The algorithms that read ``fedrcl.beta``.
_SWEPT = ("fedrcl", "fedscl")


def _beta_sweep(runs: Sequence[RunRecord]) -> dict[str, dict[float, list[tuple[float, float]]]]:
    """``{setting: {beta: [(final EMA, mean raw accuracy of the last 10 rounds), ...]}}`` (one
    pair per seed) when the FedRCL runs among ``runs`` differ in ``fedrcl.beta`` and in no other
    FedRCL setting; the other methods' runs do not stop it."""
    swept = [r for r in runs if r.config.get("algorithm") in _SWEPT and r.rows]
    if len({json.dumps(r.config.get("fedrcl.beta")) for r in swept}) < 2:
        return {}
    keys = sorted({k for r in swept for k in r.config if k.startswith("fedrcl.")})
    differing = [k for k in keys
                 if len({json.dumps(r.config.get(k)) for r in swept}) > 1]
    if differing != ["fedrcl.beta"] or len({r.config.get("algorithm") for r in swept}) > 1:
        return {}
    _, _, cells = group(runs)
    sweep: dict = {}
    for (_, s), hit in cells.items():
        for x in hit:
            if id(x) in {id(y) for y in swept}:
                last = x.rows[-1]["round"]
                sweep.setdefault(s, {}).setdefault(float(x.config["fedrcl.beta"]), []).append(
                    (x.rows[-1]["test_accuracy_ema"], x.recent_at(last, 10)))
    return sweep


def _spread(values: list[float]) -> str:
    import numpy as np

    v = np.asarray(values, np.float64)
    return f"{v.mean():.3f} ± {v.std():.3f} [{v.min():.3f}, {v.max():.3f}]"


def client_spread(runs: Sequence[RunRecord], r: int, window: int = 10) -> str:
    """The spread over clients at round ``r``, for runs with per-client metrics: over the
    clients sampled in rounds ``r - window + 1 .. r``, the mean ± sd [min, max] of their local
    loss and of their accuracy on their own data before and after local training."""
    rows = []
    for run in runs:
        lines = [x for x in run.clients if r - window < x["round"] <= r]
        if not lines:
            continue
        cells = [_spread([v for x in lines for v in x[key]]) if key in lines[0] else "—"
                 for key in ("loss", "acc_before", "acc_after")]
        rows.append(f"| `{run.path.name}` | {sum(len(x['clients']) for x in lines)} | "
                    + " | ".join(cells) + " |")
    if not rows:
        return ""
    return (f"Spread over clients, rounds {max(1, r - window + 1)}-{r} (mean ± sd [min, max] "
            "over the sampled clients):\n\n| run | client-rounds | local loss | accuracy on "
            "own data before | after local training |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def report(run_dirs: Sequence[str | Path], out: str | Path, at: Sequence[int] = (),
           baseline: str | None = None, window: int = 25) -> Path:
    """Writes ``report.md`` and the figures for ``run_dirs`` into ``out``; returns its path.
    ``baseline``: a method's label; adds the paired differences from it (seed by seed) and,
    over the ``window`` rounds up to each reported round, the within-run comparison."""
    if window < 1:
        raise ReportError(f"--window {window}: must be a number of rounds >= 1")
    if any(r < 1 for r in at):
        raise ReportError(f"--at {' '.join(map(str, at))}: rounds are numbered from 1")
    runs = [run for p in run_dirs for run in read_runs(p)]
    if not runs:
        raise ReportError("no run directories given")
    if not at:
        at = [min(r.last_round for r in runs)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _plots(runs, out)
    spread = "\n".join(x for x in (client_spread(runs, r) for r in at) if x)
    diffs = paired(runs, baseline, at, window) if baseline else ""
    analysis = analysis_table(runs, at)
    captions = {"convergence.png": CONVERGENCE_CAPTION,
                "collapse.png": "the representation analysis over rounds (solid: the global "
                                "model; dashed: a local model)",
                "beta_sweep.png": "FedRCL's accuracy at the last round against beta: the EMA "
                                  "and the raw mean of the last 10 rounds, per value of beta "
                                  "the mean over its seeds with bars of ± one sd"}
    data = write_data(rows(runs, at), out)
    text = ("# Report\n\n" + table(runs, at) + (f"\n{diffs}\n" if diffs else "")
            + (f"\n{analysis}" if analysis else "")
            + (f"\n{spread}" if spread else "")
            + "\nFigures:\n\n" + "".join(f"- `{p.name}`: {captions[p.name]}.\n"
                                          for p in figures)
            + "\nThe tables as data: " + ", ".join(f"`{p.name}`" for p in data) + ".\n")
    (out / "report.md").write_text(text)
    return out / "report.md"
