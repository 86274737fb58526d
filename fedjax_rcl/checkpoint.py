"""Checkpoints of everything the next round reads, through Orbax.

A checkpoint holds the ``ServerState`` (global params and model state, server optimizer state,
the per-client state table, the round index, the root key) and a JSON record of the host-side
loop state (rounds done, the accuracy EMA, the config digest, a fingerprint of the state). Orbax
writes each checkpoint into a temporary directory and renames it when complete, so a process
killed at any moment, even during a save, leaves only whole checkpoints; ``restore_latest``
additionally checks each restored state against its fingerprint and falls back to the previous
checkpoint, with a warning, when the newest one is damaged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import struct

from fedjax_rcl.rundir import checkpoint_steps

_log = logging.getLogger(__name__)

# The suffix of the temporary directory Orbax writes a checkpoint into before its commit.
TMP_SUFFIX = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class Restored:
    """A restored checkpoint: the state, its JSON record and its step (rounds done), and the
    newer checkpoints that were skipped as damaged (``(step, reason)``, newest first)."""

    state: Any
    meta: dict
    step: int
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)


class _QuietFailedReads(logging.Filter):
    """Drops what a restore that failed leaves behind in the logs.

    Orbax reads a checkpoint's arrays concurrently (one tensorstore read per array, gathered
    on an event loop it closes when the gather ends). When one read fails (a damaged file),
    the gather raises at once and the loop closes while the other reads are still in flight;
    as each finishes, its callback finds the loop closed and reports "RuntimeError: Event loop
    is closed" as an unraisable exception, and asyncio logs each failed task as "never
    retrieved" — "Task exception ..." naming the ``async_deserialize`` coroutine, or "Future
    exception ..." (no coroutine named) holding tensorstore's read error. The restore has
    already failed and ``restore_latest`` reports the damaged checkpoint once, so these repeats
    (a traceback per array) carry nothing; they are dropped, and every other unraisable
    exception and log record passes through unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" or "exception was never retrieved" not in str(record.msg):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        failed_read = "async_deserialize" in record.getMessage() or (
            exc is not None and "tensorstore_spec" in str(exc))
        return not failed_read


_quiet_installed = [False]


def _quiet_failed_reads() -> None:
    """Installs ``_QuietFailedReads`` once per process (the asyncio log filter, and an
    unraisable-exception hook that drops only "Event loop is closed" without an object)."""
    if _quiet_installed[0]:
        return
    import sys

    logging.getLogger("asyncio").addFilter(_QuietFailedReads())
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    _quiet_installed[0] = True


def _damage(e: Exception) -> str:
    """A damaged checkpoint's reason in one line."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first[:200]}"


@jax.jit
def _leaf_sums(state) -> list[jax.Array]:
    leaves = jax.tree.leaves(state)
    return [jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32)))])
            for x in leaves]


def fingerprint(state) -> list[list[float]]:
    """Per-leaf ``(sum, sum of squares)``: cheap, computed on device, and bitwise reproducible
    for a bitwise identical state on the same backend — a restore that silently read damaged
    data shows up as a mismatch."""
    from fedjax_rcl.engine.sharding import to_host

    return [[float(a), float(b)] for a, b in to_host(_leaf_sums(state))]


def _same_fingerprint(a, b) -> bool:
    # A tolerance, not bit equality, so that a checkpoint moves between backends (a GPU's sum
    # rounds differently from a CPU's); damage shows up as far larger differences or NaN.
    if b is None or len(a) != len(b):
        return False
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6))


class _quiet_logger:
    """Raises a logger's level to CRITICAL for a ``with`` block."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name)

    def __enter__(self):
        self._level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)


# The key of a checkpoint tree whose leaves' leading sizes vary between checkpoints (the sparse
# client table, ``fedjax_rcl.engine.tables.SparseTable``): restored with the saved shapes.
RAGGED = "sparse"


def _before_added_fields(abstract):
    """``(older, back)``: a target like ``abstract`` without the ``ADDED_FIELDS`` that hold no
    array (the state as checkpoints written before those fields existed hold it), in a struct
    or a dict of them, and ``back(restored)`` giving ``abstract``'s structure again; None if
    there is no such field."""
    if isinstance(abstract, dict):
        parts = {k: _before_added_fields(v) for k, v in abstract.items()}
        if all(p is None for p in parts.values()):
            return None
        older = {k: abstract[k] if p is None else p[0] for k, p in parts.items()}
        return older, lambda t: {k: t[k] if p is None else p[1](t[k]) for k, p in parts.items()}
    added = [n for n in getattr(type(abstract), "ADDED_FIELDS", ())
             if not jax.tree.leaves(getattr(abstract, n))]
    if not added:
        return None
    kept = [f.name for f in dataclasses.fields(abstract) if f.name not in added]
    older = struct.dataclass(type(f"{type(abstract).__name__}Before", (),
                                  {"__annotations__": dict.fromkeys(kept, Any)}))
    return (older(**{n: getattr(abstract, n) for n in kept}),
            lambda t: abstract.replace(**{n: getattr(t, n) for n in kept}))


