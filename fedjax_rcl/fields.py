"""How each setting of the run config is treated besides its value, declared with the setting.

Every setting is a dataclass field: a core key of ``fedjax_rcl.config``, or a key of an
algorithm's or server optimizer's section. ``setting`` declares one with its default and says,
where it is declared, what the config digest, ``resume`` and the reports make of it:

- ``resume_safe``: a resumed run may change it, as it decides no result (``rounds``,
  ``checkpoint_every``); it is not part of the config digest that checkpoints carry.
- ``digest_neutral``: it was added after runs existed. While it holds its declared default it is
  left out of the digest, so that the checkpoints written before it existed, whose config
  without it means that default, still resume. A setting added to a config that runs already
  use is declared so, and its default never changes.
- ``replicate``: it tells replicates of one configuration apart (``seed``): reports pool runs
  that differ only in such settings.
- ``report=False``: it says nothing about what a run is (where its files go, how it is laid
  out on the hardware); reports ignore it.

A field holding a section may be declared with a treatment too, which then applies to every
setting of the section (``tracking``: all resume-safe). ``declared`` reads the treatments back
as dotted keys. This module imports nothing else from the package, so that a section in any
layer can declare its settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

__all__ = ["Declared", "Treatment", "declared", "setting"]

# The key of a field's metadata that holds its ``Treatment``.
_METADATA_KEY = "fedjax_rcl.treatment"


@dataclasses.dataclass(frozen=True)
class Treatment:
    """What the digest, ``resume`` and the reports make of a setting (see the module)."""

    resume_safe: bool = False
    digest_neutral: bool = False
    replicate: bool = False
    report: bool = True

    def within(self, section: Treatment) -> Treatment:
        """This setting's treatment inside a section declared ``section``: a flag the section
        sets holds for every setting in it."""
        return Treatment(resume_safe=self.resume_safe or section.resume_safe,
                         digest_neutral=self.digest_neutral or section.digest_neutral,
                         replicate=self.replicate or section.replicate,
                         report=self.report and section.report)


_PLAIN = Treatment()


def setting(default: Any = dataclasses.MISSING, *,
            default_factory: Any = dataclasses.MISSING, resume_safe: bool = False,
            digest_neutral: bool = False, replicate: bool = False, report: bool = True) -> Any:
    """A dataclass field with its default (or ``default_factory``) and its treatment; the
    flags are described in the module."""
    treatment = Treatment(resume_safe=resume_safe, digest_neutral=digest_neutral,
                          replicate=replicate, report=report)
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_METADATA_KEY: treatment})


class Declared(NamedTuple):
    """A setting as declared: its treatment (a section's included) and its default
    (``dataclasses.MISSING`` where the field has none)."""

    treatment: Treatment
    default: Any


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _section(section: Any, f: dataclasses.Field) -> Any:
    """The dataclass (type or instance) a field holds, or None where it holds a value: a
    section instance's field's value, a section type's field's ``default_factory``."""
    if not isinstance(section, type):
        value = getattr(section, f.name)
        return value if dataclasses.is_dataclass(value) else None
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def declared(section: Any, prefix: str = "", within: Treatment = _PLAIN) -> dict[str, Declared]:
    """Every setting of ``section`` (a config dataclass, type or instance) and of the sections
    it holds, by dotted key (``server.fedadam.tau``), with its treatment and default. A field
    declared without ``setting`` is treated plainly: part of the digest, fixed on resume,
    reported."""
    out = {}
    for f in dataclasses.fields(section):
        treatment = f.metadata.get(_METADATA_KEY, _PLAIN).within(within)
        inner = _section(section, f)
        if inner is not None:
            out.update(declared(inner, f"{prefix}{f.name}.", treatment))
        else:
            out[f"{prefix}{f.name}"] = Declared(treatment, _default(f))
    return out
