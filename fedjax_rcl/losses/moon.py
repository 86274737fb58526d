"""MOON's model-contrastive loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_rcl.losses.contrastive import Features, l2_normalize, pool_features

Array = jax.Array


def moon_loss(
    z: Features, z_global: Features, z_prev: Features, *, temperature: float | Array = 0.5
) -> Array:
    r"""Model-contrastive loss: pull the local representation to the global model's, away from
    the previous local model's.

    With :math:`\operatorname{sim}` the cosine similarity of pooled, L2-normalised
    (``x / max(||x||, 1e-12)``) representations:

    .. math::
      \ell_i = -\log \frac{e^{\operatorname{sim}(z_i, z^{g}_i)/\tau}}
        {e^{\operatorname{sim}(z_i, z^{g}_i)/\tau} + e^{\operatorname{sim}(z_i, z^{p}_i)/\tau}}
      = \operatorname{softplus}\Bigl(\frac{\operatorname{sim}(z_i, z^{p}_i)
        - \operatorname{sim}(z_i, z^{g}_i)}{\tau}\Bigr), \qquad
      \mathcal L = \frac1B \sum_i \ell_i .

    The local objective is :math:`\ell_{CE} + \mu \mathcal L`. ``z_global`` and ``z_prev`` are
    targets: they pass through ``stop_gradient`` here, so only ``z`` receives a gradient.

    Paper: Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021,
    https://arxiv.org/abs/2103.16257 (Eq. 3). The reference code (github.com/QinbinLi/MOON,
    ``train_net_fedcon``) matches the equation: cross-entropy over the logits
    ``[cos(z, z_glob), cos(z, z_prev)] / tau`` with ``torch.nn.CosineSimilarity`` (its norm
    floor is 1e-8 instead of the 1e-12 per vector used here, which matters only for vectors of
    norm below 1e-8); it can also keep several previous models as extra negatives
    (``model_buffer_size``, default 1: the single negative here).

    Args:
      z: ``[B, ..., D]`` the local model's projections (pooled over the middle axes).
      z_global: ``[B, ..., D]`` the global model's projections of the same inputs.
      z_prev: ``[B, ..., D]`` the previous local model's projections of the same inputs.
      temperature: :math:`\tau > 0` (MOON 0.5).

    Returns:
      ``[B, ..., D], [B, ..., D], [B, ..., D] -> []`` the loss.
    """
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    shapes = {jnp.shape(z), jnp.shape(z_global), jnp.shape(z_prev)}
    if len(shapes) != 1:
        raise ValueError(
            "z, z_global and z_prev must have the same shape [B, ..., D], got "
            f"{jnp.shape(z)}, {jnp.shape(z_global)} and {jnp.shape(z_prev)}."
        )
    if jnp.shape(z)[0] == 0:
        raise ValueError("moon_loss needs a non-empty batch, got B = 0.")
    local = l2_normalize(pool_features(z))
    target = jax.lax.stop_gradient(l2_normalize(pool_features(z_global)))
    previous = jax.lax.stop_gradient(l2_normalize(pool_features(z_prev)))
    positive = jnp.sum(local * target, axis=-1)
    negative = jnp.sum(local * previous, axis=-1)
    return jnp.mean(jax.nn.softplus((negative - positive) / temperature))
