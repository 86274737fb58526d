"""Build: from a validated config to an ``Experiment``, every piece of a run assembled and
nothing compiled yet (data on device, partition, model, client algorithm, client and server
optimizers, the round, the client-table strategy, evaluation).

The composition root reads build -> loop -> record: ``experiment.build`` (here), then a
command's program (``training`` for ``train``, ``mfcl.run`` for ``mfcl``) runs the stages of
``loop.run_stage``, with the run directory's files and lock in ``rundir``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_rcl import registry
from fedjax_rcl.algorithms import ClientAlgorithm, make_algorithm, model_kwargs
from fedjax_rcl.config import CoreConfig
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
)
from fedjax_rcl.engine.sharding import client_mesh, put_replicated
from fedjax_rcl.engine.tables import Advance, ClientTable, client_table
from fedjax_rcl.models import ModelFns, get_model, model_fns
from fedjax_rcl.models.base import with_precision
from fedjax_rcl.server import server_optimizer
from fedjax_rcl.validation import ConfigError


@dataclasses.dataclass(kw_only=True)
class Experiment:
    """Everything a run needs, built from its config.

    Attributes:
      cfg, dataset, parts: the config, the data in host memory, each client's train indices.
      model, algorithm, settings: what trains, on what objective, how (static settings).
      data, test: the training set with the client index table, and the test batches, on
        the device.
      state: the state before round 0, placed by ``table``.
      local_update: pure, one client (``engine.client.make_local_update``).
      round_rows: pure ``(state, data, rows) -> (state, metrics, new_rows)``, one round over
        the sampled clients' state rows (``engine.round.make_round``).
      table: where the per-client state table lives (``engine.tables``).
      evaluate: jitted ``(params, model_state, test) -> {"accuracy", "loss"}``.
      server_start: ``(params, opt_state) -> params``, what clients start local training from
        (the server optimizer's; FedACG's look-ahead), for side computations such as the
        analysis.
      mesh: the clients mesh, None on one device.
    """

    cfg: CoreConfig
    dataset: ImageDataset
    parts: list[np.ndarray]
    model: ModelFns
    algorithm: ClientAlgorithm
    data: ClientData
    test: TestData
    state: ServerState
    settings: LocalTraining
    local_update: Callable
    round_rows: Callable
    table: ClientTable
    evaluate: Callable
    server_start: Callable
    mesh: Mesh | None = None

    @functools.cached_property
    def run_round(self) -> Callable:
        """Pure ``(state, data) -> (state, metrics)``: one round over a state that holds its
        client table (``client_states=device``)."""
        return self.table.run_round(self.round_rows)

    def compile_rounds(self, capacity: int | None = None) -> Advance:
        """Compiles the rounds between evaluations: ``advance(state, n) -> (state,
        metrics)`` for up to ``capacity`` (default ``cfg.eval_every``) rounds per call, the
        metrics as NumPy arrays ``[n, ...]``."""
        return self.table.compile(self.round_rows, self.state, self.data,
                                  capacity or self.cfg.eval_every)


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
    convolutions) and costs cache and memory, so a ResNet round and the pfl workload's round
    are faster one client after another; MOON's CNN (small weights) is as fast either way, so
    it stays vmapped. On a GPU, vmapped clients' convolutions become grouped convolutions, and
    a ResNet-18 round was faster one client after another in the same compiled program. The
    measurements are in BENCHMARKS.md ("Clients side by side"). TPUs keep the vmapped layout
    (not measured).
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
    # Local training (and the algorithm's own forward passes) in the configured precision;
    # evaluation and analysis in float32.
    train_model = with_precision(model, cfg.precision)
    algorithm = make_algorithm(cfg, train_model)
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
        num_views=registry.algorithm(cfg.algorithm).num_views,
        client_eval=cfg.client_eval,
        precision=cfg.precision,
    )
    if algorithm.optimizer is not None:  # the algorithm prescribes its own (MFCL: Adam)
        opt = algorithm.optimizer(cfg.lr, clip_norm=cfg.clip_norm,
                                  weight_decay=cfg.weight_decay)
    else:
        opt = client_optimizer(cfg.lr, clip_norm=cfg.clip_norm, weight_decay=cfg.weight_decay,
                               momentum=cfg.momentum)
    sopt = server_optimizer(cfg)
    local_update = make_local_update(train_model, algorithm, opt, settings,
                                     penalty=sopt.client_penalty, penalty_name=sopt.penalty_name)
    reports = report_like(train_model, algorithm, params, model_state, dataset.image_shape,
                          cfg.batch_size, settings.num_views)
    round_rows = make_round(local_update, sopt, num_clients=cfg.num_clients,
                            server_message=algorithm.server_message,
                            participation=cfg.participation, aggregation=cfg.aggregation,
                            mesh=mesh, clients_in_parallel=clients_in_parallel(cfg))
    table = client_table(cfg.client_states, cfg.num_clients,
                         clients_per_round(cfg.num_clients, cfg.participation), mesh)
    state = init_server_state(params, model_state, algorithm, sopt, root, reports)
    state = table.place(jax.device_get(state), algorithm.init_client_state(params, model_state))
    return Experiment(cfg=cfg, dataset=dataset, parts=parts, model=model, algorithm=algorithm,
                      data=data, test=test, state=state, settings=settings,
                      local_update=local_update, round_rows=round_rows, table=table,
                      evaluate=jax.jit(make_evaluate(model, mean=dataset.mean,
                                                     std=dataset.std)),
                      server_start=sopt.start, mesh=mesh)
