"""The ``train`` program: federated rounds of an ``Experiment`` to ``cfg.rounds``, through the
shared run loop (``fedjax_rcl.loop``).

The rounds between two evaluations are one call of one compiled executable (``compile``);
each evaluation appends a line to ``metrics.jsonl`` as it finishes; checkpoints are saved
synchronously on evaluation boundaries; an accuracy plot is drawn at the end. ``train`` starts
a run, ``resume_single`` continues one from its newest complete checkpoint, ``restore_run`` /
``evaluate_run`` read one back.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from fedjax_rcl import interrupts
from fedjax_rcl.checkpoint import Checkpointer, Restored
from fedjax_rcl.config import (
    CoreConfig,
    config_digest,
    degenerate_settings,
    is_grid,
)
from fedjax_rcl.data import ImageDataset, augment
from fedjax_rcl.engine.round import ServerState, clients_per_round
from fedjax_rcl.engine.sharding import initialize_distributed, is_primary, to_host
from fedjax_rcl.engine.tables import Advance
from fedjax_rcl.experiment import Experiment, build
from fedjax_rcl.loop import (
    Callback,
    Sink,
    Stage,
    TrainingError,
    load_run_config,
    locked_run,
    new_run,
    progress_text,
    require_command,
    restore_checked,
    resume_config,
    resumed_records,
    run_stage,
    save_checkpoint,
)
from fedjax_rcl.metrics import RECENT_WINDOWS, ema, recent_mean
from fedjax_rcl.models.base import PRECISIONS
from fedjax_rcl.nn import narrow_conv, pool
from fedjax_rcl.provenance import recorded_layout
from fedjax_rcl.rundir import RunDir, atomic_write_lines
from fedjax_rcl.validation import ConfigError

__all__ = ["CompiledRounds", "TrainingError", "check_finite",
           "checkpoint_meta", "checkpoint_tree", "compile_analysis", "compile_program",
           "continue_run", "cut_back", "evaluate_run", "plot_run", "prior_seconds",
           "progress_line", "restore_run", "resume_single", "rounds_stage",
           "state_from_checkpoint", "train"]

def check_finite(metrics: dict, first_round: int, n: int) -> None:
    losses = np.asarray(metrics["client_loss"][:n])
    bad = np.argwhere(~np.isfinite(losses))
    if len(bad):
        i, j = bad[0]
        client = int(np.asarray(metrics["clients"])[i, j])
        raise TrainingError(f"non-finite local loss ({losses[i, j]}) in round {first_round + i + 1}"
                            f" at client {client}; stopping")


def _silent(message: str) -> None:
    del message


def _join_cluster(cfg: CoreConfig) -> None:
    d = cfg.distributed
    initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)


def checkpoint_meta(cfg: CoreConfig, done: int, acc_ema: float | None) -> dict:
    return {"round": done, "test_accuracy_ema": acc_ema, "config_digest": config_digest(cfg)}


@dataclasses.dataclass(frozen=True)
class CompiledRounds:
    """A single run's compiled programs: ``advance(state, n) -> (state, metrics [n])`` for the
    rounds between evaluations, ``evaluate(params, model_state, test)``, the seconds compiling
    took, and with ``analysis_every`` the representation analysis, its programs compiled
    too."""

    advance: Advance
    evaluate: Callable
    compile_s: float
    analyze: Callable | None = None


def compile_analysis(exp: Experiment, state: ServerState) -> Callable:
    """The run's representation analysis, its programs compiled (not run) for ``state``."""
    analyze = exp.analysis(exp.cfg.analysis_images)
    analyze.compile_ahead(state)
    return analyze


def compile_program(exp: Experiment, log: Callable[[str], None] = _silent) -> CompiledRounds:
    """Compiles, once, before the loop, everything the loop runs: the rounds (through the
    experiment's client-table strategy), the evaluation and, with ``analysis_every``, the
    analysis, so that the time it prints is the time until the first round can run."""
    log("compiling the round (once per run; a repeat reads JAX's cache)...")
    interrupts.test_point("compiling")
    t0 = time.perf_counter()
    advance = exp.compile_rounds()
    evaluate = exp.evaluate.lower(exp.state.params, exp.state.model_state, exp.test).compile(
        exp.compiler_options or None)
    analyze = compile_analysis(exp, exp.state) if exp.cfg.analysis_every else None
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s")
    return CompiledRounds(advance, evaluate, compile_s, analyze)


