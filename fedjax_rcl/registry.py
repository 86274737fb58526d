"""What the config can name: algorithms, models, server optimizers and datasets, each registered
by its own module, built-in or the user's, and the values of the core keys that models and layers
offer (``precision``, ``conv_impl``, ``norm``: ``register_choices``).

An entry names its builder and, optionally, a config section: a dataclass of hyperparameters
with defaults that becomes a key of the run config (``fedprox.mu``, ``server.fedadam.tau``),
type-checked by OmegaConf and value-checked by the section's own ``check``. ``fedjax_rcl.config``
builds its schema from these entries and knows no particular algorithm, model or optimizer.

Built-in entries register when their packages are imported (``load_builtins``: every module of
``fedjax_rcl.datasets``, ``fedjax_rcl.algorithms``, ``fedjax_rcl.models`` and
``fedjax_rcl.server``, then the ``fedjax_rcl.plugins`` entry-point group of installed packages):
a new built-in is one module there. A user's module registers the same way and is named in the
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
(``fedjax_rcl.validation`` has the context and helpers such as ``finite``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

PLUGIN_GROUP = "fedjax_rcl.plugins"


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
        entry point, or registered by the running program itself); see ``provided_by``.
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
      build: ``(num_classes, *, conv_impl, norm, width, projection_dim) -> flax Module`` whose
        ``__call__(x, *, train)`` returns a ``ModelOutput``; ``width`` is None when unset.
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
    """

    name: str
    build: Callable
    num_levels: int
    norms: tuple[str, ...] = ("group",)
    width: bool = False
    num_blocks: int = 0
    min_input_size: int | None = None


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
# Config keys an algorithm section may not take (the run config's own top-level keys); set by
# ``fedjax_rcl.config``.
RESERVED_KEYS: set[str] = set()
# The ``plugins`` module being imported by ``load_plugins`` (entries registered meanwhile are
# its own: a run's config.yaml records only the sections of the plugins that run names).
_importing_plugin: str | None = None
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
    if section in RESERVED_KEYS:
        raise ValueError(f"algorithm {name!r}: section {section!r} is a core config key")
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
                           model_kwargs or _no_kwargs, _importing_plugin, command)
    _add(ALGORITHMS, entry, "algorithm", replace)
    return entry


def register_model(name: str, build: Callable, *, num_levels: int,
                   norms: tuple[str, ...] = ("group",), width: bool = False,
                   num_blocks: int = 0, min_input_size: int | None = None,
                   replace: bool = False) -> ModelEntry:
    """Makes ``model=name`` available (see ``ModelEntry`` for the arguments)."""
    if min_input_size is not None and (isinstance(min_input_size, bool) or not isinstance(
            min_input_size, int) or min_input_size < 1):
        raise ValueError(f"model {name!r}: min_input_size={min_input_size!r}: must be an "
                         "integer >= 1 or None")
    entry = ModelEntry(name, build, num_levels, tuple(norms), width, num_blocks, min_input_size)
    _add(MODELS, entry, "model", replace)
    return entry


def register_server_optimizer(name: str, build: Callable, *, config: type | None = None,
                              default_lr: float = 1.0,
                              replace: bool = False) -> ServerOptimizerEntry:
    """Makes ``server.optimizer=name`` available (see ``ServerOptimizerEntry``)."""
    if name in ("optimizer", "lr"):
        raise ValueError(f"server optimizer {name!r}: a core key of the server section")
    entry = ServerOptimizerEntry(name, build, config, default_lr, _importing_plugin)
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
    entry = DatasetEntry(name, loader, _importing_plugin, doc,
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
    """The entry of the config key ``name``'s values (after the built-ins registered them)."""
    load_builtins()
    return CHOICES[name]


def import_modules(package: str) -> None:
    """Imports every module of a package whose name does not start with ``_`` (so that each
    registers itself)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


_builtins_loaded = False
_datasets_loaded = False


def load_builtin_datasets() -> None:
    """Imports every built-in dataset module (``fedjax_rcl.datasets``; light: each imports its
    source only to load), once."""
    global _datasets_loaded
    if not _datasets_loaded:
        _datasets_loaded = True
        import_modules("fedjax_rcl.datasets")


def load_builtins() -> None:
    """Imports every built-in algorithm, model, server optimizer and dataset module, and the
    installed packages' ``fedjax_rcl.plugins`` entry points (once)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    load_builtin_datasets()
    for package in ("fedjax_rcl.algorithms", "fedjax_rcl.models", "fedjax_rcl.server"):
        import_modules(package)
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        ep.load()


def load_plugins(names, search=()) -> list[str]:
    """Imports the user's modules named in ``plugins`` (dotted module names), looked up on
    ``sys.path``, in the current directory (as ``python -m`` would) and in the directories
    ``search``. Returns one problem line per module that cannot be imported, with a hint
    where to run from."""
    global _importing_plugin
    load_builtins()  # first: a plugin's own imports must not make built-ins its entries
    problems = []
    for folder in (os.getcwd(), *search):
        if folder and folder not in sys.path:
            sys.path.append(folder)
    for name in names or ():
        if not isinstance(name, str) or not name:
            problems.append(f"plugins: {name!r}: give a module name such as my_algorithms")
            continue
        _importing_plugin = name
        try:
            importlib.import_module(name)
        except Exception as e:  # a plugin's import error, whatever it is, is a config problem
            first = str(e).splitlines()[0] if str(e) else ""
            hint = ""
            if isinstance(e, ModuleNotFoundError) and e.name == name.split(".")[0]:
                looked = ", ".join(dict.fromkeys((os.getcwd(), *search)))
                hint = (f"; looked in {looked} and on sys.path: run from the directory that "
                        "holds it, or add that directory to PYTHONPATH")
            problems.append(f"plugins: cannot import {name!r} ({type(e).__name__}: {first})"
                            f"{hint}")
        finally:
            _importing_plugin = None
    return problems


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
    load_builtins()
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r}: allowed {', '.join(ALGORITHMS)}") from None


def model(name: str) -> ModelEntry:
    """The entry of ``model=name`` (ValueError naming the allowed values)."""
    load_builtins()
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"model={name!r}: allowed {', '.join(MODELS)}") from None


def server_optimizer(name: str) -> ServerOptimizerEntry:
    """The entry of ``server.optimizer=name`` (ValueError naming the allowed values)."""
    load_builtins()
    try:
        return SERVER_OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"server.optimizer={name!r}: allowed "
                         f"{', '.join(SERVER_OPTIMIZERS)}") from None
