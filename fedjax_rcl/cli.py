"""Command line: ``fedjax-rcl train [CONFIG.yaml] [key=value ...]``, ``resume RUN_DIR``,
``eval RUN_DIR``, ``report RUN_DIR...``, ``partition [CONFIG.yaml] [key=value ...]``, ``mfcl
[CONFIG.yaml] [key=value ...]`` (MFCL's two phases and linear probe; ``resume`` continues it
too) and ``suite run|table SUITE.yaml`` (a suite of runs in resumable chunks).

Every configuration or data problem is reported before anything is compiled, one line per
problem naming the field, the value and what is allowed, with exit status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

EXIT_USAGE = 2
EXIT_TRAINING = 1
NO_PROGRESS = ("one plain line per evaluation instead of a progress bar (the default when "
               "the output is not a terminal)")


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("fedjax-rcl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _config_args(p: argparse.ArgumentParser,
                 example: str = "rounds=50 dataset=imagefolder:path/to/data.zip "
                                "server.lr=1.0") -> None:
    p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help=f"an optional YAML config, then dotted overrides, e.g. {example} "
                        "(fedjax-rcl config lists every key)")


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument is a config file if it has no ``=`` and looks like one."""
    if args and "=" not in args[0] and (
        args[0].endswith((".yaml", ".yml")) or os.path.isfile(args[0])
    ):
        return args[0], args[1:]
    return None, args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedjax-rcl",
        description="Federated learning simulated in JAX: every sampled client trains at once, "
                    "one compiled program per round.")
    p.add_argument("--version", action="version", version=f"fedjax-rcl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a federated model")
    _config_args(t)
    t.add_argument("--no-progress", action="store_true", help=NO_PROGRESS)
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit")
    r = sub.add_parser("resume", help="continue a run from its newest complete checkpoint")
    r.add_argument("run_dir", help="the run directory")
    r.add_argument("overrides", nargs="*", metavar="key=value",
                   help="e.g. rounds=200 (keys that change results need --force)")
    r.add_argument("--force", action="store_true",
                   help="resume even if the overrides change the run's results")
    r.add_argument("--no-progress", action="store_true", help=NO_PROGRESS)
    e = sub.add_parser("eval", help="evaluate a run's newest checkpoint; prints JSON")
    e.add_argument("run_dir", help="the run directory")
    e.add_argument("--strict", action="store_true",
                   help="fail (exit 2) if the newest checkpoint is damaged, instead of "
                        "evaluating the newest one that restores")
    rep = sub.add_parser("report", help="tables and figures in the paper's layout from runs")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    rep.add_argument("--out", default="report", help="output directory (default: report)")
    rep.add_argument("--at", nargs="+", type=int, default=[], metavar="ROUND",
                     help="rounds to tabulate (default: the last round every run reached)")
    rep.add_argument("--baseline", metavar="METHOD",
                     help="also each method's paired difference from this one (its label in "
                     "the table, e.g. fedavg), seed by seed, mean ± sd over the seeds")
    rep.add_argument("--window", type=int, default=25, metavar="ROUNDS",
                     help="with --baseline: also count, seed by seed, the rounds among the "
                     "last ROUNDS up to each reported one in which a method's raw accuracy is "
                     "above the baseline's (default: 25)")
    m = sub.add_parser("mfcl", help="MFCL: federated client-module training, the server's "
                       "contrastive training on the clients' representations, linear probe")
    _config_args(m)
    m.add_argument("--no-progress", action="store_true", help=NO_PROGRESS)
    m.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit")
    c = sub.add_parser("config", help="list the config keys: type, default, allowed values, "
                       "meaning")
    c.add_argument("args", nargs="*", metavar="[SECTION|KEY] [plugins=[...]]",
                   help="a section (fedrcl, server.fedadam) or a key (fedrcl.beta); default: "
                        "every key. plugins=[module] adds the sections of your plugins")
    su = sub.add_parser("suite", help="run a suite of experiments in resumable chunks, or "
                        "tabulate it")
    su.add_argument("action", choices=["run", "table"])
    su.add_argument("suite", metavar="SUITE.yaml", help="the suite file (base config, runs)")
    su.add_argument("overrides", nargs="*", metavar="key=value",
                    help="settings applied to every run of the suite (recorded in each run's "
                         "config.yaml), e.g. precision=bf16 or dataset=imagefolder:PATH")
    su.add_argument("--chunk", type=int, default=10, help="run: rounds per turn (default 10)")
    su.add_argument("--only", nargs="+", metavar="RUN", help="run: only these runs")
    su.add_argument("--out", help="table: where table.md and ema_accuracy.png go (default: "
                    "experiments/results/<suite name>)")
    su.add_argument("--runs-dir", metavar="DIR",
                    help="the runs' directory instead of the suite's runs_dir (for instance "
                         "a cache outside the repository, which keeps their checkpoints)")
    s = sub.add_parser("partition", help="partition statistics, and with --plot a clients x "
                       "classes plot")
    _config_args(s, "num_clients=100 partition=dirichlet alpha=0.05 dataset=cifar10")
    s.add_argument("--plot", metavar="PATH", default=None,
                   help="also save a clients x classes plot there (PNG); default: no plot")
    return p


