"""Client algorithms through the engine: every objective runs, MOON's state table, FedRCL's
objective decreases, BatchNorm/TwinNorm statistics travel with the model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engine_reference import sequential_local_updates, sequential_round

from fedjax_rcl.algorithms import ALGORITHMS, Batch, LocalContext, fedprox, fedrcl
from fedjax_rcl.algorithms.fedprox import FedProxConfig
from fedjax_rcl.config import Config
from fedjax_rcl.experiment import build
from fedjax_rcl.models import ResNet, get_model, model_fns


def _cfg(**kw):
    base = dict(dataset="toy", model="cnn", num_clients=6, participation=0.5, partition="iid",
                local_epochs=1, batch_size=16, rounds=2)
    base.update(kw)
    return Config(**base)


# The client algorithms `train` runs (MFCL's phase 1 runs with `fedjax-rcl mfcl`, on its own
# model; tests/test_mfcl.py).
TRAIN_ALGORITHMS = sorted(n for n, e in ALGORITHMS.items() if e.command == "train")
# The compiled round against the client-by-client loop, in the default step for one algorithm
# of each kind: FedRCL (two views, the multi-level objective), MOON (a per-client state table)
# and SCAFFOLD (server state and control variates). The others' in the slow step, and their
# round's trace in the default one. Most local objectives are also checked against NumPy on
# their own (test_baseline_losses, test_fedntd, test_fedmlb, test_losses, test_stateful);
# FedCL's and FitNet's only through this round, in the slow step.
ROUND_IN_DEFAULT_STEP = ("fedrcl", "moon", "scaffold")
ROUND_IN_SLOW_STEP = tuple(n for n in TRAIN_ALGORITHMS if n not in ROUND_IN_DEFAULT_STEP)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.slow] if n in ROUND_IN_SLOW_STEP else [])
    for n in TRAIN_ALGORITHMS])
def test_every_algorithm_runs_a_round_and_matches_sequential(toy, name):
    exp = build(_cfg(algorithm=name), toy)
    mean, clients, losses = sequential_round(exp, exp.state)
    state, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    np.testing.assert_array_equal(metrics["clients"], clients)
    np.testing.assert_allclose(metrics["client_loss"], losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.params, mean, rtol=1e-5, atol=1e-5)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("name", ROUND_IN_SLOW_STEP)
def test_every_algorithm_traces_a_round(toy, name):
    """The round of each algorithm compared with the loop in the slow step only: it traces,
    and its outputs have the round's shapes (parameters and client states keep theirs, one loss
    per sampled client)."""
    exp = build(_cfg(algorithm=name), toy)
    state, metrics = jax.eval_shape(exp.run_round, exp.state, exp.data)
    chex.assert_trees_all_equal_shapes_and_dtypes(state.params, exp.state.params)
    chex.assert_trees_all_equal_shapes_and_dtypes(state.client_states, exp.state.client_states)
    assert metrics["client_loss"].shape == metrics["clients"].shape == (3,)
    assert metrics["loss"].shape == ()


@pytest.mark.slow
def test_moon_state_table_holds_exactly_the_sampled_clients_models(toy):
    exp = build(_cfg(algorithm="moon", num_clients=8, participation=0.25), toy)
    before = exp.state
    clients, results = sequential_local_updates(exp, before)
    after, _ = jax.jit(exp.run_round)(before, exp.data)
    prev_params, _ = after.client_states
    init_params, _ = before.client_states
    sampled = set(clients.tolist())
    for c in range(exp.cfg.num_clients):
        row = jax.tree.map(lambda t, c=c: np.asarray(t[c]), prev_params)
        if c in sampled:
            trained = results[clients.tolist().index(c)][0]
            chex.assert_trees_all_close(row, trained, rtol=1e-5, atol=1e-6)
            assert not np.allclose(jax.tree.leaves(row)[0],
                                   np.asarray(jax.tree.leaves(init_params)[0][c]))
        else:  # untouched: still the initial global model
            chex.assert_trees_all_equal(row, exp.state.params)


@pytest.mark.slow
def test_moon_term_uses_this_clients_previous_model(toy):
    """One local step from a table of four different previous models: the local model still
    equals the global one at that step, so the MOON term is mean_i softplus((cos(z_g, z_prev)
    - 1) / tau) with z_prev from THIS client's row. Checked against NumPy on the model's
    projections, for every client; a term computed with the global model (log 2) or with
    another client's row would not match."""
    exp = build(_cfg(algorithm="moon", num_clients=4, participation=1.0, augment=False,
                     batch_size=60), toy)  # 60 images per client: one step of the whole client
    keys = iter(jax.random.split(jax.random.PRNGKey(7), 64))
    table = jax.tree.map(  # each client's previous model: the global one, perturbed its own way
        lambda t: t + 0.3 * jnp.std(t) * jax.random.normal(next(keys), t.shape),
        exp.state.client_states)
    state = exp.state.replace(client_states=table)
    clients, results = sequential_local_updates(exp, state)
    # The engine's round reads the same rows: its clients' terms equal the loop's.
    _, metrics = jax.jit(exp.run_round)(state, exp.data)
    np.testing.assert_allclose(metrics["client_loss"], [float(r[3]["loss"]) for r in results],
                               rtol=1e-5)
    prev_params, prev_state = table
    model, tau = exp.model, exp.cfg.moon.temperature
    mean, std = np.asarray(toy.mean, np.float32), np.asarray(toy.std, np.float32)

    def unit_projection(params, model_state, images):
        out, _ = model.apply(params, model_state, jnp.asarray(images), train=False)
        z = np.asarray(out.projection, np.float64)
        return z / np.linalg.norm(z, axis=-1, keepdims=True)

    expected = {}
    for c in range(4):
        idx = np.asarray(exp.data.client_indices[c])[:int(exp.data.client_sizes[c])]
        images = (toy.train_images[idx].astype(np.float32) / 255 - mean) / std
        z_g = unit_projection(state.params, state.model_state, images)
        rows = [jax.tree.map(lambda t, k=k: t[k], (prev_params, prev_state)) for k in range(4)]
        z_p = [unit_projection(*row, images) for row in rows]
        expected[c] = [np.mean(np.logaddexp(0, (np.sum(z_g * z, -1) - 1) / tau)) for z in z_p]
    for j, c in enumerate(clients.tolist()):
        got = float(results[j][3]["moon"])
        assert got == pytest.approx(expected[c][c], rel=1e-4)
        assert abs(got - np.log(2)) > 1e-3  # the global model as negative would give log 2
        for k in range(4):  # every other client's previous model gives another value
            if k != c:
                assert got != pytest.approx(expected[c][k], rel=1e-4)


