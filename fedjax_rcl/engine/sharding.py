"""Clients as a named mesh axis: the same round on one device, several, or several processes.

The sampled clients' local training is sharded over the ``clients`` axis of a 1-D mesh
(``jax.sharding.Mesh``); everything else — the global model, the training and test sets — is
replicated, and the per-client state table is sharded with the clients when its length divides
evenly. ``engine.round`` runs each device's block of clients with ``shard_map`` — the very code
that runs them on one device — and XLA turns the client mean into an all-reduce (the drjax way:
clients are a named axis, the per-client code does not change).

Single host: ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives N CPU devices (set it
before JAX starts). Several processes: ``initialize_distributed`` calls
``jax.distributed.initialize`` (gloo collectives on CPU); ``jax.devices()`` then lists every
process's devices and the mesh spans them all.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_rcl.engine.round import CLIENTS


def initialize_distributed(coordinator_address: str | None, num_processes: int,
                           process_id: int) -> None:
    """Joins a multi-process JAX cluster (no-op for a single process)."""
    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id)


def client_mesh(devices: int) -> Mesh | None:
    """A 1-D mesh named ``clients`` over the first ``devices`` devices (0: all of them);
    None when that is a single device (nothing to shard)."""
    available = jax.devices()
    n = len(available) if devices == 0 else devices
    if n > len(available):
        raise ValueError(f"devices={devices}: only {len(available)} available "
                         f"({jax.default_backend()})")
    if n == 1:
        return None
    return Mesh(np.asarray(available[:n]), (CLIENTS,))


def _put(x, sharding):
    x = np.asarray(x)
    # Works across processes: every process supplies the (identical) host data for the shards
    # it holds.
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def put_replicated(tree, mesh: Mesh | None):
    """Places every leaf on every device of the mesh (or on the default device)."""
    if mesh is None:
        return jax.device_put(tree)
    return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), tree)


def put_client_table(tree, mesh: Mesh | None):
    """Places a ``[num_clients, ...]`` table sharded by client when it divides evenly."""
    if mesh is None:
        return jax.device_put(tree)
    n = mesh.shape[CLIENTS]

    def one(x):
        spec = P(CLIENTS) if np.ndim(x) and np.shape(x)[0] % n == 0 else P()
        return _put(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, tree)


def to_host(tree):
    """Fetches outputs to NumPy, also when they live on several processes' devices: a
    replicated array is read from this process's copy; a sharded one is gathered from every
    process (a collective: all processes must call this together)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.sharding.is_fully_replicated:
                x = x.addressable_data(0)
            else:
                from jax.experimental import multihost_utils

                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def is_primary() -> bool:
    """Whether this process writes the run's files (metrics, config, plots)."""
    return jax.process_index() == 0
