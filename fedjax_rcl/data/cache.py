"""The on-disk cache of decoded arrays: sources that decode many files pay for it once.

``cached_arrays(cache_dir, kind, key, build)`` returns ``build()``'s arrays, reading them from
``CACHE_DIR/KIND-HASH.npz`` when an entry for ``key`` exists; writes are atomic (a temporary
file renamed into place), so a process killed while saving never leaves a partial entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = ["CACHE_FORMAT_VERSION", "cached_arrays", "default_cache_dir"]

_log = logging.getLogger(__name__)

# Bump when the layout or meaning of cached arrays changes: old cache files are then ignored.
CACHE_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """The cache root (decoded arrays here; JAX's compile cache in ``jax/``, the oneDNN
    extension in ``ext/``): ``$FEDJAX_RCL_CACHE``, else ``$XDG_CACHE_HOME/fedjax_rcl`` (the
    XDG base-directory convention), else ``~/.cache/fedjax_rcl``."""
    if os.environ.get("FEDJAX_RCL_CACHE"):
        return Path(os.environ["FEDJAX_RCL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedjax_rcl"


def cached_arrays(cache_dir: str | os.PathLike | None, kind: str, key: Sequence,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Returns ``build()``'s arrays, from the on-disk cache when an entry for ``key`` exists.

    The entry is ``CACHE_DIR/KIND-HASH.npz`` with ``HASH`` over ``(CACHE_FORMAT_VERSION,
    *key)``; callers put into ``key`` whatever identifies the source's content (path, size,
    mtime). It is written to a temporary file in the same directory and renamed into place, so
    a process killed while saving never leaves a partial entry; an unreadable entry counts as a
    miss and is rebuilt. A cache that cannot be written only costs a warning.

    Args:
        cache_dir: Cache directory; None for :func:`default_cache_dir`.
        kind: Short readable prefix of the file name, e.g. ``"imagefolder"``.
        key: JSON-serialisable values identifying the source.
        build: Produces the arrays (``str`` arrays allowed; no object arrays) on a miss.

    Returns:
        Name -> array, as ``build`` returned them.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT_VERSION, *key]).encode()).hexdigest()
    path = cache_dir / f"{kind}-{digest[:24]}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            _log.warning("ignoring unreadable cache entry %s (%s); rebuilding it", path, err)
    arrays = build()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # A process killed mid-save leaves its temporary file: drop those older than an hour
        # (younger ones may belong to a concurrent writer).
        for stale in cache_dir.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        _log.warning("could not write the data cache %s (%s); the next load decodes again",
                     path, err)
    return arrays
