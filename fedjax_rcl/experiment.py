"""From a validated ``Config`` to a finished run: build, compile once, loop, record.

``build`` assembles the pieces (data on device, partition, model, client algorithm, client and
server optimizers, the fused-rounds program, evaluation); ``train`` runs it: the rounds between
two evaluations are one call of one compiled executable, metrics are appended to
``metrics.jsonl`` as each evaluation finishes, and an accuracy plot is drawn at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.algorithms import ClientAlgorithm, registered
from fedjax_rcl.checkpoint import Checkpointer, Restored
from fedjax_rcl.config import (
    RESUME_SAFE_KEYS,
    Config,
    ConfigError,
    changed_keys,
    config_digest,
    load_config,
    to_yaml,
)
from fedjax_rcl.data import ImageDataset, load_dataset, partition
from fedjax_rcl.data.device import ClientData, TestData, pack_clients, pack_test
from fedjax_rcl.engine.client import LocalTraining, client_optimizer, make_local_update
from fedjax_rcl.engine.evaluate import make_evaluate
from fedjax_rcl.engine.round import (
    ServerState,
    clients_per_round,
    init_key,
    init_server_state,
    make_round,
    make_run_rounds,
)
from fedjax_rcl.metrics import ema
from fedjax_rcl.models import ModelFns, get_model, model_fns
from fedjax_rcl.server import server_optimizer


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names round and client."""


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built from its config."""

    cfg: Config
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


def make_partition(cfg: Config, labels: np.ndarray) -> list[np.ndarray]:
    """The configured partition, with its errors reported against config fields."""
    try:
        return partition(labels, cfg.num_clients, method=cfg.partition, seed=cfg.seed,
                         alpha=cfg.alpha, shards_per_client=cfg.shards_per_client,
                         balanced=cfg.balanced)
    except ValueError as e:
        raise ConfigError([f"partition={cfg.partition!r} with num_clients={cfg.num_clients} on "
                           f"{len(labels)} training samples: {e}"]) from None


def build(cfg: Config, dataset: ImageDataset | None = None, *,
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
    data = pack_clients(dataset.train_images, dataset.train_labels, parts)
    test = pack_test(dataset.test_images, dataset.test_labels, cfg.eval_batch_size)

    entry = registered(cfg.algorithm)
    module = module or get_model(cfg.model, num_classes=dataset.num_classes,
                                 conv_impl=cfg.conv_impl, norm=cfg.norm,
                                 **entry.model_kwargs(cfg))
    model = model_fns(module)
    algorithm = entry.make(cfg, model)
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
    )
    opt = client_optimizer(cfg.lr, clip_norm=cfg.clip_norm, weight_decay=cfg.weight_decay,
                           momentum=cfg.momentum)
    local_update = make_local_update(model, algorithm, opt, settings)
    sopt = server_optimizer(cfg.server.optimizer, lr=cfg.server.lr)
    run_round = make_round(local_update, sopt, num_clients=cfg.num_clients,
                           participation=cfg.participation, aggregation=cfg.aggregation)
    run_rounds = jax.jit(make_run_rounds(run_round, cfg.eval_every), donate_argnums=0)
    evaluate = jax.jit(make_evaluate(model, mean=dataset.mean, std=dataset.std))
    state = init_server_state(params, model_state, algorithm, sopt, cfg.num_clients, root)
    return Experiment(cfg, dataset, parts, model, algorithm, data, test, state, settings,
                      local_update, run_round, run_rounds, evaluate)


def default_run_dir(cfg: Config) -> Path:
    name = cfg.dataset.split(":", 1)[0]
    return Path("runs") / f"{name}-{cfg.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(cfg: Config) -> Path:
    """The run directory; refuses one that already holds a run (checked before any work)."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError([f"run_dir={str(run_dir)!r}: already holds a run (metrics.jsonl); "
                           "choose another run_dir"])
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"run_dir={str(run_dir)!r}: exists and is not a directory"])
    return run_dir


