"""The typed run configuration: dataclasses, YAML files, dotted overrides, full validation.

A run is described by one ``Config``. It is built from the defaults below, then a YAML file,
then ``key=value`` overrides (``fedjax-rcl train exp.yaml rounds=50 server.lr=0.5``), through
OmegaConf's structured configs (types enforced, unknown keys rejected). ``validate`` then checks
every field and reports all problems at once, each naming the field, the value and what is
allowed, before anything is compiled. The defaults are the quick offline main job; the paper's
settings live in ``experiments/*.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from fedjax_rcl.tracking import TrackingConfig
from fedjax_rcl.validation import (
    CheckContext,
    ConfigError,
    check_levels,
    finite,
    one_of,
    require,
)

__all__ = ["CheckContext", "ConfigError", "CoreConfig", "SweepConfig", "check_levels",
           "degenerate_settings", "finite", "flat_keys", "grid_members", "is_grid",
           "load_config", "member_name", "schema", "to_yaml", "validate", "with_setting"]


@dataclass
class ServerConfig:
    """The server optimizer on the pseudo-gradient; each registered optimizer adds its own
    section here (``server.fedadam.tau``).

    Attributes:
      optimizer: what the server does with the clients' mean model: ``fedavg`` takes it,
        ``fedavgm`` adds momentum, ``fedadam`` Adam's scaling, ``fedacg`` a look-ahead.
      lr: the server learning rate; null: the optimizer's default (1; FedAdam 0.01).
    """

    optimizer: str = "fedavg"
    lr: float | None = None


@dataclass
class DistributedConfig:
    """Several processes (hosts) as one JAX cluster; every process runs the same command with
    its own ``process_id``.

    Attributes:
      coordinator_address: ``host:port`` of process 0 (needed when ``num_processes > 1``).
      num_processes: processes in the cluster.
      process_id: this process's index, 0 to ``num_processes - 1``.
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0


@dataclass
class SweepConfig:
    """One float setting's values, one run each, in one compiled program (``fedjax_rcl.grid``).

    Attributes:
      key: the setting swept, a float key such as ``fedrcl.beta``, ``alpha`` or ``lr``
        (``fedrcl.beta=[0.5,1,2]`` on the command line sets ``key`` and ``values``); null: no
        sweep.
      values: its values, one run each (with ``seeds``: one run per value and seed).
    """

    key: str | None = None
    values: list[float] = field(default_factory=list)


