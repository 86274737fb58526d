"""Normalization layers selectable by name (``norm=`` in the config).

- ``group``: GroupNorm, 2 groups, PyTorch's epsilon 1e-5 (Flax's default is 1e-6), two-pass
  variance — the FedRCL reference's ``nn.GroupNorm(2, C)`` — with its analytic gradient
  (``fedjax_rcl.nn.group_norm``).
- ``batch``: BatchNorm with running statistics (PyTorch's momentum 0.1, i.e. Flax's 0.9); the
  statistics are model state that clients update locally and the server averages.
- ``twin``: Twin Normalization (MFCL): GroupNorm whose statistics span both augmented views of a
  sample; needs batches of view pairs in training, and takes each image alone in evaluation.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_rcl import registry
from fedjax_rcl.nn.group_norm import GroupNorm
from fedjax_rcl.nn.twin_norm import TwinNorm

NORMS = ("group", "batch", "twin")
registry.register_choices("norm", NORMS)


class Norm(nn.Module):
    """One normalization layer of the kind named by ``kind``.

    Attributes:
      kind: one of ``NORMS``.
      num_groups: groups for ``group`` and ``twin``.
      twin_variance: ``twin``'s variance, ``"pooled"`` (MFCL's Eq. 2) or ``"views"`` (its
        code listing; ``fedjax_rcl.nn.twin_norm``).

    ``relu=True`` at the call returns ``max(norm(x), 0)``; GroupNorm applies it (and its
    gradient mask) inside its own passes over the activation, the others after.
    """

    kind: str = "group"
    num_groups: int = 2
    twin_variance: str = "pooled"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool, relu: bool = False) -> jax.Array:
        if self.kind == "group":
            return GroupNorm(num_groups=self.num_groups, epsilon=1e-5, name="gn")(x, relu)
        if self.kind == "batch":
            y = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                             use_fast_variance=False, name="bn")(x)
        elif self.kind == "twin":
            y = TwinNorm(num_groups=self.num_groups, epsilon=1e-5,
                         variance=self.twin_variance, name="tn")(x, paired=train)
        else:
            raise ValueError(f"norm={self.kind!r}: allowed {NORMS}")
        return nn.relu(y) if relu else y
