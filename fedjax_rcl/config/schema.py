"""The run config's schema: the core keys as dataclasses, and ``Config``, those plus one section
per registered algorithm and server optimizer (``schema``), and the run's record of it
(``to_yaml``).

The defaults are the quick offline main job; the paper's settings live in
``experiments/*.yaml``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from fedjax_rcl import builtins, registry
from fedjax_rcl.fields import setting
from fedjax_rcl.validation import ConfigError, one_of


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

    coordinator_address: str | None = setting(None, resume_safe=True)
    num_processes: int = 1
    process_id: int = setting(0, resume_safe=True)


@dataclass
class SweepConfig:
    """One float setting's values, one run each, in one compiled program (``fedjax_rcl.grid``).

    Attributes:
      key: the setting swept, a float key such as ``fedrcl.beta``, ``alpha`` or ``lr``
        (``fedrcl.beta=[0.5,1,2]`` on the command line sets ``key`` and ``values``); null: no
        sweep.
      values: its values, one run each (with ``seeds``: one run per value and seed).
    """

    key: str | None = setting(None, digest_neutral=True)
    values: list[float] = setting(default_factory=list, digest_neutral=True)


WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class TrackingConfig:
    """Where the metrics are mirrored besides ``metrics.jsonl`` (no result changes).

    Attributes:
      tensorboard: write TensorBoard event files to ``<run_dir>/tensorboard`` (needs
        tensorboardX).
      wandb: mirror the run to Weights & Biases (needs wandb and a login, or offline mode).
      wandb_project: the W&B project.
      wandb_entity: the W&B entity; null: the logged-in user's default.
      wandb_mode: ``offline`` keeps the run local (``wandb sync`` later).
    """

    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fedjax-rcl"
    wandb_entity: str | None = None
    wandb_mode: str = "online"

    def check(self, ctx) -> list[str]:
        del ctx
        p = []
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            p.append("tensorboard=True: needs tensorboardX, which is not installed "
                     "(pip install 'fedjax-rcl[tensorboard]'), or set tracking.tensorboard=false")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            p.append("wandb=True: needs wandb, which is not installed (pip install wandb), or set "
                     "tracking.wandb=false")
        one_of(p, "wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.wandb_project:
            p.append(f"wandb_project={self.wandb_project!r}: must be a non-empty name")
        return p


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
        within the program; 1: one after another; 0: all or 1, by the layout cost model.
      sweep: one float setting's values, one run each in the same program (``sweep.key``,
        ``sweep.values``; ``fedrcl.beta=[0.5,1,2]`` sets both); with ``seeds``, one run per
        value and seed. Each is an ordinary run directory ``run_dir/<key>-<value>[-seed-<s>]``.
      init_threefry_partitionable: draw the initial weights with threefry's partitionable
        bit layout (JAX's default), as the project's earliest runs did, so that a new run can
        share their start.
      dataset: a registered dataset's name (the built-in ones follow; a plugin may register
        more), or ``imagefolder:PATH`` (a directory or .zip holding ``train/<class>/*`` and
        ``test/<class>/*``).
      data_dir: the TFDS data directory (cifar10, cifar100) or where Tiny-ImageNet's archive
        is; null: TFDS's default.
      model: the network every client trains.
      width: a ResNet's first-stage channels (stages w, 2w, 4w, 8w); null: 64.
      plugins: modules to import first; they register algorithms, models, server optimizers
        or datasets, so that this config may name them.
      algorithm: the client algorithm (the local objective and any per-client state).
      num_clients: clients in the federation.
      participation: the fraction of clients sampled each round (at least one).
      sampling_version: the client sampler's version: ``1`` permutes the population each
        round (its cost grows with ``num_clients``: about a second a round at a million
        clients on a CPU); ``2`` (Floyd's algorithm) costs what the clients sampled cost.
        Both are uniform over the subsets; their draws differ, and a version's never change.
      partition: how the training set is split among clients.
      alpha: the Dirichlet concentration (smaller: more heterogeneous clients).
      balanced: Dirichlet split with equal client sizes (the FedRCL reference's), or MOON's
        per-class split (false).
      shards_per_client: ``partition=shards``: label-sorted shards per client.
      partition_version: the split procedures' version: ``1`` as first written (the balanced
        Dirichlet split takes time growing with clients x samples: a minute at 50,000
        clients of CIFAR-10); ``2`` draws the same law in time linear in the samples, with
        other draws for the same seed. A version's draws never change.
      split_file: ``partition=file``: the clients' training indices, in the FedRCL reference's
        split-file format (the ``str()`` of a dict ``{client: [indices]}``), indexing the
        training set in the order this dataset loads it; the seed then draws no split.
        ``tools/authors_split.py`` maps the reference's files (indices into the binary
        CIFAR-10 release) onto an image-folder copy such as the JPEG archive.
      rounds: rounds of the run.
      local_epochs: passes over its data a sampled client makes per round.
      batch_size: samples per local step.
      drop_last: an epoch takes only full batches, leaving out the rest of its shuffled order
        (PyTorch's ``drop_last=True``, as MOON's code trains); false: the last batch is filled
        up from the start of the order (the FedRCL reference's epochs see every sample).
      lr: the client learning rate at round 0, epoch 0.
      lr_decay: the client learning rate is ``lr * lr_decay ** (round + epoch)``, as the
        FedRCL reference decays it.
      momentum: the client SGD momentum.
      weight_decay: coupled weight decay of the client SGD (added to the clipped gradient).
      clip_norm: global gradient-norm clipping of each local step; 0 disables it.
      aggregation: client weights of the server mean: by data size, or uniform.
      augment: random rotation, crop and flip during local training.
      transforms: whose training transforms and constants: ``fedrcl`` (the FedRCL reference's
        rotation, zero-padded crop and flip, the dataset's normalisation constants) or
        ``moon`` (MOON's CIFAR-10 pipeline: reflect-padded crop and flip, no rotation, and its
        normalisation constants for training and test alike; 3-channel images only).
      eval_every: rounds between evaluations (the rounds in between run as one compiled call).
      checkpoint_every: save at the first evaluation at least this many rounds after the last
        save, and at the end; 0: only at round 0 and at the end.
      keep_checkpoints: newest checkpoints kept.
      eval_batch_size: test images per evaluation batch.
      ema_decay: the decay per round of the smoothed test accuracy the papers report (an
        evaluation every k rounds applies ``ema_decay ** k``, exact only for k = 1).
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
        matmul forms), ``patches`` for local training with several clients side by side on a
        GPU (their per-client weights would make grouped convolutions), ``native`` elsewhere.
      devices: devices the sampled clients are sharded over; 0: every device.
      clients_in_parallel: clients trained side by side within a round; 0: chosen per model
        and backend (all at once, or one at a time where that is faster).
      client_states: where the per-client state table (MOON's previous local models) lives:
        on the device, in host memory, or ``sparse``: in host memory with rows only for the
        clients that have trained (a client never sampled reads the initial state), so that
        its memory grows with the clients who trained, not with the population; ``disk``:
        those rows in files memory-mapped from the run directory (``client_table/``), for
        tables larger than host memory; ``auto``: ``device`` where the whole table fits, else
        ``sparse`` where its rows fit in host memory, else ``disk``, chosen from an estimate
        made before anything is built and recorded in the run's config (its resume keeps it).
        A table that cannot be held is refused.
      norm: the normalisation of the models that offer a choice (``twin`` needs a two-view
        algorithm).
      run_dir: the run directory; null: ``runs/<dataset>-<algorithm>-<time>-<4 hex>``.
    """

    # ``setting`` says how the digest, ``resume`` and the reports treat a key
    # (``fedjax_rcl.fields``); a key added after runs exist is declared ``digest_neutral``.
    seed: int = setting(0, replicate=True)
    seeds: list[int] = setting(default_factory=list, digest_neutral=True, replicate=True)
    runs_in_parallel: int = setting(1, digest_neutral=True)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    init_threefry_partitionable: bool = setting(False, digest_neutral=True, replicate=True)
    dataset: str = "digits"
    data_dir: str | None = setting(None, resume_safe=True, report=False)
    model: str = "cnn"
    width: int | None = None
    plugins: list[str] = setting(default_factory=list, resume_safe=True, report=False)
    algorithm: str = "fedrcl"
    num_clients: int = 20
    participation: float = 0.25
    sampling_version: int = setting(1, digest_neutral=True)
    partition: str = "dirichlet"
    alpha: float = 0.3
    balanced: bool = True
    shards_per_client: int = 2
    partition_version: int = setting(1, digest_neutral=True)
    split_file: str | None = setting(None, digest_neutral=True)
    rounds: int = setting(100, resume_safe=True, report=False)
    local_epochs: int = 5
    batch_size: int = 50
    drop_last: bool = setting(False, digest_neutral=True)
    lr: float = 0.1
    lr_decay: float = 0.998
    momentum: float = 0.0
    weight_decay: float = 1e-3
    clip_norm: float = 10.0
    aggregation: str = "size"
    augment: bool = True
    transforms: str = setting("fedrcl", digest_neutral=True)
    eval_every: int = 1
    checkpoint_every: int = setting(10, resume_safe=True, report=False)
    keep_checkpoints: int = setting(3, resume_safe=True, report=False)
    eval_batch_size: int = setting(500, resume_safe=True, report=False)
    ema_decay: float = 0.9
    analysis_every: int = setting(0, resume_safe=True, report=False)
    analysis_images: int = setting(1000, resume_safe=True, report=False)
    client_metrics: bool = setting(False, resume_safe=True)
    client_eval: bool = setting(False, digest_neutral=True)
    precision: str = setting("fp32", digest_neutral=True)
    conv_impl: str = setting("auto", report=False)
    devices: int = setting(1, report=False)
    clients_in_parallel: int = setting(0, report=False)
    client_states: str = setting("device", report=False)
    norm: str = "group"
    run_dir: str | None = setting(None, resume_safe=True, report=False)
    server: ServerConfig = field(default_factory=ServerConfig)
    distributed: DistributedConfig = setting(default_factory=DistributedConfig, report=False)
    # Mirrors of metrics.jsonl (TensorBoard, Weights & Biases): they change no result and say
    # nothing about the run.
    tracking: TrackingConfig = setting(default_factory=TrackingConfig, resume_safe=True,
                                       report=False)