@dataclass
class CoreConfig:
    """One federated run's core keys. ``Config`` adds a section per registered algorithm
    (``fedrcl.beta``) and server optimizer (``server.fedadam.tau``); ``validate`` enforces
    the ranges.

    Attributes:
      seed: the root of every random choice of the run: the split, the initial weights, the
        client sampling and each client's shuffles and augmentations.
      seeds: several runs in one compiled program, one per seed (``seeds=[0,1,2]``): each an
        ordinary run directory ``run_dir/seed-<s>`` with ``seed: s``, equal to that seed run
        alone; ``seed`` is then unused. Empty: one run.
      runs_in_parallel: with ``seeds`` or a ``sweep``, runs trained side by side (``vmap``)
        within the program; 1: one after another; 0: all at once.
      sweep: one float setting's values, one run each in the same program (``sweep.key``,
        ``sweep.values``; ``fedrcl.beta=[0.5,1,2]`` sets both); with ``seeds``, one run per
        value and seed. Each is an ordinary run directory ``run_dir/<key>-<value>[-seed-<s>]``.
      init_threefry_partitionable: draw the initial weights with threefry's partitionable
        bit layout (JAX's default), as the project's earliest runs did, so that a new run can
        share their start.
      dataset: ``digits`` (offline default), ``cifar10``, ``cifar100``, ``tiny_imagenet``, or
        ``imagefolder:PATH`` (a directory or .zip holding ``train/<class>/*`` and
        ``test/<class>/*``).
      data_dir: the TFDS data directory (cifar10, cifar100) or where Tiny-ImageNet's archive
        is; null: TFDS's default.
      model: the network every client trains.
      width: a ResNet's first-stage channels (stages w, 2w, 4w, 8w); null: 64.
      plugins: modules to import first; they register algorithms, models or server
        optimizers, so that this config may name them.
      algorithm: the client algorithm (the local objective and any per-client state).
      num_clients: clients in the federation.
      participation: the fraction of clients sampled each round (at least one).
      partition: how the training set is split among clients.
      alpha: the Dirichlet concentration (smaller: more heterogeneous clients).
      balanced: Dirichlet split with equal client sizes (the FedRCL reference's), or MOON's
        per-class split (false).
      shards_per_client: ``partition=shards``: label-sorted shards per client.
      rounds: rounds of the run.
      local_epochs: passes over its data a sampled client makes per round.
      batch_size: samples per local step.
      lr: the client learning rate at round 0, epoch 0.
      lr_decay: the client learning rate is ``lr * lr_decay ** (round + epoch)``, as the
        FedRCL reference decays it.
      momentum: the client SGD momentum.
      weight_decay: coupled weight decay of the client SGD (added to the clipped gradient).
      clip_norm: global gradient-norm clipping of each local step; 0 disables it.
      aggregation: client weights of the server mean: by data size, or uniform.
      augment: random rotation, crop and flip during local training.
      eval_every: rounds between evaluations (the rounds in between run as one compiled call).
      checkpoint_every: save at the first evaluation at least this many rounds after the last
        save, and at the end; 0: only at the end.
      keep_checkpoints: newest checkpoints kept.
      eval_batch_size: test images per evaluation batch.
      ema_decay: the decay of the smoothed test accuracy the papers report.
      analysis_every: every this many rounds, the representation analysis (effective rank,
        VCI, class covariances, mean pairwise cosine and spread share of the global and one
        local model's features; the participation histogram); 0: off.
      analysis_images: test images the analysis uses (a fixed class-balanced subset).
      client_metrics: write each round's sampled clients, their data sizes and local losses to
        ``clients.jsonl`` (one line per round), for the spread over clients.
      client_eval: also each sampled client's accuracy on its own training samples before and
        after its local training (one evaluation pass over its data each); implies
        ``client_metrics``.
      precision: the type local training computes in: ``fp32``; ``bf16`` or ``fp16`` with
        float32 master weights, optimizer and server state (``fp16`` scales the loss as
        PyTorch's GradScaler does, as the FedRCL authors train). Evaluation stays float32.
      conv_impl: how convolutions run: ``auto`` picks ``cpu`` on CPUs (oneDNN, else the
        matmul forms) and ``native`` elsewhere.
      devices: devices the sampled clients are sharded over; 0: every device.
      clients_in_parallel: clients trained side by side within a round; 0: chosen per model
        and backend (all at once, or one at a time where that is faster).
      client_states: where the per-client state table (MOON's previous local models) lives:
        on the device, or in host memory.
      norm: the normalisation of the models that offer a choice (``twin`` needs a two-view
        algorithm).
      run_dir: the run directory; null: ``runs/<dataset>-<algorithm>-<time>-<4 hex>``.
    """

    seed: int = 0
    seeds: list[int] = field(default_factory=list)
    runs_in_parallel: int = 1
    sweep: SweepConfig = field(default_factory=SweepConfig)
    init_threefry_partitionable: bool = False
    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "cnn"
    width: int | None = None
    plugins: list[str] = field(default_factory=list)
    algorithm: str = "fedrcl"
    num_clients: int = 20
    participation: float = 0.25
    partition: str = "dirichlet"
    alpha: float = 0.3
    balanced: bool = True
    shards_per_client: int = 2
    rounds: int = 100
    local_epochs: int = 5
    batch_size: int = 50
    lr: float = 0.1
    lr_decay: float = 0.998
    momentum: float = 0.0
    weight_decay: float = 1e-3
    clip_norm: float = 10.0
    aggregation: str = "size"
    augment: bool = True
    eval_every: int = 1
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    eval_batch_size: int = 500
    ema_decay: float = 0.9
    analysis_every: int = 0
    analysis_images: int = 1000
    client_metrics: bool = False
    client_eval: bool = False
    precision: str = "fp32"
    conv_impl: str = "auto"
    devices: int = 1
    clients_in_parallel: int = 0
    client_states: str = "device"
    norm: str = "group"
    run_dir: str | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # Mirrors of metrics.jsonl (TensorBoard, Weights & Biases); they change no result.
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def _reserve_core_keys() -> None:
    from fedjax_rcl import registry

    registry.RESERVED_KEYS.update(f.name for f in dataclasses.fields(CoreConfig))


