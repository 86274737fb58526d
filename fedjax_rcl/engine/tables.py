"""Where the per-client state table lives, as a strategy the round, the loop and the analysis
call through.

Algorithms with per-client state (MOON: each client's previous local model) keep a table with
one row per client, leaves ``[num_clients, ...]``. The round itself never sees the table: it
takes the sampled clients' rows and returns their new rows (``engine.round.make_round``). A
table strategy decides where the rows come from:

* ``DeviceTable`` (``client_states=device``, the default): the table is a field of the
  ``ServerState`` on the device; rows are gathered and scattered inside the compiled program,
  and the rounds between two evaluations are one call (``make_run_rounds``).
* ``HostTable`` (``client_states=host``): the table is NumPy arrays in host memory, for tables
  larger than the device (MOON with a ResNet-18 and 100 clients holds 100 models); each round
  is one compiled call and only the sampled clients' rows cross between host and device.

Both give the same results; a checkpoint holds the server state, plus the host table if any.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from fedjax_rcl.data.device import ClientData
from fedjax_rcl.engine.round import RoundRows, ServerState, make_run_rounds, sample_clients
from fedjax_rcl.engine.sharding import put_client_table, put_replicated, to_host
from fedjax_rcl.types import ClientState, Metrics

# ``advance(state, n) -> (state, metrics)``: ``n`` rounds, metrics as NumPy ``[n, ...]``.
Advance = Callable[[ServerState, int], tuple[ServerState, dict]]

CLIENT_TABLES = ("device", "host", "sparse", "auto")


class ClientTable(Protocol):
    """A place for the per-client state table (see the module docstring)."""

    name: str

    def place(self, state: ServerState, row: ClientState) -> ServerState:
        """The initial state as the loop keeps it: ``state`` (holding no table) on the device,
        every client's row a copy of ``row`` (a client that never trained)."""

    def run_round(self, round_rows: RoundRows) -> Callable:
        """A pure ``(state, data) -> (state, metrics)`` of one round over a state that holds
        its table (device tables only)."""

    def compile(self, round_rows: RoundRows, state: ServerState, data: ClientData,
                capacity: int, compiler_options: dict | None = None) -> Advance:
        """Compiles the rounds for up to ``capacity`` rounds per call, with XLA's
        ``compiler_options`` if any."""

    def row(self, state: ServerState, client: int) -> ClientState:
        """One client's row, on the device."""

    def checkpoint(self, state: ServerState) -> Any:
        """What a checkpoint holds for ``state``."""

    def restore(self, tree: Any) -> ServerState:
        """The state a checkpoint tree holds (the host table, if any, is read back)."""

    def server_part(self, tree: Any) -> Any:
        """The server state inside a checkpoint tree."""

    def with_server(self, tree: Any, server: Any) -> Any:
        """The checkpoint tree with its server state replaced."""


def _repeat(row: ClientState, n: int) -> ClientState:
    """``n`` copies of one row, in host memory: leaves ``[n, ...]``."""
    return jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], n, axis=0),
                        jax.device_get(row))


def _gather_round(round_rows: RoundRows, num_clients: int, per_round: int, sampling: int):
    def run_round(state: ServerState, data: ClientData) -> tuple[ServerState, Metrics]:
        sampled = sample_clients(state.key, state.round, num_clients, per_round, sampling)
        rows = jax.tree.map(lambda t: t[sampled], state.client_states)
        new_state, metrics, new_rows = round_rows(state, data, rows)
        table = jax.tree.map(lambda t, r: t.at[sampled].set(r), state.client_states, new_rows)
        return new_state.replace(client_states=table), metrics

    return run_round


