"""Validation of a whole run config: every field's range and the ties between fields, all
problems at once, one line each naming the field, the value and what is allowed, before
anything is compiled; and the valid settings that probably do not do what was meant
(``degenerate_settings``).
"""

from __future__ import annotations

import dataclasses
import os

from fedjax_rcl import builtins, registry
from fedjax_rcl.config.schema import CoreConfig, SweepConfig, field_type
from fedjax_rcl.config.sweeps import SHAPE_SETTINGS, SWEEPABLE, is_grid, with_setting
from fedjax_rcl.validation import CheckContext, ConfigError, finite, one_of, require

# ``transforms=`` (the pipelines themselves: ``fedjax_rcl.data.augment.TRANSFORMS``).
TRANSFORMS = ("fedrcl", "moon")


def _validate_sections(cfg: CoreConfig, p: list[str]) -> None:
    """Each section's own ``check``, every section (a YAML may set several), each problem
    prefixed with the section's key."""
    model = registry.MODELS.get(cfg.model)
    ctx = CheckContext(cfg.model, model.num_levels if model else None,
                                model.num_blocks if model else None, cfg.algorithm, cfg.norm)
    sections = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                if f.name not in ("server", "distributed")
                and dataclasses.is_dataclass(getattr(cfg, f.name))]
    sections += [(f"server.{f.name}", getattr(cfg.server, f.name))
                 for f in dataclasses.fields(cfg.server)
                 if dataclasses.is_dataclass(getattr(cfg.server, f.name))]
    for key, section in sections:
        check = getattr(section, "check", None)
        if check is not None:
            p.extend(f"{key}.{problem}" for problem in check(ctx))


def algorithm_reads(algorithm: str) -> str:
    """What an algorithm reads besides the shared settings, said for a refused key: its
    section's keys, or that it has none."""
    entry = registry.ALGORITHMS.get(algorithm)
    if entry is None or entry.section is None or entry.config is None:
        return "it reads no section of its own, only the shared settings"
    keys = ", ".join(f"{entry.section}.{f.name}" for f in dataclasses.fields(entry.config))
    return f"it reads: {keys}"


def optimizer_reads(optimizer: str) -> str:
    """What a server optimizer reads besides ``server.lr``, said for a refused key."""
    entry = registry.SERVER_OPTIMIZERS.get(optimizer)
    if entry is None or entry.config is None:
        return "it reads no section of its own, only server.lr"
    keys = ", ".join(f"server.{optimizer}.{f.name}" for f in dataclasses.fields(entry.config))
    return f"it reads: {keys}"


def unread_settings(algorithm: str, keys, optimizer: str | None = None) -> list[str]:
    """One line per dotted key that the run does not read: a key in another algorithm's
    section than ``algorithm``'s, or in another server optimizer's section
    (``server.<name>.*``) than ``optimizer``'s. A setting given for it, or a sweep of it,
    would change nothing (``algorithm=fedavg 'fedrcl.beta=[0.5,2]'`` trained identical runs;
    ``server.fedadam.tau=0.1`` with ``server.optimizer=fedavg`` likewise). ``optimizer``
    None (or not registered) checks the algorithm sections only."""
    entry = registry.ALGORITHMS.get(algorithm)
    own = entry.section if entry is not None else None
    readers: dict[str, list[str]] = {}
    for e in registry.ALGORITHMS.values():
        if e.section:
            readers.setdefault(e.section, []).append(e.name)
    known_optimizer = optimizer in registry.SERVER_OPTIMIZERS
    problems = []
    for key in dict.fromkeys(keys):
        parts = key.split(".")
        section = parts[0]
        if section in readers and section != own and entry is not None:
            who = ", ".join(f"algorithm={name}" for name in readers[section])
            problems.append(f"{key}: algorithm {algorithm} does not read it "
                            f"({algorithm_reads(algorithm)}; {section}.* is read by {who})")
        elif (section == "server" and len(parts) >= 2 and known_optimizer
              and parts[1] != optimizer and parts[1] in registry.SERVER_OPTIMIZERS):
            problems.append(f"{key}: server optimizer {optimizer} does not read it "
                            f"({optimizer_reads(optimizer)}; server.{parts[1]}.* is read by "
                            f"server.optimizer={parts[1]})")
    return problems


