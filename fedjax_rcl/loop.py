"""The run loop every command shares: advance in compiled blocks, evaluate, record, checkpoint.

A run is one or more *stages* (federated rounds for ``train``; MFCL's phase-1 rounds and
phase-2 server epochs for ``mfcl``), each advanced to its end by ``run_stage``:

1. ``advance`` the state by the steps up to the next evaluation (one compiled call for a
   device-resident run), and evaluate -- with host<->device copies outside explicit
   ``device_get``/``device_put`` disallowed, so a hidden copy in the hot loop is an error;
2. turn the block's output into one metrics line (``record``), which also stops the run with a
   ``TrainingError`` naming the step on a non-finite loss;
3. append the line to ``metrics.jsonl`` (never half a line: an interrupt waits for it) and
   mirror it to the trackers;
4. checkpoint on evaluation boundaries, at the first at least ``checkpoint_every`` steps after
   the last save and at the end; the save is made durable before the loop goes on, so an
   interrupt can always name the last complete checkpoint and the command that resumes it;
5. report progress: a bar on a terminal, one plain line per evaluation elsewhere.

``new_run`` and ``locked_run`` hold what starting and continuing a run directory share: the
checks before anything is written, the exclusive lock, the resolved ``config.yaml``, the
provenance records and the interrupt status line; ``require_command`` refuses a config another
command runs, and ``restore_checked`` reads a checkpoint back only if the config that wrote it
is the one the run continues with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from fedjax_rcl import interrupts, provenance, registry, rundir
from fedjax_rcl.checkpoint import Checkpointer, Restored
from fedjax_rcl.config import (
    CoreConfig,
    changed_keys,
    config_digest,
    keys_declared,
    load_config,
    to_dict,
    to_yaml,
)
from fedjax_rcl.engine.sharding import is_primary
from fedjax_rcl.experiment import compile_options
from fedjax_rcl.tracking import Trackers
from fedjax_rcl.validation import ConfigError

__all__ = ["Callback", "Sink", "Stage", "TrainingError", "load_run_config", "locked_run", "new_run",
           "progress_text", "require_command", "restore_checked", "resume_config",
           "resumed_records", "run_stage", "save_checkpoint"]


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message names where. The command line
    exits with status 1; the last complete checkpoint stays intact."""


@dataclasses.dataclass
class Stage:
    """One stretch of a run that ``run_stage`` advances to its end.

    Attributes:
      label: what a step is called in progress lines and checkpoint names (``"round"``,
        ``"phase 2 epoch"``).
      unit: the step's plural in rates (``"rounds"``, ``"epochs"``).
      total: the step count at the end.
      every: steps per block (one evaluation and one metrics line per block).
      checkpoint_every: save at the first block end at least this many steps after the last
        save (0: only at the stage's end; a new run's step 0 is saved by its caller).
      advance: ``(state, done, n) -> (state, out)``: the next ``n`` steps after ``done`` and
        their evaluation, fetched to the host explicitly.
      record: ``(state, out, done, n, block_s, elapsed_s) -> dict``: the metrics line for the
        block that ends at ``done``; raises ``TrainingError`` on a non-finite loss.
      checkpoint: ``(state, done, record) -> (tree, meta)``: what to save at ``done``.
      checkpointer: where checkpoints go.
      describe: ``record -> str``: the numbers of a progress line.
      postfix: ``record -> dict``: the numbers beside a terminal's bar.
      step_lines: ``(out, done, n) -> list[dict]``: lines for a second file, one per step of
        the block (per-client metrics), written before the block's metrics line; None: none.
    """

    label: str
    unit: str
    total: int
    every: int
    checkpoint_every: int
    advance: Callable[[Any, int, int], tuple[Any, Any]]
    record: Callable[..., dict]
    checkpoint: Callable[[Any, int, dict], tuple[Any, dict]]
    checkpointer: Checkpointer
    describe: Callable[[dict], str]
    postfix: Callable[[dict], dict] = lambda record: {}
    step_lines: Callable[[Any, int, int], list[dict]] | None = None