def schema() -> type:
    """The run config's dataclass: ``CoreConfig`` plus one section per registered algorithm
    (top-level key) and server optimizer (``server.<name>``), rebuilt when the registry
    changes. ``Config`` is this class.

    Raises:
      ConfigError: an algorithm's section is named as a core key (``rounds``, ``lr``).
    """
    builtins.load()
    if _schema_cache[0] == registry.version:
        return _schema_cache[1]
    core = {f.name for f in dataclasses.fields(CoreConfig)}
    taken = [f"algorithm {e.name!r}: section {e.section!r} is a core config key (register it "
             "with another section name)"
             for e in registry.ALGORITHMS.values() if e.config is not None and e.section in core]
    if taken:
        raise ConfigError(taken)
    sections = {}
    for entry in registry.ALGORITHMS.values():
        if entry.config is not None:
            sections.setdefault(entry.section, entry.config)
    server_sections = [(e.name, e.config, field(default_factory=e.config))
                       for e in registry.SERVER_OPTIMIZERS.values() if e.config is not None]
    server = dataclasses.make_dataclass("ServerConfig", server_sections, bases=(ServerConfig,))
    server.__module__ = "fedjax_rcl.config"
    server.__doc__ = ServerConfig.__doc__
    fields = [("server", server, field(default_factory=server))]
    fields += [(name, cls, field(default_factory=cls)) for name, cls in sections.items()]
    cls = dataclasses.make_dataclass("Config", fields, bases=(CoreConfig,))
    cls.__module__ = "fedjax_rcl.config"
    cls.__doc__ = CoreConfig.__doc__
    _schema_cache[:] = [registry.version, cls]
    return cls


_schema_cache: list = [None, None]


def section_type(key: str):
    """The dataclass holding the dotted key's last part, or None."""
    cls = schema()
    for part in key.split(".")[:-1]:
        sub = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if sub is None or not dataclasses.is_dataclass(sub.default_factory):
            return None
        cls = sub.default_factory
    return cls


def field_type(key: str) -> str | None:
    """The annotation of a dotted config key (``"str | None"``), or None if it is not one."""
    section = section_type(key)
    if section is None:
        return None
    fields = {f.name: f.type for f in dataclasses.fields(section)}
    name = key.split(".")[-1]
    return str(fields[name]) if name in fields else None


def to_yaml(cfg: CoreConfig) -> str:
    """The run's record (``config.yaml``): every key, less the sections of plugins this
    config does not name (a fresh process reading it back would not know them)."""
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
    """The config as nested plain dicts."""
    return dataclasses.asdict(cfg)
