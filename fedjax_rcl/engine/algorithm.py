"""What the engine runs for a client: a local objective plus, optionally, per-client state.

The engine owns everything else -- sampling, batching, augmentation, the model's forward pass in
training mode, the client optimizer, the scan over local steps, aggregation -- so a client
algorithm is a small factory of pure functions with its hyperparameters in the closure, as
google/fedjax's ``algorithms/fed_avg.py`` and optax's ``GradientTransformation``. The algorithms
themselves live one module each in ``fedjax_rcl.algorithms``, each registered with
``fedjax_rcl.registry.register_algorithm``; the registry entry, not this object, holds what is
known of an algorithm before it is built (its name, its config section, how many augmented
views of each sample its objective reads, the command that runs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from fedjax_rcl.models.base import ModelOutput, ModelState
from fedjax_rcl.types import ClientState, Metrics, Params, PRNGKey


class Batch(NamedTuple):
    """One local step's data.

    Attributes:
      images: normalized ``float32 [V * B, H, W, C]``; with ``V`` augmented views (the
        algorithm's registered ``num_views``), rows ``i, i + B, ..., i + (V-1) B`` are views
        of the same sample.
      labels: ``int32 [B]``.
    """

    images: jax.Array
    labels: jax.Array


class LocalContext(NamedTuple):
    """What a local objective may read besides the model output, its parameters and batch.

    Attributes:
      global_params: the model the server sent this round, which local training started from
        (FedProx, MOON; FedACG's look-ahead when ``server.optimizer=fedacg``).
      global_model_state: the server model's non-trained state (BatchNorm statistics).
      client_state: this client's persistent state (MOON: its previous local model).
      key: PRNG key for this step (for stochastic objectives).
      label_counts: ``float32 [num_classes]``, this client's samples per class (FedLC).
      server_message: what the server sent every client this round besides the model
        (FedProc: the global class prototypes), ``()`` for algorithms that have none.
      server_state: the algorithm's persistent server state at the start of the round
        (SCAFFOLD: the server control variate ``c``), ``()`` for algorithms that have none.
    """

    global_params: Params
    global_model_state: ModelState
    client_state: ClientState
    key: PRNGKey
    label_counts: jax.Array | None = None
    server_message: Any = ()
    server_state: Any = ()


class RoundContext(NamedTuple):
    """What a client's end-of-round hooks (``update_client_state``, ``client_result``) read.

    Attributes:
      global_params: the model this client's local training started from.
      global_model_state: its non-trained state.
      server_state: the algorithm's server state the client trained with.
      steps: ``float32 []``, the local steps this client took (``K``: its batches per epoch
        times the epochs).
      lr_sum: ``float32 []``, the sum of the learning rates of those steps (``K * lr`` at a
        constant rate), so that ``(x - y) / lr_sum`` is the mean scaled step.
      learning_rate: ``float32 []``, the rate of the round's first local step.
      round: ``int32 []``, the round's index.
      num_clients: ``N``, the population (a Python int).
      sampled_fraction: ``|S| / N``, the fraction of it sampled each round (a Python float).
    """

    global_params: Params
    global_model_state: ModelState
    server_state: Any
    steps: jax.Array
    lr_sum: jax.Array
    learning_rate: jax.Array
    round: jax.Array
    num_clients: int
    sampled_fraction: float


class ServerContext(NamedTuple):
    """What the algorithm's server hook (``update_server_state``) reads.

    Attributes:
      global_params: the model the round's clients started from.
      round: ``int32 []``, the round's index.
      num_clients: ``N``, the population.
      sampled: ``|S|``, the clients sampled this round.
    """

    global_params: Params
    round: jax.Array
    num_clients: int
    sampled: int


# ``objective(output, params, batch, context) -> (loss [], metrics {name: []})``.
# ``output`` is the model's training-mode forward pass on ``batch.images`` with ``params``; the
# engine differentiates the loss w.r.t. ``params`` through it. The metrics dict must have the
# same keys at every step (they are scanned).
Objective = Callable[[ModelOutput, Params, "Batch", LocalContext], tuple[jax.Array, Metrics]]


def _no_state(params: Params, model_state: ModelState) -> ClientState:
    del params, model_state
    return ()


def _keep_state(state: ClientState, params: Params, model_state: ModelState,
                ctx: RoundContext) -> ClientState:
    del params, model_state, ctx
    return state


def zeros_like_params(params: Params, model_state: ModelState) -> Params:
    """A float32 zero for each parameter: the initial state of control variates and duals
    (SCAFFOLD's ``c`` and ``c_i``, FedDyn's ``h`` and ``g_k``)."""
    del model_state
    return jax.tree.map(lambda p: jax.numpy.zeros(p.shape, jax.numpy.float32), params)


def _no_server_state(params: Params, model_state: ModelState) -> Any:
    del params, model_state
    return ()


@dataclasses.dataclass(frozen=True)
class ClientAlgorithm:
    """A federated client algorithm as pure functions.

    Attributes:
      objective: the local objective (see ``Objective``).
      init_client_state: ``(params, model_state) -> state``, one client's state before it has
        ever trained, from the initial global model; the engine stacks it into a
        ``[num_clients, ...]`` table.
      update_client_state: ``(old_state, trained_params, trained_model_state, ctx) ->
        new_state`` at the end of the client's local training; ``ctx`` is the round's
        ``RoundContext`` (the model it started from, the server state, the steps taken and
        their learning rates, the population and the sampled fraction).
      client_result: ``(old_state, new_state, trained_params, trained_model_state, ctx) ->
        pytree`` a client sends the server besides its model, summed over the round's sampled
        clients and passed to ``update_server_state`` (SCAFFOLD: ``c_i^+ - c_i``); None:
        nothing.
      init_server_state: ``(params, model_state) -> state``, the algorithm's persistent server
        state before round 0 (SCAFFOLD: ``c = 0``), checkpointed with the run; every client
        reads it as ``LocalContext.server_state``.
      update_server_state: ``(state, summed_results, mean_params, ctx: ServerContext) ->
        (state, mean_params)`` after the clients' models are averaged and before the server
        optimizer: the next state, and the mean model the server optimizer takes (FedDyn
        subtracts ``h / alpha``); None: the state is kept and the mean used as it is.
      correct_update: ``(updates, params, ctx: LocalContext, learning_rate) -> updates``, a
        change to each local step's update after the client optimizer (SCAFFOLD's
        ``-lr (c - c_i)``, outside the momentum, as its authors' and NIID-Bench's code apply
        it); None: the optimizer's update.
      report: ``(output, batch) -> pytree`` of sums a client sends the server, taken on each
        training step of its last local epoch and summed (FedProc: per-class feature sums and
        counts); None: the client sends only its model.
      server_message: ``summed_reports -> message``, what the server broadcasts next round
        from the reports summed over the round's clients (``LocalContext.server_message``);
        before the first round it is built from all-zero reports.
      optimizer: ``(learning_rate, clip_norm, weight_decay) -> optax transformation`` when
        the algorithm prescribes its client optimizer (MFCL's phase 1: Adam), wrapped in
        ``optax.inject_hyperparams`` so the engine sets the learning rate per step; None: the
        configured SGD (``engine.client.client_optimizer``).
    """

    objective: Objective
    init_client_state: Callable[[Params, ModelState], ClientState] = _no_state
    update_client_state: Callable[[ClientState, Params, ModelState, RoundContext],
                                  ClientState] = _keep_state
    report: Callable[[ModelOutput, Batch], Any] | None = None
    server_message: Callable[[Any], Any] | None = None
    optimizer: Callable[..., Any] | None = None
    client_result: Callable[..., Any] | None = None
    init_server_state: Callable[[Params, ModelState], Any] = _no_server_state
    update_server_state: Callable[..., tuple[Any, Params]] | None = None
    correct_update: Callable[..., Any] | None = None