def _enable_compilation_cache() -> None:
    """Keeps compiled programs on disk between runs (JAX's persistent cache), so a second run
    of the same configuration, a resume or an eval skips most of the compile. Honours an
    explicit ``JAX_COMPILATION_CACHE_DIR``; ``FEDJAX_RCL_JAX_CACHE=0`` turns it off."""
    if os.environ.get("FEDJAX_RCL_JAX_CACHE") == "0" or os.environ.get(
        "JAX_COMPILATION_CACHE_DIR"
    ):
        return
    import jax

    from fedjax_rcl.data.sources import default_cache_dir

    jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax"))


def _fail(msg: str, status: int) -> int:
    for line in str(msg).splitlines():
        print(f"fedjax-rcl: error: {line}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line (not a call from Python, e.g. a test)
        # SIGINT/SIGTERM from here on: status 130/143 and a line saying what is on disk.
        # (Before this point -- the interpreter starting -- the signal's default action ends
        # the process, which shells also report as 130/143.) Once the command returns, they
        # are ignored while the interpreter shuts down (`interrupts.work_done`).
        from fedjax_rcl import console, interrupts

        interrupts.install()
        # `fedjax-rcl train | head` closes the pipe: the command goes on (fedjax_rcl.console).
        console.keep_going_without_readers()
        try:
            return _command(argv)
        finally:
            interrupts.work_done()
    return _command(argv)


def _command(argv: list[str] | None) -> int:
    import shlex

    # What the run directory records as this process's command (commands.txt).
    command_line = shlex.join(["fedjax-rcl", *(sys.argv[1:] if argv is None else argv)])
    # Overrides may come before or after options (`train --no-progress rounds=5 lr=0.1`):
    # argparse leaves positionals that follow an option unparsed, so collect them here.
    p = parser()
    args, extra = p.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        # `--rounds=10` is a setting written as an option: say how to write it.
        settings = [x.lstrip("-") for x in unknown if x.startswith("-") and "=" in x
                    and x.lstrip("-")[:1].isalpha()]
        hint = ("" if not settings or args.command in ("eval", "report", "suite", "config") else
                f" (write settings as key=value: {' '.join(settings)})")
        p.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extra:
        if args.command in ("eval", "report"):
            p.error(f"{args.command} takes no overrides: {' '.join(extra)}")
        if args.command in ("resume", "suite"):
            args.overrides = [*args.overrides, *extra]
        else:
            args.args = [*args.args, *extra]
    # Imports after parsing so that `--help` and usage errors are instant.
    from fedjax_rcl.config import load_config, to_yaml
    from fedjax_rcl.data import DataError
    from fedjax_rcl.loop import TrainingError
    from fedjax_rcl.validation import ConfigError

    _enable_compilation_cache()
    try:
        if args.command == "resume":
            from fedjax_rcl.api import resume

            resume(args.run_dir, *args.overrides, force=args.force,
                   progress=not args.no_progress, log=print, command=command_line)
            return 0
        if args.command == "report":
            from fedjax_rcl.report import ReportError, report

            try:
                print(report(args.run_dirs, args.out, args.at, args.baseline, args.window))
            except ReportError as e:
                return _fail(str(e), EXIT_USAGE)
            return 0
        if args.command == "suite":
            return _suite(args)
        if args.command == "config":
            return _config(args.args)
        if args.command == "eval":
            from fedjax_rcl.api import evaluate

            result = evaluate(args.run_dir, strict=args.strict)
            for run in result.get("runs", [result]):
                _say_evaluated(run)
            print(json.dumps(result))
            return 0
        path, overrides = _split_config_args(args.args)
        if args.command in ("train", "mfcl"):
            from fedjax_rcl import api
            from fedjax_rcl.data.sources import spec_only
            from fedjax_rcl.training import warn_stderr

            # --print-config reads no data: only the dataset's spec is checked, not that the
            # data is there (it prints offline, for data this machine does not have).
            no_data = spec_only if args.print_config else contextlib.nullcontext
            with no_data():
                cfg = api.resolved_config(path, *overrides, program=args.command)
            if args.print_config:
                print(to_yaml(cfg), end="")
                return 0
            api.train(cfg, program=args.command, progress=not args.no_progress, log=print,
                      warn=warn_stderr, command=command_line)
        elif args.command == "partition":
            return _partition(load_config(path, overrides), args.plot)
    except (ConfigError, DataError) as e:
        return _fail(str(e), EXIT_USAGE)
    except TrainingError as e:
        return _fail(str(e), EXIT_TRAINING)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return 0


def _say_evaluated(run: dict) -> None:
    """One line on standard error: which checkpoint ``eval`` evaluated, and why not the
    newest when it fell back from a damaged one."""
    if "fell_back_from" in run:
        print(f"fedjax-rcl: warning: {run['run_dir']}: the newest checkpoint (round "
              f"{run['fell_back_from']}) is damaged ({run['reason']}); evaluated round "
              f"{run['round']} instead", file=sys.stderr)
    else:
        print(f"fedjax-rcl: evaluated {run['run_dir']} at round {run['round']} (its newest "
              "checkpoint)", file=sys.stderr)


def _config(args: list[str]) -> int:
    from fedjax_rcl import reference
    from fedjax_rcl.config import load_config
    from fedjax_rcl.validation import ConfigError

    queries = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    wrong = [o for o in overrides if o.partition("=")[0] != "plugins"]
    if len(queries) > 1 or wrong:
        raise ConfigError([f"config {' '.join(args)}: give at most one SECTION or KEY, and "
                           "plugins=[module] to include a plugin's sections"])
    if overrides:
        load_config(None, overrides)  # imports the plugins (their errors are config errors)
    print(reference.text(queries[0] if queries else None), end="")
    return 0


def _suite(args) -> int:
    import shlex
    from pathlib import Path

    from fedjax_rcl import suite
    from fedjax_rcl.validation import ConfigError

    spec = suite.with_overrides(suite.load_suite(args.suite), args.overrides)
    if args.runs_dir:
        spec["runs_dir"] = args.runs_dir
    if args.action == "run":
        if args.chunk < 1:
            raise ConfigError([f"--chunk {args.chunk}: must be >= 1"])
        from fedjax_rcl import interrupts

        again = shlex.join(["fedjax-rcl", "suite", "run", args.suite, "--chunk",
                            str(args.chunk), *(["--only", *args.only] if args.only else []),
                            *(["--runs-dir", args.runs_dir] if args.runs_dir else []),
                            *args.overrides])
        interrupts.set_status(f"suite {args.suite}: each run keeps its last complete "
                              f"checkpoint (a stopped run's line above names it); continue "
                              f"with: {again}")
        suite.run(spec, args.chunk, args.only)
    else:
        out = Path(args.out) if args.out else Path("experiments/results") / Path(args.suite).stem
        print(suite.table(spec, out), end="")
    return 0


def _partition(cfg, plot_path: str | None) -> int:
    """Prints the split's statistics as JSON; saves a plot only when ``--plot`` names one."""
    from fedjax_rcl.data import class_counts, heterogeneity_summary, load_dataset, plot_class_counts
    from fedjax_rcl.experiment import make_partition
    from fedjax_rcl.validation import ConfigError

    if plot_path is not None:
        parent = os.path.dirname(os.path.abspath(plot_path))
        if not os.path.isdir(parent):  # checked before the data is loaded
            raise ConfigError([f"--plot {plot_path}: directory {parent} does not exist; "
                               "create it or give another path"])
    ds = load_dataset(cfg.dataset, data_dir=cfg.data_dir)
    parts = make_partition(cfg, ds.train_labels)
    counts = class_counts(ds.train_labels, parts, ds.num_classes)
    summary = heterogeneity_summary(counts)
    name = cfg.dataset
    if name.startswith("imagefolder:"):  # the file or folder name, not a long path
        name = "imagefolder:" + os.path.basename(name.split(":", 1)[1].rstrip("/"))
    setting = {"dirichlet": f"dirichlet (alpha={cfg.alpha}, "
                            f"{'balanced' if cfg.balanced else 'unbalanced'})",
               "shards": f"shards ({cfg.shards_per_client} per client)",
               "file": f"split file {os.path.basename(cfg.split_file or '')}"}.get(
                   cfg.partition, cfg.partition)
    out = {**summary, "dataset": cfg.dataset, "partition": cfg.partition, "alpha": cfg.alpha,
           "num_clients": cfg.num_clients}
    if plot_path is not None:
        plot_class_counts(counts, plot_path, class_names=ds.class_names,
                          title=f"{name}: {setting}, {cfg.num_clients} clients")
        out["plot"] = plot_path
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
