"""Normalization layers selectable by name (``norm=`` in the model config).

``group``: GroupNorm with PyTorch's epsilon 1e-5 (Flax's default is 1e-6) and a two-pass
variance, as in the FedRCL reference (``nn.GroupNorm(2, C)`` everywhere in its ResNet).
"""

from __future__ import annotations

import flax.linen as nn

NORMS = ("group",)


def make_norm(kind: str, *, num_groups: int = 2, name: str | None = None) -> nn.Module:
    """Returns a fresh normalization module of the given kind.

    Args:
      kind: one of ``NORMS``.
      num_groups: groups for ``group``.
      name: Flax submodule name.
    """
    if kind == "group":
        return nn.GroupNorm(
            num_groups=num_groups, epsilon=1e-5, use_fast_variance=False, name=name
        )
    raise ValueError(f"norm={kind!r}: allowed {NORMS}")
