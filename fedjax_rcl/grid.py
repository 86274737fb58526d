"""Several runs in one compiled program: ``train`` with ``seeds=[s0, s1, ...]``, a sweep of one
float setting (``fedrcl.beta=[0.5,1,2]``), or both.

Federated learning results need several seeds per setting. Run one after another as separate
processes, each compiles the same program again and, on an accelerator, each small model
leaves most of the device idle. Here the runs share one program: a leading *run axis* over the
whole round.

The run directory::

    RUN_DIR/config.yaml, commands.txt, environment.jsonl    the grid (``seeds``, ``sweep``)
    RUN_DIR/seed-<s>/                                        one ordinary run per seed
    RUN_DIR/<key>-<value>[-seed-<s>]/                        ... per value (and seed)

Each member is built exactly as that seed's run alone (``seed: s``: its own split, initial
weights and client sampling) and is an ordinary run directory (``config.yaml``,
``metrics.jsonl``, ``checkpoints/``, ``accuracy.png``; ``resume`` and ``eval`` take it as
any run). A swept setting enters the program as a traced value per run (the training program
is built again with it, ``Experiment.program_for``), so the runs still share one program; a
setting the program branches on in Python cannot (it is refused before the run starts), and
neither can one that sets the program's shapes (``participation``). ``alpha`` changes only
the split, which is each member's data. The members' client index tables are padded to the
largest client of any member, so that one program fits them all: a client's steps past its
own data are masked, as an uneven client's already are, and its shuffles do not depend on
the padding, so a member's results are those of its run alone. Their server states are
stacked on the run axis and the rounds between two evaluations are ``lax.map``ped over it:
the runs go one after another inside the program, each with the arithmetic it has alone (the
tests compare seeds bitwise; a swept value is an operand where the run alone has a constant
XLA may fold, so a sweep agrees within float reassociation), which is what a CPU wants.
``runs_in_parallel=K`` instead trains groups of K runs side by side (``vmap``), as an
accelerator that one small run leaves idle may want; results then agree within float
reassociation. ``runs_in_parallel=0`` lets the layout cost model choose between all runs side
by side and one after another (``runs_in_parallel``), as ``clients_in_parallel=0`` chooses for
the clients. A grid whose runs' states cannot fit on the device is refused before compiling
(``check_fits``).

``fedjax-rcl resume RUN_DIR`` continues every member from the newest round all of them have a
checkpoint of; ``fedjax-rcl resume RUN_DIR/seed-1`` continues one member alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl import registry, rundir
from fedjax_rcl.checkpoint import Checkpointer
from fedjax_rcl.config import (
    CoreConfig,
    SweepConfig,
    degenerate_settings,
    grid_members,
    with_setting,
)
from fedjax_rcl.data import ImageDataset, load_dataset
from fedjax_rcl.engine import layout
from fedjax_rcl.engine.round import clients_per_round, make_run_rounds
from fedjax_rcl.engine.sharding import to_host
from fedjax_rcl.experiment import (
    Experiment,
    build,
    clients_in_parallel,
    make_partition,
    training_step_gflop,
)
from fedjax_rcl.loop import (
    Callback,
    Sink,
    Stage,
    TrainingError,
    locked_run,
    new_run,
    require_command,
    restore_checked,
    resumed_records,
    run_stage,
    save_checkpoint,
)
from fedjax_rcl.provenance import recorded_layout
from fedjax_rcl.training import (
    check_finite,
    checkpoint_meta,
    compile_analysis,
    cut_back,
    layout_record,
    plot_run,
    prior_accuracies,
    prior_seconds,
    rounds_stage,
    warn_stderr,
)
from fedjax_rcl.validation import ConfigError

__all__ = ["GridProgram", "build_members", "check_fits", "check_sweep", "compile_grid",
           "continue_grid",
           "device_memory", "evaluate_grid", "member_configs",
           "member_dir", "runs_in_parallel", "train_grid"]


def member_dir(parent: Path, seed: int) -> Path:
    """Where the member of seed ``seed`` of a grid of seeds lives."""
    return Path(parent) / rundir.member_name(seed)


def setting(cfg, key: str):
    """The value of the dotted setting ``key`` in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def member_configs(cfg: CoreConfig, parent: Path | None) -> list[CoreConfig]:
    """One ordinary run config per member: per value of ``cfg.sweep`` (that setting set to
    it) and per seed of ``cfg.seeds`` (``seed: s``), no ``seeds`` or ``sweep``, its run
    directory inside ``parent`` (``config.grid_members`` names it)."""
    base = dataclasses.replace(cfg, seeds=[], sweep=SweepConfig())
    out = []
    for name, seed, value in grid_members(list(cfg.seeds), cfg.sweep.key,
                                          list(cfg.sweep.values)):
        c = base if seed is None else dataclasses.replace(base, seed=seed)
        c = c if value is None else with_setting(c, cfg.sweep.key, float(value))
        out.append(dataclasses.replace(
            c, run_dir=None if parent is None else str(Path(parent) / name)))
    return out