def saved_steps(directory: str | Path) -> list[int]:
    """The steps of the whole checkpoints in ``directory`` (none if it is absent), read from
    the directory names without opening a ``CheckpointManager``: a save in progress or cut
    short is not one of them (``rundir.checkpoint_steps``)."""
    return checkpoint_steps(Path(directory))


class Checkpointer:
    """Saves and restores run checkpoints under ``directory`` (Orbax ``CheckpointManager``).

    Args:
      directory: where checkpoints live (``RUN_DIR/checkpoints``).
      keep: how many of the newest checkpoints to keep.
      async_save: write in a background thread (the device-to-host copy still happens before
        ``save`` returns, so the caller may reuse or donate the state right away).
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save that was killed
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state, meta: dict) -> None:
        """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON) as checkpoint ``step``."""
        meta = {**meta, "fingerprint": fingerprint(state)}
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore_latest(self, like, *, at_most: int | None = None,
                       warn=None) -> Restored | None:
        """The newest checkpoint (of step ``at_most`` or earlier, if given) that restores and
        matches its fingerprint, else None.

        Args:
          like: a state with the right structure, shapes and dtypes (e.g. the freshly built
            initial state); its values are not used.
          warn: ``warn(message)`` for each damaged checkpoint skipped (default: a logged
            warning); the skipped ones are also in ``Restored.skipped``.
        """
        _quiet_failed_reads()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        skipped: list[tuple[int, str]] = []
        for step in reversed([s for s in self.steps() if at_most is None or s <= at_most]):
            try:
                # Orbax's own error logs about a damaged file (absl) would repeat ours.
                with _quiet_logger("absl"):
                    state, meta = self._restore(step, abstract)
                if not _same_fingerprint(fingerprint(state), meta.get("fingerprint")):
                    raise ValueError("restored values do not match the saved fingerprint")
            except Exception as e:  # any failure to read a checkpoint means it is damaged
                skipped.append((step, _damage(e)))
                message = (f"checkpoint {step} in {self.directory} is damaged ({_damage(e)}); "
                           "trying the previous one")
                if warn is None:
                    _log.warning("%s", message)
                else:
                    warn(message)
                continue
            return Restored(state=state, meta=meta, step=step, skipped=skipped)
        return None

    def _restore(self, step: int, abstract):
        """Checkpoint ``step`` restored into ``abstract``'s structure; one written before the
        state had its ``ADDED_FIELDS`` (fields that hold no array while unused) restores with
        them empty."""
        def read(target):
            out = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                              meta=ocp.args.JsonRestore()))
            return out["state"], dict(out["meta"])

        if isinstance(abstract, dict) and RAGGED in abstract:
            abstract = self._ragged_shapes(step, abstract)
        try:
            return read(abstract)
        except ValueError:
            older = _before_added_fields(abstract)
            if older is None:
                raise
            state, meta = read(older[0])
            return older[1](state), meta

    def _ragged_shapes(self, step: int, abstract: dict) -> dict:
        """``abstract`` with the leaves under its ``RAGGED`` key shaped as checkpoint ``step``
        saved them (a table of the clients that have trained holds more rows later on)."""
        saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        saved = dict(getattr(saved, "item_metadata", saved) or {})
        if RAGGED not in saved:
            return abstract
        # Leaf by leaf in order (the metadata keeps lists where the state has tuples).
        saved_leaves = jax.tree.leaves(saved[RAGGED])
        leaves, treedef = jax.tree.flatten(abstract[RAGGED])
        if len(saved_leaves) != len(leaves):
            return abstract
        shaped = [jax.ShapeDtypeStruct(tuple(m.shape), a.dtype)
                  for m, a in zip(saved_leaves, leaves, strict=True)]
        return {**abstract, RAGGED: jax.tree.unflatten(treedef, shaped)}

    def uncommit(self, step: int) -> None:
        """For the kill tests only: waits for checkpoint ``step`` and renames it back to an
        uncommitted temporary directory, the state a save killed just before its commit
        leaves (``steps`` and ``restore_latest`` then skip it, as they skip a torn save)."""
        self._manager.wait_until_finished()
        src = self.directory / str(step)
        src.rename(self.directory / f"{step}{TMP_SUFFIX}-{int(time.time())}")
        self._manager.reload()

    def set_aside(self, steps) -> list[Path]:
        """Moves the given checkpoints out of the way (to ``<directory>-damaged/``) without
        deleting anything, so that a resumed run can write those steps again."""
        moved = []
        aside = self.directory.with_name(self.directory.name + "-damaged")
        for step in steps:
            src = self.directory / str(step)
            if src.exists():
                aside.mkdir(exist_ok=True)
                dst = aside / f"{step}-{int(time.time())}"
                src.rename(dst)
                moved.append(dst)
                _log.warning("moved damaged checkpoint %s to %s", src, dst)
        self._manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until every pending save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def state_nbytes(state) -> int:
    """Bytes of all arrays in a state (checkpoint payload before compression)."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))
