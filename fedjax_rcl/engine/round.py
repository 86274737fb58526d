"""The federated round as one compiled program, and several rounds fused.

``round_rows(state, data, rows) -> (state, metrics, new_rows)``, the sampled clients' rows of
the per-client state table in and their new rows out (``engine.tables`` keeps the table, on
the device or in host memory):

1. keys depend only on (seed, round, client): ``fold_in(fold_in(client_root, round), client)``,
   so a resumed run is identical to an uninterrupted one;
2. ``m = max(int(participation * num_clients), 1)`` clients sampled without replacement;
3. the server's broadcast (``ServerOptimizer.start``: the global model, or FedACG's
   look-ahead) sent to every client (``in_axes=None``), with each sampled client's state row;
4. ``vmap`` over the sampled clients of the local ``scan`` (``engine/client.py``);
5. weighted mean of client models (and of their BatchNorm statistics, if any) over the client
   axis, added up group by group as the groups finish (clients one after another never hold
   more than one group's trained models at once), then over devices;
6. server optimizer (optax) on the pseudo-gradient ``theta - mean_k theta_k``; the clients' new
   state rows returned.

``run_rounds(state, data, n)`` runs ``n`` rounds in one ``fori_loop`` (``n`` is a traced value, so
every chunk length between evaluations uses the same executable) and returns each round's
metrics in a buffer of static length ``capacity``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_rcl.data.device import ClientData
from fedjax_rcl.engine.algorithm import ClientAlgorithm, ServerContext
from fedjax_rcl.engine.client import LocalUpdate
from fedjax_rcl.models.base import ModelState
from fedjax_rcl.server.aggregate import client_weights, weighted_sum
from fedjax_rcl.server.optimizers import ServerOptimizer
from fedjax_rcl.types import ClientState, Metrics, Params, PRNGKey

# The mesh axis that clients are sharded over.
CLIENTS = "clients"
# Metrics a local update may report that stay per client (``client_<name>`` in the round's).
PER_CLIENT_METRICS = ("acc_before", "acc_after")
# Independent streams derived from the root key.
_SAMPLING_STREAM, _CLIENT_STREAM, _INIT_STREAM = 0, 1, 2


@struct.dataclass
class ServerState:
    """Everything the next round reads.

    Attributes:
      params: global model parameters.
      model_state: global non-trained model variables (BatchNorm statistics; ``{}`` if none).
      opt_state: server optimizer state.
      client_states: per-client state table, leaves ``[num_clients, ...]`` (``()`` if none).
      round: ``int32 []``, index of the next round to run (0-based).
      key: ``uint32 [2]``, the run's root PRNG key.
      message: what the server broadcasts besides the model (``ClientAlgorithm.server_message``;
        ``()`` if nothing).
      algorithm_state: the client algorithm's persistent server state
        (``ClientAlgorithm.init_server_state``; SCAFFOLD's control variate), ``()`` if none.
    """

    params: Params
    model_state: ModelState
    opt_state: optax.OptState
    client_states: ClientState
    round: jax.Array
    key: PRNGKey
    message: Any = ()
    algorithm_state: Any = ()

    # Fields added after checkpoints existed: a checkpoint written before restores with them
    # empty (``fedjax_rcl.checkpoint``), as every algorithm without server state leaves them.
    ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("algorithm_state",)


# ``round_rows(state, data, rows) -> (state, metrics, new_rows)`` (``make_round``): one round
# on the sampled clients' state rows.
RoundRows = Callable[[ServerState, ClientData, ClientState],
                     tuple[ServerState, Metrics, ClientState]]
# ``run_round(state, data) -> (state, metrics)``: one round, the client table included.
RunRound = Callable[[ServerState, ClientData], tuple[ServerState, Metrics]]
# ``run_rounds(state, data, n) -> (state, metrics)`` (``make_run_rounds``): ``n`` rounds fused.
RunRounds = Callable[[ServerState, ClientData, jax.Array], tuple[ServerState, Metrics]]


def init_server_state(params: Params, model_state: ModelState, algorithm: ClientAlgorithm,
                      server_opt: ServerOptimizer, key: PRNGKey,
                      report_like=None) -> ServerState:
    """The state before round 0, without the per-client table (``client_states=()``: a
    ``engine.tables`` strategy places it), and the server's message from all-zero reports
    shaped as ``report_like`` (an algorithm with a ``report``)."""
    return ServerState(params=params, model_state=model_state, opt_state=server_opt.tx.init(params),
                       client_states=(), round=jnp.zeros((), jnp.int32), key=key,
                       message=initial_message(algorithm, report_like),
                       algorithm_state=algorithm.init_server_state(params, model_state))


def initial_message(algorithm: ClientAlgorithm, report_like):
    """The server's message before any client has reported: from all-zero reports."""
    if algorithm.server_message is None:
        return ()
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), report_like)
    return algorithm.server_message(zeros)


