"""The training set on the device, and the clients as an index table into it.

Batches are gathered by index inside the compiled round, so no data crosses from host to device
during training; only shapes are static: ``[num_clients, max_size]`` indices padded with 0 plus
the true sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import struct


@struct.dataclass
class ClientData:
    """Device-resident training data and the client partition.

    Attributes:
      images: ``uint8 [N, H, W, C]``, the whole training set.
      labels: ``int32 [N]``.
      client_indices: ``int32 [num_clients, max_size]``; row ``k`` holds client ``k``'s sample
        indices in its first ``client_sizes[k]`` entries, then padding (0).
      client_sizes: ``int32 [num_clients]``.
    """

    images: jax.Array
    labels: jax.Array
    client_indices: jax.Array
    client_sizes: jax.Array

    @property
    def num_clients(self) -> int:
        return self.client_indices.shape[0]

    @property
    def max_size(self) -> int:
        return self.client_indices.shape[1]


def index_table(parts: Sequence[np.ndarray], width: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pads a list of per-client index arrays into ``([num_clients, width], [num_clients])``;
    ``width`` defaults to the largest client (a larger one pads several runs to one shape)."""
    sizes = np.asarray([len(p) for p in parts], np.int32)
    if sizes.min(initial=1) < 1:
        empty = int(np.argmin(sizes))
        raise ValueError(f"client {empty} has no samples; every client needs at least one")
    width = int(sizes.max()) if width is None else width
    if width < sizes.max():
        raise ValueError(f"width {width} < the largest client's {int(sizes.max())} samples")
    table = np.zeros((len(parts), width), np.int32)
    for k, p in enumerate(parts):
        table[k, : len(p)] = p
    return table, sizes


def pack_clients(images: np.ndarray, labels: np.ndarray,
                 parts: Sequence[np.ndarray], width: int | None = None) -> ClientData:
    """The training set and the partition as host arrays (each client's indices padded to
    ``width``, default the largest client); ``engine.sharding.put_replicated`` then places
    them on the devices (one transfer each)."""
    table, sizes = index_table(parts, width)
    return ClientData(images=np.asarray(images, np.uint8), labels=np.asarray(labels, np.int32),
                      client_indices=table, client_sizes=sizes)


@struct.dataclass
class TestData:
    """The test set on device, padded to whole evaluation batches.

    Attributes:
      images: ``uint8 [num_batches, batch, H, W, C]``.
      labels: ``int32 [num_batches, batch]``.
      mask: ``bool [num_batches, batch]``, False on padding.
    """

    images: jax.Array
    labels: jax.Array
    mask: jax.Array


def pack_test(images: np.ndarray, labels: np.ndarray, batch_size: int) -> TestData:
    """Pads the test set to a whole number of batches (host arrays, placed like
    ``pack_clients``'s)."""
    n = len(labels)
    batch_size = min(batch_size, n)
    nb = -(-n // batch_size)
    pad = nb * batch_size - n
    imgs = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
    labs = np.concatenate([labels, np.zeros(pad, labels.dtype)]).astype(np.int32)
    mask = np.arange(nb * batch_size) < n
    return TestData(images=imgs.reshape(nb, batch_size, *images.shape[1:]),
                    labels=labs.reshape(nb, batch_size), mask=mask.reshape(nb, batch_size))


__all__ = ["ClientData", "TestData", "index_table", "pack_clients", "pack_test"]