def create_run_dir(run_dir: Path) -> Path:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError([f"run_dir={str(run_dir)!r}: cannot create ({e.strerror})"]) from None
    return run_dir


def _check_finite(metrics: dict, first_round: int, n: int) -> None:
    losses = np.asarray(metrics["client_loss"][:n])
    bad = np.argwhere(~np.isfinite(losses))
    if len(bad):
        i, j = bad[0]
        client = int(np.asarray(metrics["clients"])[i, j])
        raise TrainingError(f"non-finite local loss ({losses[i, j]}) in round {first_round + i + 1}"
                            f" at client {client}; stopping")


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a file so that a reader (or a resumed run) never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics_upto(path: Path, last_round: int) -> list[str]:
    """The lines of ``metrics.jsonl`` for rounds ``<= last_round``; a torn last line (a run
    killed while writing it) is dropped."""
    if not path.exists():
        return []
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("round", last_round + 1) <= last_round:
            keep.append(line)
    return keep


def _checkpoint_meta(cfg: Config, done: int, acc_ema: float | None) -> dict:
    return {"round": done, "test_accuracy_ema": acc_ema, "config_digest": config_digest(cfg)}


def _compile(exp: Experiment, log):
    t0 = time.perf_counter()
    n_dev = jax.device_put(np.int32(exp.cfg.eval_every))
    step = exp.run_rounds.lower(exp.state, exp.data, n_dev).compile()
    evaluate = exp.evaluate.lower(exp.state.params, exp.state.model_state, exp.test).compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s")
    return step, evaluate, compile_s


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
    step, evaluate, compile_s = _compile(exp, log)
    record: dict = {}
    start, first = time.perf_counter(), done
    bar = tqdm(total=cfg.rounds, initial=done, unit="round", disable=not progress,
               dynamic_ncols=True)
    try:
        with open(run_dir / "metrics.jsonl", "a") as out:
            while done < cfg.rounds:
                n = min(cfg.eval_every - done % cfg.eval_every, cfg.rounds - done)
                # Hidden host<->device copies in the hot loop are errors (STYLE #13).
                with jax.transfer_guard("disallow"):
                    state, metrics = step(state, exp.data, jax.device_put(np.int32(n)))
                    metrics = jax.device_get(metrics)
                    _check_finite(metrics, done, n)
                    ev = jax.device_get(evaluate(state.params, state.model_state, exp.test))
                done += n
                acc = float(ev["accuracy"])
                acc_ema = ema(acc_ema, acc, cfg.ema_decay)
                terms = {k: float(np.mean(v[:n])) for k, v in metrics.items()
                         if k not in ("loss", "client_loss", "clients")}
                record = {"round": done, "test_accuracy": acc, "test_accuracy_ema": acc_ema,
                          "test_loss": float(ev["loss"]),
                          "train_loss": float(np.mean(metrics["loss"][:n])), **terms,
                          "elapsed_s": round(time.perf_counter() - start, 3)}
                out.write(json.dumps(record) + "\n")
                out.flush()
                if done == cfg.rounds or (cfg.checkpoint_every
                                          and done % cfg.checkpoint_every == 0):
                    ckpt.save(done, state, _checkpoint_meta(cfg, done, acc_ema))
                bar.update(n)
                bar.set_postfix(loss=f"{record['train_loss']:.3f}", acc=f"{acc:.3f}",
                                ema=f"{acc_ema:.3f}")
    finally:
        bar.close()
        ckpt.close()  # waits for pending saves: a stopped run keeps its last good checkpoint
    elapsed = time.perf_counter() - start
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "accuracy.png",
                 title=f"{cfg.algorithm} · {cfg.model} · {cfg.dataset}")
    if record:
        rate = (done - first) / elapsed
        log(f"done: rounds {first}..{done} in {elapsed:.1f} s ({rate:.2f} rounds/s, "
            f"compile {compile_s:.1f} s); test accuracy {record['test_accuracy']:.4f}, "
            f"EMA {record['test_accuracy_ema']:.4f}; metrics in {run_dir / 'metrics.jsonl'}, "
            f"plot {run_dir / 'accuracy.png'}")
    return {**record, "compile_s": compile_s, "run_dir": str(run_dir)}