def degenerate_settings(cfg: CoreConfig) -> list[str]:
    """Valid settings that probably do not do what was meant, one line each (a warning at the
    start of a run, not an error): a participation that rounds to fewer clients than it says,
    and an evaluation interval the run never reaches before its end."""
    from fedjax_rcl.engine.round import clients_per_round

    out = []
    expected = cfg.participation * cfg.num_clients
    m = clients_per_round(cfg.num_clients, cfg.participation)
    if expected < 1:
        out.append(f"participation={cfg.participation:g} x num_clients={cfg.num_clients} = "
                   f"{expected:g} clients: each round samples {m} client (the minimum)")
    elif abs(expected - round(expected)) > 1e-9:
        out.append(f"participation={cfg.participation:g} x num_clients={cfg.num_clients} = "
                   f"{expected:g} clients: each round samples {m} (rounded down)")
    if cfg.eval_every > cfg.rounds:
        out.append(f"eval_every={cfg.eval_every} > rounds={cfg.rounds}: the run is evaluated "
                   f"only at its end (round {cfg.rounds})")
    return out


def _validate_sweep(cfg: CoreConfig, p: list[str]) -> None:
    """A sweep names one float setting that leaves the program's shapes alone, and each of its
    values makes a valid run (its problems prefixed with ``key=value``)."""
    key, values = cfg.sweep.key, list(cfg.sweep.values)
    if key is None:
        require(p, not values, "sweep.values", values, "needs sweep.key (the setting swept)")
        return
    kind = field_type(key)
    if kind not in SWEEPABLE:
        p.append(f"sweep.key={key!r}: must name a float setting, such as fedrcl.beta, alpha or "
                 "lr" + ("" if kind is None else f" ({key} is {kind})"))
        return
    unread = unread_settings(cfg.algorithm, [key], cfg.server.optimizer)
    if unread:
        p.append(f"sweep.key={key!r}: a sweep of a setting the run does not read trains "
                 f"identical runs; {unread[0]}")
        return
    if key in SHAPE_SETTINGS:
        p.append(f"sweep.key={key!r}: {key} {SHAPE_SETTINGS[key]}, the program's shapes; its "
                 "values cannot share one program (run them separately)")
        return
    require(p, bool(values) and all(finite(v) for v in values), "sweep.values", values,
            f"must be a non-empty list of finite numbers (the values of {key})")
    require(p, len(set(values)) == len(values), "sweep.values", values,
            "must not repeat a value")
    base = dataclasses.replace(cfg, seeds=[], sweep=SweepConfig())
    for v in values if all(finite(v) for v in values) else ():
        try:
            validate(with_setting(base, key, float(v)), check_data=False)
        except ConfigError as e:
            p.extend(f"{key}={float(v):.12g}: {x}" for x in e.problems if x not in p)