def init_key(key: PRNGKey) -> PRNGKey:
    """The key that initialises the global model (its own stream of the root key)."""
    return jax.random.fold_in(key, _INIT_STREAM)


def clients_per_round(num_clients: int, participation: float) -> int:
    """``max(int(participation * num_clients), 1)``."""
    return max(int(participation * num_clients), 1)


# Client samplers by version (``sampling_version``): a version's draws never change.
SAMPLING_VERSIONS = (1, 2)


def sample_clients(key: PRNGKey, round_index: jax.Array, num_clients: int, m: int,
                   version: int = 1) -> jax.Array:
    """``int32 [m]`` distinct client ids for this round, uniformly among the ``m``-subsets.

    Version 1: ``jax.random.choice`` without replacement, which permutes the whole population
    (``O(N)`` a round: a second a round at a million clients on a CPU). Version 2: Floyd's
    algorithm (Bentley & Floyd, CACM 1987): for ``j = N - m .. N - 1`` draw ``t`` uniform in
    ``[0, j]`` and take ``t``, or ``j`` if ``t`` is taken already; ``O(m^2)`` work, none of it
    growing with the population. Both give every ``m``-subset the same probability; their
    draws differ.
    """
    k = jax.random.fold_in(jax.random.fold_in(key, _SAMPLING_STREAM), round_index)
    if version == 1:
        return jax.random.choice(k, num_clients, (m,), replace=False).astype(jnp.int32)
    if version != 2:
        raise ValueError(f"sampling version {version!r}: allowed {SAMPLING_VERSIONS}")

    def step(i, taken):
        j = num_clients - m + i
        t = jax.random.randint(jax.random.fold_in(k, i), (), 0, j + 1, dtype=jnp.int32)
        seen = jnp.any((taken == t) & (jnp.arange(m) < i))
        return taken.at[i].set(jnp.where(seen, j, t).astype(jnp.int32))

    return jax.lax.fori_loop(0, m, step, jnp.zeros((m,), jnp.int32))


def client_keys(key: PRNGKey, round_index: jax.Array, clients: jax.Array) -> jax.Array:
    """``[m, 2]`` keys ``fold_in(fold_in(client_root, round), client)``."""
    root = jax.random.fold_in(jax.random.fold_in(key, _CLIENT_STREAM), round_index)
    return jax.vmap(lambda c: jax.random.fold_in(root, c))(clients)