def checkpoint_tree(exp: Experiment, state: ServerState):
    """What a checkpoint holds: the server state, plus the host-memory table if there is one."""
    return exp.table.checkpoint(state)


def state_from_checkpoint(exp: Experiment, tree) -> ServerState:
    """The server state a checkpoint tree holds (a host-memory table is read back)."""
    return exp.table.restore(tree)


def _describe(exp: Experiment, run_dir: Path) -> str:
    cfg = exp.cfg
    return (f"run_dir: {run_dir}  |  {cfg.dataset}: {len(exp.dataset.train_labels)} train / "
            f"{len(exp.dataset.test_labels)} test, {exp.dataset.num_classes} classes  |  "
            f"{cfg.algorithm} on {cfg.model}, {cfg.num_clients} clients, "
            f"{clients_per_round(cfg.num_clients, cfg.participation)} per round  |  "
            f"backend {jax.default_backend()}, {exp.layout}")


def progress_line(record: dict, rounds: int, rounds_run: int, seconds: float) -> str:
    """One evaluation as a plain line: where the run is, its numbers, speed and ETA (the rate
    of this process's rounds so far, compile excluded)."""
    return progress_text("round", "rounds", record["round"], rounds, _numbers(record),
                         rounds_run, seconds)


def _numbers(record: dict) -> str:
    return (f"train loss {record['train_loss']:.4f}  test acc {record['test_accuracy']:.4f} "
            f"(EMA {record['test_accuracy_ema']:.4f})")


def rounds_stage(exp: Experiment, program: CompiledRounds | None, ckpt: Checkpointer,
                 acc_ema: float | None, prior_s: float,
                 history: Sequence[tuple[int, float]] = (), *, analyze: Callable | None = None
                 ) -> Stage:
    """The federated rounds as a stage of the run loop. ``history``: the ``(round, test
    accuracy)`` of the run's earlier evaluations (a resumed run's), for the means over the last
    rounds. ``program`` None: a grid's member, whose rounds the grid's program advances (the
    stage gives its metrics line, checkpoint and per-client lines), its compiled analysis
    ``analyze``."""
    cfg = exp.cfg
    recent = list(history)
    analyze = program.analyze if program is not None else analyze
    if cfg.analysis_every and analyze is None:
        analyze = exp.analysis(cfg.analysis_images)
    ema_now = [acc_ema]

    def advance(state, done, n):
        assert program is not None, "a grid member's rounds are advanced by the grid"
        state, metrics = program.advance(state, n)
        check_finite(metrics, done, n)
        interrupts.test_point("evaluating", done + n)
        return state, (metrics, to_host(program.evaluate(state.params, state.model_state,
                                                         exp.test)))

    def record(state, out, done, n, block_s, elapsed_s):
        metrics, ev = out
        acc = float(ev["accuracy"])
        # ema_decay is per round: a block of n rounds applies ema_decay**n (exact for n = 1).
        ema_now[0] = ema(ema_now[0], acc, cfg.ema_decay, n)
        recent.append((done, acc))
        del recent[:-max(RECENT_WINDOWS)]  # at most one evaluation a round
        terms = {k: float(np.mean(v[:n])) for k, v in metrics.items()
                 if k != "loss" and not k.startswith("client")}
        line = {"round": done, "test_accuracy": acc, "test_accuracy_ema": ema_now[0],
                "ema_rounds": n,
                **{f"test_accuracy_last{w}": recent_mean(recent, done, w)
                   for w in RECENT_WINDOWS},
                "test_loss": float(ev["loss"]), "train_loss": float(np.mean(metrics["loss"][:n])),
                **terms, "round_s": round(block_s / n, 3), "elapsed_s": round(elapsed_s, 3),
                "total_s": round(prior_s + elapsed_s, 3)}
        if analyze is not None and done % cfg.analysis_every == 0:
            line.update(analyze(state))
        return line

    def checkpoint(state, done, line):
        return exp.table.checkpoint(state), checkpoint_meta(cfg, done,
                                                             line["test_accuracy_ema"])

    sizes = np.asarray([len(p) for p in exp.parts])

    def client_lines(out, done, n):
        """One ``clients.jsonl`` line per round of the block: the sampled clients, their data
        sizes and local losses (and accuracies on their own data, with ``client_eval``)."""
        metrics, _ = out
        lines = []
        for i in range(n):
            ids = np.asarray(metrics["clients"][i])
            line = {"round": done - n + i + 1, "clients": ids.tolist(),
                    "size": sizes[ids].tolist(),
                    "loss": np.asarray(metrics["client_loss"][i], np.float64).tolist()}
            for key in ("acc_before", "acc_after"):
                if f"client_{key}" in metrics:
                    line[key] = np.asarray(metrics[f"client_{key}"][i], np.float64).tolist()
            lines.append(line)
        return lines

    return Stage(label="round", unit="rounds", total=cfg.rounds, every=cfg.eval_every,
                 checkpoint_every=cfg.checkpoint_every, advance=advance, record=record,
                 checkpoint=checkpoint, checkpointer=ckpt, describe=_numbers,
                 postfix=lambda r: {"loss": f"{r['train_loss']:.3f}",
                                    "acc": f"{r['test_accuracy']:.3f}",
                                    "ema": f"{r['test_accuracy_ema']:.3f}"},
                 step_lines=client_lines if cfg.client_metrics or cfg.client_eval else None)