def _label(cfg: CoreConfig, key: str | None) -> str:
    """How messages name a member: its directory, else its seed and value."""
    if cfg.run_dir:
        return Path(cfg.run_dir).name
    return f"seed {cfg.seed}" + ("" if key is None else f", {key}={setting(cfg, key)}")


def build_members(cfgs: list[CoreConfig], dataset: ImageDataset | None = None,
                  kept_layouts: list[int | None] | None = None) -> list[Experiment]:
    """Every member's experiment, built as its run alone but with its client table padded to
    the largest client of any member (one program shape for all); ``kept_layouts``: each
    member's recorded clients' layout, kept on resume (``build``'s ``kept_layout``)."""
    dataset = dataset or load_dataset(cfgs[0].dataset, data_dir=cfgs[0].data_dir)
    widest = max(max(len(p) for p in make_partition(c, dataset.train_labels)) for c in cfgs)
    kept_layouts = kept_layouts or [None] * len(cfgs)
    return [build(c, dataset, pad_clients_to=widest, kept_layout=k)
            for c, k in zip(cfgs, kept_layouts, strict=True)]


def device_memory() -> int | None:
    """Bytes the device can hold: an accelerator's allocator limit, a CPU's physical memory
    (None: unknown)."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(exps: list[Experiment], limit: int | None = None,
               grid: CoreConfig | None = None) -> int:
    """Refuses, before anything is compiled, a grid whose runs' state cannot fit: every run
    keeps its server state (model, server optimizer, per-client table) and client index table
    on the device, twice while a block's new state is written (the data set is shared). The
    working memory of the runs in flight comes on top and is not counted. ``grid``: the
    grid's config, to name it in the refusal. Returns the estimate in bytes."""
    from fedjax_rcl.checkpoint import state_nbytes

    each = [2 * state_nbytes(e.state) + e.data.client_indices.nbytes for e in exps]
    need = sum(each) + exps[0].data.images.nbytes
    limit = device_memory() if limit is None else limit
    if limit is not None and need > 0.8 * limit:
        fit = max(0, int((0.8 * limit - exps[0].data.images.nbytes) // max(each)))
        if grid is None or grid.sweep.key is None:
            label = f"seeds={list(grid.seeds) if grid else [e.cfg.seed for e in exps]}"
            fewer = "seeds"
        else:
            label = f"{grid.sweep.key}={list(grid.sweep.values)}" + (
                f", seeds={list(grid.seeds)}" if grid.seeds else "")
            fewer = "values or seeds"
        raise ConfigError([f"{label}: {len(exps)} runs need about {_size(need)} on the device "
                           f"({_size(max(each))} each: model, optimizer and per-client table, "
                           f"twice; the data set once) beyond 80 % of its {_size(limit)}; at "
                           f"most {fit} fit: use fewer {fewer}"])
    return need


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _member(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


def runs_in_parallel(exps: list[Experiment], platform: str | None = None,
                     kept: int | None = None) -> int:
    """How many of the members train side by side: ``runs_in_parallel`` as configured (at most
    every member), its 0 resolved by the layout cost model (``layout.runs_side_by_side``): all
    of them when the step work they put on the device together (members x the clients a member
    trains side by side x one client's training-step GFLOP, ``training_step_gflop``) is below
    the platform's threshold, else 1 (one after another, each with the arithmetic of its run
    alone). The members share one program, so the first member's model and settings stand for
    all. ``platform``: default JAX's backend. ``kept``: the grid's recorded choice, which a
    resumed grid keeps (``provenance.recorded_layout``)."""
    first = exps[0]
    cfg = first.cfg
    if cfg.runs_in_parallel:
        return min(cfg.runs_in_parallel, len(exps))
    if kept is not None:
        return min(kept, len(exps))
    step = training_step_gflop(first.model, first.state.params, first.state.model_state,
                               first.dataset.image_shape, cfg.batch_size,
                               registry.algorithm(cfg.algorithm).num_views)
    per_round = clients_per_round(cfg.num_clients, cfg.participation)
    platform = platform or jax.default_backend()
    clients = min(clients_in_parallel(cfg, step, platform) or per_round, per_round)
    return len(exps) if layout.runs_side_by_side(len(exps), clients, step, platform) else 1


@dataclasses.dataclass(frozen=True)
class GridProgram:
    """The compiled grid: ``advance(states, n) -> (states, metrics [R, n, ...])`` and
    ``evaluate(states) -> {"accuracy", "loss"} [R]`` (NumPy), the seconds compiling took, and
    with ``analysis_every`` each member's analysis, its programs compiled too."""

    advance: Callable
    evaluate: Callable
    compile_s: float
    analyses: tuple = ()


def _member_rounds(exps: list[Experiment], key: str | None):
    """``(rounds_for, values)``: ``rounds_for(value)`` is the members' rounds between two
    evaluations (``value``: a member's traced value of the swept setting ``key``), ``values``
    each member's value, weakly typed as a Python float is (a bf16 program stays bf16)."""
    first = exps[0]
    capacity = first.cfg.eval_every
    if key is None:
        rounds = make_run_rounds(first.table.run_round(first.round_rows), capacity)
        return (lambda value: rounds), jnp.stack([jnp.asarray(0.0)] * len(exps))

    def rounds_for(value):
        program = first.program_for(with_setting(first.cfg, key, value))
        return make_run_rounds(first.table.run_round(program.round_rows), capacity)

    return rounds_for, jnp.stack([jnp.asarray(float(setting(e.cfg, key))) for e in exps])


def check_sweep(exps: list[Experiment], key: str | None) -> None:
    """Refuses, before the run starts, a swept setting the program branches on in Python
    (it cannot be a traced value), by tracing one member's rounds with it traced."""
    if key is None:
        return
    rounds_for, values = _member_rounds(exps, key)
    e = exps[0]
    try:
        jax.eval_shape(lambda v: rounds_for(v)(e.state, e.data, jnp.int32(1)), values[0])
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
            jax.errors.TracerArrayConversionError) as err:
        raise ConfigError([f"sweep.key={key!r}: the training program decides by the value of "
                           f"{key} in Python ({type(err).__name__}), so its values cannot "
                           "share one program; run them separately"]) from None


def compile_grid(exps: list[Experiment], states, log: Callable[[str], None] = print,
                 key: str | None = None, runs_layout: int | None = None) -> GridProgram:
    """Compiles the members' rounds between two evaluations, mapped over the run axis, and
    their evaluation, once (``key``: the swept setting, a traced value per member;
    ``runs_layout``: a resumed grid's recorded ``runs_in_parallel``)."""
    first = exps[0]
    capacity = first.cfg.eval_every
    group = runs_in_parallel(exps, kept=runs_layout)
    batch = None if group <= 1 else group  # lax.map: vmap within groups
    rounds_for, values = _member_rounds(exps, key)
    values = jax.device_put(values)
    indices = jax.device_put(np.stack([np.asarray(e.data.client_indices) for e in exps]))
    sizes = jax.device_put(np.stack([np.asarray(e.data.client_sizes) for e in exps]))

    def advance_all(states, data, indices, sizes, values, n):
        def one(member):
            state, idx, size, value = member
            return rounds_for(value)(state, data.replace(client_indices=idx,
                                                         client_sizes=size), n)

        return jax.lax.map(one, (states, indices, sizes, values), batch_size=batch)

    def evaluate_all(states, test):
        return jax.lax.map(lambda s: first.evaluate(s.params, s.model_state, test), states,
                           batch_size=batch)

    side = ("one after another" if group <= 1 else "side by side" if group == len(exps)
            else f"{group} side by side at a time")
    log(f"compiling the round of {len(exps)} runs, {side} (once; a repeat reads JAX's "
        "cache)...")
    t0 = time.perf_counter()
    n0 = jax.device_put(np.int32(capacity))
    options = first.compiler_options or None
    compiled = jax.jit(advance_all, donate_argnums=0).lower(
        states, first.data, indices, sizes, values, n0).compile(options)
    evaluate = jax.jit(evaluate_all).lower(states, first.test).compile(options)
    analyses = (tuple(compile_analysis(e, _member(states, i)) for i, e in enumerate(exps))
                if first.cfg.analysis_every else ())
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s")

    def advance(states, n: int):
        states, metrics = compiled(states, first.data, indices, sizes, values,
                                   jax.device_put(np.int32(n)))
        return states, jax.tree.map(lambda x: x[:, :n], to_host(metrics))

    return GridProgram(advance, lambda states: to_host(evaluate(states, first.test)),
                       compile_s, analyses)


class _Checkpointers:
    """The members' checkpointers as one: a grid checkpoint is every member's, same step."""

    def __init__(self, checkpointers: list[Checkpointer]):
        self.members = checkpointers

    def save(self, step: int, trees, metas) -> None:
        for c, tree, meta in zip(self.members, trees, metas, strict=True):
            c.save(step, tree, meta)

    def wait(self) -> None:
        for c in self.members:
            c.wait()

    def close(self) -> None:
        for c in self.members:
            c.close()


class _Sinks:
    """Every member's metrics file: a grid line carries one line per member (``"runs"``)."""

    def __init__(self, sinks: list[Sink]):
        self.members = sinks

    def write(self, record: dict) -> None:
        for sink, line in zip(self.members, record["runs"], strict=True):
            sink.write(line)

    def close(self) -> None:
        for sink in self.members:
            sink.close()


class _StepSinks(_Sinks):
    """Every member's ``clients.jsonl``: an item is one list of lines per member."""

    def write(self, per_member: list) -> None:
        for sink, lines in zip(self.members, per_member, strict=True):
            for line in lines:
                sink.write(line)


def _spread(values: list[float]) -> tuple[float, float]:
    mean = float(np.mean(values))
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def _by_value(exps: list[Experiment], key: str | None, lines: list[dict]) -> str:
    """The members' test accuracy (and EMA) as a progress line gives it: mean ± sd over the
    seeds of each value of a sweep's setting, never over different values."""
    if key is None:
        acc, acc_sd = _spread([x["test_accuracy"] for x in lines])
        ema, ema_sd = _spread([x["test_accuracy_ema"] for x in lines])
        return (f"test acc {acc:.4f} ± {acc_sd:.4f} over {len(lines)} seeds (EMA {ema:.4f} ± "
                f"{ema_sd:.4f})")
    groups: dict = {}
    for e, x in zip(exps, lines, strict=True):
        groups.setdefault(setting(e.cfg, key), []).append(x)
    parts = []
    for value, hit in groups.items():
        acc, acc_sd = _spread([x["test_accuracy"] for x in hit])
        ema, ema_sd = _spread([x["test_accuracy_ema"] for x in hit])
        parts.append(f"{key}={value}: {acc:.4f}" + (
            f" ± {acc_sd:.4f} (EMA {ema:.4f} ± {ema_sd:.4f}, {len(hit)} seeds)" if len(hit) > 1
            else f" (EMA {ema:.4f})"))
    return "test acc " + "; ".join(parts)


def _grid_stage(exps: list[Experiment], program: GridProgram, ckpts: list[Checkpointer],
                emas: list, priors: list[float], key: str | None = None,
                histories: list | None = None) -> Stage:
    """The members' rounds as one stage of the run loop: each member's metrics line, checkpoint
    and per-client lines are those of its own stage (``training.rounds_stage``)."""
    cfg = exps[0].cfg
    histories = histories or [()] * len(exps)
    analyses = program.analyses or (None,) * len(exps)
    members = [rounds_stage(e, None, c, a, p, h, analyze=z)
               for e, c, a, p, h, z in zip(exps, ckpts, emas, priors, histories, analyses,
                                           strict=True)]
    analysis = bool(cfg.analysis_every)

    def advance(states, done, n):
        states, metrics = program.advance(states, n)
        evals = program.evaluate(states)
        outs = []
        for i, e in enumerate(exps):
            m = _member(metrics, i)
            try:
                check_finite(m, done, n)
            except TrainingError as err:
                raise TrainingError(f"{_label(e.cfg, key)}: {err}") from None
            outs.append((m, _member(evals, i)))
        return states, outs

    def record(states, outs, done, n, block_s, elapsed_s):
        lines = [m.record(_member(states, i) if analysis else None, out, done, n, block_s,
                          elapsed_s) for i, (m, out) in enumerate(zip(members, outs, strict=True))]
        acc, acc_sd = _spread([x["test_accuracy"] for x in lines])
        ema, ema_sd = _spread([x["test_accuracy_ema"] for x in lines])
        return {"round": done, "runs": lines, "test_accuracy": acc, "test_accuracy_sd": acc_sd,
                "test_accuracy_ema": ema, "test_accuracy_ema_sd": ema_sd,
                "train_loss": float(np.mean([x["train_loss"] for x in lines])),
                "summary": _by_value(exps, key, lines)}

    def checkpoint(states, done, line):
        pairs = [m.checkpoint(_member(states, i), done, run)
                 for i, (m, run) in enumerate(zip(members, line["runs"], strict=True))]
        return [t for t, _ in pairs], [meta for _, meta in pairs]

    def step_lines(outs, done, n):
        return [[m.step_lines(out, done, n) for m, out in zip(members, outs, strict=True)]]

    def describe(r):
        return r["summary"]

    return Stage(label="round", unit="rounds", total=cfg.rounds, every=cfg.eval_every,
                 checkpoint_every=cfg.checkpoint_every, advance=advance, record=record,
                 checkpoint=checkpoint, checkpointer=_Checkpointers(ckpts), describe=describe,
                 postfix=lambda r: {"acc": f"{r['test_accuracy']:.3f}",
                                    "ema": f"{r['test_accuracy_ema']:.3f}"},
                 step_lines=step_lines if members[0].step_lines is not None else None)


def _grid_layout(exps: list[Experiment], runs_layout: int | None = None) -> dict:
    """The layout a grid's process records for the grid (its members record their own)."""
    return {"clients_in_parallel": exps[0].in_parallel,
            "runs_in_parallel": runs_in_parallel(exps, kept=runs_layout),
            "describe": exps[0].layout}


def _run_grid(parent: Path, exps: list[Experiment], ckpts: list[Checkpointer], states,
              done: int, emas: list, *, progress: bool, log, callbacks=(),
              key: str | None = None, runs_layout: int | None = None) -> dict:

    dirs = [Path(e.cfg.run_dir) for e in exps]
    grid_ckpt = _Checkpointers(ckpts)
    try:
        program = compile_grid(exps, states, log, key, runs_layout)
        stage = _grid_stage(exps, program, ckpts, emas,
                            [prior_seconds(d, done) for d in dirs], key,
                            [prior_accuracies(d, done) for d in dirs])
        sink = _Sinks([Sink(d, e.cfg, resumed_at=done) for d, e in zip(dirs, exps, strict=True)])
        clients = (_StepSinks([Sink(d, path=rundir.RunDir(d).clients) for d in dirs])
                   if stage.step_lines is not None else None)
        first, start = done, time.perf_counter()
        try:
            states, record, stopped = run_stage(stage, states, done, run_dir=parent, sink=sink,
                                                progress=progress, log=log,
                                                callbacks=callbacks, step_sink=clients)
        finally:
            sink.close()
            if clients is not None:
                clients.close()
        elapsed = time.perf_counter() - start
    finally:
        grid_ckpt.close()
    for d, e in zip(dirs, exps, strict=True):
        plot_run(d, e.cfg, f" · {d.name}")
    if record:
        log(f"done: {len(exps)} runs, rounds {first}..{record['round']} in {elapsed:.1f} s "
            f"(compile {program.compile_s:.1f} s); {record['summary']}; runs in "
            f"{parent}/{{{','.join(d.name for d in dirs)}}}")
    return {**record, "compile_s": program.compile_s, "run_dir": str(parent),
            "stopped_early": stopped}


def _check_command(cfg: CoreConfig) -> None:
    require_command(cfg, "train", lambda runs_with: (
        f"seeds={list(cfg.seeds)}, sweep.key={cfg.sweep.key!r}: several runs in one program "
        f"are 'fedjax-rcl train' runs; algorithm={cfg.algorithm!r} runs with 'fedjax-rcl "
        f"{runs_with}'"))


def train_grid(cfg: CoreConfig, *, dataset: ImageDataset | None = None, progress: bool = True,
               log: Callable[[str], None] = print, command: str | None = None,
               warn: Callable[[str], None] = warn_stderr,
               callbacks: tuple[Callback, ...] = ()) -> dict:
    """Trains one run per member (seed of ``cfg.seeds``, value of ``cfg.sweep``, or both) in
    one compiled program (module docstring).

    Returns the last grid line: the mean and sd over the runs of the test accuracy and its
    EMA, each run's own line (``"runs"``) and ``run_dir`` (the grid's directory). Callbacks
    see the grid lines.
    """
    _check_command(cfg)
    for line in degenerate_settings(cfg):
        warn(line)

    def prepare() -> list[Experiment]:
        log(f"loading data: {cfg.dataset} ...")
        exps = build_members(member_configs(cfg, None), dataset)
        check_fits(exps, grid=cfg)
        check_sweep(exps, cfg.sweep.key)
        return exps

    recorded: dict = {}  # the grid's layout as its first record has it, decided once

    def grid_layout(exps: list[Experiment]) -> dict:
        recorded.update(_grid_layout(exps))
        return recorded

    with new_run(cfg, prepare, command=command, layout=grid_layout) as (parent, exps):
        cfgs = member_configs(cfg, parent)
        exps = [dataclasses.replace(e, cfg=c) for e, c in zip(exps, cfgs, strict=True)]
        with contextlib.ExitStack() as members:
            for c, e in zip(cfgs, exps, strict=True):
                members.enter_context(new_run(c, lambda: None, command=command,
                                              layout=lambda _, e=e: layout_record(e)))
            names = ", ".join(Path(c.run_dir).name for c in cfgs)
            log(f"run_dir: {parent}  |  {len(cfgs)} runs ({names}) of {cfg.algorithm} on "
                f"{cfg.model}, {cfg.dataset}  |  backend {jax.default_backend()}, "
                f"{exps[0].layout}")
            ckpts = [Checkpointer(rundir.RunDir(c.run_dir).checkpoint_dir(),
                                  keep=c.keep_checkpoints) for c in cfgs]
            grid_ckpt = _Checkpointers(ckpts)
            save_checkpoint(grid_ckpt, parent, 0, [e.table.checkpoint(e.state) for e in exps],
                            [checkpoint_meta(c, 0, None) for c in cfgs], "round 0")
            return _run_grid(parent, exps, ckpts, _stack([e.state for e in exps]), 0,
                             [None] * len(exps), progress=progress, log=log,
                             callbacks=callbacks, key=cfg.sweep.key,
                             runs_layout=recorded.get("runs_in_parallel"))


def continue_grid(run_dir: Path, cfg: CoreConfig, *, force: bool = False,
                  dataset: ImageDataset | None = None, progress: bool = True,
                  log: Callable[[str], None] = print, command: str | None = None,
                  callbacks: tuple[Callback, ...] = ()) -> dict:
    """Continues every member of a grid from the newest round all of them have a complete
    checkpoint of (``cfg``: the grid's config, already read and checked)."""
    _check_command(cfg)
    run_dir = Path(run_dir)
    cfgs = member_configs(cfg, run_dir)
    missing = [c.run_dir for c in cfgs if not rundir.RunDir(c.run_dir).config.is_file()]
    if missing:
        raise ConfigError([f"run_dir={str(run_dir)!r}: its member(s) {', '.join(missing)} are "
                           "missing; a grid resumes only whole"])
    with locked_run(run_dir), contextlib.ExitStack() as locks:
        for c in cfgs:
            locks.enter_context(rundir.locked(Path(c.run_dir)))
        log(f"loading data: {cfg.dataset} ...")
        # The layouts the grid began with, not the cost model's choice today.
        backend = jax.default_backend()
        exps = build_members(cfgs, dataset,
                             [recorded_layout(c.run_dir, backend) for c in cfgs])
        runs_layout = recorded_layout(run_dir, backend, "runs_in_parallel")
        check_fits(exps, grid=cfg)
        check_sweep(exps, cfg.sweep.key)
        ckpts = [Checkpointer(rundir.RunDir(c.run_dir).checkpoint_dir(),
                              keep=c.keep_checkpoints) for c in cfgs]
        try:
            restored = _restore_common(exps, ckpts, force)
        except BaseException:
            for c in ckpts:
                c.close()
            raise
        done = restored[0].step
        for c, e in zip(ckpts, exps, strict=True):
            c.set_aside([s for s in c.steps() if s > done])
            cut_back(Path(e.cfg.run_dir), e.cfg, done, command=command,
                     layout=layout_record(e))
        grid = _grid_layout(exps, runs_layout)  # decided once: recorded and compiled
        resumed_records(run_dir, cfg, [], command=command, first=done, layout=grid)
        log(f"resuming {len(exps)} runs from the checkpoints of round {done} (of {cfg.rounds})")
        states = _stack([e.table.restore(r.state) for e, r in zip(exps, restored, strict=True)])
        return _run_grid(run_dir, exps, ckpts, states, done,
                         [r.meta.get("test_accuracy_ema") for r in restored],
                         progress=progress, log=log, callbacks=callbacks,
                         key=cfg.sweep.key, runs_layout=grid["runs_in_parallel"])


def _restore_common(exps: list[Experiment], ckpts: list[Checkpointer], force: bool) -> list:
    """Every member's checkpoint of the newest round all of them have, each written with
    the member's config (``loop.restore_checked``)."""
    latest = None
    for _ in range(2):  # the newest of each, then all at the oldest of those
        restored = [restore_checked(c, e.table.checkpoint(e.state), e.cfg, e.cfg.run_dir,
                                    force=force, against="the grid's", at_most=latest)
                    for e, c in zip(exps, ckpts, strict=True)]
        if any(r is None for r in restored):
            bad = [e.cfg.run_dir for e, r in zip(exps, restored, strict=True) if r is None]
            raise ConfigError([f"{', '.join(bad)}: no complete checkpoint"
                               + (f" of round {latest} or earlier" if latest else "")])
        steps = {r.step for r in restored}
        if len(steps) == 1:
            break
        latest = min(steps)
    else:
        raise ConfigError([f"the members have no checkpoint of one common round (newest: "
                           f"{sorted(steps)})"])
    return restored


def evaluate_grid(run_dir: Path, cfg: CoreConfig, *, dataset: ImageDataset | None = None,
                  strict: bool = False) -> dict:
    """Every member's newest complete checkpoint on the full test set, and the mean and sd of
    the test accuracy and loss over them (``training.evaluate_run`` for each member: which
    checkpoint, and ``strict``)."""
    from fedjax_rcl.training import evaluate_run

    if dataset is None:
        dataset = load_dataset(cfg.dataset, data_dir=cfg.data_dir)
    runs = [evaluate_run(c.run_dir, dataset=dataset, strict=strict)
            for c in member_configs(cfg, run_dir)]
    acc, acc_sd = _spread([r["test_accuracy"] for r in runs])
    loss, loss_sd = _spread([r["test_loss"] for r in runs])
    return {"run_dir": str(run_dir), "runs": runs, "test_accuracy": acc,
            "test_accuracy_sd": acc_sd, "test_loss": loss, "test_loss_sd": loss_sd}
