"""MFCL's client side after phase 1: the frozen client module as an encoder, the BatchNorm
statistics a client may compute over its own data (``mfcl.bn_statistics=client``), and the
representation pairs the kept clients send the server in phase 2.

MFCL: Motamedi & Kim, "Modular Federated Contrastive Learning with Twin Normalization for
Resource-limited Clients" (TMLR). ``fedjax_rcl.mfcl.run`` orchestrates the phases around these.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.config import CoreConfig
from fedjax_rcl.experiment import Experiment
from fedjax_rcl.mfcl import phase2
from fedjax_rcl.models.mfcl import ClientModule
from fedjax_rcl.nn import conv

__all__ = ["ClientEncoder", "client_encoder", "client_statistics", "represent_all"]


def _batch_dependent(cfg: CoreConfig) -> bool:
    """Whether the client module's phase-2 output depends on its batch (BatchNorm computing
    with batch statistics, ``mfcl.bn_statistics=batch``)."""
    return cfg.norm == "batch" and cfg.mfcl.bn_statistics == "batch"


def _client_statistics_mode(cfg: CoreConfig) -> bool:
    """Whether each client normalises its phase-2 representations with its own BatchNorm
    statistics (``mfcl.bn_statistics=client``)."""
    return cfg.norm == "batch" and cfg.mfcl.bn_statistics == "client"


class ClientEncoder:
    """The frozen client module of a phase-1 model: ``encode(x, paired, batch_stats=None)``.

    ``paired`` (a client computing its view pairs) makes Twin Normalization take rows i and
    i + K together and, with ``mfcl.bn_statistics=batch``, BatchNorm use the statistics of the
    batch ``x``. ``batch_stats`` (``mfcl.bn_statistics=client``) replaces the model's running
    statistics with a client's own (``client_statistics``); BatchNorm then computes in its
    evaluation form with those.

    Which statistics MFCL's BatchNorm client module uses for the representations is not
    stated in the paper: it writes them ``z = f_theta_T(x)``, a function of the final
    federated parameters alone, which is the evaluation form with the averaged running
    statistics (``running``, the default) when those statistics count among the parameters,
    as they do for a Keras model averaged by FedAvg (MFCL's implementation is TensorFlow).
    ``batch`` and ``client`` are the two other readings (``MfclConfig.bn_statistics``).

    Attributes:
      module: the ``ClientModule``.
      apply: ``module.apply`` tracing with the run's evaluation convolutions (the phase-1
        model's, ``ModelFns.conv_impl``).
      variables: its variables (``params`` and, for BatchNorm, ``batch_stats``).
      norm: the client module's normalisation.
      bn_layers: the names of its normalisation layers, in order, each after the convolution
        ``conv{i}`` of the same index.
    """

    bn_layers = ("norm1", "norm2")

    def __init__(self, exp: Experiment, params, model_state):
        ae = exp.model.module
        self.module = ClientModule(ae.norm, ae.group_size, tn_variance=ae.tn_variance)
        self.apply = conv.under(exp.model.conv_impl, self.module.apply)
        self.norm = exp.cfg.norm
        self._batch_stats = _batch_dependent(exp.cfg)
        self._compiled: dict = {}
        # The autoencoder's "client" submodule's variables, every collection.
        self.variables = {"params": params["client"],
                          **{k: v["client"] for k, v in model_state.items()}}

    def __call__(self, x: jax.Array, paired: bool, batch_stats=None) -> jax.Array:
        if batch_stats is not None:  # a client's own statistics, BatchNorm's evaluation form
            return self.apply({**self.variables, "batch_stats": batch_stats}, x, train=False)
        # Twin Normalization: the client computes each pair's representations together;
        # GroupNorm, and BatchNorm by default, use their evaluation form (running
        # statistics), which depends on no other sample.
        if paired and self._batch_stats:  # training form; the running statistics stay frozen
            return self.apply(self.variables, x, train=True, mutable=["batch_stats"])[0]
        return self.apply(self.variables, x, train=paired and self.norm == "twin")

    def norm_input_moments(self, x: jax.Array, mask: jax.Array, batch_stats, layer: int
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(count, mean [C], M2 [C])`` of the input of BatchNorm layer ``layer`` (1-based:
        the output of ``conv{layer}``) over the rows of ``x [2N, H, W, 3]`` whose pair is
        marked in ``mask [N]`` (rows i and i + N), the earlier layers normalised with
        ``batch_stats``; ``M2`` is the sum of squared deviations from ``mean``."""
        name = f"conv{layer}"
        _, state = self.apply(
            {**self.variables, "batch_stats": batch_stats}, x, train=False,
            capture_intermediates=lambda mdl, method: mdl.name == name,
            mutable=["intermediates"])
        y = state["intermediates"][name]["__call__"][0]
        m = jnp.concatenate([mask, mask]).astype(y.dtype)[:, None, None, None]
        count = jnp.sum(m) * y.shape[1] * y.shape[2]
        mean = jnp.sum(y * m, axis=(0, 1, 2)) / count
        return count, mean, jnp.sum(jnp.square(y - mean) * m, axis=(0, 1, 2))

    def compiled(self, what: str, arg=None):
        """This encoder's functions for ``mfcl.bn_statistics=client``, each compiled once:
        ``("views", blur)``: ``(key, images, pool) -> views [2N, H, W, 3]`` (the augmented
        view pairs, ``phase2.make_representations`` with no encoder); ``("moments",
        layer)``: ``(views, mask, batch_stats) -> norm_input_moments``; ``("encode",)``:
        ``(views, batch_stats) -> representations``. The augmentations compile once, not
        once per function."""
        if (what, arg) not in self._compiled:
            if what == "views":
                fn = phase2.make_representations(lambda x, paired: x, paired=True, blur=arg)
            elif what == "moments":
                def fn(x, mask, batch_stats):
                    return self.norm_input_moments(x, mask, batch_stats, arg)
            else:
                def fn(x, batch_stats):
                    return self(x, True, batch_stats)
            self._compiled[what, arg] = jax.jit(fn)
        return self._compiled[what, arg]


def client_encoder(exp: Experiment):
    """``(params, model_state) -> ClientEncoder``: the frozen client module of a phase-1
    model (``ClientEncoder``)."""

    def make(params, model_state):
        return ClientEncoder(exp, params, model_state)

    return make


def _padded(rows: np.ndarray, chunk: int) -> tuple[np.ndarray, jax.Array]:
    """``rows`` (at most ``chunk``) padded to ``chunk`` by repeating the last, and the mask
    of the real ones."""
    m = len(rows)
    return (np.concatenate([rows, np.repeat(rows[-1:], chunk - m, 0)]),
            jnp.asarray(np.arange(chunk) < m))


def client_statistics(exp: Experiment, encode: ClientEncoder, rows: np.ndarray,
                      chunk: int = 250, images: jax.Array | None = None) -> dict:
    """A client's own BatchNorm statistics (``mfcl.bn_statistics=client``): for each BatchNorm
    layer of the client module in turn, the mean and (biased) variance of its input over all
    the views of the client's pool ``rows [n, 2]`` (both views of each, as it sends them),
    the earlier layers normalised with the statistics already computed -- the population
    statistics BatchNorm's running averages estimate, of this client's data alone, with the
    final phase-1 weights. Chunks of ``chunk`` pairs, combined exactly (Chan et al.'s
    pairwise update of the mean and the sum of squared deviations, in float64).

    ``images``: the training images already on the device (default: put there now).

    Returns the client module's ``batch_stats`` collection with those statistics."""
    key = jax.random.PRNGKey(exp.cfg.seed)
    images = jnp.asarray(exp.dataset.train_images) if images is None else images
    views = encode.compiled("views", exp.cfg.mfcl.blur)
    stats = jax.tree.map(jnp.asarray, encode.variables["batch_stats"])
    for i, name in enumerate(encode.bn_layers, 1):
        moments = encode.compiled("moments", i)
        n, mean, m2 = 0.0, 0.0, 0.0
        for s in range(0, len(rows), chunk):
            block, mask = _padded(rows[s:s + chunk], chunk)
            x = views(key, images[block[:, 0]], jnp.asarray(block))
            nb, mb, m2b = (np.asarray(v, np.float64) for v in moments(x, mask, stats))
            total = n + nb
            delta = mb - mean
            mean, m2 = mean + delta * (nb / total), m2 + m2b + delta ** 2 * (n * nb / total)
            n = total
        stats = {**stats, name: {"bn": {"mean": jnp.asarray(mean, jnp.float32),
                                        "var": jnp.asarray(m2 / n, jnp.float32)}}}
    return stats


def _represent_with_own_statistics(exp: Experiment, encode: ClientEncoder, pool: np.ndarray,
                                   bounds: list, owners: list, chunk: int) -> jax.Array:
    """``represent_all`` with ``mfcl.bn_statistics=client``: each client's statistics over
    all of its runs (``bounds`` of the pool, ``owners`` the client of each), then its runs
    normalised with them in padded chunks of ``chunk`` pairs."""
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(exp.cfg.seed)
    views, apply = encode.compiled("views", exp.cfg.mfcl.blur), encode.compiled("encode")
    firsts, seconds, stats = [], [], {}
    for (start, end), c in zip(bounds, owners, strict=True):
        if c not in stats and end > start:
            rows = [pool[s:e] for (s, e), o in zip(bounds, owners, strict=True) if o == c]
            stats[c] = client_statistics(exp, encode, np.concatenate(rows), chunk, images)
        for s in range(start, end, chunk):
            m = min(chunk, end - s)
            rows, _ = _padded(pool[s:s + m], chunk)
            r = apply(views(key, images[rows[:, 0]], jnp.asarray(rows)), stats[c])
            firsts.append(r[:m])
            seconds.append(r[chunk:chunk + m])
    return jnp.concatenate(firsts + seconds)


def represent_all(exp: Experiment, encode, pool: np.ndarray, segments: list[int],
                   chunk: int = 250, owners: Sequence[int] | None = None) -> jax.Array:
    """The representation pairs the kept clients send: ``[2P, h, w, c]``, first views then
    second views (row i and row i + P a pair).

    ``segments`` are the lengths of the pool's per-client runs (in pool order), ``owners``
    the client of each (None: each its own; a client with several draws, ``rho > 1``, owns
    several). A client module whose output depends on the batch (``mfcl.bn_statistics=
    batch``) is run on each client's own batches of ``batch_size`` pairs, as the client
    would; with ``mfcl.bn_statistics=client`` each client's runs are normalised with its own
    statistics (``client_statistics`` over all of its runs), in padded chunks of ``chunk``
    pairs of one client; any other in padded chunks of ``chunk`` pairs across clients (one
    compiled shape; the same result)."""
    cfg = exp.cfg.mfcl
    starts = np.cumsum([0, *segments])
    bounds = list(zip(starts[:-1], starts[1:], strict=True))
    if _client_statistics_mode(exp.cfg):
        owners = list(range(len(segments))) if owners is None else list(owners)
        return _represent_with_own_statistics(exp, encode, pool, bounds, owners, chunk)
    represent = jax.jit(phase2.make_representations(encode, paired=True, blur=cfg.blur))
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(exp.cfg.seed)
    if _batch_dependent(exp.cfg):
        batches = [(s, min(s + exp.cfg.batch_size, end)) for start, end in bounds
                   for s in range(start, end, exp.cfg.batch_size)]
        pad = False  # a client's last batch is smaller (its own compiled shape)
    else:
        batches = [(s, min(s + chunk, len(pool))) for s in range(0, len(pool), chunk)]
        pad = True
    firsts, seconds = [], []
    for s, e in batches:
        rows, m = pool[s:e], e - s
        if pad and m < chunk:  # pad the last chunk, drop the padding
            rows = np.concatenate([rows, np.repeat(rows[-1:], chunk - m, 0)])
        r = represent(key, images[rows[:, 0]], jnp.asarray(rows))
        firsts.append(r[:m])
        seconds.append(r[len(rows):len(rows) + m])
    return jnp.concatenate(firsts + seconds)