def prior_seconds(run_dir: Path, done: int) -> float:
    """Loop time of a run's rounds before ``done`` (its earlier processes, if resumed)."""
    prior = RunDir(run_dir).read_metrics(upto=done)
    return prior[-1].get("total_s", 0.0) if prior else 0.0


def prior_accuracies(run_dir: Path, done: int) -> list[tuple[int, float]]:
    """``(round, test accuracy)`` of a run's evaluations up to ``done`` (a resumed run's last
    ``max(RECENT_WINDOWS)``, enough for the means over the last rounds)."""
    rows = RunDir(run_dir).read_metrics(upto=done)
    return [(x["round"], x["test_accuracy"]) for x in rows[-max(RECENT_WINDOWS):]]


def ema_cadence(cfg) -> str:
    """What the EMA of a run evaluated every ``k > 1`` rounds is, for its done line (empty
    for ``k = 1``, where it is the paper's per-round EMA)."""
    k = cfg.eval_every
    return ("" if k == 1 else f" (evaluated every {k} rounds: {cfg.ema_decay:g}**{k} per "
            "evaluation, the paper's per-round EMA only at eval_every=1; the means of the last "
            "10 and 50 rounds in metrics.jsonl do not depend on it)")


def split_text(cfg) -> str:
    """The split a run trains on, as titles name it: ``IID``, ``Dirichlet alpha 0.3`` (FedRCL's
    equal-size draw; MOON's is marked ``unequal sizes``), ``2 shards a client`` or ``split
    <file name>``."""
    if cfg.partition == "iid":
        return "IID"
    if cfg.partition == "shards":
        return f"{cfg.shards_per_client} shards a client"
    if cfg.partition == "file":
        return f"split {Path(cfg.split_file or '').name}"
    return f"Dirichlet alpha {cfg.alpha:g}" + ("" if cfg.balanced else ", unequal sizes")


def plot_run(run_dir: Path, cfg: CoreConfig, title_suffix: str = "") -> None:
    """The run's ``accuracy.png`` from its ``metrics.jsonl``."""
    from fedjax_rcl.plots import plot_metrics

    run = RunDir(run_dir)
    plot_metrics(run.metrics, run.plot,
                 title=f"{cfg.algorithm} · {cfg.model} · {cfg.dataset} · {split_text(cfg)} · "
                       f"{cfg.num_clients} clients · seed {cfg.seed}{title_suffix}",
                 ema_decay=cfg.ema_decay, eval_every=cfg.eval_every)


