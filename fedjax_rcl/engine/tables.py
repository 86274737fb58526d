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

* ``SparseTable`` (``client_states=sparse``): host memory, rows only for the clients that have
  trained (a client never sampled reads the initial state).
* ``DiskTable`` (``client_states=disk``): as ``sparse``, its rows in files memory-mapped from
  the run directory, for tables larger than host memory.

All give the same results; a checkpoint holds the server state, plus the host table if any (a
disk table's rows in a snapshot beside it: ``DiskTable``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
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

CLIENT_TABLES = ("device", "host", "sparse", "disk", "auto")


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
            self._grow(max(need, 2 * capacity, 16))
        self.slot[fresh] = np.arange(self.count, need)
        self.count = need
        for table, new in zip(jax.tree.leaves(self.store), jax.tree.leaves(new_rows),
                              strict=True):
            table[self.slot[ids]] = new

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` rows, the rows held kept."""
        self.store = jax.tree.map(
            lambda t: np.concatenate([t, np.zeros((capacity - t.shape[0], *t.shape[1:]),
                                                  t.dtype)]), self.store)

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


# Bytes copied at a time between a disk table's files (its store and its snapshots).
_CHUNK_BYTES = 64 << 20


def _chunk_rows(a: np.ndarray) -> int:
    """Rows of ``a`` in one chunk of ``_CHUNK_BYTES``."""
    return max(1, _CHUNK_BYTES // max(1, a[:1].nbytes))


def _copy_rows(dst: np.ndarray, src: np.ndarray, n: int) -> float:
    """``dst[:n] = src[:n]`` a chunk at a time (both may be files mapped into memory larger
    than it), in the same pass the float64 sum of those rows (a checkpoint's check)."""
    step, total = _chunk_rows(src), 0.0
    for a in range(0, n, step):
        chunk = src[a:min(n, a + step)]
        dst[a:min(n, a + step)] = chunk
        total += float(np.sum(chunk, dtype=np.float64))
    return total


class DiskTable(SparseTable):
    """``SparseTable`` with its rows in files: one per leaf of the client state under
    ``directory`` (``store/<i>.bin``, leaves ``[capacity, ...]``, memory-mapped, grown by
    doubling), so that a table larger than host memory is held; the operating system keeps
    in memory the pages the rounds touch. Only ``slot`` (8 bytes a client of the population)
    stays in memory.

    Orbax copies host arrays into memory before it writes them, and restores each array whole,
    so the rows do not go through it: ``checkpoint`` writes the trained rows, as of the
    checkpoint's round, to a snapshot (``snapshots/<round>/<i>.npy``, written under a
    temporary name and renamed when complete) and gives Orbax the clients' ids and each leaf's
    float64 sum (no snapshot while no client has trained); ``restore`` reads the snapshot of
    the checkpoint's round back, checking the sums. The snapshots of the newest ``keep``
    rounds are kept (the checkpoints a restore can fall back to), older ones removed."""

    name = "disk"

    def __init__(self, num_clients: int, per_round: int, mesh: Mesh | None = None,
                 sampling: int = 1, *, directory: str | Path, keep: int = 3):
        super().__init__(num_clients, per_round, mesh, sampling)
        self.directory, self.keep = Path(directory), max(1, keep)

    def _files(self) -> list[Path]:
        return [self.directory / "store" / f"{i}.bin"
                for i in range(len(jax.tree.leaves(self.initial)))]

    def place(self, state: ServerState, row: ClientState) -> ServerState:
        state = super().place(state, row)
        (self.directory / "store").mkdir(parents=True, exist_ok=True)
        for path in self._files():  # a new table: no row of an earlier process is read
            path.unlink(missing_ok=True)
        self._grow(16)
        return state

    def _grow(self, capacity: int) -> None:
        leaves, treedef = jax.tree.flatten(self.initial)
        grown = []
        for path, init in zip(self._files(), leaves, strict=True):
            with open(path, "a+b") as f:  # existing rows stay where they are
                f.truncate(capacity * init.nbytes)
            grown.append(np.memmap(path, init.dtype, "r+", shape=(capacity, *init.shape)))
        self.store = jax.tree.unflatten(treedef, grown)

    def _snapshot(self, step: int) -> Path:
        return self.directory / "snapshots" / str(step)

    def checkpoint(self, state: ServerState):
        step, n = int(jax.device_get(state.round)), self.count
        sums = [0.0] * len(jax.tree.leaves(self.initial))
        if n:  # no rows (a fresh table, or the template a restore reads into): no snapshot
            sums = self._write_snapshot(step, n)
        return {"server": state, "sparse": {
            "ids": np.concatenate([[-1], self.trained()]).astype(np.int64),
            "sums": np.asarray(sums, np.float64)}}

    def _write_snapshot(self, step: int, n: int) -> list[float]:
        """The first ``n`` rows of the store as the snapshot of round ``step``; each leaf's
        sum."""
        final = self._snapshot(step)
        tmp = final.with_name(f"{step}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sums = []
        for i, table in enumerate(jax.tree.leaves(self.store)):
            out = np.lib.format.open_memmap(tmp / f"{i}.npy", "w+", table.dtype,
                                            (n, *table.shape[1:]))
            sums.append(_copy_rows(out, table, n))
            out.flush()
            del out
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._prune(step)
        return sums

    def _prune(self, newest: int) -> None:
        """Removes the snapshots older than the newest ``keep`` (and none newer than
        ``newest``: a run resumed from an older checkpoint writes its rounds again)."""
        steps = sorted(int(p.name) for p in (self.directory / "snapshots").iterdir()
                       if p.name.isdigit())
        for old in [x for x in steps if x <= newest][:-self.keep]:
            shutil.rmtree(self._snapshot(old), ignore_errors=True)

    def restore(self, tree) -> ServerState:
        step = int(np.asarray(jax.device_get(tree["server"].round)))
        ids = np.asarray(tree["sparse"]["ids"], np.int64)[1:]
        snapshot = self._snapshot(step)
        leaves = jax.tree.leaves(self.initial)
        files = [snapshot / f"{i}.npy" for i in range(len(leaves))]
        if len(ids) and not all(f.is_file() for f in files):
            raise FileNotFoundError(f"client_states=disk: the table's snapshot of round {step} "
                                    f"is missing ({snapshot})")
        self.slot[:] = -1
        self.slot[ids] = np.arange(len(ids))
        self.count = len(ids)
        capacity = jax.tree.leaves(self.store)[0].shape[0]
        if self.count > capacity:
            self._grow(max(self.count, 2 * capacity))
        for f, table, want in zip(files, jax.tree.leaves(self.store), tree["sparse"]["sums"],
                                  strict=True):
            if not self.count:
                break
            saved = np.load(f, mmap_mode="r")
            if (saved.shape[0] != self.count
                    or _copy_rows(table, saved, self.count) != float(want)):
                raise ValueError(f"client_states=disk: the table's snapshot of round {step} "
                                 f"does not match its checkpoint ({f})")
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


def disk_free(directory: str | Path) -> int:
    """Bytes free on the file system that holds ``directory`` (or its nearest existing
    parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


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
    that can have trained by round ``rounds`` (``sparse``, ``disk``)."""
    return (min(num_clients, per_round * rounds) if where in ("sparse", "disk")
            else num_clients)


def table_memory_problem(where: str, algorithm: str, row: ClientState, num_clients: int, *,
                         host_free: int | None = None, device_free: int | None = None,
                         disk: int | None = None) -> str | None:
    """One line saying that the per-client table cannot be held where ``client_states``
    puts it, with what it needs and what there is (None when it fits). Checked before anything
    is built or compiled. On a CPU a device table is held twice while it is placed (the host
    copy it is made from and the device's), a host table once; a disk table takes its rows
    once in its store and once in each snapshot a checkpoint keeps, against ``disk`` (bytes
    free where the run directory is). ``num_clients``: the rows it holds at most
    (``table_rows``)."""
    row_bytes, total = table_bytes(row, num_clients)
    if not total:
        return None
    if where == "disk":
        need, have = 2 * total, disk if disk is not None else 0
        if need <= 0.9 * have:
            return None
        return (f"client_states=disk: {algorithm}'s per-client state needs {_gb(need)} on "
                f"disk ({num_clients:,} clients who can have trained x {_gb(row_bytes)}, in "
                f"the table and a checkpoint's snapshot) and the run directory's file system "
                f"has {_gb(have)} free; use fewer clients, fewer rounds or a smaller model")
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
    hint += ", or client_states=disk (those rows in files)"
    what = "clients" if where != "sparse" else "clients who can have trained"
    return (f"client_states={where}: {algorithm}'s per-client state needs {_gb(need)} "
            f"({num_clients:,} {what} x {_gb(row_bytes)}) and {place} has {_gb(have)} "
            f"available; use fewer clients or a smaller model{hint}")


def choose_table(row: ClientState, num_clients: int, per_round: int, rounds: int, *,
                 host_free: int | None = None, device_free: int | None = None,
                 disk: int | None = None) -> str:
    """``client_states=auto``: ``device`` when the whole table fits there (the fastest: rows
    move inside the compiled program), else ``sparse`` (rows only for the clients who train,
    in host memory) when those fit, else ``disk`` (the same rows in files; ``disk``: bytes
    free for them, refused later in one line if even that cannot hold them)."""
    if table_memory_problem("device", "", row, num_clients, host_free=host_free,
                            device_free=device_free) is None:
        return "device"
    rows = table_rows("sparse", num_clients, per_round, rounds)
    if disk is None or table_memory_problem("sparse", "", row, rows,
                                            host_free=host_free) is None:
        return "sparse"
    return "disk"


def describe_table(where: str, row: ClientState, num_clients: int) -> str:
    """``"client states 1.20 GB on the device"`` for the start-up line ("" without state);
    ``sparse``: at most that much, in host memory, ``num_clients`` being ``table_rows``."""
    _, total = table_bytes(row, num_clients)
    if not total:
        return ""
    if where in ("sparse", "disk"):
        place = "in host memory" if where == "sparse" else "on disk"
        return (f", client states at most {_gb(total)} {place} (rows for the "
                f"{num_clients:,} clients who can have trained)")
    return f", client states {_gb(total)} on the {where}"


def client_table(where: str, num_clients: int, per_round: int,
                 mesh: Mesh | None = None, sampling: int = 1, *,
                 directory: str | Path | None = None, keep: int = 3) -> ClientTable:
    """The strategy ``client_states=where`` names (``device``, ``host``, ``sparse`` or
    ``disk``, whose files go under ``directory`` and whose snapshots follow the ``keep``
    newest checkpoints; ``auto`` is resolved by ``choose_table`` before)."""
    tables = {"device": DeviceTable, "host": HostTable, "sparse": SparseTable}
    if where == "disk":
        if directory is None:
            raise ValueError("client_states='disk' needs a directory for its files")
        return DiskTable(num_clients, per_round, mesh, sampling, directory=directory,
                         keep=keep)
    if where not in tables:
        raise ValueError(f"client_states={where!r}: allowed: {', '.join(CLIENT_TABLES)}")
    return tables[where](num_clients, per_round, mesh, sampling)
