"""Jitted, batched evaluation of the global model on the full test set."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_rcl.data.augment import normalize
from fedjax_rcl.data.device import TestData
from fedjax_rcl.models.base import ModelFns, ModelState
from fedjax_rcl.types import Metrics, Params


def make_evaluate(model: ModelFns, *, mean: Sequence[float], std: Sequence[float]
                  ) -> Callable[[Params, ModelState, TestData], Metrics]:
    """Builds ``evaluate(params, model_state, test) -> {"accuracy", "loss"}`` on every test
    sample (the model in evaluation mode).

    Batches run one after another with ``lax.map`` (bounded memory); padding is masked out.
    """

    def evaluate(params: Params, model_state: ModelState, test: TestData) -> Metrics:
        def one(batch):
            images, labels, mask = batch
            out, _ = model.apply(params, model_state, normalize(images, mean, std), train=False)
            logits = out.logits
            correct = (jnp.argmax(logits, -1) == labels) & mask
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(correct), jnp.sum(jnp.where(mask, ce, 0.0))

        correct, loss = jax.lax.map(one, (test.images, test.labels, test.mask))
        n = jnp.sum(test.mask)
        return {"accuracy": jnp.sum(correct) / n, "loss": jnp.sum(loss) / n}

    return evaluate