def _fixed_batch(toy, n=32):
    x = (toy.train_images[:n].astype(np.float32) / 255 - 0.4) / 0.3
    return Batch(jnp.asarray(x), jnp.asarray(toy.train_labels[:n]))


def _descend(algorithm, module, batch, steps=15, lr=0.05):
    model = model_fns(module, conv_impl="patches")
    params, ms = model.init(jax.random.PRNGKey(0), batch.images[:1])
    ctx = LocalContext(params, ms, (), jax.random.PRNGKey(1))

    def loss(p):
        out, _ = model.apply(p, ms, batch.images, train=True)
        return algorithm.objective(out, p, batch, ctx)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    opt = optax.sgd(lr)
    opt_state, history = opt.init(params), []
    for _ in range(steps):
        (value, terms), g = grad(params)
        history.append((float(value), {k: float(v) for k, v in terms.items()}))
        updates, opt_state = opt.update(g, opt_state)
        params = optax.apply_updates(params, updates)
    return history


@pytest.mark.slow
def test_fedrcl_local_loss_decreases_on_a_fixed_batch(toy):
    history = _descend(fedrcl(), get_model("cnn", num_classes=4), _fixed_batch(toy))
    values = [v for v, _ in history]
    assert values[-1] < 0.8 * values[0]
    assert history[-1][1]["scl"] < history[0][1]["scl"]


