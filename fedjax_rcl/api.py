"""Runs from Python: start, continue and evaluate a run, and get its metrics back.

    import fedjax_rcl

    run = fedjax_rcl.train(None, "algorithm=fedavg", "rounds=20")   # the command line's keys
    run.metrics[-1]["test_accuracy"]                               # every evaluation, in order
    run = fedjax_rcl.resume(run.run_dir, "rounds=40")               # identical to never stopping

Each kind of run is a *program* over the shared run loop (``fedjax_rcl.loop``): a single run
(``fedjax_rcl.training``: federated rounds), a grid of them in one program
(``fedjax_rcl.grid``) and MFCL (``fedjax_rcl.mfcl.run``: its two phases and probe). A
registered algorithm names the command that runs it (``registry.AlgorithmEntry.command``);
``programs.kind_of`` reads the kind from a run's config, so each function here looks it up
once and ``resume`` and ``evaluate`` take any run; no program knows another.

Bad input raises ``ConfigError`` (or ``DataError`` for unreadable data) before anything is
compiled, its message the lines the command line prints; a non-finite loss raises
``TrainingError`` naming the round and the client, the last complete checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

from fedjax_rcl.config import CoreConfig, load_config, to_dict
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.loop import Callback, load_run_config, resume_config
from fedjax_rcl.programs import COMMAND_DEFAULTS, kind_of
from fedjax_rcl.rundir import RunDir

__all__ = ["Run", "evaluate", "load", "resolved_config", "resume", "round_reached", "train"]


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory after a ``train`` or ``resume`` from Python.

    Attributes:
      run_dir: the run directory.
      config: its resolved config.
      metrics: every metrics line of the run, in order (``metrics.jsonl``; the lines of earlier
        processes of a resumed run included).
      stopped_early: a callback stopped the run before its last round (it resumes from there).
      members: for several runs in one program (``seeds=[...]``), each seed's run (its
        ``metrics`` are its own); the grid's own ``metrics`` are empty.
    """

    run_dir: Path
    config: CoreConfig
    metrics: list[dict]
    stopped_early: bool = False
    members: tuple[Run, ...] = ()

    @property
    def last(self) -> dict | None:
        """The last metrics line (None before the first evaluation)."""
        return self.metrics[-1] if self.metrics else None


def _silent(message: str) -> None:
    del message


def _warn(message: str) -> None:
    warnings.warn(f"fedjax-rcl: {message}", UserWarning, stacklevel=4)


def _read(run_dir: Path, cfg: CoreConfig, result: dict) -> Run:
    members = tuple(_read(Path(c.run_dir), c, result)
                    for c in kind_of(cfg).members(run_dir, cfg))
    return Run(run_dir, cfg, RunDir(run_dir).read_metrics(),
               bool(result.get("stopped_early", False)), members)


class _Literal(str):
    def __repr__(self) -> str:
        return str(self)


def _python_command(name: str, args: tuple, kwargs: dict) -> str:
    """How ``commands.txt`` records a run started from Python: the call and its arguments."""
    shown = [repr(os.fspath(a)) if isinstance(a, os.PathLike) else repr(a) for a in args]
    shown += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"python: fedjax_rcl.{name}({', '.join(shown)})"


def round_reached(run_dir: str | os.PathLike) -> int | None:
    """The round a finished stretch of training reached: a federated run's newest complete
    checkpoint, a grid's oldest such among its members, an MFCL run's last phase-1 round
    once its probe is written; None when it is not known (no checkpoint, MFCL unfinished).
    ``RunDir.round_reached``: the directory alone says which kind of run it holds."""
    return RunDir(run_dir).round_reached()


def resolved_config(config=None, *overrides: str, program: str | None = None) -> CoreConfig:
    """The resolved config ``train`` would run: from ``None`` (the defaults), a mapping (a YAML
    file's content), a YAML path or a built config, with ``key=value`` overrides on top. With
    ``program`` (``"train"`` or ``"mfcl"``), that command's own defaults lie under the file and
    the overrides (``fedjax-rcl mfcl`` starts from MFCL's setting)."""
    defaults = dict(COMMAND_DEFAULTS[program]) if program else {}
    if isinstance(config, CoreConfig):
        if not overrides:
            return config
        config = to_dict(config)
    if config is None or isinstance(config, Mapping):
        return load_config(None, list(overrides), defaults={**defaults, **(config or {})})
    if isinstance(config, str | os.PathLike):
        return load_config(os.fspath(config), list(overrides), defaults=defaults or None)
    raise TypeError(f"config: a dict, a YAML path, a config or None, not {type(config)}")


