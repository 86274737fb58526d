"""Representation analysis during training (FedRCL, Figures 2 and 3): how collapsed are the
global model's and a local model's features?

Every ``analysis_every`` rounds the run records, on a fixed, class-balanced subset of the test
set (``analysis_images`` images, ``analysis_subset``), the penultimate features
(``ModelOutput.embedding``) of

* the global model, and
* one client's local model: the first client sampled for the next round, trained from the
  round's starting point exactly as that round will train it (same keys, same data): the
  paper plots local models, which are where the skewed data collapse the features first.

From each, on the host in float64 (``fedjax_rcl.metrics``): the effective rank, the within- and
between-class covariance traces and the variability collapse index (the paper's measures, all
of centred features), and the measures that keep the mean -- the effective rank of the
uncentred second moment, the mean pairwise cosine and the spread share -- which see features
collapsing towards one point, where centring removes the point and the centred rank of the
small residual around it can stay high. Also the participation
histogram: how often each client has been sampled so far (recomputed from the sampling rule,
so a resumed run reports the same). The analysis changes nothing in the run (the retrained
client is a side computation), so its settings may change on resume.

Cost: one client's local update plus two forward passes over the subset, per analysis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.data.augment import normalize
from fedjax_rcl.engine.round import client_keys, sample_clients
from fedjax_rcl.metrics.representation import (
    class_covariance_traces,
    effective_rank,
    mean_pairwise_cosine,
    spread_share,
    variability_collapse_index,
)


def _summary(prefix: str, features: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    x = np.asarray(features, np.float64)
    within, between = class_covariance_traces(x, labels)
    return {f"{prefix}_effective_rank": effective_rank(x),
            f"{prefix}_vci": variability_collapse_index(x, labels),
            f"{prefix}_trace_within": within, f"{prefix}_trace_between": between,
            f"{prefix}_effective_rank_uncentred": effective_rank(x, centred=False),
            f"{prefix}_mean_cosine": mean_pairwise_cosine(x),
            f"{prefix}_spread_share": spread_share(x)}


def analysis_subset(labels, num_images: int) -> np.ndarray:
    """Indices of ``num_images`` test images with the classes interleaved: the i-th image of
    every class comes before the (i+1)-th of any, in the test set's order. The subset is
    class-balanced whatever that order is -- an image folder lists its test set class by
    class, so its first 1,000 images would all be one class and the between-class terms (and
    the VCI) would be undefined."""
    labels = np.asarray(labels)
    counts = np.bincount(labels)
    by_class = np.argsort(labels, kind="stable")
    rank = np.empty(len(labels), np.int64)  # position of each image within its class
    rank[by_class] = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.sort(np.lexsort((labels, rank))[:num_images])


def make_analysis(model, dataset, data, local_update, server_start, row, *, num_clients: int,
                  clients_per_round: int, rounds: int, num_images: int, sampling: int = 1):
    """Builds ``analyze(state) -> dict`` of metrics at ``state`` (before the round
    ``state.round`` runs); ``analyze.compile_ahead(state)`` compiles its programs without
    running them, so that a run's compile time includes them.

    Args:
      model: the ``ModelFns`` that trains; its ``embedding`` output is analysed.
      dataset: the ``ImageDataset`` whose test set the subset is drawn from.
      data: the ``ClientData`` on the device.
      local_update: one client's pure local update (``engine.client.make_local_update``).
      server_start: ``(params, opt_state) -> params`` that clients start from.
      row: ``(state, client) -> row``, a client's state row (``ClientTable.row``).
      num_clients, clients_per_round: the population and the clients a round samples.
      rounds: the run's last round (the participation histogram's fixed range).
      num_images: the size of the analysed test subset (``analysis_subset``).
    """
    labels = np.asarray(dataset.test_labels)
    subset = analysis_subset(labels, num_images)
    images, labels = np.asarray(dataset.test_images)[subset], labels[subset]
    mean, std = dataset.mean, dataset.std
    m = clients_per_round

    @jax.jit
    def features(params, model_state, x):
        out, _ = model.apply(params, model_state, normalize(x, mean, std), train=False)
        return out.embedding

    @jax.jit
    def local_model(state, data, client_row):
        client = sample_clients(state.key, state.round, num_clients, m, sampling)[0]
        key = client_keys(state.key, state.round, client[None])[0]
        start = server_start(state.params, state.opt_state)
        params, model_state, _, _ = local_update(
            start, state.model_state, client_row, key, data.client_indices[client],
            data.client_sizes[client], state.round, data, state.message,
            state.algorithm_state)
        return params, model_state, client

    @jax.jit
    def histogram(key, done):
        # Over a fixed range (this process's last round) with the later rounds masked out, so
        # that every analysis reuses one compiled program.
        r = jnp.arange(max(rounds, 1))
        picks = jax.vmap(lambda i: sample_clients(key, i, num_clients, m, sampling))(r)
        counted = jnp.broadcast_to((r < done)[:, None], picks.shape).astype(jnp.int32)
        return jnp.zeros((num_clients,), jnp.int32).at[picks.reshape(-1)].add(
            counted.reshape(-1))

    @jax.jit
    def first_client(key, round_):
        return sample_clients(key, round_, num_clients, m, sampling)[0]

    def analyze(state) -> dict:
        x = jnp.asarray(images)
        out = _summary("global", jax.device_get(features(state.params, state.model_state, x)),
                       labels)
        first = int(first_client(state.key, state.round))
        params, model_state, client = local_model(state, data, row(state, first))
        out.update(_summary("local", jax.device_get(features(params, model_state, x)), labels))
        out["local_client"] = int(client)
        counts = np.asarray(jax.device_get(histogram(state.key, int(state.round))))
        out["participation"] = counts.tolist()
        return out

    def compile_ahead(state) -> None:
        """Compiles every program ``analyze(state)`` runs (for states shaped as ``state``)
        without running the analysis: a later call finds them in JAX's cache."""
        x = jnp.asarray(images)
        features.lower(state.params, state.model_state, x).compile()
        first = int(first_client(state.key, state.round))
        local_model.lower(state, data, row(state, first)).compile()
        histogram.lower(state.key, int(state.round)).compile()

    analyze.compile_ahead = compile_ahead
    return analyze
