"""FedProc through the engine's broadcast path: clients report per-class feature sums of their
last epoch, the server divides the sums over the round's clients, and next round every client
trains against those prototypes."""

import chex
import jax
import numpy as np
import pytest
from engine_reference import sequential_local_updates, sequential_round

from fedjax_rcl.config import Config
from fedjax_rcl.experiment import build
from fedjax_rcl.losses import prototypes_from_sums


@pytest.mark.slow
def test_prototypes_are_the_reported_class_means_and_drive_round_two(toy):
    cfg = Config(dataset="toy", model="cnn", num_clients=6, participation=0.5, partition="iid",
                 local_epochs=2, batch_size=16, rounds=2, algorithm="fedproc")
    exp = build(cfg, toy)
    protos0, present0 = exp.state.message
    assert not np.asarray(present0).any()  # nothing reported before round 0
    _, results = sequential_local_updates(exp, exp.state)
    step = jax.jit(exp.run_round)
    state, metrics = step(exp.state, exp.data)
    assert float(metrics["proto"]) == 0.0  # round 0 has no prototypes to contrast with
    sums = sum(r[3]["report"][0] for r in results)
    counts = sum(r[3]["report"][1] for r in results)
    # Each client reports one epoch of its data: 40 samples, rounded up to whole batches.
    assert counts.sum() == len(results) * 3 * 16
    want, present = prototypes_from_sums(sums, counts)
    np.testing.assert_array_equal(np.asarray(state.message[1]), np.asarray(present))
    np.testing.assert_allclose(np.asarray(state.message[0]), np.asarray(want), rtol=1e-5,
                               atol=1e-6)
    assert np.asarray(present).all()
    # Round 2: the vmapped round equals clients trained one by one against those prototypes.
    mean, clients, losses = sequential_round(exp, state)
    new_state, metrics = step(state, exp.data)
    np.testing.assert_allclose(metrics["client_loss"], losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state.params, mean, rtol=1e-5, atol=1e-5)
    assert float(metrics["proto"]) > 0