class DeviceTable:
    """The table as ``ServerState.client_states`` on the device (sharded by client over a
    mesh when it divides evenly); several rounds fuse into one compiled call."""

    name = "device"

    def __init__(self, num_clients: int, per_round: int, mesh: Mesh | None = None,
                 sampling: int = 1):
        self.num_clients, self.per_round, self.mesh = num_clients, per_round, mesh
        self.sampling = sampling

    def place(self, state: ServerState, row: ClientState) -> ServerState:
        return put_replicated(state, self.mesh).replace(
            client_states=put_client_table(_repeat(row, self.num_clients), self.mesh))

    def run_round(self, round_rows: RoundRows):
        return _gather_round(round_rows, self.num_clients, self.per_round, self.sampling)

    def compile(self, round_rows: RoundRows, state: ServerState, data: ClientData,
                capacity: int, compiler_options: dict | None = None) -> Advance:
        fused = jax.jit(make_run_rounds(self.run_round(round_rows), capacity),
                        donate_argnums=0)
        compiled = fused.lower(state, data, put_replicated(np.int32(capacity), self.mesh)
                               ).compile(compiler_options or None)

        def advance(state: ServerState, n: int):
            state, metrics = compiled(state, data, put_replicated(np.int32(n), self.mesh))
            return state, jax.tree.map(lambda x: x[:n], to_host(metrics))

        return advance

    def row(self, state: ServerState, client: int) -> ClientState:
        return jax.tree.map(lambda t: t[client], state.client_states)

    def checkpoint(self, state: ServerState):
        return state

    def restore(self, tree) -> ServerState:
        return tree

    def server_part(self, tree):
        return tree

    def with_server(self, tree, server):
        del tree
        return server


class HostTable:
    """The table as NumPy arrays in host memory (``rows``, leaves ``[num_clients, ...]``);
    the state on the device holds none (``client_states=()``). Rounds run one compiled call
    each; the sampled clients' rows go to the device and their new rows come back."""

    name = "host"

    def __init__(self, num_clients: int, per_round: int, mesh: Mesh | None = None,
                 sampling: int = 1):
        self.num_clients, self.per_round, self.mesh = num_clients, per_round, mesh
        self.sampling = sampling
        self.rows: Any = ()

    def place(self, state: ServerState, row: ClientState) -> ServerState:
        self.rows = _repeat(row, self.num_clients)
        return put_replicated(state, self.mesh)

    def run_round(self, round_rows: RoundRows):
        raise TypeError("client_states=host: the table is in host memory, outside the state; "
                        "rounds run through compile()")

    def compile(self, round_rows: RoundRows, state: ServerState, data: ClientData,
                capacity: int, compiler_options: dict | None = None) -> Advance:
        del capacity  # one round per call: the rows of the next round depend on this one's
        m = self.per_round
        rows = put_replicated(self._gather(np.arange(m)), self.mesh)
        one = jax.jit(round_rows, donate_argnums=0).lower(state, data, rows).compile(
            compiler_options or None)
        sampler = jax.jit(lambda key, r: sample_clients(key, r, self.num_clients, m,
                                                        self.sampling))
        sampler.lower(state.key, state.round).compile()  # now, not in the first round

        def advance(state: ServerState, n: int):
            history = []
            for _ in range(n):  # host memory is touched between rounds, by design
                ids = np.asarray(to_host(sampler(state.key, state.round)))
                rows = put_replicated(self._gather(ids), self.mesh)
                state, metrics, new_rows = one(state, data, rows)
                self._scatter(ids, to_host(new_rows))
                history.append(to_host(metrics))
            return state, jax.tree.map(lambda *xs: np.stack(xs), *history)

        return advance

    def _gather(self, ids: np.ndarray):
        """The rows of clients ``ids`` (host arrays, leaves ``[len(ids), ...]``)."""
        return jax.tree.map(lambda t: t[ids], self.rows)

    def _scatter(self, ids: np.ndarray, new_rows) -> None:
        """Writes the clients' new rows back."""
        for table, new in zip(jax.tree.leaves(self.rows), jax.tree.leaves(new_rows),
                              strict=True):
            table[ids] = new

    def row(self, state: ServerState, client: int) -> ClientState:
        del state
        return jax.tree.map(lambda t: jax.numpy.asarray(t[client]), self.rows)

    def checkpoint(self, state: ServerState):
        return {"server": state, "host": self.rows}

    def restore(self, tree) -> ServerState:
        for table, saved in zip(jax.tree.leaves(self.rows), jax.tree.leaves(tree["host"]),
                                strict=True):
            table[...] = np.asarray(saved)
        return tree["server"]

    def server_part(self, tree):
        return tree["server"]

    def with_server(self, tree, server):
        return {**tree, "server": server}


