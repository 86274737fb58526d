"""From a validated ``Config`` to a finished run: build, compile once, loop, record.

``build`` assembles the pieces (data on device, partition, model, client algorithm, client and
server optimizers, the fused-rounds program, evaluation); ``train`` runs it: the rounds between
two evaluations are one call of one compiled executable, metrics are appended to
``metrics.jsonl`` as each evaluation finishes, and an accuracy plot is drawn at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_rcl import interrupts, registry, rundir
from fedjax_rcl.algorithms import ClientAlgorithm, make_algorithm, model_kwargs
from fedjax_rcl.checkpoint import Checkpointer, Restored
from fedjax_rcl.config import (
    RESUME_SAFE_KEYS,
    ConfigError,
    CoreConfig,
    changed_keys,
    config_digest,
    load_config,
    to_yaml,
)
from fedjax_rcl.data import ImageDataset, load_dataset, partition
from fedjax_rcl.data.device import ClientData, TestData, pack_clients, pack_test
from fedjax_rcl.engine.client import (
    LocalTraining,
    client_optimizer,
    make_local_update,
    report_like,
)
from fedjax_rcl.engine.evaluate import make_evaluate
from fedjax_rcl.engine.round import (
    ServerState,
    clients_per_round,
    init_key,
    init_server_state,
    make_round,
    make_run_rounds,
    sample_clients,
)
from fedjax_rcl.engine.sharding import (
    client_mesh,
    initialize_distributed,
    is_primary,
    put_client_table,
    put_replicated,
    to_host,
)
from fedjax_rcl.metrics import ema
from fedjax_rcl.models import ModelFns, get_model, model_fns
from fedjax_rcl.rundir import atomic_write_text, read_metrics_upto
from fedjax_rcl.server import server_optimizer


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names round and client."""


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built from its config."""

    cfg: CoreConfig
    dataset: ImageDataset
    parts: list[np.ndarray]
    model: ModelFns
    algorithm: ClientAlgorithm
    data: ClientData
    test: TestData
    state: ServerState
    settings: LocalTraining
    local_update: Callable  # pure, one client: see engine.client.make_local_update
    run_round: Callable  # pure (state, data) -> (state, metrics)
    run_rounds: Callable  # jitted (state, data, n) -> (state, metrics[eval_every])
    evaluate: Callable  # jitted (params, model_state, test) -> metrics
    mesh: Mesh | None = None  # the clients mesh, None on one device
    # ``client_states=host``: the per-client state table as NumPy arrays in host memory, and
    # the jitted single round that takes and returns the sampled clients' rows.
    host_table: object = None
    round_step: Callable | None = None


def make_partition(cfg: CoreConfig, labels: np.ndarray) -> list[np.ndarray]:
    """The configured partition, with its errors reported against config fields."""
    try:
        return partition(labels, cfg.num_clients, method=cfg.partition, seed=cfg.seed,
                         alpha=cfg.alpha, shards_per_client=cfg.shards_per_client,
                         balanced=cfg.balanced)
    except ValueError as e:
        raise ConfigError([f"partition={cfg.partition!r} with num_clients={cfg.num_clients} on "
                           f"{len(labels)} training samples: {e}"]) from None


def clients_in_parallel(cfg: CoreConfig, platform: str | None = None) -> int | None:
    """``cfg.clients_in_parallel``, with 0 resolved: all sampled clients side by side (None),
    except the models registered ``one_client_at_a_time_on_cpu`` (the ResNets), which train one
    client after another on a CPU (1).

    Why: on a CPU, batching clients buys no throughput (the cores are busy with one client's
    convolutions) and costs cache and memory; for ResNet-18 a FedRCL round of 5 clients takes
    0.77x the time one after another with the patch convolutions, 0.74x with oneDNN's
    (benchmarks/HISTORY.md). The small CNN's round is as fast vmapped.
    """
    if cfg.clients_in_parallel:
        return cfg.clients_in_parallel
    platform = platform or jax.default_backend()
    one_at_a_time = registry.model(cfg.model).one_client_at_a_time_on_cpu
    return 1 if platform == "cpu" and one_at_a_time else None


def build(cfg: CoreConfig, dataset: ImageDataset | None = None, *,
          module: nn.Module | None = None) -> Experiment:
    """Assembles a run (nothing is compiled yet).

    Args:
      cfg: a validated config.
      dataset: an already loaded dataset (tests reuse one); default ``load_dataset(cfg.dataset)``.
      module: a Flax model to use instead of ``cfg.model`` (its ``__call__(x, *, train)`` must
        return a ``ModelOutput``).
    """
    dataset = dataset or load_dataset(cfg.dataset, data_dir=cfg.data_dir)
    if cfg.num_clients > len(dataset.train_labels):
        raise ConfigError([f"num_clients={cfg.num_clients}: must be <= the "
                           f"{len(dataset.train_labels)} training samples of {cfg.dataset}"])
    parts = make_partition(cfg, dataset.train_labels)
    largest = max(len(p) for p in parts)
    if cfg.batch_size > largest:
        raise ConfigError([f"batch_size={cfg.batch_size}: larger than every client's data (the "
                           f"largest of the {cfg.num_clients} clients holds {largest} samples); "
                           f"use batch_size <= {largest} or fewer clients"])
    try:
        mesh = client_mesh(cfg.devices)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    data = put_replicated(pack_clients(dataset.train_images, dataset.train_labels, parts), mesh)
    test = put_replicated(pack_test(dataset.test_images, dataset.test_labels,
                                    cfg.eval_batch_size), mesh)

    module = module or get_model(cfg.model, num_classes=dataset.num_classes,
                                 conv_impl=cfg.conv_impl, norm=cfg.norm, width=cfg.width,
                                 **model_kwargs(cfg))
    model = model_fns(module)
    algorithm = make_algorithm(cfg, model)
    root = jax.random.PRNGKey(cfg.seed)
    params, model_state = model.init(init_key(root), np.zeros((1, *dataset.image_shape)))

    sizes = np.asarray([len(p) for p in parts])
    settings = LocalTraining(
        batch_size=cfg.batch_size,
        local_epochs=cfg.local_epochs,
        steps_per_epoch=math.ceil(int(sizes.max()) / cfg.batch_size),
        uniform_sizes=bool(sizes.min() == sizes.max()),
        lr_fn=lambda r, e: cfg.lr * jnp.power(cfg.lr_decay, (r + e).astype(jnp.float32)),
        mean=dataset.mean,
        std=dataset.std,
        hflip=dataset.hflip,
        augment=cfg.augment,
        num_classes=dataset.num_classes,
    )
    opt = client_optimizer(cfg.lr, clip_norm=cfg.clip_norm, weight_decay=cfg.weight_decay,
                           momentum=cfg.momentum)
    sopt = server_optimizer(cfg)
    local_update = make_local_update(model, algorithm, opt, settings,
                                     penalty=sopt.client_penalty, penalty_name=sopt.penalty_name)
    host = cfg.client_states == "host"
    reports = report_like(model, algorithm, params, model_state, dataset.image_shape,
                          cfg.batch_size)
    run_round = make_round(local_update, sopt, num_clients=cfg.num_clients,
                           server_message=algorithm.server_message,
                           participation=cfg.participation, aggregation=cfg.aggregation,
                           mesh=mesh, clients_in_parallel=clients_in_parallel(cfg),
                           host_states=host)
    evaluate = jax.jit(make_evaluate(model, mean=dataset.mean, std=dataset.std))
    if host:
        one = jax.device_get(algorithm.init_client_state(params, model_state))
        host_table = jax.tree.map(
            lambda x: np.repeat(np.asarray(x)[None], cfg.num_clients, axis=0), one)
        state = init_server_state(params, model_state, algorithm, sopt, 0, root, reports)
        state = put_replicated(jax.device_get(state.replace(client_states=())), mesh)
        return Experiment(cfg, dataset, parts, model, algorithm, data, test, state, settings,
                          local_update, run_round, None, evaluate, mesh, host_table,
                          jax.jit(run_round, donate_argnums=0))
    run_rounds = jax.jit(make_run_rounds(run_round, cfg.eval_every), donate_argnums=0)
    state = jax.device_get(
        init_server_state(params, model_state, algorithm, sopt, cfg.num_clients, root, reports))
    state = put_replicated(state.replace(client_states=()), mesh).replace(
        client_states=put_client_table(state.client_states, mesh))
    return Experiment(cfg, dataset, parts, model, algorithm, data, test, state, settings,
                      local_update, run_round, run_rounds, evaluate, mesh)


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


def _checkpoint_tree(exp: Experiment, state: ServerState):
    """What a checkpoint holds: the server state, plus the host-memory table if there is one."""
    return state if exp.host_table is None else {"server": state, "host": exp.host_table}


def _from_checkpoint_tree(exp: Experiment, tree) -> ServerState:
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
    record: dict = {}
    start, first, last_saved = time.perf_counter(), done, done
    # Loop time of the rounds before ``done`` (earlier processes of this run, if resumed).
    prior = read_metrics_upto(run_dir / "metrics.jsonl", done)
    prior_s = json.loads(prior[-1]).get("total_s", 0.0) if prior else 0.0
    bar = tqdm(total=cfg.rounds, initial=done, unit="round",
               disable=not progress or not is_primary(), dynamic_ncols=True)
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
                if out is not None:
                    with interrupts.critical():  # never a torn line
                        out.write(json.dumps(record) + "\n")
                        out.flush()
                # Checkpoints land on evaluation boundaries, so a resumed run's metrics lines
                # line up with the uninterrupted run's.
                if done == cfg.rounds or (cfg.checkpoint_every
                                          and done - last_saved >= cfg.checkpoint_every):
                    last_saved = done
                    _save(ckpt, run_dir, done, _checkpoint_tree(exp, state),
                          _checkpoint_meta(cfg, done, acc_ema))
                bar.update(n)
                bar.set_postfix(loss=f"{record['train_loss']:.3f}", acc=f"{acc:.3f}",
                                ema=f"{acc_ema:.3f}")
    finally:
        bar.close()
        ckpt.close()  # waits for pending saves: a stopped run keeps its last good checkpoint
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


def train(cfg: CoreConfig, *, dataset: ImageDataset | None = None, progress: bool = True,
          log: Callable[[str], None] = print) -> dict:
    """Runs ``cfg.rounds`` rounds from scratch; returns the last metrics record.

    Writes to the run directory: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per
    evaluation: ``round`` = rounds completed, ``test_accuracy``, ``test_accuracy_ema``,
    ``test_loss``, ``train_loss`` = mean local loss over the rounds since the last evaluation,
    each loss term, ``round_s`` = wall time per round of this evaluation block including the
    evaluation, ``elapsed_s`` = time since this process's loop began, ``total_s`` = the same
    summed over the run's processes, resumes included), ``checkpoints/`` (Orbax; round 0, every
    ``checkpoint_every`` rounds and the last) and ``accuracy.png``.
    """
    _join_cluster(cfg)
    log = log if is_primary() else _silent
    run_dir = rundir.resolve_new(cfg)
    exp = build(cfg, dataset)  # data-dependent checks happen here, still before any compile
    run_dir = rundir.create_new(cfg, run_dir)
    with rundir.locked(run_dir, enabled=is_primary(), new_run=True):
        interrupts.resume_status(run_dir, None)
        with interrupts.critical():
            _write(run_dir / "config.yaml", to_yaml(cfg))
        log(_describe(exp, run_dir))
        ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        # A run always has a checkpoint.
        _save(ckpt, run_dir, 0, _checkpoint_tree(exp, exp.state), _checkpoint_meta(cfg, 0, None))
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
           log: Callable[[str], None] = print) -> dict:
    """Continues a run from its newest complete checkpoint (e.g. to more ``rounds``).

    The result is identical to a run that was never interrupted: the checkpoint holds
    everything the next round reads, and every key depends only on (seed, round, client).
    ``metrics.jsonl`` is cut back to the checkpoint's round and continues from there. Overrides
    that change results (anything but ``RESUME_SAFE_KEYS``) are refused unless ``force``.
    """
    run_dir = Path(run_dir)
    saved, cfg = _load_run_config(run_dir, overrides)
    _join_cluster(cfg)
    with rundir.locked(run_dir, enabled=is_primary()):
        interrupts.set_status(f"run_dir {run_dir}: unchanged; continue with: fedjax-rcl resume "
                              f"{run_dir}")
        return _resume_locked(run_dir, saved, cfg, force=force, dataset=dataset,
                              progress=progress, log=log if is_primary() else _silent)


def _resume_locked(run_dir: Path, saved: CoreConfig, cfg: CoreConfig, *, force: bool,
                   dataset: ImageDataset | None, progress: bool, log) -> dict:
    changed = changed_keys(saved, cfg)
    if changed and not force:
        raise ConfigError([f"resume: {', '.join(changed)} would change the run's results "
                           f"(only {', '.join(RESUME_SAFE_KEYS)} may change); pass --force to "
                           "continue anyway"])
    exp = build(cfg, dataset)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    restored = ckpt.restore_latest(_checkpoint_tree(exp, exp.state))
    if restored is None:
        if read_metrics_upto(run_dir / "metrics.jsonl", 1 << 62):
            ckpt.close()
            raise ConfigError([f"run_dir={str(run_dir)!r}: has metrics but no complete "
                               "checkpoint to resume from"])
        # Killed before its first checkpoint was complete: nothing was lost but the start.
        log(f"{run_dir}: no complete checkpoint yet; starting the run from round 0")
        restored = Restored(_checkpoint_tree(exp, exp.state), _checkpoint_meta(cfg, 0, None), 0)
        _save(ckpt, run_dir, 0, restored.state, restored.meta)
    digest = restored.meta.get("config_digest")
    if digest != config_digest(cfg) and not force:
        ckpt.close()
        raise ConfigError([f"resume: the checkpoint in {run_dir} was written with a different "
                           "config than config.yaml now holds; pass --force to continue anyway"])
    done = restored.step
    ckpt.set_aside([s for s in ckpt.steps() if s > done])  # the damaged ones we skipped
    lines = read_metrics_upto(run_dir / "metrics.jsonl", done)
    with interrupts.critical():
        _write(run_dir / "metrics.jsonl", "".join(f"{x}\n" for x in lines))
        _write(run_dir / "config.yaml", to_yaml(cfg))
    interrupts.resume_status(run_dir, done)
    log(_describe(exp, run_dir))
    log(f"resuming from the checkpoint of round {done} (of {cfg.rounds})")
    state = _from_checkpoint_tree(exp, restored.state)
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
        restored = ckpt.restore_latest(_checkpoint_tree(exp, exp.state))
    finally:
        ckpt.close()
    if restored is None:
        raise ConfigError([f"run_dir={str(run_dir)!r}: no complete checkpoint"])
    return exp, restored


def evaluate_run(run_dir: str | Path, *, dataset: ImageDataset | None = None) -> dict:
    """Evaluates a run's newest complete checkpoint on the full test set."""
    exp, restored = load_run(run_dir, dataset=dataset)
    state = _from_checkpoint_tree(exp, restored.state)
    ev = to_host(exp.evaluate(state.params, state.model_state, exp.test))
    return {"run_dir": str(run_dir), "round": restored.step,
            "test_accuracy": float(ev["accuracy"]), "test_loss": float(ev["loss"]),
            "test_accuracy_ema": restored.meta.get("test_accuracy_ema")}
