"""MFCL's phase 2: the clients' representations, and the server's contrastive training on them.

After phase 1 the client module is frozen. Every client that does not drop out (probability
``delta``) sends, for each of its samples, ``rho`` draws of two augmented views passed through
the client module; the server trains the rest of ResNet-18 and a projection head on those
representation pairs with NT-Xent (SimCLR Eq. 1; MFCL Eq. 7), LARS and a cosine learning rate
from ``server_lr``, BatchNorm at the server (Motamedi & Kim, MFCL, TMLR).

The representations are computed once, as the clients would send them (``representations``),
and kept on the device; an epoch of server training is one compiled ``lax.scan`` over its
steps (``make_server_epoch``). Keys depend only on (seed, sample, draw) and (seed, epoch), so a
resumed phase 2 is identical to an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from fedjax_rcl.data.contrastive_augment import simclr_view
from fedjax_rcl.losses import nt_xent_loss

# Independent streams of the run's root key.
_DROPOUT_STREAM, _VIEW_STREAM, _EPOCH_STREAM, _SERVER_INIT_STREAM = 11, 12, 13, 14


@struct.dataclass
class ServerTraining:
    """Phase 2's state: everything the next server epoch reads.

    Attributes:
      params, batch_stats: the server model (ResNet-18 after the client module + head).
      opt_state: LARS's state.
      epoch: ``int32 []`` epochs done.
    """

    params: dict
    batch_stats: dict
    opt_state: optax.OptState
    epoch: jax.Array


def kept_clients(key: jax.Array, num_clients: int, delta: float) -> np.ndarray:
    """Which clients send representations: each drops out with probability ``delta``
    (independently, from the run's key). If every client dropped out, client 0 is kept, so
    that the server has something to train on."""
    u = np.asarray(jax.random.uniform(jax.random.fold_in(key, _DROPOUT_STREAM), (num_clients,)))
    kept = u >= delta
    if not kept.any():
        kept[0] = True
    return np.flatnonzero(kept)


def sample_pool(parts: list[np.ndarray], kept: np.ndarray, rho: int) -> np.ndarray:
    """``int32 [P, 2]`` rows ``(sample index, draw)``: every sample of the kept clients, ``rho``
    draws each (``P = rho * sum of their sizes``)."""
    samples = np.concatenate([parts[k] for k in kept]).astype(np.int32)
    draws = np.repeat(np.arange(rho, dtype=np.int32), len(samples))
    return np.stack([np.tile(samples, rho), draws], axis=1)


def make_representations(encode: Callable, *, paired: bool, blur: bool):
    """Builds ``represent(key, images_uint8 [N, H, W, C], pool [N, 2]) -> [2N, h, w, c]``:
    the client module's outputs for two views of each row, rows i and i + N the pair.

    Views are keyed by (sample, draw, view), so a draw's representation is the same whoever
    computes it and whenever. ``encode(x, paired)`` is the frozen client module; with Twin
    Normalization the two views are normalised together (``paired``), as the client computes
    them.
    """

    def represent(key, images, pool):
        root = jax.random.fold_in(key, _VIEW_STREAM)
        x = images.astype(jnp.float32) / 255.0

        def views(img, row):
            k = jax.random.fold_in(jax.random.fold_in(root, row[0]), row[1])
            return (simclr_view(jax.random.fold_in(k, 0), img, blur=blur),
                    simclr_view(jax.random.fold_in(k, 1), img, blur=blur))

        a, b = jax.vmap(views)(x, pool)
        return encode(jnp.concatenate([a, b]), paired)

    return represent


def server_optimizer(lr: float, weight_decay: float, total_steps: int
                     ) -> optax.GradientTransformation:
    """LARS (You et al. 2017, as SimCLR) with a cosine learning rate from ``lr`` to 0 over
    ``total_steps``; biases and normalisation parameters are neither decayed nor adapted
    (SimCLR's convention)."""
    schedule = optax.cosine_decay_schedule(lr, max(total_steps, 1))

    def is_matrix(params):
        return jax.tree.map(lambda p: p.ndim > 1, params)

    return optax.lars(schedule, weight_decay=weight_decay, weight_decay_mask=is_matrix,
                      trust_ratio_mask=is_matrix, momentum=0.9)


def init_server_training(model, key: jax.Array, rep_shape: tuple[int, ...],
                         tx: optax.GradientTransformation) -> ServerTraining:
    """The server model's initial state on representations of shape ``rep_shape``."""
    # Jitted (eagerly every layer's initialiser compiles on its own), and with threefry's
    # non-partitionable bit layout, as `models.model_fns` initialises (a shorter XLA:CPU
    # compile; the same weights on every backend).
    init = jax.jit(lambda k, x: model.init(k, x, train=False))
    with jax.threefry_partitionable(False):
        variables = init(jax.random.fold_in(key, _SERVER_INIT_STREAM),
                         jnp.zeros((2, *rep_shape), jnp.float32))
    params = variables["params"]
    return ServerTraining(params=params, batch_stats=variables.get("batch_stats", {}),
                          opt_state=tx.init(params), epoch=jnp.zeros((), jnp.int32))


def make_server_epoch(model, tx: optax.GradientTransformation, *, batch_size: int,
                      temperature: float):
    """Builds ``epoch(state, reps [2P, h, w, c], key) -> (state, mean loss)``: one pass over
    the ``P`` representation pairs in a fresh order (``P // batch_size`` steps; the last
    partial batch is dropped, as SimCLR does), one ``lax.scan``."""

    def loss_fn(params, batch_stats, pairs):
        (_, z), updates = model.apply({"params": params, "batch_stats": batch_stats}, pairs,
                                      train=True, mutable=["batch_stats"])
        k = pairs.shape[0] // 2
        return nt_xent_loss(z[:k], z[k:], temperature=temperature), updates["batch_stats"]

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def epoch(state: ServerTraining, reps: jax.Array, key: jax.Array):
        p = reps.shape[0] // 2
        steps = p // batch_size
        order = jax.random.permutation(
            jax.random.fold_in(jax.random.fold_in(key, _EPOCH_STREAM), state.epoch), p)

        def step(carry, t):
            params, batch_stats, opt_state = carry
            rows = jax.lax.dynamic_slice_in_dim(order, t * batch_size, batch_size)
            pairs = jnp.concatenate([reps[rows], reps[rows + p]])
            (loss, batch_stats), grads = grad_fn(params, batch_stats, pairs)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), batch_stats, opt_state), loss

        (params, batch_stats, opt_state), losses = jax.lax.scan(
            step, (state.params, state.batch_stats, state.opt_state), jnp.arange(steps))
        new = ServerTraining(params=params, batch_stats=batch_stats, opt_state=opt_state,
                             epoch=state.epoch + 1)
        return new, jnp.mean(losses)

    return epoch