class SparseTable(HostTable):
    """The table in host memory with rows only for the clients that have trained: a client
    never sampled reads ``initial`` (the algorithm's state before training), so memory grows
    with the clients who trained, not with the population (a million clients, a few thousand
    sampled over a run). ``slot[c]`` is client ``c``'s row in ``store`` (leaves
    ``[capacity, ...]``, grown by doubling), -1 before it first trains. The same results as
    the dense tables; a checkpoint holds the trained clients' ids and rows (``{"server",
    "sparse": {"ids", "rows"}}``), whose count varies from one checkpoint to the next."""

    name = "sparse"

    def __init__(self, num_clients: int, per_round: int, mesh: Mesh | None = None,
                 sampling: int = 1):
        super().__init__(num_clients, per_round, mesh, sampling)
        self.slot = np.full(num_clients, -1, np.int64)
        self.count = 0
        self.initial: Any = ()
        self.store: Any = ()

    def place(self, state: ServerState, row: ClientState) -> ServerState:
        self.initial = jax.tree.map(np.asarray, jax.device_get(row))
        self.slot[:] = -1
        self.count = 0
        self.store = _repeat(row, 0)
        return put_replicated(state, self.mesh)

    def _gather(self, ids: np.ndarray):
        slots = self.slot[ids]
        fresh = slots < 0

        def take(store, init):
            out = store[np.maximum(slots, 0)] if store.shape[0] else np.empty(
                (len(ids), *init.shape), init.dtype)
            out[fresh] = init
            return out

        return jax.tree.map(take, self.store, self.initial)

    def _scatter(self, ids: np.ndarray, new_rows) -> None:
        fresh = ids[self.slot[ids] < 0]
        need = self.count + len(fresh)
        capacity = jax.tree.leaves(self.store)[0].shape[0] if jax.tree.leaves(self.store) else 0
        if need > capacity:  # grow by doubling: amortised O(1) a row
            grown = max(need, 2 * capacity, 16)
            self.store = jax.tree.map(
                lambda t: np.concatenate([t, np.zeros((grown - t.shape[0], *t.shape[1:]),
                                                      t.dtype)]), self.store)
        self.slot[fresh] = np.arange(self.count, need)
        self.count = need
        for table, new in zip(jax.tree.leaves(self.store), jax.tree.leaves(new_rows),
                              strict=True):
            table[self.slot[ids]] = new

    def row(self, state: ServerState, client: int) -> ClientState:
        del state
        return jax.tree.map(jax.numpy.asarray, jax.tree.map(
            lambda t: t[0], self._gather(np.asarray([client]))))

    def trained(self) -> np.ndarray:
        """The ids of the clients that have trained, in the order their rows were made."""
        ids = np.flatnonzero(self.slot >= 0)
        return ids[np.argsort(self.slot[ids])]

    def checkpoint(self, state: ServerState):
        # First the initial row under id -1 (Orbax saves no empty array: at round 0 no client
        # has trained), then the trained clients' rows in slot order.
        n = self.count
        return {"server": state, "sparse": {
            "ids": np.concatenate([[-1], self.trained()]).astype(np.int64),
            "rows": jax.tree.map(lambda t, init: np.concatenate([init[None], t[:n]]),
                                 self.store, self.initial)}}

    def restore(self, tree) -> ServerState:
        ids = np.asarray(tree["sparse"]["ids"], np.int64)[1:]
        self.slot[:] = -1
        self.slot[ids] = np.arange(len(ids))
        self.count = len(ids)
        self.store = jax.tree.map(lambda t, init: np.array(t[1:], dtype=init.dtype),
                                  tree["sparse"]["rows"], self.initial)
        return tree["server"]


