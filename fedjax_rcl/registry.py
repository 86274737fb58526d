"""What the config can name: algorithms, models, server optimizers and datasets, each registered
by its own module, built-in or the user's, and the values of the core keys that models and layers
offer (``precision``, ``conv_impl``, ``norm``: ``register_choices``).

An entry names its builder and, optionally, a config section: a dataclass of hyperparameters
with defaults that becomes a key of the run config (``fedprox.mu``, ``server.fedadam.tau``),
type-checked by OmegaConf and value-checked by the section's own ``check``. ``fedjax_rcl.config``
builds its schema from these entries and knows no particular algorithm, model or optimizer.

This module holds the tables and imports nothing of the package: ``fedjax_rcl.builtins``, above
every package that registers, imports the built-in entries, the installed packages'
``fedjax_rcl.plugins`` entry points and the user's plugin modules, and the lookups here read the
tables as they are. A user's module registers the same way as a built-in one and is named in the
run config, ``plugins: [my_algorithms]``, so that ``train``, ``resume`` and ``eval`` import it
before reading the rest of the config::

    # my_algorithms.py
    import dataclasses
    from fedjax_rcl import registry
    from fedjax_rcl.algorithms import ClientAlgorithm, cross_entropy

    @dataclasses.dataclass
    class LabelSmoothingConfig:
        smoothing: float = 0.1

    def build(settings, model):
        def objective(out, params, batch, ctx):
            ...
        return ClientAlgorithm(objective)

    registry.register_algorithm("label_smoothing", build, config=LabelSmoothingConfig)

A section may define ``check(self, ctx: CheckContext) -> list[str]``: one line per problem,
``"field=value: what is allowed"``; the config prefixes the section's key
(``fedjax_rcl.validation`` has the context and helpers such as ``finite``). A section may not be
named as a core key of the run config (``rounds``, ``lr``): the config's schema refuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


def _no_kwargs(settings) -> dict:
    del settings
    return {}


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """A client algorithm the config can name.

    Attributes:
      name: the ``algorithm=`` value.
      build: ``(settings, model: ModelFns) -> ClientAlgorithm``; ``settings`` is the run's
        instance of ``config`` (None when the algorithm has no section).
      config: dataclass of its hyperparameters (None: it has none).
      section: the config key of those hyperparameters (default: ``name``); two algorithms may
        share one (FedSCL reads FedRCL's).
      num_views: augmented views of each sample in a local batch (2 for view-contrastive
        objectives; the engine augments each sample this many times, and ``norm=twin`` needs
        2). The one place this is declared: it is known before the model is built.
      model_kwargs: ``settings -> dict`` of extra model arguments (MOON's projection head).
      origin: the ``plugins`` module whose import registered it (None: built in, an installed
        entry point, or registered by the running program itself); set by ``owned_by``, see
        ``provided_by``.
      command: the command that runs it (``train``; ``mfcl`` for MFCL's two phases, whose
        client algorithm is only phase 1).
    """

    name: str
    build: Callable
    config: type | None = None
    section: str | None = None
    num_views: int = 1
    model_kwargs: Callable[[Any], dict] = _no_kwargs
    origin: str | None = None
    command: str = "train"


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """A model the config can name.

    Attributes:
      name: the ``model=`` value.
      build: ``(num_classes, *, norm, projection_dim) -> flax Module`` whose
        ``__call__(x, *, train)`` returns a ``ModelOutput``, with ``width=`` too (None when
        unset) for a model that declares ``width``. How its convolutions run is no argument:
        the engine chooses it where it traces the model (``fedjax_rcl.nn.conv``).
      num_levels: feature levels in its ``ModelOutput.features``.
      norms: the ``norm=`` values it accepts (its first is the default).
      width: whether ``width=`` applies (a ResNet's first-stage channels).
      num_blocks: the blocks the model is cut into for FedMLB's hybrid paths: its
        ``ModelOutput.blocks`` has this many activations and ``__call__(h, train=..., start=k)``
        runs the model from block ``k`` on ``h = blocks[k - 1]``; 0: the model cannot be entered
        in the middle (``algorithm=fedmlb`` refuses it).
      min_input_size: the smallest image height and width it takes (its valid convolutions and
        pools leave a non-empty feature map), so that smaller data are refused before anything
        is compiled; None: not stated (a plugin's model), nothing is checked.
      cpu_xla_options: ``(name, value)`` pairs of XLA options the run's programs compile with
        on a CPU (``jax.stages.Lowered.compile``'s ``compiler_options``), where a measured
        choice differs by model; one the user sets in ``XLA_FLAGS`` is left to the user.
      cpu_thread_env: ``(name, value)`` pairs of the OpenMP runtime's environment (under the
        oneDNN kernels) the run's process starts it with, where a measured choice differs by
        model (``fedjax_rcl.nn.onednn.set_thread_env``; one the user sets is left to the user).
    """

    name: str
    build: Callable
    num_levels: int
    norms: tuple[str, ...] = ("group",)
    width: bool = False
    num_blocks: int = 0
    min_input_size: int | None = None
    cpu_xla_options: tuple[tuple[str, str], ...] = ()
    cpu_thread_env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class ServerOptimizerEntry:
    """A server optimizer the config can name (``server.optimizer=``).

    Attributes:
      name: the value.
      build: ``(settings, lr: float) -> fedjax_rcl.server.ServerOptimizer``.
      config: dataclass of its hyperparameters, the config section ``server.<name>``.
      default_lr: the server learning rate when ``server.lr`` is null.
      origin: as ``AlgorithmEntry.origin``.
    """

    name: str
    build: Callable
    config: type | None = None
    default_lr: float = 1.0
    origin: str | None = None


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """A dataset the config can name (``dataset=``). The built-in ones register through
    ``register_dataset`` too, one module each under ``fedjax_rcl.datasets``.

    Attributes:
      name: the value.
      loader: called with the keyword arguments it takes of ``data_dir`` (the config's) and
        ``cache_dir`` (where decoded arrays may be cached); returns an ``ImageDataset``, or a
        mapping with ``train_images`` and ``test_images`` (uint8 ``[N, H, W, C]``),
        ``train_labels`` and ``test_labels`` (integers in ``0 .. len(class_names) - 1``),
        ``class_names`` and optionally ``mean``/``std`` (per channel, in [0, 1] pixel units;
        default: ``mean``/``std`` below, else the training images' statistics) and ``hflip``
        (whether horizontal flips keep the labels; default true). See
        ``fedjax_rcl.data.sources.from_arrays``.
      origin: as ``AlgorithmEntry.origin``.
      doc: one line saying what the data are and where they come from (the configuration
        reference lists it under ``dataset``).
      mean, std: fixed per-channel normalisation constants, whatever the source (an image
        folder that ``recognise`` says holds this dataset gets them too); None: the data's own
        statistics.
      recognise: ``(class_names, (H, W, C)) -> bool``: whether an image folder with these
        classes and images holds this dataset; None: never.
      check: ``check(data_dir=...)``: a cheap check that the data can be loaded, without
        decoding them, raising ``DataError`` naming what is wrong; None: nothing to check.
    """

    name: str
    loader: Callable[..., Any]
    origin: str | None = None
    doc: str = ""
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    recognise: Callable[[Any, tuple[int, ...]], bool] | None = None
    check: Callable[..., None] | None = None


@dataclasses.dataclass(frozen=True)
class ChoiceEntry:
    """The values a core config key may take that models and layers offer (``precision``,
    ``conv_impl``, ``norm``), registered by the module that implements them, so that the config
    names them without importing that module.

    Attributes:
      name: the config key.
      values: its allowed values.
      check: ``value -> problem line or None``, for a value that is allowed but cannot run here
        (``conv_impl=onednn`` without the oneDNN extension); None: every value runs.
    """

    name: str
    values: tuple[str, ...]
    check: Callable[[str], str | None] | None = None


ALGORITHMS: dict[str, AlgorithmEntry] = {}
MODELS: dict[str, ModelEntry] = {}
SERVER_OPTIMIZERS: dict[str, ServerOptimizerEntry] = {}
DATASETS: dict[str, DatasetEntry] = {}
CHOICES: dict[str, ChoiceEntry] = {}
# The prefix of a dataset spec that names an image folder (``imagefolder:PATH``).
IMAGEFOLDER_PREFIX = "imagefolder:"
# Bumped by every registration, so that the config schema is rebuilt when entries change.
version = 0


def _add(table: dict, entry, kind: str, replace: bool) -> None:
    global version
    if not entry.name or not isinstance(entry.name, str):
        raise ValueError(f"{kind} name {entry.name!r}: must be a non-empty string")
    if entry.name in table and not replace and table[entry.name] != entry:
        raise ValueError(f"{kind} {entry.name!r} is already registered (pass replace=True to "
                         "override it)")
    config = getattr(entry, "config", None)
    if config is not None and not dataclasses.is_dataclass(config):
        raise TypeError(f"{kind} {entry.name!r}: config must be a dataclass type, got {config!r}")
    table[entry.name] = entry
    version += 1


def register_algorithm(name: str, build: Callable, *, config: type | None = None,
                       section: str | None = None, num_views: int = 1,
                       model_kwargs: Callable[[Any], dict] | None = None,
                       command: str = "train", replace: bool = False) -> AlgorithmEntry:
    """Makes ``algorithm=name`` available (see ``AlgorithmEntry`` for the arguments)."""
    section = section or (name if config is not None else None)
    if config is None and section is not None:
        owners = [e for e in ALGORITHMS.values() if e.section == section and e.config]
        if not owners:
            raise ValueError(f"algorithm {name!r}: section {section!r} has no registered config")
        config = owners[0].config
    for other in ALGORITHMS.values():
        if other.name != name and other.section == section and section and other.config \
                is not config:
            raise ValueError(f"algorithm {name!r}: section {section!r} belongs to "
                             f"{other.name!r} with another config type")
    entry = AlgorithmEntry(name, build, config, section, num_views,
                           model_kwargs or _no_kwargs, None, command)
    _add(ALGORITHMS, entry, "algorithm", replace)
    return entry


def register_model(name: str, build: Callable, *, num_levels: int,
                   norms: tuple[str, ...] = ("group",), width: bool = False,
                   num_blocks: int = 0, min_input_size: int | None = None,
                   cpu_xla_options: tuple[tuple[str, str], ...] = (),
                   cpu_thread_env: tuple[tuple[str, str], ...] = (),
                   replace: bool = False) -> ModelEntry:
    """Makes ``model=name`` available (see ``ModelEntry`` for the arguments)."""
    if min_input_size is not None and (isinstance(min_input_size, bool) or not isinstance(
            min_input_size, int) or min_input_size < 1):
        raise ValueError(f"model {name!r}: min_input_size={min_input_size!r}: must be an "
                         "integer >= 1 or None")
    entry = ModelEntry(name, build, num_levels, tuple(norms), width, num_blocks, min_input_size,
                       tuple((str(k), str(v)) for k, v in cpu_xla_options),
                       tuple((str(k), str(v)) for k, v in cpu_thread_env))
    _add(MODELS, entry, "model", replace)
    return entry


def register_server_optimizer(name: str, build: Callable, *, config: type | None = None,
                              default_lr: float = 1.0,
                              replace: bool = False) -> ServerOptimizerEntry:
    """Makes ``server.optimizer=name`` available (see ``ServerOptimizerEntry``)."""
    if name in ("optimizer", "lr"):
        raise ValueError(f"server optimizer {name!r}: a core key of the server section")
    entry = ServerOptimizerEntry(name, build, config, default_lr)
    _add(SERVER_OPTIMIZERS, entry, "server optimizer", replace)
    return entry


def register_dataset(name: str, loader: Callable[..., Any], *, doc: str = "",
                     mean=None, std=None,
                     recognise: Callable[[Any, tuple[int, ...]], bool] | None = None,
                     check: Callable[..., None] | None = None,
                     replace: bool = False) -> DatasetEntry:
    """Makes ``dataset=name`` available (see ``DatasetEntry``); it then partitions, trains,
    resumes and evaluates like every other dataset."""
    if str(name).startswith(IMAGEFOLDER_PREFIX.rstrip(":")):
        raise ValueError(f"dataset {name!r}: {IMAGEFOLDER_PREFIX}PATH names an image folder")
    if not callable(loader):
        raise TypeError(f"dataset {name!r}: loader must be callable, got {loader!r}")
    if (mean is None) != (std is None):
        raise ValueError(f"dataset {name!r}: give both mean and std, or neither")
    entry = DatasetEntry(name, loader, None, doc,
                         None if mean is None else tuple(float(m) for m in mean),
                         None if std is None else tuple(float(x) for x in std),
                         recognise, check)
    _add(DATASETS, entry, "dataset", replace)
    return entry


def register_choices(name: str, values, *, check: Callable[[str], str | None] | None = None,
                     replace: bool = False) -> ChoiceEntry:
    """Makes ``values`` the allowed values of the config key ``name`` (see ``ChoiceEntry``)."""
    entry = ChoiceEntry(name, tuple(values), check)
    _add(CHOICES, entry, "config key", replace)
    return entry


def choices(name: str) -> ChoiceEntry:
    """The entry of the config key ``name``'s values (KeyError naming the keys that have one)."""
    try:
        return CHOICES[name]
    except KeyError:
        raise KeyError(f"config key {name!r} has no registered values (registered: "
                       f"{', '.join(CHOICES) or 'none'}; fedjax_rcl.builtins.load() registers "
                       "the built-in ones)") from None


@contextlib.contextmanager
def owned_by(module: str) -> Iterator[None]:
    """Makes ``module`` the ``origin`` of every entry registered or replaced inside the block
    (a plugin's import): found by comparing the tables before and after, so that registering
    takes no owner and keeps none. The tables then hold a copy of such an entry with its
    origin set (what ``register_*`` returned has none)."""
    global version
    tables = (ALGORITHMS, SERVER_OPTIMIZERS, DATASETS)  # those whose entries have an origin
    before = [dict(t) for t in tables]
    try:
        yield
    finally:
        for table, old in zip(tables, before, strict=True):
            for key, entry in list(table.items()):
                if old.get(key) is not entry and entry.origin is None:
                    table[key] = dataclasses.replace(entry, origin=module)
                    version += 1


def plugin_dirs(names) -> dict[str, str]:
    """``{module: directory}``: where each imported plugin module was found -- the directory
    to put on ``sys.path`` to import it again (a run records it, so that ``resume`` and
    ``eval`` find its plugins from anywhere)."""
    out = {}
    for name in names or ():
        top = sys.modules.get(str(name).split(".")[0])
        origin = getattr(top, "__file__", None)
        if origin is None:
            continue
        path = os.path.dirname(os.path.abspath(origin))
        if os.path.basename(origin) == "__init__.py":  # a package: its parent folder
            path = os.path.dirname(path)
        out[str(name)] = path
    return out


def provided_by(entry, plugins) -> bool:
    """Whether a config naming ``plugins`` has ``entry`` in a fresh process: built-ins and the
    running program's own registrations always, a plugin's entries when it is named. (One
    process may have imported plugins of earlier runs; their sections are no part of this
    run's record.)"""
    return entry.origin is None or entry.origin in (plugins or ())


def algorithm(name: str) -> AlgorithmEntry:
    """The entry of ``algorithm=name`` (ValueError naming the allowed values)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r}: allowed {', '.join(ALGORITHMS)}") from None


def model(name: str) -> ModelEntry:
    """The entry of ``model=name`` (ValueError naming the allowed values)."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"model={name!r}: allowed {', '.join(MODELS)}") from None


def server_optimizer(name: str) -> ServerOptimizerEntry:
    """The entry of ``server.optimizer=name`` (ValueError naming the allowed values)."""
    try:
        return SERVER_OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"server.optimizer={name!r}: allowed "
                         f"{', '.join(SERVER_OPTIMIZERS)}") from None
