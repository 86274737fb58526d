"""One client's local training: a ``lax.scan`` over local steps (step 4 of the round).

Each step gathers a batch by index from the device-resident training set, augments it in-graph,
takes the gradient of the algorithm's local objective and applies the client optimizer. The
function is written for one client; the round ``vmap``s it over the sampled clients, and the tests
run it client by client to check the ``vmap``.

Local epochs and uneven clients, with static shapes: client ``k`` with ``n_k`` samples runs
``S_k = ceil(n_k / B)`` steps per epoch for ``E`` epochs. The scan has the static length
``E * ceil(max_k n_k / B)``; a client's steps past ``E * S_k`` are masked (its parameters and
optimizer state pass through unchanged: padded, masked, never branched in Python). Each epoch
draws a fresh permutation of the client's samples; a final partial batch is filled by wrapping
around to the start of that epoch's permutation, so every batch has exactly ``B`` samples (for
the paper's 500 samples per client and B = 50 there is no partial batch and no padding at all).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_rcl.data.augment import augment_batch, normalize
from fedjax_rcl.data.device import ClientData
from fedjax_rcl.engine.algorithm import Batch, ClientAlgorithm, LocalContext, RoundContext
from fedjax_rcl.models.base import ModelFns, ModelState
from fedjax_rcl.types import ClientState, Metrics, Params, PRNGKey


def client_optimizer(learning_rate: float, *, clip_norm: float | None, weight_decay: float,
                     momentum: float) -> optax.GradientTransformation:
    """The reference's client optimizer as an optax chain, learning rate injectable per step.

    .. math::
        g \\leftarrow \\operatorname{clip}_{\\|\\cdot\\| \\le c}(g),\\quad
        g \\leftarrow g + \\lambda w,\\quad w \\leftarrow w - \\eta_{t,e}\\, \\mathrm{SGD}_\\mu(g)

    Gradient clipping by global norm, then coupled weight decay (PyTorch SGD's ``weight_decay``
    adds ``lambda * w`` after the reference clips), then SGD with optional momentum. The optimizer
    state is created afresh every round, as the reference builds a new optimizer per round.
    """

    def make(learning_rate):
        parts = []
        if clip_norm is not None and clip_norm > 0:
            parts.append(optax.clip_by_global_norm(clip_norm))
        if weight_decay > 0:
            parts.append(optax.add_decayed_weights(weight_decay))
        parts.append(optax.sgd(learning_rate, momentum=momentum if momentum > 0 else None))
        return optax.chain(*parts)

    return optax.inject_hyperparams(make)(learning_rate=learning_rate)


@dataclasses.dataclass(frozen=True)
class LocalTraining:
    """Static settings of local training (everything that shapes the compiled program).

    Attributes:
      batch_size: B.
      local_epochs: E.
      steps_per_epoch: ``ceil(max_k n_k / B)`` (``floor`` with ``drop_last``), the scan's
        steps per epoch.
      uniform_sizes: every client has the same size, so no step is ever masked.
      lr_fn: ``(round, epoch) -> learning rate`` (traced integers in, scalar out).
      mean, std: normalization constants; hflip, max_degrees, crop_padding, pad_mode:
        augmentation (``fedjax_rcl.data.augment``).
      augment: False to only normalize (no random geometry).
      num_classes: size of ``LocalContext.label_counts`` (0: not computed).
      num_views: augmented views of each sample in a batch (the algorithm's registered
        ``num_views``: 2 for view-contrastive objectives).
      client_eval: also measure each client's accuracy on its own (unaugmented) training
        samples with the model it starts from and the model it trained (``acc_before``,
        ``acc_after`` in its metrics), for per-client metrics.
      precision: ``fp32``, ``bf16`` or ``fp16``: the type the model computes in (the model
        passed to ``make_local_update`` does the casting, ``models.with_precision``); with
        ``fp16`` the loss is scaled dynamically (``GradScaler``).
      num_clients, sampled_fraction: the population and the fraction of it sampled each
        round, which the algorithm's ``RoundContext`` passes on.
      drop_last: an epoch is ``floor(n_k / B)`` full batches, the rest of the shuffled order
        left out (PyTorch's ``DataLoader(drop_last=True)``, as MOON's code trains); otherwise
        ``ceil(n_k / B)``, the last batch filled up from the start of the order.
    """

    batch_size: int
    local_epochs: int
    steps_per_epoch: int
    uniform_sizes: bool
    lr_fn: Callable[[jax.Array, jax.Array], jax.Array]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool = True
    max_degrees: float = 10.0
    crop_padding: int = 4
    pad_mode: str = "zero"
    augment: bool = True
    num_classes: int = 0
    num_views: int = 1
    client_eval: bool = False
    precision: str = "fp32"
    num_clients: int = 0
    sampled_fraction: float = 0.0
    drop_last: bool = False

    @property
    def num_steps(self) -> int:
        return self.local_epochs * self.steps_per_epoch


_MODEL_STREAM = 0x6D6F64  # fold_in data of the model's dropout key within a step's key


def epoch_permutations(key: PRNGKey, size: jax.Array, max_size: int, epochs: int) -> jax.Array:
    """``[epochs, max_size]`` positions; each row's first ``size`` entries permute ``0..size-1``."""

    def one(e):
        u = jax.random.uniform(jax.random.fold_in(key, e), (max_size,))
        u = jnp.where(jnp.arange(max_size) < size, u, 2.0)  # padding sorts last
        return jnp.argsort(u).astype(jnp.int32)

    return jax.vmap(one)(jnp.arange(epochs))


