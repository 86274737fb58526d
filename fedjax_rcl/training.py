"""Loop and record: run an ``Experiment`` from a round to ``cfg.rounds``.

The rounds between two evaluations are one call of one compiled executable; each evaluation
appends a line to ``metrics.jsonl`` as it finishes; checkpoints are saved synchronously on
evaluation boundaries (so an interrupt can always name the last complete one); an accuracy
plot is drawn at the end. ``train`` starts a run, ``resume`` continues one from its newest
complete checkpoint, ``load_run`` / ``evaluate_run`` read one back.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import struct

from fedjax_rcl import interrupts, provenance, registry, rundir
from fedjax_rcl.checkpoint import Checkpointer, Restored
from fedjax_rcl.config import (
    RESUME_SAFE_KEYS,
    ConfigError,
    CoreConfig,
    changed_keys,
    config_digest,
    legacy_config_digest,
    load_config,
    to_dict,
    to_yaml,
)
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.engine.round import (
    ServerState,
    clients_per_round,
    sample_clients,
)
from fedjax_rcl.engine.sharding import (
    initialize_distributed,
    is_primary,
    put_replicated,
    to_host,
)
from fedjax_rcl.experiment import Experiment, build
from fedjax_rcl.metrics import ema
from fedjax_rcl.rundir import atomic_write_text, read_metrics_upto
from fedjax_rcl.tracking import Trackers


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names round and client."""


def _check_finite(metrics: dict, first_round: int, n: int) -> None:
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


def _write(path: Path, text: str) -> None:
    """Replaces a run file atomically (the primary process writes; the others skip)."""
    if is_primary():
        atomic_write_text(path, text)


def _checkpoint_meta(cfg: CoreConfig, done: int, acc_ema: float | None) -> dict:
    return {"round": done, "test_accuracy_ema": acc_ema, "config_digest": config_digest(cfg)}


def _compile(exp: Experiment, log):
    """Compiles the round program and the evaluation once, before the loop."""
    log("compiling the round (once per run; a repeat reads JAX's cache)...")
    t0 = time.perf_counter()
    if exp.host_table is None:
        n_dev = put_replicated(np.int32(exp.cfg.eval_every), exp.mesh)
        fused = exp.run_rounds.lower(exp.state, exp.data, n_dev).compile()

        def advance(state, n):
            state, metrics = fused(state, exp.data, put_replicated(np.int32(n), exp.mesh))
            return state, jax.tree.map(lambda x: x[:n], to_host(metrics))
    else:
        m = clients_per_round(exp.cfg.num_clients, exp.cfg.participation)
        rows = jax.tree.map(lambda t: t[:m], exp.host_table)
        one = exp.round_step.lower(exp.state, exp.data, rows).compile()
        sampler = jax.jit(lambda key, r: sample_clients(key, r, exp.cfg.num_clients, m))

        def advance(state, n):
            # Round by round: only the sampled clients' rows cross between host and device.
            history = []
            for _ in range(n):
                ids = to_host(sampler(state.key, state.round))
                rows = put_replicated(jax.tree.map(lambda t, ids=ids: t[ids], exp.host_table),
                                      exp.mesh)
                state, metrics, new_rows = one(state, exp.data, rows)
                for table, new in zip(jax.tree.leaves(exp.host_table),
                                      jax.tree.leaves(to_host(new_rows)), strict=True):
                    table[ids] = new
                history.append(to_host(metrics))
            return state, jax.tree.map(lambda *xs: np.stack(xs), *history)

    evaluate = exp.evaluate.lower(exp.state.params, exp.state.model_state, exp.test).compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s")
    return advance, evaluate, compile_s


def checkpoint_tree(exp: Experiment, state: ServerState):
    """What a checkpoint holds: the server state, plus the host-memory table if there is one."""
    return state if exp.host_table is None else {"server": state, "host": exp.host_table}


