"""What every model returns, and the functional pair (init, apply) the engine uses."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_rcl import registry
from fedjax_rcl.nn import conv
from fedjax_rcl.nn.conv import torch_dense

ModelState = Any  # non-trained variables (BatchNorm statistics); ``{}`` for most models


class ModelOutput(NamedTuple):
    """Output of a model.

    Attributes:
      logits: ``[B, num_classes]``.
      features: the multi-level features, each pre-ReLU and spatially mean-pooled to ``[B, C_l]``,
        from the earliest level to the last (FedRCL's levels). Logits are not a level.
      embedding: ``[B, D]``, the representation the classifier reads (after the last ReLU and the
        global pool).
      projection: ``[B, P]`` from the projection head (MOON), or None when the model has none.
      blocks: the activations after each block the model is cut into (post-ReLU, unpooled),
        where FedMLB grafts the global model's remaining blocks (``ModelFns.apply_from``);
        ``()`` for a model that cannot be entered in the middle.

    A model entered after block ``k`` (``start=k``) returns only the levels and blocks it ran.
    """

    logits: jax.Array
    features: tuple[jax.Array, ...]
    embedding: jax.Array
    projection: jax.Array | None = None
    blocks: tuple[jax.Array, ...] = ()


def spatial_mean(x: jax.Array) -> jax.Array:
    """``[B, H, W, C] -> [B, C]``; ``[B, C]`` passes through."""
    return x.mean(axis=(1, 2)) if x.ndim == 4 else x


class ProjectionHead(nn.Module):
    """MOON's 2-layer MLP projection head: dense(D) -> ReLU -> dense(out)."""

    features: int = 256

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        d = h.shape[-1]
        h = nn.relu(torch_dense(d, d, name="proj1")(h))
        return torch_dense(d, self.features, name="proj2")(h)


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """A Flax module as two pure functions over explicit variables.

    Attributes:
      init: ``(key, sample_images) -> (params, model_state)``.
      apply: ``(params, model_state, images, *, train, rng=None) -> (ModelOutput,
        new_model_state)``; ``new_model_state`` is the input state unless ``train`` updates
        BatchNorm statistics. ``rng`` is the module's ``"dropout"`` stream (Flax's name for it):
        local training passes a fresh key every step, so ``nn.Dropout(rate,
        deterministic=not train)`` in a model just works.
      module: the underlying Flax module.
      apply_from: ``(params, model_state, h, *, start) -> ModelOutput``: the model in
        evaluation mode from block ``start`` on, ``h`` being ``ModelOutput.blocks[start - 1]``
        of some forward pass (FedMLB's hybrid paths); for modules whose ``__call__`` takes
        ``start`` (``registry.ModelEntry.num_blocks > 0``).
      conv_impl: the convolutions the three functions trace with
        (``fedjax_rcl.nn.conv.implementation``).
    """

    init: Callable[..., tuple[Any, ModelState]]
    apply: Callable[..., tuple[ModelOutput, ModelState]]
    module: nn.Module
    apply_from: Callable[..., ModelOutput] | None = None
    conv_impl: str = "auto"


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_variables(module: nn.Module, conv_impl: str, key, sample):
    """``module.init`` under ``conv_impl``'s convolutions, compiled once per process for each
    equal module and ``conv_impl`` (Flax modules are frozen dataclasses, equal when their
    class and fields are): a run, its resume, evaluation and each member of a grid build the
    same model, and would otherwise each compile its initialiser again. The threefry layout
    set around the call is part of the jit key."""
    with conv.implementation(conv_impl):
        return module.init(key, sample, train=False)


def model_fns(module: nn.Module, *, conv_impl: str = "auto",
              partitionable_init: bool = False) -> ModelFns:
    """Wraps a module whose ``__call__(x, *, train)`` returns a ``ModelOutput``.

    ``conv_impl``: the convolutions (``fedjax_rcl.nn.conv.CONV_IMPLS``) its layers run,
    chosen here, where the engine's programs trace the model: each function below traces the
    module under ``nn.conv.implementation(conv_impl)``, so whatever jits it compiles them in.
    ``partitionable_init``: draw the initial weights with threefry's partitionable layout
    (JAX's default; the config's ``init_threefry_partitionable``), to start from the weights
    of a run recorded with it.
    """
    conv.resolve_conv_impl(conv_impl)  # an unknown name fails here

    # Jitted: run eagerly, every layer's initialiser would compile on its own (seconds).
    try:
        hash(module)
        jit_init = functools.partial(_init_variables, module, conv_impl)
    except TypeError:  # a module with an unhashable field: its own compiled initialiser
        jit_init = jax.jit(conv.under(
            conv_impl, lambda key, sample: module.init(key, sample, train=False)))

    def init(key, sample):
        # Initial weights come from threefry's original, non-partitionable bit layout: the
        # same weights for a seed on every backend (as with JAX's default), and a much shorter
        # XLA:CPU compile, because the partitionable layout (JAX's default since 0.5) hashes a
        # counter shaped like every parameter (BENCHMARKS.md). Set around the call, not inside
        # the traced function, because random bits are lowered after tracing. Initialisation
        # only: training's randomness (sampling, augmentation, dropout) keeps JAX's default.
        with jax.threefry_partitionable(partitionable_init):
            variables = dict(jit_init(key, jnp.asarray(sample, jnp.float32)))
        params = variables.pop("params")
        return params, variables

    def apply(params, model_state, images, *, train: bool, rng=None):
        variables = {"params": params, **model_state}
        rngs = {"dropout": rng} if rng is not None else None
        with conv.implementation(conv_impl):
            if train and model_state:
                out, updates = module.apply(variables, images, train=True, rngs=rngs,
                                            mutable=list(model_state))
                return out, {**model_state, **updates}
            return module.apply(variables, images, train=train, rngs=rngs), model_state

    def apply_from(params, model_state, h, *, start: int):
        with conv.implementation(conv_impl):
            return module.apply({"params": params, **model_state}, h, train=False, start=start)

    return ModelFns(init=init, apply=apply, module=module, apply_from=apply_from,
                    conv_impl=conv_impl)


# ``precision=`` of the config: the dtype local training computes in.
PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
registry.register_choices("precision", PRECISIONS)


def _cast(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
        tree)


def with_precision(fns: ModelFns, precision: str) -> ModelFns:
    """The model computing in a lower precision, its weights kept in float32.

    ``apply`` casts the float32 weights and the images to ``bfloat16`` or ``float16``, runs the
    model (convolutions and dense layers compute in that type; the normalisation layers take
    their statistics in at least float32) and returns its outputs in float32, so that losses
    are computed in float32 and gradients reach the float32 weights through the casts: the
    master-weights scheme of mixed-precision training (Micikevicius et al., ICLR 2018), as
    PyTorch's autocast does it for the FedRCL authors. The non-trained state (BatchNorm
    statistics) stays float32. ``precision="fp32"`` returns ``fns`` unchanged.
    """
    if precision == "fp32":
        return fns
    dtype = PRECISIONS[precision]

    def apply(params, model_state, images, *, train: bool, rng=None):
        out, new_state = fns.apply(_cast(params, dtype), model_state, images.astype(dtype),
                                   train=train, rng=rng)
        return _cast(out, jnp.float32), _cast(new_state, jnp.float32)

    def apply_from(params, model_state, h, *, start: int):
        return _cast(fns.apply_from(_cast(params, dtype), model_state, h.astype(dtype),
                                    start=start), jnp.float32)

    return dataclasses.replace(fns, apply=apply,
                               apply_from=apply_from if fns.apply_from else None)
