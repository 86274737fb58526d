"""What a client algorithm is: a local objective plus, optionally, per-client state.

The engine owns everything else (sampling, batching, augmentation, the client optimizer, the
scan over local steps, aggregation), so an algorithm is a small factory of pure functions with
its hyperparameters in the closure (STYLE #1, as fedjax's ``algorithms/fed_avg.py``). Adding an
algorithm means adding one module and one registry entry; the engine does not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.types import ClientState, Metrics, Params, PRNGKey

# ``apply_fn(params, images, *, train) -> ModelOutput``: the model, as the engine calls it.
ApplyFn = Callable[..., ModelOutput]


class Batch(NamedTuple):
    """One local step's data.

    Attributes:
      images: normalized ``float32 [V * B, H, W, C]``; with ``V = num_views`` augmented views,
        rows ``i, i + B, ..., i + (V-1) B`` are views of the same sample.
      labels: ``int32 [B]``.
    """

    images: jax.Array
    labels: jax.Array


class LocalContext(NamedTuple):
    """What a local objective may read besides its own parameters and batch.

    Attributes:
      global_params: the server model this round started from (FedProx, MOON).
      client_state: this client's persistent state (MOON: its previous local model).
      key: PRNG key for this step (for stochastic objectives).
    """

    global_params: Params
    client_state: ClientState
    key: PRNGKey


# ``local_loss(params, batch, context) -> (loss [], metrics {name: []})``; differentiated w.r.t.
# ``params``. The metrics dict must have the same keys at every step (they are scanned).
LocalLoss = Callable[[Params, Batch, LocalContext], tuple[jax.Array, Metrics]]


def _no_state(params: Params) -> ClientState:
    del params
    return ()


def _keep_state(state: ClientState, trained_params: Params) -> ClientState:
    del trained_params
    return state


@dataclasses.dataclass(frozen=True)
class ClientAlgorithm:
    """A federated client algorithm as pure functions.

    Attributes:
      name: registry name.
      local_loss: the local objective (see ``LocalLoss``).
      num_views: augmented views of each sample per batch (2 for view-contrastive objectives).
      init_client_state: one client's initial state from the initial global params; the engine
        stacks it into a ``[num_clients, ...]`` table.
      update_client_state: ``(old_state, trained_params) -> new_state`` after local training.
    """

    name: str
    local_loss: LocalLoss
    num_views: int = 1
    init_client_state: Callable[[Params], ClientState] = _no_state
    update_client_state: Callable[[ClientState, Params], ClientState] = _keep_state