def masked_sum(xs, mask: jax.Array):
    """``sum_t xs[t]`` over the steps ``t`` where ``mask[t]`` (leaves ``[steps, ...]``), added
    in step order. A client's masked steps are its last ones, so they add exact zeros at the
    end: the sum is the same however far the client is padded (several runs in one program pad
    to the largest client of any of them), where a tree reduction's order would depend on the
    padded length."""

    def add(total, x_m):
        x, m = x_m
        return jax.tree.map(lambda t, v: t + jnp.where(m, v, jnp.zeros_like(v)), total, x), None

    zeros = jax.tree.map(lambda v: jnp.zeros(v.shape[1:], v.dtype), xs)
    return jax.lax.scan(add, zeros, (xs, mask))[0]


def report_like(model: ModelFns, algorithm: ClientAlgorithm, params: Params,
                model_state: ModelState, image_shape: tuple[int, ...], batch_size: int,
                num_views: int = 1):
    """Shapes and dtypes of one step's ``algorithm.report`` (None if it has none)."""
    if algorithm.report is None:
        return None
    images = jnp.zeros((batch_size * num_views, *image_shape), jnp.float32)
    batch = Batch(images, jnp.zeros((batch_size,), jnp.int32))

    def one(p, s):
        return algorithm.report(model.apply(p, s, batch.images, train=False)[0], batch)

    return jax.eval_shape(one, params, model_state)


