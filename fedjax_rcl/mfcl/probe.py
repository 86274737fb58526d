"""Linear probe: top-1 accuracy of a linear classifier on frozen features (the standard
evaluation of self-supervised representations; SimCLR §4, MFCL's tables).

The features are computed once; the classifier (one dense layer, softmax cross-entropy) trains
with Adam for a fixed number of epochs in one compiled program, from a key of the run, so the
probe is deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def linear_probe(train_x: jax.Array, train_y: jax.Array, test_x: jax.Array, test_y: jax.Array,
                 *, num_classes: int, epochs: int, lr: float, batch_size: int,
                 key: jax.Array) -> dict:
    """Trains ``softmax(W x + b)`` on ``train_x [N, D]`` and reports test top-1.

    Features are standardised with the training set's per-dimension mean and standard
    deviation (a fixed affine map, so the probe stays linear in the frozen features) to make
    one learning rate work across models and normalisations. The last partial batch of each
    epoch is dropped.

    Returns:
      ``{"linear_probe_accuracy", "linear_probe_train_accuracy", "linear_probe_loss"}``
      (floats: test top-1, train top-1, final training loss).
    """
    train_x, test_x = jnp.asarray(train_x, jnp.float32), jnp.asarray(test_x, jnp.float32)
    train_y, test_y = jnp.asarray(train_y, jnp.int32), jnp.asarray(test_y, jnp.int32)
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    n, d = train_x.shape
    batch_size = min(batch_size, n)
    steps = n // batch_size
    tx = optax.adam(lr)
    params = {"w": jnp.zeros((d, num_classes)), "b": jnp.zeros((num_classes,))}

    def loss_fn(p, x, y):
        logits = x @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def fit(params, key):
        def epoch(carry, e):
            def step(carry, t):
                params, opt_state = carry
                rows = jax.lax.dynamic_slice_in_dim(order, t * batch_size, batch_size)
                loss, grads = jax.value_and_grad(loss_fn)(params, train_x[rows], train_y[rows])
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), loss

            order = jax.random.permutation(jax.random.fold_in(key, e), n)
            carry, losses = jax.lax.scan(step, carry, jnp.arange(steps))
            return carry, jnp.mean(losses)

        (params, _), losses = jax.lax.scan(epoch, (params, tx.init(params)), jnp.arange(epochs))
        return params, losses[-1]

    params, last_loss = fit(params, key)

    def accuracy(x, y):
        return float(jnp.mean(jnp.argmax(x @ params["w"] + params["b"], -1) == y))

    return {"linear_probe_accuracy": accuracy(test_x, test_y),
            "linear_probe_train_accuracy": accuracy(train_x, train_y),
            "linear_probe_loss": float(last_loss)}