def cohort_layout(m: int, devices: int, clients_in_parallel: int | None) -> tuple[int, int]:
    """How the ``m`` sampled clients are laid out: ``(groups, per_group)``.

    ``per_group`` clients train side by side (``vmap``, sharded over ``devices``), the groups one
    after another (``lax.map``), which bounds memory when clients are many or models large.
    ``per_group`` is rounded up to a multiple of ``devices``; ``groups * per_group >= m``, and the
    extra slots are padded clients that weigh 0 (padded and masked, never a Python branch).
    """
    k = m if not clients_in_parallel else min(clients_in_parallel, m)
    k = -(-k // devices) * devices
    return -(-m // k), k


def make_round(local_update: LocalUpdate, server_opt: ServerOptimizer, *, num_clients: int,
               server_message: Callable[[Any], Any] | None = None,
               update_server_state: Callable[..., Any] | None = None,
               participation: float, aggregation: str, mesh: Mesh | None = None,
               clients_in_parallel: int | None = None, sampling: int = 1) -> RoundRows:
    """Builds the round as a pure function of the sampled clients' state rows; a table
    strategy (``engine.tables``) supplies the rows and keeps the new ones.

    Args:
      local_update: from ``engine.client.make_local_update``.
      server_opt: what the clients start from (``start``) and the optax transformation applied
        to the pseudo-gradient (``tx``).
      num_clients, participation: the population and the sampled fraction.
      aggregation: ``size`` or ``uniform`` client weights.
      server_message: the algorithm's ``server_message`` (for one with a ``report``).
      update_server_state: the algorithm's ``update_server_state`` (for one with server state):
        it receives the clients' ``result`` summed over the round's sampled clients.
      mesh: a mesh with a ``clients`` axis to shard the sampled clients over (None: one device).
        The same code runs on one device, several, or several processes; only float
        reassociation in the client mean differs.
      clients_in_parallel: at most this many clients train at once (None: all sampled).
      sampling: the client sampler's version (``sample_clients``).
    Returns:
      ``round_rows(state, data, rows) -> (state, metrics, new_rows)`` with ``rows`` the state
      rows of ``sample_clients(state.key, state.round, num_clients, m)`` in that order. Metrics:
      ``loss`` (mean over sampled clients), ``client_loss`` ``[m]``, ``clients`` ``[m]``,
      the mean of each term the local objective reports, and, when local training measures
      them (``LocalTraining.client_eval``), ``client_acc_before`` and ``client_acc_after``
      ``[m]``.
    """
    m = clients_per_round(num_clients, participation)
    devices = 1 if mesh is None else mesh.shape[CLIENTS]
    groups, per_group = cohort_layout(m, devices, clients_in_parallel)
    padded = groups * per_group
    vmapped = jax.vmap(local_update, in_axes=(None, None, 0, 0, 0, 0, None, None, None, None))

    def spread(x, spec):
        return x if mesh is None else jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, spec))

    def train_group(params, model_state, round_index, data, message, algo_state, group):
        """``k`` clients side by side: ``group`` leaves ``[k, ...]`` -> outputs ``[k, ...]``."""
        rows, keys, idx, sizes = group
        if jax.tree.leaves(keys)[0].shape[0] == 1:
            # One client at a time: call it unbatched. A vmap of size 1 still turns every
            # convolution into a batched one, slower on XLA:CPU (BENCHMARKS.md).
            one = jax.tree.map(lambda x: x[0], (rows, keys, idx, sizes))
            out = local_update(params, model_state, *one, round_index, data, message,
                               algo_state)
            return jax.tree.map(lambda x: x[None], out)
        return vmapped(params, model_state, rows, keys, idx, sizes, round_index, data, message,
                       algo_state)

    def train_local(params, model_state, round_index, data, message, algo_state, xs, w):
        """This device's clients (all of them without a mesh), ``per_group // devices`` at a
        time: leaves ``[n, ...]``, weights ``w`` ``[n]`` (their share of the round's mean) ->
        ``(sums, rest)``: ``sums`` the weighted sums of the trained models and model states
        (float32, added over groups as each finishes, then over devices) and of the clients'
        ``result`` (unweighted, over the clients of weight > 0: the round's real ones; ``()``
        without one), ``rest`` the new state rows and the metrics, leaves ``[n, ...]``."""
        n = jax.tree.leaves(xs)[0].shape[0]
        k = per_group // devices

        def run(group, wg):
            trained, trained_ms, new_rows, client_metrics = train_group(
                params, model_state, round_index, data, message, algo_state, group)
            results = client_metrics.pop("result", ())
            real = (wg > 0).astype(jnp.float32)
            result_sums = jax.tree.map(
                lambda r: jnp.tensordot(real.astype(r.dtype), r, axes=(0, 0)), results)
            return ((*weighted_sum((trained, trained_ms), wg), result_sums),
                    (new_rows, client_metrics))

        if n == k:
            sums, rest = run(xs, w)
        else:
            split = lambda x: x.reshape(n // k, k, *x.shape[1:])
            groups_xs, groups_w = jax.tree.map(split, xs), split(w)
            # The sums have the shapes of the model and its state (the round subtracts the
            # mean from the global model), in weighted_sum's float32, and of the results.
            first = jax.tree.map(lambda x: x[0], (groups_xs, groups_w))
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(run, *first)[0])

            def body(acc, group):
                sums, rest = run(*group)
                return jax.tree.map(jnp.add, acc, sums), rest

            sums, rest = jax.lax.scan(body, zeros, (groups_xs, groups_w))
            rest = jax.tree.map(lambda x: x.reshape(n, *x.shape[2:]), rest)
        if mesh is not None:
            sums = jax.lax.psum(sums, CLIENTS)
        return sums, rest

    # With a mesh, each device trains its block of clients with exactly the single-device code
    # (shard_map rather than XLA's automatic partitioning: an FFI call such as the oneDNN
    # convolutions has no partitioning rule, and XLA would replicate it on every device).
    # check_vma=False: every value inside is per device, and the global model is each client's
    # private starting point; the gradients taken inside are local, never summed over devices.
    train = train_local if mesh is None else jax.shard_map(
        train_local, mesh=mesh,
        in_specs=(P(), P(), P(), P(), P(), P(), P(CLIENTS), P(CLIENTS)),
        out_specs=(P(), P(CLIENTS)), check_vma=False)

    def train_clients(state, data, clients, rows, w):
        """Local training of ``padded`` clients: ``[padded]`` ids and mean weights ->
        ``(sums, rest)`` (``train_local``)."""
        xs = (rows, client_keys(state.key, state.round, clients),
              data.client_indices[clients], data.client_sizes[clients])
        start = server_opt.start(state.params, state.opt_state)
        return train(start, state.model_state, state.round, data, state.message,
                     state.algorithm_state, xs, w)

    def round_rows(state: ServerState, data: ClientData,
                   rows: ClientState) -> tuple[ServerState, Metrics, ClientState]:
        sampled = sample_clients(state.key, state.round, num_clients, m, sampling)
        valid = jnp.arange(padded) < m
        clients = jnp.zeros((padded,), jnp.int32).at[:m].set(sampled)  # pads train client 0
        rows = jax.tree.map(  # padded slots train copies of the first sampled client's row
            lambda r: jnp.concatenate([r, jnp.broadcast_to(r[:1], (padded - m, *r.shape[1:]))])
            if padded > m else r, rows)
        weights = jnp.where(valid, client_weights(data.client_sizes[clients], aggregation), 0.0)
        (sum_params, sum_ms, sum_results), (new_rows, client_metrics) = train_clients(
            state, data, clients, rows, weights / jnp.sum(weights))
        like = lambda sums, tree: jax.tree.map(lambda s, x: s.astype(x.dtype), sums, tree)
        mean_params = like(sum_params, state.params)
        algorithm_state = state.algorithm_state
        if update_server_state is not None:
            start = server_opt.start(state.params, state.opt_state)
            algorithm_state, mean_params = update_server_state(
                algorithm_state, sum_results, mean_params,
                ServerContext(start, state.round, num_clients, m))
        pseudo_grad = jax.tree.map(jnp.subtract, state.params, mean_params)
        updates, opt_state = server_opt.tx.update(pseudo_grad, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        reports = client_metrics.pop("report", None)
        # Per-client values that are not averaged: each sampled client's own.
        own = {k: client_metrics.pop(k)[:m] for k in PER_CLIENT_METRICS if k in client_metrics}
        message = state.message
        if reports is not None:  # summed over the round's real clients
            message = server_message(jax.tree.map(
                lambda r: jnp.tensordot(valid.astype(r.dtype), r, axes=(0, 0)), reports))
        metrics = {k: jnp.sum(jnp.where(valid, v, 0.0)) / m for k, v in client_metrics.items()}
        metrics["client_loss"] = client_metrics["loss"][:m]
        metrics["clients"] = sampled
        metrics.update({f"client_{k}": v for k, v in own.items()})
        if mesh is not None:  # every process reads the metrics
            metrics = jax.tree.map(lambda x: spread(x, P()), metrics)
        new_state = state.replace(params=params, model_state=like(sum_ms, state.model_state),
                                  opt_state=opt_state, round=state.round + 1, message=message,
                                  algorithm_state=algorithm_state)
        return new_state, metrics, jax.tree.map(lambda r: r[:m], new_rows)

    return round_rows


def make_run_rounds(run_round: RunRound, capacity: int) -> RunRounds:
    """Fuses up to ``capacity`` rounds: ``run_rounds(state, data, n) -> (state, metrics)``.

    ``metrics`` leaves are ``[capacity, ...]``; entries ``0..n-1`` hold rounds
    ``state.round .. state.round + n - 1``, the rest are zeros.
    """

    def run_rounds(state: ServerState, data: ClientData,
                   n: jax.Array) -> tuple[ServerState, Metrics]:
        shapes = jax.eval_shape(run_round, state, data)[1]
        buffers = jax.tree.map(lambda s: jnp.zeros((capacity, *s.shape), s.dtype), shapes)

        def body(i, carry):
            state, buffers = carry
            state, metrics = run_round(state, data)
            buffers = jax.tree.map(
                lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, i, 0), buffers, metrics
            )
            return state, buffers

        return jax.lax.fori_loop(0, n, body, (state, buffers))

    return run_rounds