class Sink:
    """Where metrics lines go: a JSONL file of the run directory (``path``, default its
    ``metrics.jsonl``, appended as they come, by the primary process only) and, given the
    config, the trackers it selects."""

    def __init__(self, run_dir: Path, cfg: CoreConfig | None = None, *, resumed_at: int = 0,
                 path: Path | None = None):
        self._primary = is_primary()
        path = rundir.RunDir(run_dir).metrics if path is None else path
        self._file = open(path, "a") if self._primary else None
        self._trackers = (Trackers(cfg.tracking, run_dir, resumed_at=resumed_at,
                                   config=to_dict(cfg))
                          if cfg is not None and self._primary else None)

    def write(self, record: dict) -> None:
        if self._file is not None:
            with interrupts.critical():  # never a torn line
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        if self._trackers is not None:
            self._trackers.log(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._trackers is not None:
            self._trackers.close()


def save_checkpoint(ckpt: Checkpointer, run_dir: Path, step: int, tree, meta: dict,
                    where: str) -> None:
    """A checkpoint made durable before the caller goes on, so that an interrupt (which
    waits for it) can name it, ``where`` (``"round 10"``), as the last complete one."""
    with interrupts.critical():
        ckpt.save(step, tree, meta)
        if interrupts.test_kill_due("saving", step):
            # A test kills the process "during this save": leave exactly the on-disk state of
            # a save killed before its commit (Orbax's temporary directory), not a race with
            # the background commit.
            ckpt.uncommit(step)
        interrupts.test_point("saving", step)
        ckpt.wait()
    interrupts.resume_status(run_dir, where)


def _eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "-"
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def progress_text(label: str, unit: str, done: int, total: int, numbers: str,
                  steps_run: int, seconds: float) -> str:
    """One evaluation as a plain line: where the run is, its numbers, and the speed and ETA
    of this process's steps so far (compile excluded)."""
    rate = steps_run / seconds if seconds > 0 else float("inf")
    left = (total - done) / rate if rate > 0 else float("inf")
    return f"{label} {done}/{total}  {numbers}  {rate:.2f} {unit}/s  ETA {_eta(left)}"


# ``callback(record) -> stop``: sees every metrics line as it is written; a true return value
# stops the run cleanly after that evaluation (a checkpoint is made there, so it resumes).
Callback = Callable[[dict], Any]


def run_stage(stage: Stage, state, done: int, *, run_dir: Path, sink: Sink,
              progress: bool = False, log: Callable[[str], None] = print,
              callbacks: tuple[Callback, ...] = (),
              step_sink: Sink | None = None) -> tuple[Any, dict, bool]:
    """Advances ``state`` from step ``done`` to ``stage.total`` (see the module docstring).

    Every metrics line goes to each of ``callbacks`` once written; when one of them returns a
    true value, the stage checkpoints at that step (if it has not just done so) and stops.

    Returns:
      ``(state, record, stopped)``: the state reached, the last metrics line (``{}`` when the
      stage was already complete), and whether a callback stopped the stage early.
    """
    from tqdm import tqdm

    record: dict = {}
    start, first, last_saved = time.perf_counter(), done, done
    # A bar (with tqdm's rate and ETA) on a terminal; elsewhere (logs, pipes, --no-progress)
    # one plain line per evaluation, since a redrawn bar is noise in a file.
    on_terminal = progress and is_primary() and sys.stderr.isatty()
    bar = tqdm(total=stage.total, initial=done, unit=stage.label.split()[-1],
               disable=not on_terminal, dynamic_ncols=True)
    # One process: a signal saves the round the block reaches (interrupts.saving_on_request).
    # Several: each process would see its signal at its own block and stop there while the
    # others wait in the next block's collectives, so a signal ends them at once, as before.
    on_request = (interrupts.saving_on_request() if jax.process_count() == 1
                  else contextlib.nullcontext())
    try:
        with on_request:
            while done < stage.total:
                if interrupts.requested() is not None:
                    # A SIGINT or SIGTERM: the round reached is saved, then the process stops.
                    if last_saved != done:
                        tree, meta = stage.checkpoint(state, done, record)
                        save_checkpoint(stage.checkpointer, run_dir, done, tree, meta,
                                        f"{stage.label} {done}")
                    for s in (sink, step_sink):
                        if s is not None:
                            s.close()
                    interrupts.stop()
                n = min(stage.every - done % stage.every, stage.total - done)
                interrupts.test_point("training", done + 1, done + n)
                block_start = time.perf_counter()
                with jax.transfer_guard("disallow"):
                    state, out = stage.advance(state, done, n)
                block_s = time.perf_counter() - block_start
                done += n
                record = stage.record(state, out, done, n, block_s,
                                      time.perf_counter() - start)
                if step_sink is not None and stage.step_lines is not None:
                    for line in stage.step_lines(out, done, n):
                        step_sink.write(line)
                sink.write(record)
                stopped = any([bool(callback(record)) for callback in callbacks])
                # A SIGINT or SIGTERM during the block: save the round it reached (the next
                # turn of the loop stops).
                signalled = interrupts.requested() is not None
                if done == stage.total or stopped or signalled or (
                        stage.checkpoint_every and done - last_saved >= stage.checkpoint_every):
                    last_saved = done
                    tree, meta = stage.checkpoint(state, done, record)
                    save_checkpoint(stage.checkpointer, run_dir, done, tree, meta,
                                    f"{stage.label} {done}")
                bar.update(n)
                bar.set_postfix(stage.postfix(record))
                if not on_terminal:
                    log(progress_text(stage.label, stage.unit, done, stage.total,
                                      stage.describe(record), done - first,
                                      time.perf_counter() - start))
                if stopped:
                    log(f"stopped by a callback at {stage.label} {done}; continue with: "
                        f"fedjax-rcl resume {run_dir}")
                    return state, record, True
                interrupts.test_point("between", done)
    finally:
        bar.close()
    return state, record, False


@contextlib.contextmanager
def new_run(cfg: CoreConfig, prepare: Callable[[], Any], *, command: str | None,
            primary: bool = True, layout: Callable[[Any], dict] | None = None
            ) -> Iterator[tuple[Path, Any]]:
    """Starts a run directory for ``cfg`` and holds it for the ``with`` block.

    ``cfg.run_dir`` is refused before any work if it holds a run; ``prepare()`` (loading the
    data, building the experiment) runs next, so its errors leave no directory behind; then
    the directory is created and locked, and ``config.yaml``, ``commands.txt`` and
    ``environment.jsonl`` are written (``layout(prepare())``: the clients' layout it records).

    Yields:
      ``(run_dir, prepare())``.
    """
    run_dir = rundir.resolve_new(cfg)
    prepared = prepare()
    run_dir = rundir.create_new(cfg, run_dir)
    with rundir.locked(run_dir, enabled=primary, new_run=True):
        interrupts.resume_status(run_dir, None)
        if primary:
            with interrupts.critical():
                rundir.atomic_write_text(rundir.RunDir(run_dir).config, to_yaml(cfg))
            provenance.record(run_dir, command, 0, cfg.plugins, input_files(cfg),
                              compile_options(cfg.model),
                              layout(prepared) if layout is not None else None)
        yield run_dir, prepared


def input_files(cfg: CoreConfig) -> tuple[str, ...]:
    """The files besides the dataset that a run's config reads: its split file."""
    return (cfg.split_file,) if cfg.partition == "file" and cfg.split_file else ()


@contextlib.contextmanager
def locked_run(run_dir: Path, *, primary: bool = True) -> Iterator[None]:
    """Holds an existing run directory's lock for the ``with`` block; until a checkpoint is
    read, an interrupt reports the directory unchanged."""
    with rundir.locked(run_dir, enabled=primary):
        interrupts.set_status(f"run_dir {run_dir}: unchanged; continue with: fedjax-rcl "
                              f"resume {run_dir}")
        yield


def resumed_records(run_dir: Path, cfg: CoreConfig, lines: list[str], *, command: str | None,
                    first: int, primary: bool = True, layout: dict | None = None) -> None:
    """Rewrites a resumed run's ``metrics.jsonl`` as ``lines`` (those up to the checkpoint it
    continues from) and its ``config.yaml`` as ``cfg``, and records this process (and the
    clients' ``layout`` it trains in)."""
    if not primary:
        return
    run = rundir.RunDir(run_dir)
    with interrupts.critical():
        rundir.atomic_write_lines(run.metrics, lines)
        rundir.atomic_write_text(run.config, to_yaml(cfg))
    provenance.record(run_dir, command, first, cfg.plugins, input_files(cfg),
                      compile_options(cfg.model), layout)


def load_run_config(run_dir: Path, overrides=()) -> tuple[CoreConfig, CoreConfig]:
    """A run's saved config and the config with ``overrides`` applied (``ConfigError`` if
    ``run_dir`` is not a run)."""
    path = rundir.RunDir(run_dir).config
    if not Path(run_dir).exists():
        raise ConfigError([f"run_dir={str(run_dir)!r}: no such directory"])
    if not Path(run_dir).is_dir():
        raise ConfigError([f"run_dir={str(run_dir)!r}: not a directory"])
    if not path.is_file():
        raise ConfigError([f"run_dir={str(run_dir)!r}: no config.yaml; not a fedjax-rcl run"])
    # Its plugins are looked up where the run found them too, so it continues from anywhere.
    found = provenance.recorded_plugin_dirs(run_dir)
    saved = load_config(str(path), [f"run_dir={run_dir}"], plugin_dirs=found)
    wanted = load_config(str(path), [*overrides, f"run_dir={run_dir}"], plugin_dirs=found)
    return saved, wanted


def resume_config(run_dir: Path, overrides=(), *, force: bool = False) -> CoreConfig:
    """The config a run continues with: its own, with ``overrides``; overrides that would
    change its results (any key not declared ``resume_safe``) are refused unless ``force``."""
    saved, cfg = load_run_config(run_dir, overrides)
    changed = changed_keys(saved, cfg)
    if changed and not force:
        may = ", ".join(keys_declared(resume_safe=True))
        raise ConfigError([f"resume: {', '.join(changed)} would change the run's results "
                           f"(only {may} may change); pass --force to continue anyway"])
    return cfg


def require_command(cfg: CoreConfig, command: str, refusal: Callable[[str], str]) -> None:
    """Refuses (``ConfigError``) a config whose algorithm another command runs: the registry
    names the command of each algorithm (``"train"``, ``"mfcl"``). ``refusal(runs_with)`` is
    the message, in the words of what was asked (start, continue, a grid)."""
    runs_with = registry.algorithm(cfg.algorithm).command
    if runs_with != command:
        raise ConfigError([refusal(runs_with)])


def restore_checked(ckpt: Checkpointer, like, cfg: CoreConfig, where: Path | str, *,
                    force: bool, against: str = "config.yaml now holds",
                    at_most: int | None = None, warn=None) -> Restored | None:
    """The newest complete checkpoint (of step ``at_most`` or earlier) that restores into
    ``like``'s structure, None if there is none; refused (``ConfigError``) unless ``force``
    when the config that wrote it (its ``config_digest``) is not ``cfg``: the run would go on
    with settings its checkpoint was not trained with. ``where``: the directory the message
    names; ``against``: what the checkpoint's config differs from."""
    restored = ckpt.restore_latest(like, at_most=at_most, warn=warn)
    if (restored is not None and restored.meta.get("config_digest") != config_digest(cfg)
            and not force):
        raise ConfigError([f"resume: the checkpoint in {where} was written with a different "
                           f"config than {against}; pass --force to continue anyway"])
    return restored