def schema() -> type:
    """The run config's dataclass: ``CoreConfig`` plus one section per registered algorithm
    (top-level key) and server optimizer (``server.<name>``), rebuilt when the registry
    changes. ``Config`` is this class."""
    from fedjax_rcl import registry

    _reserve_core_keys()
    registry.load_builtins()
    if _schema_cache[0] == registry.version:
        return _schema_cache[1]
    sections = {}
    for entry in registry.ALGORITHMS.values():
        if entry.config is not None:
            sections.setdefault(entry.section, entry.config)
    server_sections = [(e.name, e.config, field(default_factory=e.config))
                       for e in registry.SERVER_OPTIMIZERS.values() if e.config is not None]
    server = dataclasses.make_dataclass("ServerConfig", server_sections, bases=(ServerConfig,))
    server.__module__ = __name__
    server.__doc__ = ServerConfig.__doc__
    fields = [("server", server, field(default_factory=server))]
    fields += [(name, cls, field(default_factory=cls)) for name, cls in sections.items()]
    cls = dataclasses.make_dataclass("Config", fields, bases=(CoreConfig,))
    cls.__module__ = __name__
    cls.__doc__ = CoreConfig.__doc__
    _schema_cache[:] = [registry.version, cls]
    return cls


_schema_cache: list = [None, None]


def __getattr__(name: str):
    if name == "Config":  # built from the registry on first use
        return schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _section_type(key: str):
    """The dataclass holding the dotted key's last part, or None."""
    cls = schema()
    for part in key.split(".")[:-1]:
        sub = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if sub is None or not dataclasses.is_dataclass(sub.default_factory):
            return None
        cls = sub.default_factory
    return cls


_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
               "String": "a string"}


