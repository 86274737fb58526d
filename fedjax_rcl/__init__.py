"""fedjax-rcl: federated learning simulated on accelerators in JAX.

The Python entry points (imported on first use, so that ``import fedjax_rcl`` stays light):

* ``train(config=None, *overrides, callbacks=(), progress=False) -> Run``,
  ``resume(run_dir, *overrides, ...) -> Run``, ``evaluate(run_dir) -> dict``,
  ``load(run_dir) -> Run`` (``fedjax_rcl.api``);
* ``register_algorithm``, ``register_model``, ``register_server_optimizer``,
  ``register_dataset`` (``fedjax_rcl.registry``): what the config can name;
* ``ConfigError``, ``DataError``, ``TrainingError``: what bad input and a failed run raise.
"""

import importlib

_EXPORTS = {
    "train": "fedjax_rcl.api", "resume": "fedjax_rcl.api", "evaluate": "fedjax_rcl.api",
    "load": "fedjax_rcl.api", "Run": "fedjax_rcl.api",
    "register_algorithm": "fedjax_rcl.registry", "register_model": "fedjax_rcl.registry",
    "register_server_optimizer": "fedjax_rcl.registry",
    "register_dataset": "fedjax_rcl.registry",
    "ConfigError": "fedjax_rcl.validation", "DataError": "fedjax_rcl.data.dataset",
    "TrainingError": "fedjax_rcl.loop",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("fedjax-rcl")
        except PackageNotFoundError:
            return "unknown"
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