def train(cfg: Config, *, dataset: ImageDataset | None = None, progress: bool = True,
          log: Callable[[str], None] = print) -> dict:
    """Runs ``cfg.rounds`` rounds from scratch; returns the last metrics record.

    Writes to the run directory: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per
    evaluation: ``round`` = rounds completed, ``test_accuracy``, ``test_accuracy_ema``,
    ``test_loss``, ``train_loss`` = mean local loss over the rounds since the last evaluation,
    each loss term, ``elapsed_s``), ``checkpoints/`` (Orbax; round 0, every
    ``checkpoint_every`` rounds and the last) and ``accuracy.png``.
    """
    run_dir = resolve_run_dir(cfg)
    exp = build(cfg, dataset)  # data-dependent checks happen here, still before any compile
    create_run_dir(run_dir)
    atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))
    log(_describe(exp, run_dir))
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    ckpt.save(0, exp.state, _checkpoint_meta(cfg, 0, None))  # a run always has a checkpoint
    return _run(exp, run_dir, ckpt, exp.state, 0, None, progress=progress, log=log)


def _load_run_config(run_dir: Path, overrides=()) -> tuple[Config, Config]:
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
    changed = changed_keys(saved, cfg)
    if changed and not force:
        raise ConfigError([f"resume: {', '.join(changed)} would change the run's results "
                           f"(only {', '.join(RESUME_SAFE_KEYS)} may change); pass --force to "
                           "continue anyway"])
    exp = build(cfg, dataset)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    restored = ckpt.restore_latest(exp.state)
    if restored is None:
        if read_metrics_upto(run_dir / "metrics.jsonl", 1 << 62):
            ckpt.close()
            raise ConfigError([f"run_dir={str(run_dir)!r}: has metrics but no complete "
                               "checkpoint to resume from"])
        # Killed before its first checkpoint was complete: nothing was lost but the start.
        log(f"{run_dir}: no complete checkpoint yet; starting the run from round 0")
        ckpt.save(0, exp.state, _checkpoint_meta(cfg, 0, None))
        restored = Restored(exp.state, _checkpoint_meta(cfg, 0, None), 0)
    digest = restored.meta.get("config_digest")
    if digest != config_digest(cfg) and not force:
        ckpt.close()
        raise ConfigError([f"resume: the checkpoint in {run_dir} was written with a different "
                           "config than config.yaml now holds; pass --force to continue anyway"])
    done = restored.step
    ckpt.set_aside([s for s in ckpt.steps() if s > done])  # the damaged ones we skipped
    lines = read_metrics_upto(run_dir / "metrics.jsonl", done)
    atomic_write_text(run_dir / "metrics.jsonl", "".join(f"{x}\n" for x in lines))
    atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))
    log(_describe(exp, run_dir))
    log(f"resuming from the checkpoint of round {done} (of {cfg.rounds})")
    return _run(exp, run_dir, ckpt, restored.state, done, restored.meta.get("test_accuracy_ema"),
                progress=progress, log=log)


def evaluate_run(run_dir: str | Path, *, dataset: ImageDataset | None = None) -> dict:
    """Evaluates a run's newest complete checkpoint on the full test set."""
    run_dir = Path(run_dir)
    _, cfg = _load_run_config(run_dir)
    exp = build(cfg, dataset)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(exp.state)
    finally:
        ckpt.close()
    if restored is None:
        raise ConfigError([f"run_dir={str(run_dir)!r}: no complete checkpoint to evaluate"])
    ev = jax.device_get(exp.evaluate(restored.state.params, restored.state.model_state, exp.test))
    return {"run_dir": str(run_dir), "round": restored.step,
            "test_accuracy": float(ev["accuracy"]), "test_loss": float(ev["loss"]),
            "test_accuracy_ema": restored.meta.get("test_accuracy_ema")}