def train(config=None, *overrides: str, program: str | None = None,
          callbacks: tuple[Callback, ...] = (), progress: bool = False,
          dataset: ImageDataset | None = None, log: Callable[[str], None] | None = None,
          warn: Callable[[str], None] | None = None, command: str | None = None) -> Run:
    """Starts a run and trains it to ``rounds``.

    Args:
      config: None (the defaults: the offline main job), a dict of keys (nested or dotted
        sections as in a YAML file), a YAML file's path, or a config.
      *overrides: ``key=value`` strings, as on the command line (``"rounds=50"``,
        ``"fedrcl.beta=2"``).
      program: the command to run it with (``"train"`` or ``"mfcl"``; its defaults apply as in
        ``config``); default: the one the config's algorithm names. A program that does not
        run the algorithm says so (``ConfigError``).
      callbacks: each is called with every metrics line as it is written; a true return value
        stops the run cleanly after that evaluation (it is checkpointed there and
        ``resume`` continues it).
      progress: print the command line's progress lines (a bar on a terminal); False: quiet.
      dataset: an already loaded dataset to use instead of ``config.dataset``'s.
      log: where progress lines go (default: ``print`` when ``progress``).
      warn: where the warnings about settings that probably do not do what was meant go
        (default: Python's ``warnings``).

    Returns:
      The ``Run``: its directory, config and every metrics line.

    Raises:
      ConfigError, DataError: bad settings or data, before anything is compiled.
      TrainingError: a non-finite local loss (the last complete checkpoint stays).
    """
    cfg = resolved_config(config, *overrides, program=program)
    log = log or (print if progress else _silent)
    if command is None:
        shown = config if not isinstance(config, CoreConfig) else _Literal("<a CoreConfig>")
        command = _python_command("train", (shown, *overrides), {})
    kind = kind_of(cfg, program)
    kwargs = dict(dataset=dataset, log=log, command=command, callbacks=tuple(callbacks),
                  progress=progress)
    if kind.warns:
        kwargs["warn"] = warn or _warn
    result = kind.start(cfg, **kwargs)
    return _read(Path(result["run_dir"]), cfg, result)


def resume(run_dir: str | os.PathLike, *overrides: str, force: bool = False,
           callbacks: tuple[Callback, ...] = (), progress: bool = False,
           dataset: ImageDataset | None = None, log: Callable[[str], None] | None = None,
           command: str | None = None) -> Run:
    """Continues any run from its newest complete checkpoint, identically to an uninterrupted
    run. ``overrides`` that would change its results (anything but ``rounds``, the checkpoint
    and analysis intervals, the trackers, ...) are refused unless ``force``; the other
    arguments are ``train``'s."""
    run_dir = Path(run_dir)
    cfg = resume_config(run_dir, list(overrides), force=force)
    log = log or (print if progress else _silent)
    reached = round_reached(run_dir)
    if reached is not None and cfg.rounds <= reached:
        # Nothing to train: no compile, and nothing on disk changes (config.yaml keeps the
        # rounds the run was trained to).
        log(f"nothing to do: {run_dir} is at round {reached}")
        return load(run_dir)
    command = command or _python_command("resume", (str(run_dir), *overrides),
                                         {"force": force} if force else {})
    result = kind_of(cfg).continue_run(run_dir, cfg, force=force, dataset=dataset,
                                       progress=progress, log=log, command=command,
                                       callbacks=tuple(callbacks))
    return _read(run_dir, cfg, result)


def evaluate(run_dir: str | os.PathLike, *, dataset: ImageDataset | None = None,
             strict: bool = False) -> dict:
    """Evaluates a federated run's newest complete checkpoint on the full test set:
    ``{"run_dir", "round", "checkpoint", "test_accuracy", "test_loss", "test_accuracy_ema"}``,
    with ``"fell_back_from"`` and ``"reason"`` when the newest checkpoint is damaged and an
    older one was evaluated (``strict``: raise ``ConfigError`` instead); for several runs in
    one program (``seeds=[...]``), ``{"run_dir", "runs": [each run's], and the mean and sd
    over them of "test_accuracy" and "test_loss"}``. An MFCL run is refused
    (``ConfigError``): its evaluation is the linear probe its own run writes."""
    run_dir = Path(run_dir)
    _, cfg = load_run_config(run_dir)
    return kind_of(cfg).evaluate(run_dir, cfg, dataset=dataset, strict=strict)


def load(run_dir: str | os.PathLike) -> Run:
    """A run directory read back (its config and every metrics line), without running."""
    run_dir = Path(run_dir)
    _, cfg = load_run_config(run_dir)
    return _read(run_dir, cfg, {})