class GradScaler(NamedTuple):
    """PyTorch's ``torch.amp.GradScaler`` state, with its defaults: the loss is multiplied by
    ``scale`` before differentiation and the gradients divided by it; a step whose gradients
    hold an inf or NaN is skipped and the scale halved; after ``GROWTH_INTERVAL`` finite steps
    in a row the scale doubles. The FedRCL authors train in float16 this way, with a fresh
    scaler for every client every round.

    Attributes:
      scale: ``float32 []``, the current loss scale (initially 2**16).
      good_steps: ``int32 []``, finite steps since the scale last changed.
    """

    scale: jax.Array
    good_steps: jax.Array

    INIT_SCALE = 2.0 ** 16
    GROWTH_FACTOR = 2.0
    BACKOFF_FACTOR = 0.5
    GROWTH_INTERVAL = 2000

    @classmethod
    def fresh(cls) -> GradScaler:
        return cls(jnp.float32(cls.INIT_SCALE), jnp.int32(0))

    def update(self, finite: jax.Array) -> GradScaler:
        """``GradScaler.update()`` after a step whose gradients were ``finite`` (or not)."""
        grown = self.good_steps + 1 == self.GROWTH_INTERVAL
        scale = jnp.where(finite, jnp.where(grown, self.scale * self.GROWTH_FACTOR, self.scale),
                          self.scale * self.BACKOFF_FACTOR)
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return GradScaler(scale.astype(jnp.float32), good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    """Whether every entry of every leaf is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def own_accuracy(model: ModelFns, settings: LocalTraining, params: Params,
                 model_state: ModelState, indices: jax.Array, size: jax.Array,
                 data: ClientData) -> jax.Array:
    """The accuracy of a model (evaluation mode) on a client's own training samples, without
    augmentation: ``indices`` its ``int32 [max_size]`` row, ``size`` how many are real.
    Batches of ``batch_size`` run one after another; padded positions are masked."""
    b = settings.batch_size
    chunks = -(-indices.shape[0] // b)
    padded = jnp.pad(indices, (0, chunks * b - indices.shape[0]))

    def one(c):
        pos = c * b + jnp.arange(b)
        idx = padded[pos]
        x = normalize(data.images[idx], settings.mean, settings.std)
        out, _ = model.apply(params, model_state, x, train=False)
        hit = (jnp.argmax(out.logits, -1) == data.labels[idx]) & (pos < size)
        return jnp.sum(hit)

    return jnp.sum(jax.lax.map(one, jnp.arange(chunks))) / size


# ``local_update(global_params, global_model_state, client_state, key, indices, size,
# round_index, data, message, server_state) -> (params, model_state, new_client_state,
# metrics)``: one client's local training (``make_local_update``).
LocalUpdate = Callable[
    [Params, ModelState, ClientState, PRNGKey, jax.Array, jax.Array, jax.Array, ClientData, Any,
     Any], tuple[Params, ModelState, ClientState, Metrics]]


def make_local_update(model: ModelFns, algorithm: ClientAlgorithm,
                      optimizer: optax.GradientTransformation, settings: LocalTraining, *,
                      penalty: Callable[[Params, Params], jax.Array] | None = None,
                      penalty_name: str = "server_penalty") -> LocalUpdate:
    """Builds ``local_update`` for one client.

    Args:
      model, algorithm, optimizer, settings: what trains, on what objective, how.
      penalty: ``(params, global_params) -> []`` added to the algorithm's objective whatever
        the algorithm (the server optimizer's client term, FedACG's), reported as
        ``penalty_name``.

    Returns:
      ``local_update(global_params, global_model_state, client_state, key, indices, size,
      round_index, data, message=(), server_state=()) -> (params, model_state,
      new_client_state, metrics)`` where ``indices`` is the client's ``int32 [max_size]`` row,
      ``size`` its sample count, ``message`` the server's broadcast besides the model,
      ``server_state`` the algorithm's server state, and ``metrics`` holds the mean over the
      client's active steps of the loss and of each term the objective reports, for an
      algorithm with a ``report`` the report summed over its last epoch's steps (``"report"``),
      and for one with a ``client_result`` that result (``"result"``).
    """
    s = settings

    def loss_fn(params, model_state, batch, ctx, model_key):
        out, model_state = model.apply(params, model_state, batch.images, train=True,
                                       rng=model_key)
        loss, terms = algorithm.objective(out, params, batch, ctx)
        if penalty is not None:
            extra = penalty(params, ctx.global_params)
            loss, terms = loss + extra, {**terms, penalty_name: extra}
        report = () if algorithm.report is None else jax.lax.stop_gradient(
            algorithm.report(out, batch))
        return loss, (terms, model_state, report)

    scaled = s.precision == "fp16"

    def scaled_loss_fn(params, model_state, batch, ctx, model_key, scale):
        loss, aux = loss_fn(params, model_state, batch, ctx, model_key)
        return loss * scale, (loss, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    scaled_grad_fn = jax.value_and_grad(scaled_loss_fn, has_aux=True)

    def local_update(global_params: Params, global_model_state: ModelState,
                     client_state: ClientState, key: PRNGKey, indices: jax.Array,
                     size: jax.Array, round_index: jax.Array, data: ClientData,
                     message=(), server_state=()):
        perm_key, step_root = jax.random.split(key)
        max_size = indices.shape[0]
        perms = epoch_permutations(perm_key, size, max_size, s.local_epochs)
        if s.drop_last:  # S_k (a client smaller than a batch takes no step)
            client_steps = size // s.batch_size
        else:
            client_steps = (size + s.batch_size - 1) // s.batch_size
        per_epoch = jnp.maximum(client_steps, 1) if s.drop_last else client_steps
        opt_state = optimizer.init(global_params)
        counts = None
        if s.num_classes:
            held = (jnp.arange(max_size) < size).astype(jnp.float32)
            counts = jnp.zeros((s.num_classes,), jnp.float32).at[data.labels[indices]].add(held)

        def step(carry, t):
            params, model_state, opt_state, scaler = carry
            epoch, b = t // per_epoch, t % per_epoch
            pos = (b * s.batch_size + jnp.arange(s.batch_size)) % size
            idx = indices[perms[jnp.minimum(epoch, s.local_epochs - 1), pos]]
            images, labels = data.images[idx], data.labels[idx]
            k_step = jax.random.fold_in(step_root, t)
            k_aug, k_loss = jax.random.split(k_step)
            # The model's own randomness (dropout): a stream of its own, so that the augmentation
            # and objective keys are the same whether or not the model draws any.
            k_model = jax.random.fold_in(k_step, _MODEL_STREAM)
            views = [
                augment_batch(jax.random.fold_in(k_aug, v), images, mean=s.mean, std=s.std,
                              max_degrees=s.max_degrees if s.augment else 0.0,
                              crop_padding=s.crop_padding if s.augment else 0,
                              hflip=s.hflip and s.augment, pad_mode=s.pad_mode)
                for v in range(s.num_views)
            ]
            batch = Batch(jnp.concatenate(views) if len(views) > 1 else views[0], labels)
            ctx = LocalContext(global_params, global_model_state, client_state, k_loss, counts,
                               message, server_state)
            if scaled:  # float16: scale, unscale before the optimizer clips, skip infs
                (_, (loss, (terms, new_model_state, report))), grads = scaled_grad_fn(
                    params, model_state, batch, ctx, k_model, scaler.scale)
                grads = jax.tree.map(lambda g: g / scaler.scale, grads)
                finite = all_finite(grads)
                terms = {**terms, "amp_skipped": (~finite).astype(jnp.float32)}
            else:
                (loss, (terms, new_model_state, report)), grads = grad_fn(
                    params, model_state, batch, ctx, k_model)
            lr = s.lr_fn(round_index, epoch)
            opt_state.hyperparams["learning_rate"] = lr
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            if algorithm.correct_update is not None:
                updates = algorithm.correct_update(updates, params, ctx, lr)
            new_params = optax.apply_updates(params, updates)
            if scaled:  # a skipped step keeps the weights and the optimizer state; BatchNorm's
                # statistics were updated by its forward pass all the same, as in PyTorch
                new_params, new_opt_state = jax.tree.map(
                    lambda n, o: jnp.where(finite, n, o), (new_params, new_opt_state),
                    (params, opt_state))
            if s.uniform_sizes:
                active = jnp.ones((), bool)
            else:
                active = t < s.local_epochs * client_steps
            new_scaler = scaler.update(finite) if scaled else scaler
            new = (new_params, new_model_state, new_opt_state, new_scaler)
            if not s.uniform_sizes:
                new = jax.tree.map(lambda n, o: jnp.where(active, n, o), new,
                                   (params, model_state, opt_state, scaler))
            return new, (loss, terms, active, report, lr)

        (params, model_state, _, _), (losses, terms, active, reports, lrs) = jax.lax.scan(
            step, (global_params, global_model_state, opt_state, GradScaler.fresh()),
            jnp.arange(s.num_steps)
        )
        count = masked_sum(jnp.ones(s.num_steps, jnp.float32), active)
        denom = jnp.maximum(count, 1.0) if s.drop_last else count
        metrics = {"loss": masked_sum(losses, active) / denom}
        metrics.update({k: masked_sum(v, active) / denom for k, v in terms.items()})
        if algorithm.report is not None:
            last_epoch = (jnp.arange(s.num_steps) // per_epoch == s.local_epochs - 1) & active
            metrics["report"] = masked_sum(reports, last_epoch)
        if s.client_eval:
            metrics["acc_before"] = own_accuracy(model, s, global_params, global_model_state,
                                                 indices, size, data)
            metrics["acc_after"] = own_accuracy(model, s, params, model_state, indices, size,
                                                data)
        rctx = RoundContext(global_params, global_model_state, server_state, count,
                            masked_sum(jnp.asarray(lrs, jnp.float32), active),
                            jnp.asarray(s.lr_fn(round_index, jnp.zeros((), jnp.int32)),
                                        jnp.float32),
                            round_index, s.num_clients, s.sampled_fraction)
        new_state = algorithm.update_client_state(client_state, params, model_state, rctx)
        if algorithm.client_result is not None:
            metrics["result"] = algorithm.client_result(client_state, new_state, params,
                                                        model_state, rctx)
        return params, model_state, new_state, metrics

    return local_update
