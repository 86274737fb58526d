"""The configuration reference: every key of the run config with its type, default, allowed
values and meaning, read from the schema itself.

The meaning of a key is the entry for its field in its dataclass's ``Attributes:`` docstring
section (Google style: ``name: text``, continuation lines indented further), so a key is
described where it is defined, and a registered algorithm's or server optimizer's section
describes its own keys the same way. ``docs/configuration.md`` is ``markdown()``'s output (a
test keeps the two equal, and fails on a key without a description).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable

from fedjax_rcl import builtins, registry
from fedjax_rcl.config import WANDB_MODES, schema
from fedjax_rcl.config.digest import keys_declared

__all__ = ["KeyDoc", "attribute_docs", "keys", "markdown", "text"]


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One dotted config key: its type, default, allowed values (when they are a list) and
    meaning; ``section`` is the dotted key of the dataclass holding it (``""`` at the top)."""

    key: str
    type: str
    default: object
    allowed: tuple[str, ...]
    doc: str
    section: str


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: description}`` from the ``Attributes:`` section of ``cls``'s docstring (and
    its bases'), each description joined onto one line."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.getdoc(klass) if klass.__doc__ else None
        if not doc or "Attributes:" not in doc:
            continue
        lines = doc.split("Attributes:", 1)[1].splitlines()
        indent, name = None, None
        for line in lines[1:]:
            if not line.strip():
                continue
            width = len(line) - len(line.lstrip())
            if indent is None:
                indent = width
            if width < indent:
                break  # the section ended
            m = re.match(r"(\w+(?:, \w+)*): (.*)", line.strip())
            if width == indent and m:
                names, text = m.group(1).split(", "), m.group(2)
                for n in names:
                    out[n] = text
                name = names
            elif name is not None:
                for n in name:
                    out[n] = f"{out[n]} {line.strip()}"
    return out


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    text = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "")


def _allowed() -> dict[str, Callable[[], tuple[str, ...]]]:
    """The keys whose values are names from a list, and where the list lives."""
    from fedjax_rcl.data.partitioning import PARTITIONS
    from fedjax_rcl.engine.tables import CLIENT_TABLES
    from fedjax_rcl.losses.contrastive import MININGS
    from fedjax_rcl.server import AGGREGATIONS

    builtins.load()
    return {"algorithm": lambda: tuple(registry.ALGORITHMS),
            "model": lambda: tuple(registry.MODELS),
            "server.optimizer": lambda: tuple(registry.SERVER_OPTIMIZERS),
            "partition": lambda: tuple(PARTITIONS), "aggregation": lambda: tuple(AGGREGATIONS),
            "conv_impl": lambda: registry.choices("conv_impl").values,
            "norm": lambda: registry.choices("norm").values,
            "client_states": lambda: tuple(CLIENT_TABLES),
            "precision": lambda: registry.choices("precision").values,
            "fedrcl.mining": lambda: MININGS,
            "tracking.wandb_mode": lambda: tuple(WANDB_MODES)}


def _dataset_lines() -> str:
    """Each registered dataset's line (``registry.DatasetEntry.doc``), for the ``dataset``
    key: its module says what it is, the reference lists it."""
    builtins.load()
    return "".join(f" ``{e.name}``: {e.doc.rstrip('.')}." for e in registry.DATASETS.values()
                   if e.doc)


def keys() -> list[KeyDoc]:
    """Every key of the current schema (built-ins and registered plugins), in schema order."""
    allowed = _allowed()
    out: list[KeyDoc] = []

    def walk(cls: type, prefix: str) -> None:
        docs = attribute_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{key}.")
                continue
            doc = docs.get(f.name, "") + (_dataset_lines() if key == "dataset" else "")
            out.append(KeyDoc(key, _type_name(hints.get(f.name, f.type)), default,
                              allowed[key]() if key in allowed else (), doc,
                              prefix.rstrip(".")))

    walk(schema(), "")
    return out


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)


def markdown() -> str:
    """The reference as a Markdown page, one table per section."""
    lines = ["# Configuration reference", "",
             "Every key of the run config, with its type, default and meaning. Set keys in a "
             "YAML file or as",
             "`key=value` overrides (`fedjax-rcl train exp.yaml rounds=50 fedrcl.beta=2`); "
             "`fedjax-rcl train",
             "--print-config` prints a resolved config. Generated from the schema's docstrings "
             "by",
             "`python -m fedjax_rcl.reference > docs/configuration.md` (a test keeps this page "
             "current).", "",
             "A resumed run (`fedjax-rcl resume RUN_DIR key=value`) may change only the keys "
             "that do not change its results: "
             + ", ".join(f"`{k}`" for k in keys_declared(resume_safe=True))
             + ". Overriding any other key on resume is refused unless `--force`: the "
             "checkpoint was made with the saved value.", ""]
    by_section: dict[str, list[KeyDoc]] = {}
    for k in keys():
        by_section.setdefault(k.section, []).append(k)
    for section, docs in by_section.items():
        lines += [f"## `{section}`" if section else "## Core keys", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in docs:
            meaning = k.doc.replace("|", "\\|")
            if k.allowed:
                meaning += f" Allowed: {', '.join(f'`{a}`' for a in k.allowed)}."
            lines.append(f"| `{k.key}` | {k.type.replace('|', 'or')} | `{_value(k.default)}` "
                         f"| {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _plain(doc: str) -> str:
    return doc.replace("``", "`")


def text(query: str | None = None, width: int = 100) -> str:
    """The keys under ``query`` (a section such as ``fedrcl`` or ``server.fedadam``, or one
    key such as ``fedrcl.beta``; None: every key) for a terminal: the key, its type and
    default, its meaning, and the allowed values.

    Raises:
      ConfigError: ``query`` names no key or section (with the closest names).
    """
    import textwrap

    from fedjax_rcl.validation import ConfigError, did_you_mean

    every = keys()
    chosen = [k for k in every
              if query is None or k.key == query or k.key.startswith(f"{query}.")]
    if not chosen:
        names = sorted({k.key for k in every} | {k.section for k in every if k.section})
        raise ConfigError([f"config {query!r}: no such key or section"
                           f"{did_you_mean(query, names)}; sections: "
                           f"{', '.join(dict.fromkeys(k.section for k in every if k.section))}"])
    out = []
    for k in chosen:
        out.append(f"{k.key}: {k.type} = {_value(k.default)}")
        body = _plain(k.doc)
        if k.allowed:
            body += f" Allowed: {', '.join(k.allowed)}."
        out += textwrap.wrap(body, width=width, initial_indent="    ",
                             subsequent_indent="    ")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
