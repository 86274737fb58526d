"""Models run compiled in tests, as the engine runs them.

Run eagerly, every operation of a forward pass compiles a program of its own (one per
operation and shape), so a test calling a ResNet eagerly spent most of its time compiling a
hundred small programs; compiled, one program per call signature does the same work. Values
are the eager ones up to float reassociation, which the tests' tolerances allow."""

import dataclasses

import jax


class Compiled:
    """A Flax module whose ``init`` and ``apply`` are jitted (``train`` static); any other
    attribute is the module's. Traced at the first call: a convolution implementation set
    around that call (``nn.conv.implementation``) is the one compiled in."""

    def __init__(self, module):
        self.module = module
        self._init = jax.jit(module.init, static_argnames=("train",))
        self._apply = jax.jit(module.apply, static_argnames=("train",))

    def init(self, *args, **kwargs):
        return self._init(*args, **kwargs)

    def apply(self, *args, **kwargs):
        return self._apply(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


def compiled_fns(fns):
    """``ModelFns`` whose ``apply`` and ``apply_from`` are jitted (``init`` already is)."""
    return dataclasses.replace(
        fns, apply=jax.jit(fns.apply, static_argnames=("train",)),
        apply_from=jax.jit(fns.apply_from, static_argnames=("start",)) if fns.apply_from
        else None)