@struct.dataclass
class _ServerStateBeforeMessages:
    """``ServerState`` as checkpoints written before 2026-11-24 hold it (no ``message``)."""

    params: Any
    model_state: Any
    opt_state: Any
    client_states: Any
    round: Any
    key: Any


def _older_layouts(exp: Experiment) -> tuple:
    """How a checkpoint of an older state layout is read into the current one."""
    s = exp.state
    if jax.tree.leaves(s.message):  # algorithms with a message are newer than that layout
        return ()
    old = _ServerStateBeforeMessages(s.params, s.model_state, s.opt_state, s.client_states,
                                     s.round, s.key)

    def upgrade(tree):
        server = tree if exp.host_table is None else tree["server"]
        new = ServerState(params=server.params, model_state=server.model_state,
                          opt_state=server.opt_state, client_states=server.client_states,
                          round=server.round, key=server.key, message=s.message)
        return new if exp.host_table is None else {**tree, "server": new}

    return ((checkpoint_tree(exp, old), upgrade),)


def state_from_checkpoint(exp: Experiment, tree) -> ServerState:
    if exp.host_table is None:
        return tree
    for table, saved in zip(jax.tree.leaves(exp.host_table), jax.tree.leaves(tree["host"]),
                            strict=True):
        table[...] = np.asarray(saved)
    return tree["server"]


def _describe(exp: Experiment, run_dir: Path) -> str:
    cfg = exp.cfg
    return (f"run_dir: {run_dir}  |  {cfg.dataset}: {len(exp.dataset.train_labels)} train / "
            f"{len(exp.dataset.test_labels)} test, {exp.dataset.num_classes} classes  |  "
            f"{cfg.algorithm} on {cfg.model}, {cfg.num_clients} clients, "
            f"{clients_per_round(cfg.num_clients, cfg.participation)} per round  |  "
            f"backend {jax.default_backend()}")