def validate(cfg: CoreConfig, *, check_data: bool = True) -> None:
    """Checks every field; raises ``ConfigError`` listing all problems (one line each).

    Args:
      cfg: the configuration.
      check_data: also check that the dataset exists / can be obtained (cheap, no decoding).
    """
    # Imported here: these lists live with their modules, and importing them pulls in JAX.
    from fedjax_rcl.data.partitioning import PARTITIONS, VERSIONS
    from fedjax_rcl.engine.round import SAMPLING_VERSIONS
    from fedjax_rcl.engine.tables import CLIENT_TABLES
    from fedjax_rcl.server import AGGREGATIONS

    builtins.load()
    norms = registry.choices("norm").values
    models, algorithms = registry.MODELS, registry.ALGORITHMS
    p: list[str] = []
    require(p, cfg.seed >= 0, "seed", cfg.seed, "must be an integer >= 0")
    one_of(p, "model", cfg.model, models)
    model = models.get(cfg.model)
    if cfg.width is not None:
        if model is not None and not model.width:
            width_models = [m.name for m in models.values() if m.width]
            p.append(f"width={cfg.width!r}: model={cfg.model} has a fixed width; width applies "
                     f"to {', '.join(width_models)} (or leave it null)")
        else:
            require(p, cfg.width >= 2 and cfg.width % 2 == 0, "width", cfg.width,
                   "must be an even number >= 2 (GroupNorm's 2 groups split the channels)")
    one_of(p, "algorithm", cfg.algorithm, algorithms)
    require(p, cfg.num_clients >= 1, "num_clients", cfg.num_clients, "must be >= 1")
    require(p, finite(cfg.participation) and 0 < cfg.participation <= 1, "participation",
           cfg.participation, "must be in (0, 1]")
    one_of(p, "partition", cfg.partition, PARTITIONS)
    one_of(p, "partition_version", cfg.partition_version, VERSIONS)
    one_of(p, "sampling_version", cfg.sampling_version, SAMPLING_VERSIONS)
    if cfg.partition == "file" and cfg.split_file is None:
        p.append("split_file=None: partition=file needs the path of a client split file")
    elif cfg.partition != "file" and cfg.split_file is not None:
        p.append(f"split_file={cfg.split_file!r}: applies only to partition=file "
                 f"(partition={cfg.partition!r} draws its split from the seed); leave it null")
    if cfg.partition == "dirichlet":
        require(p, finite(cfg.alpha) and cfg.alpha > 0, "alpha", cfg.alpha,
               "must be a finite number > 0 (Dirichlet concentration)")
    if cfg.partition == "shards":
        require(p, cfg.shards_per_client >= 1, "shards_per_client", cfg.shards_per_client,
               "must be >= 1")
    require(p, cfg.rounds >= 1, "rounds", cfg.rounds, "must be >= 1")
    require(p, cfg.local_epochs >= 1, "local_epochs", cfg.local_epochs, "must be >= 1")
    require(p, cfg.batch_size >= 1, "batch_size", cfg.batch_size, "must be >= 1")
    require(p, finite(cfg.lr) and cfg.lr > 0, "lr", cfg.lr, "must be a finite number > 0")
    require(p, finite(cfg.lr_decay) and 0 < cfg.lr_decay <= 1, "lr_decay", cfg.lr_decay,
           "must be in (0, 1]")
    require(p, finite(cfg.momentum) and 0 <= cfg.momentum < 1, "momentum", cfg.momentum,
           "must be in [0, 1)")
    require(p, finite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay",
           cfg.weight_decay, "must be >= 0")
    require(p, finite(cfg.clip_norm) and cfg.clip_norm >= 0, "clip_norm", cfg.clip_norm,
           "must be >= 0 (0 disables clipping)")
    one_of(p, "aggregation", cfg.aggregation, AGGREGATIONS)
    one_of(p, "transforms", cfg.transforms, TRANSFORMS)
    require(p, cfg.eval_every >= 1, "eval_every", cfg.eval_every, "must be >= 1")
    require(p, isinstance(cfg.analysis_every, int) and cfg.analysis_every >= 0
           and (cfg.analysis_every == 0 or cfg.eval_every < 1
                or cfg.analysis_every % cfg.eval_every == 0),
           "analysis_every", cfg.analysis_every,
           f"must be 0 (off) or a multiple of eval_every={cfg.eval_every}")
    require(p, isinstance(cfg.analysis_images, int) and cfg.analysis_images >= 2,
           "analysis_images", cfg.analysis_images, "must be >= 2")
    require(p, cfg.eval_batch_size >= 1, "eval_batch_size", cfg.eval_batch_size, "must be >= 1")
    require(p, cfg.checkpoint_every >= 0, "checkpoint_every", cfg.checkpoint_every,
           "must be >= 0 (0: only at round 0 and at the end)")
    require(p, cfg.keep_checkpoints >= 1, "keep_checkpoints", cfg.keep_checkpoints, "must be >= 1")
    require(p, finite(cfg.ema_decay) and 0 <= cfg.ema_decay < 1, "ema_decay", cfg.ema_decay,
           "must be in [0, 1)")
    require(p, cfg.devices >= 0, "devices", cfg.devices, "must be >= 0 (0: every device)")
    require(p, cfg.clients_in_parallel >= 0, "clients_in_parallel", cfg.clients_in_parallel,
           "must be >= 0 (0: chosen by the layout cost model)")
    one_of(p, "client_states", cfg.client_states, CLIENT_TABLES)
    seeds = list(cfg.seeds)
    require(p, all(isinstance(x, int) and x >= 0 for x in seeds), "seeds", seeds,
           "must be a list of integers >= 0")
    require(p, len(set(seeds)) == len(seeds), "seeds", seeds, "must not repeat a seed")
    require(p, cfg.runs_in_parallel >= 0, "runs_in_parallel", cfg.runs_in_parallel,
           "must be >= 0 (0: chosen by the layout cost model, 1: one after another)")
    if is_grid(cfg):
        require(p, cfg.client_states == "device", "client_states", cfg.client_states,
               "must be 'device' with seeds or a sweep (the runs' tables live in one program)")
        require(p, cfg.devices == 1, "devices", cfg.devices,
               "must be 1 with seeds or a sweep (several runs share one device)")
        require(p, cfg.distributed.num_processes == 1, "distributed.num_processes",
               cfg.distributed.num_processes, "must be 1 with seeds or a sweep")
    d = cfg.distributed
    require(p, d.num_processes >= 1, "distributed.num_processes", d.num_processes, "must be >= 1")
    require(p, 0 <= d.process_id < max(d.num_processes, 1), "distributed.process_id",
           d.process_id, f"must be in [0, {d.num_processes - 1}]")
    require(p, d.num_processes == 1 or bool(cfg.run_dir), "run_dir", cfg.run_dir,
           "must be set explicitly when num_processes > 1 (all processes share it)")
    require(p, d.num_processes == 1 or bool(d.coordinator_address),
           "distributed.coordinator_address", d.coordinator_address,
           "required (host:port of process 0) when num_processes > 1")
    for key in ("conv_impl", "norm", "precision"):
        choice, value = registry.choices(key), getattr(cfg, key)
        one_of(p, key, value, choice.values)
        problem = choice.check(value) if choice.check and value in choice.values else None
        if problem:
            p.append(problem)
    one_of(p, "server.optimizer", cfg.server.optimizer, registry.SERVER_OPTIMIZERS)
    require(p, cfg.server.lr is None or (finite(cfg.server.lr) and cfg.server.lr > 0),
           "server.lr", cfg.server.lr, "must be a finite number > 0 (null: the optimizer's "
           "default)")
    require(p, cfg.run_dir is None or cfg.run_dir.strip() != "", "run_dir", cfg.run_dir,
           "must be a path or null")
    if model is not None and cfg.norm in norms and cfg.norm not in model.norms:
        p.append(f"norm={cfg.norm!r}: model={cfg.model} takes norm "
                 f"{', '.join(model.norms)}")
    if cfg.algorithm in algorithms and cfg.norm == "twin" and (
        algorithms[cfg.algorithm].num_views != 2
    ):
        two_view = [n for n, r in algorithms.items() if r.num_views == 2]
        p.append(f"norm='twin': needs batches of view pairs; algorithm={cfg.algorithm!r} uses "
                 f"one view per sample (two-view algorithms: {', '.join(two_view)})")
    _validate_sections(cfg, p)
    _validate_sweep(cfg, p)
    if check_data:
        from fedjax_rcl.data import DataError, check_dataset_spec

        try:
            check_dataset_spec(cfg.dataset, data_dir=cfg.data_dir)
        except DataError as e:
            prefix = f"dataset={cfg.dataset!r}: "
            p.append(str(e) if str(e).startswith(prefix) else prefix + str(e))
        if cfg.partition == "file" and cfg.split_file and not os.path.isfile(cfg.split_file):
            p.append(f"split_file={cfg.split_file!r}: no such file (partition=file reads the "
                     "clients' training indices from it)")
    if p:
        raise ConfigError(p)
