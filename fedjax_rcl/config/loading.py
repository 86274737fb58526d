"""Loading a run config: defaults <- a command's own <- YAML file <- ``key=value`` overrides,
through OmegaConf's structured configs (types enforced, unknown keys rejected), then
``validate``; every problem said as one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from fedjax_rcl import builtins
from fedjax_rcl.config.checks import unread_settings, validate
from fedjax_rcl.config.schema import CoreConfig, field_type, schema, section_type
from fedjax_rcl.config.sweeps import sweep_overrides
from fedjax_rcl.validation import ConfigError

_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
               "String": "a string"}


# An example list for a list setting, by its element type (``seeds=[0,1,2]``).
_LIST_EXAMPLES = {"int": "[0,1,2]", "float": "[0.5,1.0]", "str": "[a,b]"}


def _unknown_key(key: str, section=None, where: str = "") -> str:
    """The line for an unknown dotted key: a suggestion, where it is (a file's line and
    column), and the keys allowed beside it."""
    section = section or section_type(key) or schema()
    prefix, _, last = key.rpartition(".")
    names = [f.name for f in dataclasses.fields(section)]
    close = difflib.get_close_matches(last, names, n=1)  # the key's own part, not its path
    hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
    return f"{key}: unknown config key{hint}{where}; allowed keys here: {', '.join(names)}"


def _format_key_error(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        return _unknown_key(key)
    if isinstance(err, ValidationError):
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        kind = field_type(key) or ""
        if msg.startswith("Invalid value assigned") and "is not a ListConfig" in msg:
            # ``seeds=3`` or ``seeds=0,1,2``: OmegaConf's "AnyNode is not a ListConfig".
            inner = re.fullmatch(r"list\[(\w+)\]( \| None)?", kind)
            example = _LIST_EXAMPLES.get(inner.group(1) if inner else "", "[...]")
            return (f"{key}: {getattr(err, 'value', '?')}: must be a list such as "
                    f"{key}={example}")
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


def _unknown_file_keys(path: str) -> list[str]:
    """Every key of a YAML file that the schema does not know, each with its line and column
    (OmegaConf's merge stops at the first)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f)
    except Exception:  # unreadable files were reported by OmegaConf.load already
        return []
    problems: list[str] = []

    def walk(node, section, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        fields = {f.name: f for f in dataclasses.fields(section)}
        for k, v in node.value:
            name = str(k.value)
            field = fields.get(name)
            if field is None:
                mark = k.start_mark
                where = (f" (config file {path!r}, line {mark.line + 1}, column "
                         f"{mark.column + 1})")
                problems.append(_unknown_key(prefix + name, section, where))
            elif dataclasses.is_dataclass(field.default_factory):
                walk(v, field.default_factory, f"{prefix}{name}.")

    walk(root, schema(), "")
    return problems


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


def _quote_string_value(override: str) -> str:
    """``key=value`` with the value quoted when the key is a string: OmegaConf would otherwise
    read ``dataset=imagefolder:`` as the mapping ``{imagefolder: null}``."""
    key, _, value = override.partition("=")
    if field_type(key) not in ("str", "str | None") or value in ("null", "~", ""):
        return override
    if value[:1] in ("'", '"') and value[-1:] == value[:1] and len(value) > 1:
        return override
    return f"{key}='{value.replace(chr(39), chr(39) * 2)}'"


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
        plugin_problems = builtins.load_plugins(_plugins_named(layers, list(overrides)),
                                                search=plugin_dirs)
    except OmegaConfBaseException as e:
        plugin_problems = [f"plugins: {str(e).splitlines()[0]}"]
    if plugin_problems:
        raise ConfigError(plugin_problems)
    unknown = _unknown_file_keys(path) if path is not None else []
    if unknown:
        raise ConfigError(unknown)
    base = _structured_schema()
    given = [o.partition("=")[0].strip() for o in overrides]
    overrides = [_quote_string_value(o) for o in sweep_overrides(overrides)]
    # Settings given on the command line that the chosen algorithm or server optimizer does not
    # read are refused (a YAML file may set several algorithms' and server optimizers' sections:
    # a run's config.yaml records them all).
    algorithm, optimizer = _chosen(base, layers, overrides)
    unread = unread_settings(algorithm, given, optimizer) if algorithm is not None else []
    if unread:
        raise ConfigError(unread)
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


_structured: list = [None, None]  # the schema class and its OmegaConf form, made once per schema


def _structured_schema():
    """The defaults as an OmegaConf config, made again only when ``schema()`` is (a registry
    change): making it is most of what loading a config costs, and ``OmegaConf.merge`` copies
    its first argument, so the one made is never changed."""
    cls = schema()
    if _structured[0] is not cls:
        _structured[:] = [cls, OmegaConf.structured(cls)]
    return _structured[1]


def _chosen(base, layers: list, overrides: list[str]) -> tuple[str | None, str | None]:
    """The algorithm and the server optimizer the layers and overrides choose (None, None if
    they do not merge: the merge proper then says why)."""
    try:
        merged = OmegaConf.merge(base, *layers, OmegaConf.from_dotlist(overrides))
        return str(merged.algorithm), str(merged.server.optimizer)
    except OmegaConfBaseException:
        return None, None


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