def _run(exp: Experiment, run_dir: Path, ckpt: Checkpointer, state: ServerState, done: int,
         acc_ema: float | None, *, progress: bool, log) -> dict:
    """The host loop from round ``done`` to ``cfg.rounds``: fused rounds, evaluation,
    ``metrics.jsonl`` lines as they come, checkpoints, and the plot at the end."""
    from tqdm import tqdm

    from fedjax_rcl.plots import plot_metrics

    cfg = exp.cfg
    advance, evaluate, compile_s = _compile(exp, log)
    analyze = None
    if cfg.analysis_every:
        from fedjax_rcl.engine.analysis import make_analysis

        analyze = make_analysis(exp, cfg.analysis_images)
    record: dict = {}
    start, first, last_saved = time.perf_counter(), done, done
    # Loop time of the rounds before ``done`` (earlier processes of this run, if resumed).
    prior = read_metrics_upto(run_dir / "metrics.jsonl", done)
    prior_s = json.loads(prior[-1]).get("total_s", 0.0) if prior else 0.0
    # A bar (with tqdm's rate and ETA) on a terminal; elsewhere (logs, pipes, --no-progress)
    # one plain line per evaluation, since a redrawn bar is noise in a file.
    on_terminal = progress and is_primary() and sys.stderr.isatty()
    bar = tqdm(total=cfg.rounds, initial=done, unit="round", disable=not on_terminal,
               dynamic_ncols=True)
    trackers = (Trackers(cfg.tracking, run_dir, resumed_at=done, config=to_dict(cfg))
                if is_primary() else None)
    try:
        with (open(run_dir / "metrics.jsonl", "a") if is_primary()
              else contextlib.nullcontext()) as out:
            while done < cfg.rounds:
                n = min(cfg.eval_every - done % cfg.eval_every, cfg.rounds - done)
                block_start = time.perf_counter()
                # Hidden host<->device copies in the hot loop are errors (STYLE #13).
                with jax.transfer_guard("disallow"):
                    state, metrics = advance(state, n)
                    _check_finite(metrics, done, n)
                    ev = to_host(evaluate(state.params, state.model_state, exp.test))
                done += n
                acc = float(ev["accuracy"])
                acc_ema = ema(acc_ema, acc, cfg.ema_decay)
                terms = {k: float(np.mean(v[:n])) for k, v in metrics.items()
                         if k not in ("loss", "client_loss", "clients")}
                record = {"round": done, "test_accuracy": acc, "test_accuracy_ema": acc_ema,
                          "test_loss": float(ev["loss"]),
                          "train_loss": float(np.mean(metrics["loss"][:n])), **terms,
                          "round_s": round((time.perf_counter() - block_start) / n, 3),
                          "elapsed_s": round(time.perf_counter() - start, 3),
                          "total_s": round(prior_s + time.perf_counter() - start, 3)}
                if analyze is not None and done % cfg.analysis_every == 0:
                    record.update(analyze(state))
                if out is not None:
                    with interrupts.critical():  # never a torn line
                        out.write(json.dumps(record) + "\n")
                        out.flush()
                if trackers is not None:
                    trackers.log(record)
                # Checkpoints land on evaluation boundaries, so a resumed run's metrics lines
                # line up with the uninterrupted run's.
                if done == cfg.rounds or (cfg.checkpoint_every
                                          and done - last_saved >= cfg.checkpoint_every):
                    last_saved = done
                    _save(ckpt, run_dir, done, checkpoint_tree(exp, state),
                          _checkpoint_meta(cfg, done, acc_ema))
                bar.update(n)
                bar.set_postfix(loss=f"{record['train_loss']:.3f}", acc=f"{acc:.3f}",
                                ema=f"{acc_ema:.3f}")
                if not on_terminal:
                    log(progress_line(record, cfg.rounds, done - first,
                                      time.perf_counter() - start))
    finally:
        bar.close()
        ckpt.close()  # waits for pending saves: a stopped run keeps its last good checkpoint
        if trackers is not None:
            trackers.close()
    elapsed = time.perf_counter() - start
    if is_primary():
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "accuracy.png",
                     title=f"{cfg.algorithm} · {cfg.model} · {cfg.dataset}",
                     ema_decay=cfg.ema_decay, eval_every=cfg.eval_every)
    if record:
        rate = (done - first) / elapsed
        log(f"done: rounds {first}..{done} in {elapsed:.1f} s ({rate:.2f} rounds/s, "
            f"compile {compile_s:.1f} s); test accuracy {record['test_accuracy']:.4f}, "
            f"EMA {record['test_accuracy_ema']:.4f}; metrics in {run_dir / 'metrics.jsonl'}, "
            f"plot {run_dir / 'accuracy.png'}")
    return {**record, "compile_s": compile_s, "run_dir": str(run_dir)}


def progress_line(record: dict, rounds: int, rounds_run: int, seconds: float) -> str:
    """One evaluation as a plain line: where the run is, its numbers, speed and ETA (the rate
    of this process's rounds so far, compile excluded)."""
    rate = rounds_run / seconds if seconds > 0 else float("inf")
    left = (rounds - record["round"]) / rate if rate > 0 else float("inf")
    eta = ("-" if left == float("inf")
           else f"{int(left // 3600)}h{int(left % 3600 // 60):02d}m" if left >= 3600
           else f"{int(left // 60)}m{int(left % 60):02d}s")
    return (f"round {record['round']}/{rounds}  train loss {record['train_loss']:.4f}  "
            f"test acc {record['test_accuracy']:.4f} (EMA {record['test_accuracy_ema']:.4f})  "
            f"{rate:.2f} rounds/s  ETA {eta}")


