"""The typed run configuration: its schema, loading from YAML files and dotted overrides,
sweeps, the digest checkpoints carry, and validation.

A run is described by one ``Config``. It is built from the defaults, then a YAML file, then
``key=value`` overrides (``fedjax-rcl train exp.yaml rounds=50 server.lr=0.5``), through
OmegaConf's structured configs (types enforced, unknown keys rejected). ``validate`` then checks
every field and reports all problems at once, each naming the field, the value and what is
allowed, before anything is compiled. The defaults are the quick offline main job; the paper's
settings live in ``experiments/*.yaml``.

One module per concept: ``schema`` (the dataclasses and ``Config``), ``loading`` (files,
overrides and their error messages), ``sweeps`` (several runs in one program), ``digest``
(what a resumed run may change) and ``checks`` (validation). How the digest, ``resume`` and the
reports treat each setting is declared with its field (``fedjax_rcl.fields.setting``). The
names here are the public ones.
"""

from fedjax_rcl.config.checks import degenerate_settings, validate
from fedjax_rcl.config.digest import changed_keys, config_digest, flat_keys, keys_declared
from fedjax_rcl.config.loading import load_config
from fedjax_rcl.config.schema import (
    WANDB_MODES,
    CoreConfig,
    DistributedConfig,
    ServerConfig,
    SweepConfig,
    TrackingConfig,
    schema,
    to_dict,
    to_yaml,
)
from fedjax_rcl.config.sweeps import (
    SHAPE_SETTINGS,
    grid_members,
    is_grid,
    member_name,
    with_setting,
)
from fedjax_rcl.validation import CheckContext, ConfigError, check_levels, finite

__all__ = ["SHAPE_SETTINGS", "WANDB_MODES", "CheckContext", "ConfigError", "CoreConfig",
           "DistributedConfig", "ServerConfig", "SweepConfig", "TrackingConfig", "changed_keys",
           "check_levels", "config_digest", "degenerate_settings", "finite", "flat_keys",
           "grid_members", "is_grid", "keys_declared", "load_config", "member_name", "schema",
           "to_dict", "to_yaml", "validate", "with_setting"]


def __getattr__(name: str):
    if name == "Config":  # built from the registry on first use
        return schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