def layout_record(exp: Experiment) -> dict:
    """The clients' layout a process trains in, as ``environment.jsonl`` records it, with the
    implementation its models' ``nn.pool.bias_relu_max_pool`` calls run in local training
    (``"kernel"`` or ``"xla"``: they agree to rounding in the bias's gradient, not bitwise) and
    whether its ``conv_impl=cpu`` convolutions run ``nn.narrow_conv``'s kernel where it applies
    (``"kernel"`` or ``"off"``: it and oneDNN's agree to rounding), and what its training
    augmentation runs on (``data.augment``'s ``"kernel"`` or ``"xla"``: bitwise the same images
    at XLA's default settings)."""
    dtype = jax.ShapeDtypeStruct((1,), PRECISIONS[exp.cfg.precision])
    return {"clients_in_parallel": exp.in_parallel, "describe": exp.layout,
            "bias_relu_max_pool": pool.resolve_impl("auto", dtype, dtype),
            "narrow_conv": narrow_conv.resolve(dtype.dtype), "augment": augment.resolve()}


def cut_back(run_dir: Path, cfg: CoreConfig, done: int, *, command: str | None,
             layout: dict | None = None) -> None:
    """A resumed run's records cut back to round ``done``: ``metrics.jsonl`` and
    ``clients.jsonl`` (its ``config.yaml`` rewritten, this process and its ``layout``
    recorded)."""
    run = RunDir(run_dir)
    resumed_records(run_dir, cfg, run.metric_lines(upto=done), command=command, first=done,
                    primary=is_primary(), layout=layout)
    if is_primary() and run.clients.exists():  # cut back like metrics.jsonl
        with interrupts.critical():
            atomic_write_lines(run.clients, run.client_lines(upto=done))


def _run(exp: Experiment, run_dir: Path, ckpt: Checkpointer, state: ServerState, done: int,
         acc_ema: float | None, *, progress: bool, log, callbacks=()) -> dict:
    """From round ``done`` to ``cfg.rounds`` through the run loop, then the plot."""
    cfg = exp.cfg
    try:
        program = compile_program(exp, log)
        stage = rounds_stage(exp, program, ckpt, acc_ema, prior_seconds(run_dir, done),
                             prior_accuracies(run_dir, done))
        sink = Sink(run_dir, cfg, resumed_at=done)
        clients = (Sink(run_dir, path=RunDir(run_dir).clients) if stage.step_lines is not None
                   else None)
        first, start = done, time.perf_counter()
        try:
            state, record, stopped = run_stage(stage, state, done, run_dir=run_dir,
                                               sink=sink, progress=progress, log=log,
                                               callbacks=callbacks, step_sink=clients)
        finally:
            sink.close()
            if clients is not None:
                clients.close()
        elapsed = time.perf_counter() - start
    finally:
        ckpt.close()  # waits for pending saves: a stopped run keeps its last good checkpoint
    if is_primary():
        plot_run(run_dir, cfg)
    if record:
        last = record["round"]
        rate = (last - first) / elapsed
        log(f"done: rounds {first}..{last} in {elapsed:.1f} s ({rate:.2f} rounds/s, "
            f"compile {program.compile_s:.1f} s); test accuracy {record['test_accuracy']:.4f}, "
            f"EMA {record['test_accuracy_ema']:.4f}{ema_cadence(cfg)}; metrics in "
            f"{RunDir(run_dir).metrics}, plot {RunDir(run_dir).plot}")
    return {**record, "compile_s": program.compile_s, "run_dir": str(run_dir),
            "stopped_early": stopped}


def warn_stderr(message: str) -> None:
    """A warning line on standard error, as the command line prints it."""
    print(f"fedjax-rcl: warning: {message}", file=sys.stderr, flush=True)