def train(cfg: CoreConfig, *, dataset: ImageDataset | None = None, progress: bool = True,
          log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Runs ``cfg.rounds`` rounds from scratch; returns the last metrics record.

    Writes to the run directory: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per
    evaluation: ``round`` = rounds completed, ``test_accuracy``, ``test_accuracy_ema`` (the
    paper's per-round EMA when ``eval_every=1``; otherwise it advances once per evaluation),
    ``test_loss``, ``train_loss`` = mean local loss over the rounds since the last evaluation,
    each loss term, ``round_s`` = wall time per round of this evaluation block including the
    evaluation, ``elapsed_s`` = time since this process's loop began, ``total_s`` = the same
    summed over the run's processes, resumes included), ``checkpoints/`` (Orbax; round 0, every
    ``checkpoint_every`` rounds and the last) and ``accuracy.png``.
    """
    runs_with = registry.algorithm(cfg.algorithm).command
    if runs_with != "train":
        raise ConfigError([f"algorithm={cfg.algorithm!r}: runs with 'fedjax-rcl {runs_with}' "
                           "(train runs the client algorithms)"])
    _join_cluster(cfg)
    log = log if is_primary() else _silent
    run_dir = rundir.resolve_new(cfg)
    log(f"loading data: {cfg.dataset} ...")
    exp = build(cfg, dataset)  # data-dependent checks happen here, still before any compile
    run_dir = rundir.create_new(cfg, run_dir)
    with rundir.locked(run_dir, enabled=is_primary(), new_run=True):
        interrupts.resume_status(run_dir, None)
        with interrupts.critical():
            _write(run_dir / "config.yaml", to_yaml(cfg))
        if is_primary():
            provenance.record(run_dir, command, 0)
        log(_describe(exp, run_dir))
        ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        # A run always has a checkpoint.
        _save(ckpt, run_dir, 0, checkpoint_tree(exp, exp.state), _checkpoint_meta(cfg, 0, None))
        return _run(exp, run_dir, ckpt, exp.state, 0, None, progress=progress, log=log)


def _save(ckpt: Checkpointer, run_dir: Path, step: int, tree, meta: dict) -> None:
    """A checkpoint made durable before the loop goes on, so that an interrupt (which waits
    for it) can name it as the last complete one."""
    with interrupts.critical():
        ckpt.save(step, tree, meta)
        ckpt.wait()
    interrupts.resume_status(run_dir, step)


def _load_run_config(run_dir: Path, overrides=()) -> tuple[CoreConfig, CoreConfig]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError([f"run_dir={str(run_dir)!r}: no config.yaml; not a fedjax-rcl run"])
    saved = load_config(str(path), [f"run_dir={run_dir}"])
    wanted = load_config(str(path), [*overrides, f"run_dir={run_dir}"])
    return saved, wanted


def resume(run_dir: str | Path, overrides=(), *, force: bool = False,
           dataset: ImageDataset | None = None, progress: bool = True,
           log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Continues a run from its newest complete checkpoint (e.g. to more ``rounds``).

    The result is identical to a run that was never interrupted: the checkpoint holds
    everything the next round reads, and every key depends only on (seed, round, client).
    ``metrics.jsonl`` is cut back to the checkpoint's round and continues from there. Overrides
    that change results (anything but ``RESUME_SAFE_KEYS``) are refused unless ``force``.
    """
    run_dir = Path(run_dir)
    saved, cfg = _load_run_config(run_dir, overrides)
    if registry.algorithm(cfg.algorithm).command == "mfcl":
        from fedjax_rcl.mfcl.run import resume_mfcl

        changed = changed_keys(saved, cfg)
        if changed and not force:
            raise ConfigError([f"resume: {', '.join(changed)} would change the run's results; "
                               "pass --force to continue anyway"])
        with rundir.locked(run_dir):
            interrupts.set_status(f"run_dir {run_dir}: unchanged; continue with: fedjax-rcl "
                                  f"resume {run_dir}")
            with interrupts.critical():
                _write(run_dir / "config.yaml", to_yaml(cfg))
            return resume_mfcl(run_dir, cfg, force=force, dataset=dataset, log=log,
                               command=command)
    _join_cluster(cfg)
    with rundir.locked(run_dir, enabled=is_primary()):
        interrupts.set_status(f"run_dir {run_dir}: unchanged; continue with: fedjax-rcl resume "
                              f"{run_dir}")
        return _resume_locked(run_dir, saved, cfg, force=force, dataset=dataset,
                              progress=progress, log=log if is_primary() else _silent,
                              command=command)


def _resume_locked(run_dir: Path, saved: CoreConfig, cfg: CoreConfig, *, force: bool,
                   dataset: ImageDataset | None, progress: bool, log,
                   command: str | None) -> dict:
    changed = changed_keys(saved, cfg)
    if changed and not force:
        raise ConfigError([f"resume: {', '.join(changed)} would change the run's results "
                           f"(only {', '.join(RESUME_SAFE_KEYS)} may change); pass --force to "
                           "continue anyway"])
    log(f"loading data: {cfg.dataset} ...")
    exp = build(cfg, dataset)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    restored = ckpt.restore_latest(checkpoint_tree(exp, exp.state),
                                   older_layouts=_older_layouts(exp))
    if restored is None:
        if read_metrics_upto(run_dir / "metrics.jsonl", 1 << 62):
            ckpt.close()
            raise ConfigError([f"run_dir={str(run_dir)!r}: has metrics but no complete "
                               "checkpoint to resume from"])
        # Killed before its first checkpoint was complete: nothing was lost but the start.
        log(f"{run_dir}: no complete checkpoint yet; starting the run from round 0")
        restored = Restored(checkpoint_tree(exp, exp.state), _checkpoint_meta(cfg, 0, None), 0)
        _save(ckpt, run_dir, 0, restored.state, restored.meta)
    digest = restored.meta.get("config_digest")
    if digest not in (config_digest(cfg), legacy_config_digest(cfg)) and not force:
        ckpt.close()
        raise ConfigError([f"resume: the checkpoint in {run_dir} was written with a different "
                           "config than config.yaml now holds; pass --force to continue anyway"])
    done = restored.step
    ckpt.set_aside([s for s in ckpt.steps() if s > done])  # the damaged ones we skipped
    lines = read_metrics_upto(run_dir / "metrics.jsonl", done)
    with interrupts.critical():
        _write(run_dir / "metrics.jsonl", "".join(f"{x}\n" for x in lines))
        _write(run_dir / "config.yaml", to_yaml(cfg))
    if is_primary():
        provenance.record(run_dir, command, done)
    interrupts.resume_status(run_dir, done)
    log(_describe(exp, run_dir))
    log(f"resuming from the checkpoint of round {done} (of {cfg.rounds})")
    state = state_from_checkpoint(exp, restored.state)
    return _run(exp, run_dir, ckpt, state, done, restored.meta.get("test_accuracy_ema"),
                progress=progress, log=log)


def load_run(run_dir: str | Path, *, dataset: ImageDataset | None = None):
    """A run's experiment and its newest complete checkpoint.

    Returns:
      ``(experiment, restored)``; ``restored.state`` is what the checkpoint holds (the server
      state, or ``{"server", "host"}`` with a host-memory client table).
    """
    run_dir = Path(run_dir)
    _, cfg = _load_run_config(run_dir)
    _join_cluster(cfg)
    exp = build(cfg, dataset)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(checkpoint_tree(exp, exp.state),
                                       older_layouts=_older_layouts(exp))
    finally:
        ckpt.close()
    if restored is None:
        raise ConfigError([f"run_dir={str(run_dir)!r}: no complete checkpoint"])
    return exp, restored


def evaluate_run(run_dir: str | Path, *, dataset: ImageDataset | None = None) -> dict:
    """Evaluates a run's newest complete checkpoint on the full test set."""
    exp, restored = load_run(run_dir, dataset=dataset)
    state = state_from_checkpoint(exp, restored.state)
    ev = to_host(exp.evaluate(state.params, state.model_state, exp.test))
    return {"run_dir": str(run_dir), "round": restored.step,
            "test_accuracy": float(ev["accuracy"]), "test_loss": float(ev["loss"]),
            "test_accuracy_ema": restored.meta.get("test_accuracy_ema")}