def available_memory() -> int:
    """Bytes of host memory available now (Linux's ``MemAvailable``; else the free pages)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_free(device=None) -> int | None:
    """Bytes free on an accelerator (its allocator's limit less what is in use), or None where
    the backend does not say (the CPU: its memory is the host's)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def table_bytes(row: ClientState, num_clients: int) -> tuple[int, int]:
    """``(row_bytes, table_bytes)`` of a per-client table of ``num_clients`` copies of
    ``row`` (arrays or shape-dtype structs)."""
    row_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                    for x in jax.tree.leaves(row))
    return row_bytes, row_bytes * num_clients


def table_rows(where: str, num_clients: int, per_round: int, rounds: int) -> int:
    """The rows a table holds at most: every client's (dense tables), or one for each client
    that can have trained by round ``rounds`` (``sparse``)."""
    return min(num_clients, per_round * rounds) if where == "sparse" else num_clients


def table_memory_problem(where: str, algorithm: str, row: ClientState, num_clients: int, *,
                         host_free: int | None = None,
                         device_free: int | None = None) -> str | None:
    """One line saying that the per-client table cannot be held where ``client_states``
    puts it, with what it needs and what there is (None when it fits). Checked before anything
    is built or compiled. On a CPU a device table is held twice while it is placed (the host
    copy it is made from and the device's), a host table once. ``num_clients``: the rows it
    holds at most (``table_rows``)."""
    row_bytes, total = table_bytes(row, num_clients)
    if not total:
        return None
    host_free = available_memory() if host_free is None else host_free
    if where == "device":
        device_free = device_memory_free() if device_free is None else device_free
        need, have, place = ((2 * total, host_free, "host memory (a CPU device's)")
                             if device_free is None else (total, device_free, "device memory"))
    else:
        need, have, place = total, host_free, "host memory"
    if need <= 0.9 * have:
        return None
    hint = (", or client_states=host (it holds the table once, in host memory)"
            if where == "device" and total <= 0.9 * host_free else "")
    if where != "sparse":
        hint += ", or client_states=sparse (rows only for the clients who train)"
    what = "clients" if where != "sparse" else "clients who can have trained"
    return (f"client_states={where}: {algorithm}'s per-client state needs {_gb(need)} "
            f"({num_clients:,} {what} x {_gb(row_bytes)}) and {place} has {_gb(have)} "
            f"available; use fewer clients or a smaller model{hint}")


def choose_table(row: ClientState, num_clients: int, per_round: int, rounds: int, *,
                 host_free: int | None = None, device_free: int | None = None) -> str:
    """``client_states=auto``: ``device`` when the whole table fits there (the fastest: rows
    move inside the compiled program), else ``sparse`` (rows only for the clients who train,
    in host memory; refused later in one line if even that cannot be held)."""
    if table_memory_problem("device", "", row, num_clients, host_free=host_free,
                            device_free=device_free) is None:
        return "device"
    return "sparse"


def describe_table(where: str, row: ClientState, num_clients: int) -> str:
    """``"client states 1.20 GB on the device"`` for the start-up line ("" without state);
    ``sparse``: at most that much, in host memory, ``num_clients`` being ``table_rows``."""
    _, total = table_bytes(row, num_clients)
    if not total:
        return ""
    if where == "sparse":
        return (f", client states at most {_gb(total)} in host memory (rows for the "
                f"{num_clients:,} clients who can have trained)")
    return f", client states {_gb(total)} on the {where}"


def client_table(where: str, num_clients: int, per_round: int,
                 mesh: Mesh | None = None, sampling: int = 1) -> ClientTable:
    """The strategy ``client_states=where`` names (``device``, ``host`` or ``sparse``;
    ``auto`` is resolved by ``choose_table`` before)."""
    tables = {"device": DeviceTable, "host": HostTable, "sparse": SparseTable}
    if where not in tables:
        raise ValueError(f"client_states={where!r}: allowed: {', '.join(CLIENT_TABLES)}")
    return tables[where](num_clients, per_round, mesh, sampling)