def train(cfg: CoreConfig, *, dataset: ImageDataset | None = None, progress: bool = True,
          log: Callable[[str], None] = print, command: str | None = None,
          warn: Callable[[str], None] = warn_stderr, callbacks: tuple[Callback, ...] = ()
          ) -> dict:
    """Runs ``cfg.rounds`` rounds from scratch; returns the last metrics record.

    Writes to the run directory: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per
    evaluation: ``round`` = rounds completed, ``test_accuracy``, ``test_accuracy_ema`` (the
    EMA with ``ema_decay`` per round: the paper's when ``eval_every=1``; every ``k`` rounds it
    applies ``ema_decay**k`` once per evaluation, exact only for ``k = 1``), ``ema_rounds`` (the
    ``k`` of this line: rounds since the previous evaluation), ``test_accuracy_last10`` and
    ``test_accuracy_last50`` (the mean raw accuracy of the evaluations in the last 10 and 50
    rounds: figures that do not depend on the cadence),
    ``test_loss``, ``train_loss`` = mean local loss over the rounds since the last evaluation,
    each loss term, ``round_s`` = wall time per round of this evaluation block including the
    evaluation, ``elapsed_s`` = time since this process's loop began, ``total_s`` = the same
    summed over the run's processes, resumes included), ``checkpoints/`` (Orbax; round 0, every
    ``checkpoint_every`` rounds and the last), ``accuracy.png``, the provenance records
    ``commands.txt`` and ``environment.jsonl`` (``fedjax_rcl.provenance``), and with
    ``client_metrics`` ``clients.jsonl`` (one line per round: the sampled clients, their sizes
    and local losses; with ``client_eval`` their accuracies on their own data before and after
    local training).
    """
    require_command(cfg, "train", lambda runs_with: (
        f"algorithm={cfg.algorithm!r}: runs with 'fedjax-rcl {runs_with}' (train runs the "
        "client algorithms)"))
    if is_grid(cfg):
        raise ConfigError([f"seeds={list(cfg.seeds)}, sweep.key={cfg.sweep.key!r}: several "
                           "runs train with "
                           "fedjax_rcl.grid.train_grid (or fedjax_rcl.api.train, "
                           "'fedjax-rcl train'), not training.train"])
    _join_cluster(cfg)
    log = log if is_primary() else _silent
    if is_primary():
        for line in degenerate_settings(cfg):
            warn(line)

    def prepare() -> Experiment:
        log(f"loading data: {cfg.dataset} ...")
        return build(cfg, dataset)  # data-dependent checks happen here, before any compile

    with new_run(cfg, prepare, command=command, primary=is_primary(),
                 layout=layout_record) as (run_dir, exp):
        log(_describe(exp, run_dir))
        ckpt = Checkpointer(RunDir(run_dir).checkpoint_dir(), keep=cfg.keep_checkpoints)
        # A run always has a checkpoint.
        save_checkpoint(ckpt, run_dir, 0, exp.table.checkpoint(exp.state),
                        checkpoint_meta(cfg, 0, None), "round 0")
        return _run(exp, run_dir, ckpt, exp.state, 0, None, progress=progress, log=log,
                    callbacks=callbacks)


def resume_single(run_dir: str | Path, overrides=(), *, force: bool = False,
           dataset: ImageDataset | None = None, progress: bool = True,
           log: Callable[[str], None] = print, command: str | None = None,
           callbacks: tuple[Callback, ...] = ()) -> dict:
    """Continues a run from its newest complete checkpoint (e.g. to more ``rounds``).

    The result is identical to a run that was never interrupted: the checkpoint holds
    everything the next round reads, and every key depends only on (seed, round, client).
    ``metrics.jsonl`` is cut back to the checkpoint's round and continues from there. Overrides
    that change results (any key not declared ``resume_safe``) are refused unless ``force``.
    (``fedjax_rcl.api.resume`` continues a run of any command.)
    """
    run_dir = Path(run_dir)
    return continue_run(run_dir, resume_config(run_dir, overrides, force=force), force=force,
                        dataset=dataset, progress=progress, log=log, command=command,
                        callbacks=callbacks)


def continue_run(run_dir: Path, cfg: CoreConfig, *, force: bool = False,
                 dataset: ImageDataset | None = None, progress: bool = True,
                 log: Callable[[str], None] = print, command: str | None = None,
                 callbacks: tuple[Callback, ...] = ()) -> dict:
    """``resume_single`` with the config already read and checked (``loop.resume_config``)."""
    require_command(cfg, "train", lambda runs_with: (
        f"run_dir={str(run_dir)!r}: a 'fedjax-rcl {runs_with}' run; continue it with "
        f"'fedjax-rcl resume {run_dir}'"))
    _join_cluster(cfg)
    with locked_run(run_dir, primary=is_primary()):
        return _resume_locked(run_dir, cfg, force=force, dataset=dataset, progress=progress,
                              log=log if is_primary() else _silent, command=command,
                              callbacks=callbacks)


