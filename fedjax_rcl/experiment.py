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
import os
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_rcl import registry
from fedjax_rcl.algorithms import ClientAlgorithm, make_algorithm, model_kwargs
from fedjax_rcl.config import CoreConfig
from fedjax_rcl.data import ImageDataset, load_dataset, load_reference_split, partition
from fedjax_rcl.data.augment import TRANSFORMS
from fedjax_rcl.data.device import ClientData, TestData, pack_clients, pack_test
from fedjax_rcl.engine import layout
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
    cohort_layout,
    init_key,
    init_server_state,
    make_round,
)
from fedjax_rcl.engine.sharding import client_mesh, put_replicated
from fedjax_rcl.engine.tables import (
    Advance,
    ClientTable,
    choose_table,
    client_table,
    describe_table,
    disk_free,
    table_memory_problem,
    table_rows,
)
from fedjax_rcl.models import ModelFns, get_model, input_size_problem, model_fns
from fedjax_rcl.models.base import with_precision
from fedjax_rcl.nn import onednn, resolve_conv_impl
from fedjax_rcl.rundir import RunDir
from fedjax_rcl.server import ServerOptimizer, server_optimizer
from fedjax_rcl.validation import ConfigError


class TrainingProgram(NamedTuple):
    """What a run's training settings make of its model and data: the client algorithm, the
    local-training settings, the server optimizer, one client's update and one round."""

    algorithm: ClientAlgorithm
    settings: LocalTraining
    server_optimizer: ServerOptimizer
    local_update: Callable
    round_rows: Callable


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
      program_for: ``cfg -> TrainingProgram``, the training program of this run's data,
        model and layout under another config's training settings (``round_rows`` is
        ``program_for(cfg).round_rows``); a grid sweeping a setting calls it with that
        setting a traced value.
      layout: how local training runs, in words (``describe_layout``): the clients' layout
        the config or the cost model chose and the convolutions it trains with.
      in_parallel: that layout as a number: at most this many clients side by side, 0 for
        every sampled client (``clients_in_parallel``'s answer); recorded with each process
        (``environment.jsonl``'s ``layout``) so that a resumed run keeps it.
      compiler_options: the XLA options the run's programs compile with (``compile_options``).
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
    program_for: Callable[[CoreConfig], TrainingProgram] | None = None
    layout: str = ""
    in_parallel: int = 0
    compiler_options: dict[str, str] = dataclasses.field(default_factory=dict)

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
                                  capacity or self.cfg.eval_every, self.compiler_options)

    def analysis(self, num_images: int) -> Callable:
        """``analyze(state) -> dict``: the representation analysis of this run on
        ``num_images`` test images (``engine.analysis.make_analysis``)."""
        from fedjax_rcl.engine.analysis import make_analysis

        return make_analysis(
            self.model, self.dataset, self.data, self.local_update, self.server_start,
            self.table.row, num_clients=self.cfg.num_clients,
            clients_per_round=clients_per_round(self.cfg.num_clients, self.cfg.participation),
            rounds=self.cfg.rounds, num_images=num_images,
            sampling=self.cfg.sampling_version)


def compile_options(model: str, platform: str | None = None,
                    xla_flags: str | None = None) -> dict[str, str]:
    """The XLA options a run of ``model`` compiles its programs with: on a CPU the model's
    ``cpu_xla_options`` (``registry.ModelEntry``), less any the user sets in ``XLA_FLAGS``
    (``xla_flags``, default the environment's); elsewhere none."""
    if (platform or jax.default_backend()) != "cpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in registry.model(model).cpu_xla_options if f"--{k}" not in flags}


def make_partition(cfg: CoreConfig, labels: np.ndarray) -> list[np.ndarray]:
    """The configured partition, with its errors reported against config fields."""
    if cfg.partition == "file":
        try:
            parts = load_reference_split(cfg.split_file, num_samples=len(labels))
        except (OSError, ValueError) as e:
            raise ConfigError([f"split_file={cfg.split_file!r}: {e}"]) from None
        if len(parts) != cfg.num_clients:
            raise ConfigError([f"split_file={cfg.split_file!r} holds {len(parts)} clients, but "
                               f"num_clients={cfg.num_clients}: set num_clients={len(parts)}"])
        return parts
    try:
        return partition(labels, cfg.num_clients, method=cfg.partition, seed=cfg.seed,
                         alpha=cfg.alpha, shards_per_client=cfg.shards_per_client,
                         balanced=cfg.balanced, version=cfg.partition_version)
    except ValueError as e:
        raise ConfigError([f"partition={cfg.partition!r} with num_clients={cfg.num_clients} on "
                           f"{len(labels)} training samples: {e}"]) from None


def clients_in_parallel(cfg: CoreConfig, step_gflop: float,
                        platform: str | None = None) -> int | None:
    """``cfg.clients_in_parallel``, with 0 resolved by the layout cost model
    (``fedjax_rcl.engine.layout``): all sampled clients side by side (None) when one client's
    training step costs less than the platform's threshold, else one client after another (1).

    ``step_gflop``: one client's training step in GFLOP (``training_step_gflop``). Why a cost
    model: on a CPU a large client step (a ResNet, pfl's CNN) already keeps the cores busy and
    side by side only costs cache and memory, while MOON's small CNN gains from it; on a GPU,
    vmapped clients' convolutions become grouped convolutions, which makes one client after
    another the faster layout for a ResNet-18 (BENCHMARKS.md, "Which client layout").
    """
    if cfg.clients_in_parallel:
        return cfg.clients_in_parallel
    return None if layout.side_by_side(step_gflop, platform or jax.default_backend()) else 1


def training_conv_impl(conv_impl: str, clients_per_round: int, devices: int,
                       in_parallel: int | None, platform: str | None = None) -> str:
    """The convolutions local training runs: ``conv_impl`` resolved for the round's layout
    (``nn.resolve_conv_impl``), whose weights carry a client axis when more than one client
    trains side by side on a device (``in_parallel``: ``clients_in_parallel``'s answer)."""
    _, per_group = cohort_layout(clients_per_round, devices, in_parallel)
    return resolve_conv_impl(conv_impl, platform, batched_weights=per_group // devices > 1)


def describe_layout(clients_per_round: int, devices: int, in_parallel: int | None,
                    conv_impl: str) -> str:
    """``"clients side by side, conv_impl=patches"`` and the like: what ``cohort_layout`` makes
    of ``in_parallel`` for a round, and the convolutions local training runs."""
    groups, per_group = cohort_layout(clients_per_round, devices, in_parallel)
    if clients_per_round == 1:
        where = "one client a round"
    elif groups == 1:
        where = "clients side by side"
    elif per_group == devices:
        where = "clients one after another" + (" on each device" if devices > 1 else "")
    else:
        where = f"clients side by side in groups of {per_group}"
    return f"{where}, conv_impl={conv_impl}"


def training_step_gflop(model: ModelFns, params, model_state, image_shape, batch_size: int,
                        num_views: int = 1) -> float:
    """GFLOP of one client's training step: 3x the forward pass over ``batch_size`` samples of
    each of the algorithm's ``num_views`` views (an algorithm's extra forward passes, such as
    MOON's two frozen models, are not counted)."""
    fwd = layout.forward_flops(model.apply, params, model_state, image_shape, batch_size)
    return layout.TRAIN_STEP_FACTOR * num_views * fwd / 1e9


def build(cfg: CoreConfig, dataset: ImageDataset | None = None, *,
          module: nn.Module | None = None, pad_clients_to: int | None = None,
          kept_layout: int | None = None) -> Experiment:
    """Assembles a run (nothing is compiled yet).

    Args:
      cfg: a validated config.
      dataset: an already loaded dataset (tests reuse one); default ``load_dataset(cfg.dataset)``.
      module: a Flax model to use instead of ``cfg.model`` (its ``__call__(x, *, train)`` must
        return a ``ModelOutput``); its ``fedjax_rcl.nn.conv`` layers run ``cfg.conv_impl``'s
        convolutions, as a built model's do.
      pad_clients_to: shape the program for clients of up to this many samples (at least the
        largest client's): several runs with different partitions then share one program.
        The extra steps are masked, as an uneven client's are, so the results do not change.
      kept_layout: with ``cfg.clients_in_parallel=0``, the layout to keep instead of asking
        the cost model (``Experiment.in_parallel`` of the run's first process, as
        ``provenance.recorded_layout`` reads it): a resumed run keeps the layout it began with
        when the cost model has been refitted since, because two layouts agree to rounding,
        not bitwise.
    """
    if module is None and jax.default_backend() == "cpu":  # before the OpenMP runtime loads
        onednn.set_thread_env(dict(registry.model(cfg.model).cpu_thread_env))
    dataset = dataset or load_dataset(cfg.dataset, data_dir=cfg.data_dir)
    too_small = None if module is not None else input_size_problem(cfg.model, cfg.dataset,
                                                                   dataset.image_shape)
    if too_small:
        raise ConfigError([too_small])
    pipeline = TRANSFORMS[cfg.transforms]
    if pipeline.mean is not None and len(pipeline.mean) != dataset.image_shape[-1]:
        raise ConfigError([f"transforms={cfg.transforms!r}: its constants are for "
                           f"{len(pipeline.mean)}-channel images, {cfg.dataset} has "
                           f"{dataset.image_shape[-1]}"])
    mean = dataset.mean if pipeline.mean is None else pipeline.mean
    std = dataset.std if pipeline.std is None else pipeline.std
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
    padded = max(largest, pad_clients_to or 0)
    data = put_replicated(pack_clients(dataset.train_images, dataset.train_labels, parts, padded),
                          mesh)
    test = put_replicated(pack_test(dataset.test_images, dataset.test_labels,
                                    cfg.eval_batch_size), mesh)

    if module is None:
        module = get_model(cfg.model, num_classes=dataset.num_classes, norm=cfg.norm,
                           width=cfg.width, **model_kwargs(cfg))

    def configured(conv_impl: str) -> ModelFns:
        # A run's convolutions are chosen here: the model's functions trace the module under
        # them (models.model_fns); the module itself names none.
        return model_fns(module, conv_impl=conv_impl,
                         partitionable_init=cfg.init_threefry_partitionable)

    model = configured(cfg.conv_impl)
    # Local training (and the algorithm's own forward passes) in the configured precision;
    # evaluation and analysis in float32.
    train_model = with_precision(model, cfg.precision)
    root = jax.random.PRNGKey(cfg.seed)
    params, model_state = model.init(init_key(root), np.zeros((1, *dataset.image_shape)))
    sizes = np.asarray([len(p) for p in parts])
    num_views = registry.algorithm(cfg.algorithm).num_views
    if not cfg.clients_in_parallel and kept_layout is not None:
        in_parallel = kept_layout or None
    else:
        step_gflop = (training_step_gflop(model, params, model_state, dataset.image_shape,
                                          cfg.batch_size, num_views)
                      if not cfg.clients_in_parallel else math.nan)
        in_parallel = clients_in_parallel(cfg, step_gflop)
    devices = 1 if mesh is None else mesh.size
    per_round = clients_per_round(cfg.num_clients, cfg.participation)
    conv_impl = training_conv_impl(cfg.conv_impl, per_round, devices, in_parallel)
    if conv_impl != resolve_conv_impl(cfg.conv_impl):
        # Local training with per-client weights side by side: its own convolutions (the
        # same weights and results; evaluation keeps the configured ones).
        train_model = with_precision(configured(conv_impl), cfg.precision)

    def program_for(cfg: CoreConfig) -> TrainingProgram:
        # Everything the config's training settings decide; a grid calls it again with one
        # setting a traced value (fedjax_rcl.grid), so nothing here may branch on a value.
        algorithm = make_algorithm(cfg, train_model)
        settings = LocalTraining(
            batch_size=cfg.batch_size,
            local_epochs=cfg.local_epochs,
            steps_per_epoch=(padded // cfg.batch_size if cfg.drop_last
                             else math.ceil(padded / cfg.batch_size)),
            uniform_sizes=bool(sizes.min() == sizes.max() == padded),
            lr_fn=lambda r, e: cfg.lr * jnp.power(cfg.lr_decay, (r + e).astype(jnp.float32)),
            mean=mean,
            std=std,
            hflip=dataset.hflip,
            max_degrees=pipeline.max_degrees,
            crop_padding=pipeline.crop_padding,
            pad_mode=pipeline.pad_mode,
            augment=cfg.augment,
            num_classes=dataset.num_classes,
            num_views=num_views,
            client_eval=cfg.client_eval,
            precision=cfg.precision,
            num_clients=cfg.num_clients,
            sampled_fraction=per_round / cfg.num_clients,
            drop_last=cfg.drop_last,
        )
        if algorithm.optimizer is not None:  # the algorithm prescribes its own (MFCL: Adam)
            opt = algorithm.optimizer(cfg.lr, clip_norm=cfg.clip_norm,
                                      weight_decay=cfg.weight_decay)
        else:
            opt = client_optimizer(cfg.lr, clip_norm=cfg.clip_norm,
                                   weight_decay=cfg.weight_decay, momentum=cfg.momentum)
        sopt = server_optimizer(cfg)
        local_update = make_local_update(train_model, algorithm, opt, settings,
                                         penalty=sopt.client_penalty,
                                         penalty_name=sopt.penalty_name)
        round_rows = make_round(local_update, sopt, num_clients=cfg.num_clients,
                                server_message=algorithm.server_message,
                                update_server_state=algorithm.update_server_state,
                                participation=cfg.participation,
                                aggregation=cfg.aggregation, mesh=mesh,
                                clients_in_parallel=in_parallel,
                                sampling=cfg.sampling_version)
        return TrainingProgram(algorithm, settings, sopt, local_update, round_rows)

    program = program_for(cfg)
    algorithm, settings, sopt = program.algorithm, program.settings, program.server_optimizer
    reports = report_like(train_model, algorithm, params, model_state, dataset.image_shape,
                          cfg.batch_size, settings.num_views)
    row = jax.eval_shape(algorithm.init_client_state, params, model_state)
    # A disk table's files live in the run directory (none without one: never chosen then).
    table_dir = RunDir(cfg.run_dir).client_table if cfg.run_dir else None
    disk = (disk_free(table_dir) if table_dir is not None
            and cfg.client_states in ("auto", "disk") else None)
    if cfg.client_states == "auto":  # resolved in the config, which the run records
        cfg.client_states = choose_table(row, cfg.num_clients, per_round, cfg.rounds,
                                         disk=disk)
    if cfg.client_states == "disk" and table_dir is None:
        raise ConfigError(["client_states='disk': needs a run_dir (the table's files live "
                           "there)"])
    rows = table_rows(cfg.client_states, cfg.num_clients, per_round, cfg.rounds)
    too_big = table_memory_problem(cfg.client_states, cfg.algorithm, row, rows, disk=disk)
    if too_big:
        raise ConfigError([too_big])
    table = client_table(cfg.client_states, cfg.num_clients,
                         clients_per_round(cfg.num_clients, cfg.participation), mesh,
                         cfg.sampling_version, directory=table_dir,
                         keep=cfg.keep_checkpoints + 1)
    state = init_server_state(params, model_state, algorithm, sopt, root, reports)
    state = table.place(jax.device_get(state), algorithm.init_client_state(params, model_state))
    return Experiment(cfg=cfg, dataset=dataset, parts=parts, model=model, algorithm=algorithm,
                      data=data, test=test, state=state, settings=settings,
                      local_update=program.local_update, round_rows=program.round_rows,
                      table=table, program_for=program_for,
                      evaluate=jax.jit(make_evaluate(model, mean=mean, std=std)),
                      server_start=sopt.start, mesh=mesh,
                      layout=describe_layout(per_round, devices, in_parallel, conv_impl)
                      + describe_table(cfg.client_states, row, rows),
                      in_parallel=in_parallel or 0,
                      compiler_options=compile_options(cfg.model))