def test_fedprox_term_pulls_towards_the_global_model(toy):
    module = get_model("cnn", num_classes=4)
    history = _descend(fedprox(FedProxConfig(mu=1.0)), module, _fixed_batch(toy), steps=5)
    assert history[0][1]["prox"] == 0.0  # starts at the global model
    assert 0 < history[-1][1]["prox"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("norm,algorithm", [("batch", "fedavg"), ("twin", "fedcl"),
                                            ("group", "fedrcl")])
def test_normalizations_train_through_the_engine(toy, norm, algorithm):
    """BatchNorm statistics are local state, averaged by the server; TwinNorm needs view
    pairs (FedCL's two views) and evaluates each image alone."""
    module = ResNet(num_classes=4, stages=((8, 1, 1), (16, 1, 2)), norm=norm)
    exp = build(_cfg(algorithm=algorithm, norm=norm, model="resnet18", conv_impl="patches"),
                toy, module=module)
    mean, clients, losses = sequential_round(exp, exp.state)
    state, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    np.testing.assert_allclose(metrics["client_loss"], losses, rtol=1e-5, atol=1e-6)
    if norm == "batch":
        _, results = sequential_local_updates(exp, exp.state)
        stats = [r[1] for r in results]
        expected = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *stats)  # iid: equal sizes
        # Each statistic is a float32 mean over a batch's B*H*W activations of order one, which
        # the compiled round and the one-client programs sum in different orders: they differ
        # by up to a few 1e-6 (3.2e-6 seen on an AVX-512 Xeon); a client's own statistics differ
        # from the mean of all by orders more.
        chex.assert_trees_all_close(state.model_state, expected, rtol=1e-5, atol=1e-5)
        assert not np.allclose(jax.tree.leaves(stats[0])[0], jax.tree.leaves(expected)[0],
                               rtol=1e-5, atol=1e-5)
        assert not np.allclose(jax.tree.leaves(state.model_state)[0],
                               jax.tree.leaves(exp.state.model_state)[0])
    ev = jax.jit(exp.evaluate)(state.params, state.model_state, exp.test)
    assert 0.0 <= float(ev["accuracy"]) <= 1.0 and np.isfinite(float(ev["loss"]))


def test_twin_norm_with_a_one_view_algorithm_is_a_config_error():
    from fedjax_rcl.config import ConfigError, validate

    with pytest.raises(ConfigError, match="norm='twin'"):
        validate(Config(model="resnet18", norm="twin", algorithm="fedrcl"), check_data=False)


@pytest.mark.slow
def test_moon_two_rounds_vmapped_equal_a_client_by_client_loop_with_its_own_table(toy):
    """Round 2 reads each client's round-1 local model from the table (every client trains
    every round here, so every negative is a real previous model, not the global one): the
    engine and a client-by-client loop that keeps its own NumPy table agree after two rounds."""
    exp = build(_cfg(algorithm="moon", num_clients=4, participation=1.0), toy)
    state, ref = exp.state, exp.state
    table = jax.tree.map(np.array, exp.state.client_states)
    for r in range(2):
        clients, results = sequential_local_updates(exp, ref)
        for j, c in enumerate(clients):  # scatter each client's new state into the table
            jax.tree.map(lambda t, new, c=c: t.__setitem__(c, new), table, results[j][2])
        w = np.asarray(exp.data.client_sizes)[clients].astype(np.float64)
        w = w / w.sum()
        mean = jax.tree.map(lambda *xs, w=w: sum(wi * x for wi, x in zip(w, xs, strict=True)),
                            *[res[0] for res in results])
        state, metrics = jax.jit(exp.run_round)(state, exp.data)
        np.testing.assert_array_equal(metrics["clients"], clients)
        losses = [float(res[3]["loss"]) for res in results]
        np.testing.assert_allclose(metrics["client_loss"], losses, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.params, mean, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.client_states, table, rtol=1e-5, atol=1e-6)
        # The loop goes on from the engine's global weights (equal to its own up to float
        # reassociation in the weighted mean, ~1e-8) and its own table: MOON's round can turn
        # a 1e-8 change of the starting weights into a loss step of 2^-15 (seen on an Intel
        # AVX-512 machine at round 2), which would test float luck, not the table.
        ref = ref.replace(params=state.params, client_states=jax.tree.map(jnp.asarray, table),
                          round=ref.round + 1)
        if r == 0:  # round 2's negatives are real previous models, not the global one
            prev = jax.tree.leaves(table)[0]
            glob = np.asarray(jax.tree.leaves(mean)[0])
            assert all(not np.allclose(prev[c], glob) for c in range(4))