def _resume_locked(run_dir: Path, cfg: CoreConfig, *, force: bool,
                   dataset: ImageDataset | None, progress: bool, log,
                   command: str | None, callbacks=()) -> dict:
    log(f"loading data: {cfg.dataset} ...")
    # The layout the run began with, not the cost model's choice today (``build``).
    exp = build(cfg, dataset, kept_layout=recorded_layout(run_dir, jax.default_backend()))
    run = RunDir(run_dir)
    ckpt = Checkpointer(run.checkpoint_dir(), keep=cfg.keep_checkpoints)
    try:
        restored = restore_checked(ckpt, exp.table.checkpoint(exp.state), cfg, run_dir,
                                   force=force)
    except ConfigError:
        ckpt.close()
        raise
    if restored is None:
        if run.read_metrics():
            ckpt.close()
            raise ConfigError([f"run_dir={str(run_dir)!r}: has metrics but no complete "
                               "checkpoint to resume from"])
        # Killed before its first checkpoint was complete: nothing was lost but the start.
        log(f"{run_dir}: no complete checkpoint yet; starting the run from round 0")
        restored = Restored(exp.table.checkpoint(exp.state), checkpoint_meta(cfg, 0, None), 0)
        save_checkpoint(ckpt, run_dir, 0, restored.state, restored.meta, "round 0")
    done = restored.step
    ckpt.set_aside([s for s in ckpt.steps() if s > done])  # the damaged ones we skipped
    cut_back(run_dir, cfg, done, command=command, layout=layout_record(exp))
    interrupts.resume_status(run_dir, done)
    log(_describe(exp, run_dir))
    log(f"resuming from the checkpoint of round {done} (of {cfg.rounds})")
    state = exp.table.restore(restored.state)
    return _run(exp, run_dir, ckpt, state, done, restored.meta.get("test_accuracy_ema"),
                progress=progress, log=log, callbacks=callbacks)


def restore_run(run_dir: str | Path, *, dataset: ImageDataset | None = None, warn=None):
    """A run's experiment and its newest complete checkpoint that restores (damaged newer
    ones are skipped: ``warn(message)`` for each, default a logged warning; they are listed
    in ``restored.skipped``).

    Returns:
      ``(experiment, restored)``; ``restored.state`` is what the checkpoint holds (the server
      state, or ``{"server", "host"}`` with a host-memory client table).
    """
    run_dir = Path(run_dir)
    _, cfg = load_run_config(run_dir)
    _join_cluster(cfg)
    exp = build(cfg, dataset)
    ckpt = Checkpointer(RunDir(run_dir).checkpoint_dir(), keep=cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(exp.table.checkpoint(exp.state), warn=warn)
    finally:
        ckpt.close()
    if restored is None:
        raise ConfigError([f"run_dir={str(run_dir)!r}: no complete checkpoint"])
    return exp, restored


def evaluate_run(run_dir: str | Path, *, dataset: ImageDataset | None = None,
                 strict: bool = False) -> dict:
    """Evaluates a run's newest complete checkpoint on the full test set.

    Returns ``{"run_dir", "round" (the checkpoint evaluated), "checkpoint" (its directory),
    "test_accuracy", "test_loss", "test_accuracy_ema"}``; when the newest checkpoint is
    damaged and an older one was evaluated instead, also ``"fell_back_from"`` (the newest
    checkpoint's round) and ``"reason"`` (what was wrong with it).

    Raises:
      ConfigError: ``strict`` and the newest checkpoint is damaged (nothing is evaluated).
    """
    exp, restored = restore_run(run_dir, dataset=dataset, warn=lambda message: None)
    if restored.skipped and strict:
        newest, reason = restored.skipped[0]
        raise ConfigError([f"eval --strict: the newest checkpoint of {run_dir} (round {newest}) "
                           f"is damaged ({reason}); the newest that restores is round "
                           f"{restored.step}"])
    state = exp.table.restore(restored.state)
    ev = to_host(exp.evaluate(state.params, state.model_state, exp.test))
    out = {"run_dir": str(run_dir), "round": restored.step,
           "checkpoint": str(RunDir(run_dir).checkpoint_dir() / str(restored.step)),
           "test_accuracy": float(ev["accuracy"]), "test_loss": float(ev["loss"]),
           "test_accuracy_ema": restored.meta.get("test_accuracy_ema")}
    if restored.skipped:
        out["fell_back_from"], out["reason"] = restored.skipped[0]
    return out