def _format_key_error(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        section = _section_type(key) or schema()
        prefix, _, last = key.rpartition(".")
        names = [f.name for f in dataclasses.fields(section)]
        close = difflib.get_close_matches(last, names, n=1)  # the key's own part, not its path
        hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
        return (f"{key}: unknown config key{hint}; allowed keys here: {', '.join(names)}")
    if isinstance(err, ValidationError):
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        # OmegaConf's "Value '1.5' of type 'float' could not be converted to Integer", said as
        # the other messages say it: the field, the value, what is allowed.
        m = re.fullmatch(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", msg)
        if m and m.group(2) in _TYPE_WORDS:
            return f"{key}={m.group(1)}: must be {_TYPE_WORDS[m.group(2)]}"
        m = re.fullmatch(r"Value '(.*)' is not a valid bool \(type \w+\)", msg)
        if m:
            return f"{key}={m.group(1)}: must be true or false"
        return f"{key}: {msg}"
    return f"{key}: {str(err).splitlines()[0]}"


def _plugins_named(layers: list, overrides: list[str]) -> list:
    """The ``plugins`` list the file and overrides give, read before the schema exists (their
    modules may register the very sections the rest of the config sets)."""
    plugins: list = []
    for layer in layers:
        if "plugins" in layer:
            value = OmegaConf.to_container(layer)["plugins"]
            plugins = value if isinstance(value, list) else [value]
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "plugins":
            parsed = OmegaConf.from_dotlist([o]).get("plugins")
            plugins = list(parsed) if OmegaConf.is_list(parsed) else [parsed]
    return plugins


def _yaml_problem(path: str, err: Exception) -> str:
    """A YAML syntax error as one line: where (line and column, 1-based) and what."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    what = getattr(err, "problem", None) or (str(err).strip().splitlines() or [""])[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"config file {path!r}: not valid YAML{where} ({what or type(err).__name__})"


def _plugins_as_list(layer):
    """``plugins: name`` (a single module, not a list) read as ``plugins: [name]``."""
    if "plugins" in layer and isinstance(layer.get("plugins"), str):
        layer.plugins = [layer.plugins]
    return layer


def _plugin_override(override: str) -> str:
    """``plugins=name`` (no brackets) as ``plugins=[name]``."""
    key, _, value = override.partition("=")
    value = value.strip()
    if key.strip() != "plugins" or value.startswith("[") or value in ("", "null", "~"):
        return override
    return f"plugins=[{value}]"


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                defaults: dict | None = None, plugin_dirs: tuple[str, ...] = ()) -> CoreConfig:
    """Defaults <- ``defaults`` (a command's own, e.g. ``mfcl``'s) <- YAML file <-
    ``key=value`` overrides, type-checked; then ``validate``.

    The modules named in ``plugins`` are imported first (they may register what the rest of
    the config names), looked up on ``sys.path``, in the current directory and in
    ``plugin_dirs`` (for a run: where its plugins were found when it started).

    Raises:
      ConfigError: unreadable file, bad YAML, unknown key, wrong type, a plugin that cannot
        be imported, or any invalid value.
    """
    from fedjax_rcl import registry

    layers = [_plugins_as_list(OmegaConf.create(defaults))] if defaults else []
    if path is not None:
        try:
            loaded = OmegaConf.load(path)
        except FileNotFoundError:
            raise ConfigError([f"config file {path!r}: not found"]) from None
        except Exception as e:  # YAML syntax errors come in several types
            raise ConfigError([_yaml_problem(path, e)]) from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError([f"config file {path!r}: must be a mapping of keys to values"])
        layers.append(_plugins_as_list(loaded))
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError([f"override {o!r}: expected key=value" for o in bad])
    overrides = [_plugin_override(o) for o in overrides]
    try:
        plugin_problems = registry.load_plugins(_plugins_named(layers, list(overrides)),
                                                search=plugin_dirs)
    except OmegaConfBaseException as e:
        plugin_problems = [f"plugins: {str(e).splitlines()[0]}"]
    if plugin_problems:
        raise ConfigError(plugin_problems)
    base = OmegaConf.structured(schema())
    overrides = [_quote_string_value(o) for o in _sweep_overrides(overrides)]
    try:
        return _merged(base, layers, overrides)
    except ConfigError as first:
        if not overrides:
            raise
        # Report every problem at once: each override's own type errors, then the values of
        # the overrides that type-check.
        problems, good = [], []
        for o in overrides:
            try:
                _merged(base, layers, [o], check=False)
                good.append(o)
            except ConfigError as e:
                problems.extend(e.problems)
        try:
            _merged(base, layers, good)
        except ConfigError as e:
            problems.extend(p for p in e.problems if p not in problems)
        raise ConfigError(problems or first.problems) from None


def _merged(base, layers: list, overrides: list[str], *, check: bool = True) -> CoreConfig:
    """Defaults <- layers <- overrides as a ``Config``; ``validate``d when ``check``."""
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(base, *layers,
                                                  OmegaConf.from_dotlist(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError([_format_key_error(e)]) from None
    if check:
        validate(cfg)
    return cfg


def _field_type(key: str) -> str | None:
    """The annotation of a dotted config key (``"str | None"``), or None if it is not one."""
    section = _section_type(key)
    if section is None:
        return None
    fields = {f.name: f.type for f in dataclasses.fields(section)}
    name = key.split(".")[-1]
    return str(fields[name]) if name in fields else None


# Float settings that decide the program's shapes: their values cannot share one program.
SHAPE_SETTINGS = {"participation": "sets how many clients a round trains"}
_SWEEPABLE = ("float", "float | None")


def _sweep_overrides(overrides: list[str]) -> list[str]:
    """``key=[v0,v1,...]`` for a float setting as ``sweep.key=key sweep.values=[...]``; a
    list for any other single-valued setting is refused with what a sweep takes."""
    out, swept = [], []
    for o in overrides:
        key, _, value = o.partition("=")
        key, value = key.strip(), value.strip()
        kind = _field_type(key)
        if not value.startswith("[") or kind is None or kind.startswith("list"):
            out.append(o)
        elif kind in _SWEEPABLE:
            swept.append(key)
            out += [f"sweep.key={key}", f"sweep.values={value}"]
        else:
            raise ConfigError([f"{key}={value}: a list of values is a sweep, of one float "
                               f"setting (e.g. fedrcl.beta=[0.5,1,2], alpha=[0.1,0.3], "
                               f"lr=[0.05,0.1]); {key} is {kind}"])
    if len(swept) > 1:
        raise ConfigError([f"{', '.join(swept)}: lists for {len(swept)} settings; a grid "
                           "sweeps one setting (with seeds=[...] beside it)"])
    return out


def with_setting(cfg, key: str, value):
    """``cfg`` with the dotted ``key`` set to ``value`` (nested dataclasses replaced)."""
    head, _, rest = key.partition(".")
    inner = with_setting(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: inner})


def is_grid(cfg: CoreConfig) -> bool:
    """Whether ``cfg`` is several runs in one program (``seeds`` or a ``sweep``)."""
    return bool(cfg.seeds) or cfg.sweep.key is not None


def member_name(seed: int | None, key: str | None = None, value: float | None = None) -> str:
    """A grid member's directory name: ``seed-1``, ``fedrcl.beta-0.5``,
    ``fedrcl.beta-0.5-seed-1``."""
    parts = ([] if key is None else [f"{key}-{float(value):.12g}"]) + (
        [] if seed is None else [f"seed-{seed}"])
    return "-".join(parts)


def grid_members(seeds: list[int], key: str | None, values: list[float]
                 ) -> list[tuple[str, int | None, float | None]]:
    """``(name, seed or None, value or None)`` of each member of a grid, value by value,
    seed by seed."""
    return [(member_name(s, key, v), s, v) for v in (values if key is not None else [None])
            for s in (seeds or [None])]


def _quote_string_value(override: str) -> str:
    """``key=value`` with the value quoted when the key is a string: OmegaConf would otherwise
    read ``dataset=imagefolder:`` as the mapping ``{imagefolder: null}``."""
    key, _, value = override.partition("=")
    if _field_type(key) not in ("str", "str | None") or value in ("null", "~", ""):
        return override
    if value[:1] in ("'", '"') and value[-1:] == value[:1] and len(value) > 1:
        return override
    return f"{key}='{value.replace(chr(39), chr(39) * 2)}'"


# Keys that a resumed run may change without changing any result.
RESUME_SAFE_KEYS = ("rounds", "checkpoint_every", "keep_checkpoints", "eval_batch_size",
                    "data_dir", "run_dir", "distributed.coordinator_address",
                    "distributed.process_id", "analysis_every", "analysis_images",
                    "client_metrics",
                    *(f"tracking.{f.name}" for f in dataclasses.fields(TrackingConfig)))


# Settings added after runs existed, at their default (what a run's config without them
# means): left out of the digest while they hold it, so that the runs' checkpoints still resume.
DIGEST_NEUTRAL_DEFAULTS = {"mfcl.bn_statistics": "running", "init_threefry_partitionable": False,
                           "client_eval": False, "precision": "fp32", "seeds": [],
                           "runs_in_parallel": 1, "sweep.key": None, "sweep.values": [],
                           "mfcl.probe": "lbfgs",
                           "mfcl.probe_l2_grid": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0],
                           "mfcl.probe_holdout": 0.1, "mfcl.probe_max_iter": 1000,
                           "mfcl.probe_tol": 1e-5, "mfcl.probe_controls": True,
                           "mfcl.tn_variance": "pooled"}


def flat_keys(d: dict, prefix: str = "") -> dict:
    """A nested mapping as dotted keys: ``{"server": {"lr": 1}} -> {"server.lr": 1}``."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _result_settings(cfg: CoreConfig) -> dict:
    """The flat settings that decide a run's results: every core key but ``RESUME_SAFE_KEYS``
    and ``plugins``, plus the sections of the algorithm and server optimizer in use (the
    other sections are inert)."""
    from fedjax_rcl import registry

    flat = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "server":
            flat.update({f"server.{k}": v for k, v in flat_keys(dataclasses.asdict(value)).items()
                         if "." not in k or k.startswith(f"{value.optimizer}.")})
        elif f.name == "tracking":
            continue  # where metrics are mirrored changes no result
        elif f.name == "sweep":
            flat.update(flat_keys(dataclasses.asdict(value), "sweep."))
        elif dataclasses.is_dataclass(value) and f.name != "distributed":
            entry = registry.ALGORITHMS.get(cfg.algorithm)
            if entry is not None and entry.section == f.name:
                flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        elif dataclasses.is_dataclass(value):
            flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        elif f.name != "plugins":
            flat[f.name] = value
    return {k: v for k, v in flat.items() if k not in RESUME_SAFE_KEYS
            and not (k in DIGEST_NEUTRAL_DEFAULTS and v == DIGEST_NEUTRAL_DEFAULTS[k])}


def changed_keys(old: CoreConfig, new: CoreConfig) -> list[str]:
    """Dotted keys whose values differ and that would change results (see RESUME_SAFE_KEYS;
    the sections of algorithms and server optimizers not in use change nothing)."""
    a, b = _result_settings(old), _result_settings(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def config_digest(cfg: CoreConfig) -> str:
    """A hash of every result-affecting setting (checkpoints carry it)."""
    return hashlib.sha256(json.dumps(_result_settings(cfg), sort_keys=True).encode()
                          ).hexdigest()[:16]


# The algorithm sections every config had before algorithms registered their own.
_LEGACY_SECTIONS = ("fedprox", "fedrcl", "fedcl", "moon")


def legacy_config_digest(cfg: CoreConfig) -> str:
    """The digest checkpoints written before the registry carry: every key of the config of
    that time (all four algorithm sections, no server-optimizer sections, no ``plugins``), so
    that those runs still resume."""
    flat = flat_keys(dataclasses.asdict(cfg))
    known = {f.name for f in dataclasses.fields(CoreConfig)} - {"plugins"}
    keep = {k: v for k, v in flat.items()
            if k not in RESUME_SAFE_KEYS
            and not (k in DIGEST_NEUTRAL_DEFAULTS and v == DIGEST_NEUTRAL_DEFAULTS[k]) and (
                k in known and "." not in k
                or k.split(".")[0] in ("distributed", *_LEGACY_SECTIONS)
                or k in ("server.optimizer", "server.lr"))}
    if keep.get("server.lr") is None:
        keep["server.lr"] = 1.0  # that day's default
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def to_yaml(cfg: CoreConfig) -> str:
    """The run's record (``config.yaml``): every key, less the sections of plugins this
    config does not name (a fresh process reading it back would not know them)."""
    from fedjax_rcl import registry

    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    for e in registry.ALGORITHMS.values():
        if e.section is not None and not registry.provided_by(e, cfg.plugins) and not any(
                o.section == e.section and registry.provided_by(o, cfg.plugins)
                for o in registry.ALGORITHMS.values()):
            d.pop(e.section, None)
    for e in registry.SERVER_OPTIMIZERS.values():
        if not registry.provided_by(e, cfg.plugins):
            d["server"].pop(e.name, None)
    return OmegaConf.to_yaml(OmegaConf.create(d))


def to_dict(cfg: CoreConfig) -> dict:
    return dataclasses.asdict(cfg)


def _validate_sections(cfg: CoreConfig, p: list[str]) -> None:
    """Each section's own ``check``, every section (a YAML may set several), each problem
    prefixed with the section's key."""
    from fedjax_rcl import registry

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


def _check_onednn(p: list[str]) -> None:
    """``conv_impl=onednn`` needs the CPU backend and the oneDNN extension (built here, once)."""
    import jax

    from fedjax_rcl.nn import onednn

    if jax.default_backend() != "cpu":
        p.append(f"conv_impl='onednn': runs on the CPU only; the default backend is "
                 f"{jax.default_backend()} (use auto or native)")
    elif not onednn.available():
        p.append(f"conv_impl='onednn': unavailable here: {onednn.unavailable_reason()} "
                 "(use auto, which falls back to the matmul convolutions)")


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
    kind = _field_type(key)
    if kind not in _SWEEPABLE:
        p.append(f"sweep.key={key!r}: must name a float setting, such as fedrcl.beta, alpha or "
                 "lr" + ("" if kind is None else f" ({key} is {kind})"))
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
    # Imported here: the registries live with their modules, and importing them pulls in JAX.
    from fedjax_rcl import registry
    from fedjax_rcl.data.partitioning import METHODS
    from fedjax_rcl.engine.tables import CLIENT_TABLES
    from fedjax_rcl.models.base import PRECISIONS
    from fedjax_rcl.nn.conv import CONV_IMPLS
    from fedjax_rcl.nn.norm import NORMS
    from fedjax_rcl.server import AGGREGATIONS

    registry.load_builtins()
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
    one_of(p, "partition", cfg.partition, METHODS)
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
           "must be >= 0 (0: only at the end)")
    require(p, cfg.keep_checkpoints >= 1, "keep_checkpoints", cfg.keep_checkpoints, "must be >= 1")
    require(p, finite(cfg.ema_decay) and 0 <= cfg.ema_decay < 1, "ema_decay", cfg.ema_decay,
           "must be in [0, 1)")
    require(p, cfg.devices >= 0, "devices", cfg.devices, "must be >= 0 (0: every device)")
    require(p, cfg.clients_in_parallel >= 0, "clients_in_parallel", cfg.clients_in_parallel,
           "must be >= 0 (0: all sampled clients at once)")
    one_of(p, "client_states", cfg.client_states, CLIENT_TABLES)
    seeds = list(cfg.seeds)
    require(p, all(isinstance(x, int) and x >= 0 for x in seeds), "seeds", seeds,
           "must be a list of integers >= 0")
    require(p, len(set(seeds)) == len(seeds), "seeds", seeds, "must not repeat a seed")
    require(p, cfg.runs_in_parallel >= 0, "runs_in_parallel", cfg.runs_in_parallel,
           "must be >= 0 (0: all runs side by side, 1: one after another)")
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
    one_of(p, "conv_impl", cfg.conv_impl, CONV_IMPLS)
    if cfg.conv_impl == "onednn":
        _check_onednn(p)
    one_of(p, "norm", cfg.norm, NORMS)
    one_of(p, "precision", cfg.precision, PRECISIONS)
    one_of(p, "server.optimizer", cfg.server.optimizer, registry.SERVER_OPTIMIZERS)
    require(p, cfg.server.lr is None or (finite(cfg.server.lr) and cfg.server.lr > 0),
           "server.lr", cfg.server.lr, "must be a finite number > 0 (null: the optimizer's "
           "default)")
    require(p, cfg.run_dir is None or cfg.run_dir.strip() != "", "run_dir", cfg.run_dir,
           "must be a path or null")
    if model is not None and cfg.norm in NORMS and cfg.norm not in model.norms:
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
    if p:
        raise ConfigError(p)
