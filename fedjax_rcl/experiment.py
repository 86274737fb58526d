"""Build: from a validated config to an ``Experiment``, every piece of a run assembled and
nothing compiled yet (data on device, partition, model, client algorithm, client and server
optimizers, the fused-rounds program, evaluation).

The composition root reads build -> loop -> record: ``experiment.build`` (here), then
``training.train`` / ``training.resume`` (the compiled round loop, metrics and checkpoints),
with the run directory's files and lock in ``rundir``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_rcl import registry
from fedjax_rcl.algorithms import ClientAlgorithm, make_algorithm, model_kwargs
from fedjax_rcl.config import (
    ConfigError,
    CoreConfig,
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
    init_key,
    init_server_state,
    make_round,
    make_run_rounds,
)
from fedjax_rcl.engine.sharding import (
    client_mesh,
    put_client_table,
    put_replicated,
)
from fedjax_rcl.models import ModelFns, get_model, model_fns
from fedjax_rcl.server import server_optimizer


@dataclasses.dataclass(kw_only=True)
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
    # What clients start local training from: ``(params, opt_state) -> params`` (the server
    # optimizer's; FedACG's look-ahead), for side computations such as the analysis.
    server_start: Callable | None = None


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
    except the models registered ``one_client_at_a_time_on_cpu`` (the ResNets, pfl's CNN), which
    train one client after another on a CPU (1), and ``one_client_at_a_time_on_gpu`` (the
    ResNets), likewise on a GPU.

    Why: on a CPU, batching clients buys no throughput (the cores are busy with one client's
    convolutions) and costs cache and memory; for ResNet-18 a FedRCL round of 5 clients takes
    0.77x the time one after another with the patch convolutions, 0.74x with oneDNN's
    (benchmarks/HISTORY.md); the pfl workload's round (50 clients of pfl's CNN, 1.6M weights)
    0.68x. MOON's CNN (small weights) is as fast either way, within noise, so it stays vmapped.
    On an H200, vmapped clients' convolutions become grouped convolutions: a ResNet-18 FedAvg
    round of 5 clients (50 local steps each) took 1.40 s vmapped, 0.73 s one after another in
    the same compiled program (BENCHMARKS.md). TPUs keep the vmapped layout (not measured).
    """
    if cfg.clients_in_parallel:
        return cfg.clients_in_parallel
    platform = platform or jax.default_backend()
    entry = registry.model(cfg.model)
    one_at_a_time = {"cpu": entry.one_client_at_a_time_on_cpu,
                     "gpu": entry.one_client_at_a_time_on_gpu}.get(platform, False)
    return 1 if one_at_a_time else None


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
    model = model_fns(module, partitionable_init=cfg.init_threefry_partitionable)
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
    if algorithm.optimizer is not None:  # the algorithm prescribes its own (MFCL: Adam)
        opt = algorithm.optimizer(cfg.lr, clip_norm=cfg.clip_norm,
                                  weight_decay=cfg.weight_decay)
    else:
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
        return Experiment(cfg=cfg, dataset=dataset, parts=parts, model=model,
                          algorithm=algorithm, data=data, test=test, state=state,
                          settings=settings, local_update=local_update, run_round=run_round,
                          run_rounds=None, evaluate=evaluate, mesh=mesh, host_table=host_table,
                          round_step=jax.jit(run_round, donate_argnums=0),
                          server_start=sopt.start)
    run_rounds = jax.jit(make_run_rounds(run_round, cfg.eval_every), donate_argnums=0)
    state = jax.device_get(
        init_server_state(params, model_state, algorithm, sopt, cfg.num_clients, root, reports))
    state = put_replicated(state.replace(client_states=()), mesh).replace(
        client_states=put_client_table(state.client_states, mesh))
    return Experiment(cfg=cfg, dataset=dataset, parts=parts, model=model, algorithm=algorithm,
                      data=data, test=test, state=state, settings=settings,
                      local_update=local_update, run_round=run_round, run_rounds=run_rounds,
                      evaluate=evaluate, mesh=mesh, server_start=sopt.start)


# The run functions live in ``fedjax_rcl.training``; these names stay importable from here.
_TRAINING_NAMES = ("TrainingError", "train", "resume", "load_run", "evaluate_run")


def __getattr__(name: str):
    if name in _TRAINING_NAMES:
        from fedjax_rcl import training

        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
