"""A plain client-by-client round: the independent reference for the vmapped engine."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.engine.algorithm import ServerContext
from fedjax_rcl.engine.round import client_keys, clients_per_round, sample_clients


def sequential_local_updates(exp, state):
    """Runs each sampled client's local update alone (a Python loop over one jitted function).

    Returns:
      ``(clients, results)`` with ``results[j] = (params, model_state, client_state, metrics)``
      as NumPy trees.
    """
    m = clients_per_round(exp.cfg.num_clients, exp.cfg.participation)
    clients = np.asarray(sample_clients(state.key, state.round, exp.cfg.num_clients, m,
                                        exp.cfg.sampling_version))
    keys = client_keys(state.key, state.round, jnp.asarray(clients))
    step = jax.jit(exp.local_update)
    results = []
    for j, c in enumerate(clients):
        row = jax.tree.map(lambda t, c=c: t[c], state.client_states)
        out = step(state.params, state.model_state, row, keys[j], exp.data.client_indices[c],
                   exp.data.client_sizes[c], state.round, exp.data, state.message,
                   state.algorithm_state)
        results.append(jax.tree.map(np.asarray, out))
    return clients, results


def sequential_round(exp, state):
    """The round client by client, then a NumPy weighted mean (FedAvg server step), which an
    algorithm with server state then corrects (``update_server_state`` on the clients'
    results summed in NumPy).

    Returns:
      ``(mean_params, clients, client_losses)``.
    """
    clients, results = sequential_local_updates(exp, state)
    sizes = np.asarray(exp.data.client_sizes)[clients].astype(np.float64)
    m = len(clients)
    w = sizes / sizes.sum() if exp.cfg.aggregation == "size" else np.full(m, 1 / m)
    trained = [r[0] for r in results]
    mean = jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(w, xs, strict=True)), *trained)
    if exp.algorithm.update_server_state is not None:
        summed = jax.tree.map(lambda *xs: sum(xs), *[r[3]["result"] for r in results])
        ctx = ServerContext(state.params, state.round, exp.cfg.num_clients, m)
        _, mean = exp.algorithm.update_server_state(state.algorithm_state, summed, mean, ctx)
        mean = jax.tree.map(np.asarray, mean)
    return mean, clients, np.asarray([float(r[3]["loss"]) for r in results])
