"""The compiled round: vmapped clients equal a per-client loop; one compile per run."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_reference import sequential_round

from fedjax_rcl.config import Config
from fedjax_rcl.engine import layout
from fedjax_rcl.engine.round import client_keys, make_run_rounds, sample_clients
from fedjax_rcl.experiment import build
from fedjax_rcl.server import weighted_mean


def _cfg(**kw):
    base = dict(dataset="toy", model="cnn", num_clients=8, participation=0.5, partition="iid",
                local_epochs=2, batch_size=16, rounds=2, eval_every=1)
    base.update(kw)
    return Config(**base)


@pytest.mark.parametrize(
    "kw",
    [
        # balanced iid: every client the same size, no masked steps. In the slow step: every
        # other algorithm's round in test_algorithms is this layout against the same loop.
        pytest.param({}, marks=pytest.mark.slow),
        # uneven clients: masked steps, wrap-around batches
        pytest.param({"partition": "dirichlet", "alpha": 0.5, "balanced": False,
                      "num_clients": 6, "aggregation": "size"}, marks=pytest.mark.slow),
        # one client at a time, called without vmap
        pytest.param({"clients_in_parallel": 1}, marks=pytest.mark.slow),
        # groups of 3 (the last padded with a zero-weight client)
        pytest.param({"clients_in_parallel": 3}, marks=pytest.mark.slow),
    ],
    ids=["balanced", "uneven", "one-at-a-time", "groups"],
)
def test_vmapped_round_equals_sequential_clients(toy, kw):
    exp = build(_cfg(**kw), toy)
    state = exp.state
    expected_params, clients, losses = sequential_round(exp, state)
    new_state, metrics = jax.jit(exp.run_round)(state, exp.data)
    np.testing.assert_array_equal(np.asarray(metrics["clients"]), clients)
    np.testing.assert_allclose(np.asarray(metrics["client_loss"]), losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state.params, expected_params, rtol=1e-5, atol=1e-5)
    assert int(new_state.round) == 1
    if "balanced" in kw:
        sizes = np.asarray(exp.data.client_sizes)
        assert sizes.min() != sizes.max(), "the uneven case must really be uneven"


@pytest.mark.slow
def test_clients_one_after_another_hold_one_trained_model_not_all(toy):
    """With clients trained one after another, the round adds each trained model into the
    weighted mean as it finishes: its working memory does not grow with the clients per round
    (before, it stacked every client's model and averaged them at the end: 8 more copies at 10
    clients than at 2)."""
    temp, model_bytes = {}, None
    for m in (2, 10):
        exp = build(_cfg(num_clients=10, participation=m / 10, clients_in_parallel=1), toy)
        compiled = jax.jit(exp.run_round).lower(exp.state, exp.data).compile()
        temp[m] = compiled.memory_analysis().temp_size_in_bytes
        model_bytes = sum(x.nbytes for x in jax.tree.leaves(exp.state.params))
    assert temp[10] - temp[2] < model_bytes, (temp, model_bytes)


def _step_gflop(model, **kw):
    from fedjax_rcl.experiment import training_step_gflop
    from fedjax_rcl.models import get_model, model_fns

    m = model_fns(get_model(model, num_classes=10, **kw))
    params, state = m.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)))
    return training_step_gflop(m, params, state, (32, 32, 3), batch_size=50)


@pytest.mark.slow
def test_auto_clients_in_parallel_follows_the_measured_layout_table():
    """``clients_in_parallel=0`` resolves by the cost model to what BENCHMARKS.md's layout
    tables measured fastest: on a CPU MOON's CNN side by side, pfl's CNN and the ResNets (the
    narrow ResNet-10 too) one at a time; on a GPU ResNet-18 one at a time; TPUs side by side
    (not measured). An explicit value always wins."""
    from fedjax_rcl.experiment import clients_in_parallel

    cnn, pfl = _step_gflop("cnn"), _step_gflop("pfl_cnn")
    r10, r18 = _step_gflop("resnet10", width=16), _step_gflop("resnet18")
    assert cnn < pfl and cnn < r10 < r18
    assert clients_in_parallel(_cfg(model="cnn"), cnn, "cpu") is None
    for model, gflop in (("pfl_cnn", pfl), ("resnet10", r10), ("resnet18", r18)):
        assert clients_in_parallel(_cfg(model=model), gflop, "cpu") == 1, model
    assert clients_in_parallel(_cfg(model="resnet18"), r18, "gpu") == 1  # grouped convs
    assert clients_in_parallel(_cfg(model="cnn"), cnn, "gpu") is None
    assert clients_in_parallel(_cfg(model="resnet18"), r18, "tpu") is None
    assert clients_in_parallel(_cfg(model="resnet18", clients_in_parallel=4), r18, "gpu") == 4
    assert clients_in_parallel(_cfg(model="cnn", clients_in_parallel=4), cnn, "cpu") == 4


def test_build_resolves_the_layout_from_the_models_own_flops(monkeypatch, toy):
    """``build`` counts the configured model's step (3 x forward x batch x views) and hands the
    resolved layout to the round."""
    from fedjax_rcl import experiment

    seen = {}
    real = experiment.clients_in_parallel

    def spy(cfg, step_gflop, platform=None):
        seen["gflop"] = step_gflop
        return real(cfg, step_gflop, platform)

    monkeypatch.setattr(experiment, "clients_in_parallel", spy)
    exp = experiment.build(_cfg(model="cnn", batch_size=8), toy)
    fwd = layout.forward_flops(exp.model.apply, exp.state.params, exp.state.model_state,
                               exp.dataset.image_shape, 8)
    assert seen["gflop"] == pytest.approx(3 * fwd / 1e9)
    assert seen["gflop"] > 0


def test_training_convolutions_follow_the_layout():
    """On a GPU, local training with several clients side by side on a device runs the patch
    convolutions (its weights carry the client axis); one client at a time, or one per device,
    keeps the platform's."""
    from fedjax_rcl.experiment import training_conv_impl

    assert training_conv_impl("auto", 5, 1, None, "gpu") == "patches"  # all 5 side by side
    assert training_conv_impl("auto", 5, 1, 2, "gpu") == "patches"  # groups of 2
    assert training_conv_impl("auto", 5, 1, 1, "gpu") == "native"  # one after another
    assert training_conv_impl("auto", 1, 1, None, "gpu") == "native"  # one client a round
    assert training_conv_impl("auto", 2, 2, None, "gpu") == "native"  # one client per device
    assert training_conv_impl("auto", 4, 2, None, "gpu") == "patches"  # two per device
    assert training_conv_impl("auto", 5, 1, None, "cpu") == "cpu"
    assert training_conv_impl("native", 5, 1, None, "gpu") == "native"


def test_the_layout_in_words():
    from fedjax_rcl.experiment import describe_layout

    assert describe_layout(5, 1, None, "patches") == "clients side by side, conv_impl=patches"
    assert describe_layout(5, 1, 1, "native") == "clients one after another, conv_impl=native"
    assert describe_layout(5, 1, 2, "cpu") == "clients side by side in groups of 2, conv_impl=cpu"
    assert describe_layout(4, 2, 1, "cpu") == ("clients one after another on each device, "
                                               "conv_impl=cpu")
    assert describe_layout(1, 1, None, "cpu") == "one client a round, conv_impl=cpu"


@pytest.mark.slow
def test_build_trains_with_the_layouts_convolutions_and_evaluates_with_the_models(
        monkeypatch, toy):
    """Where the layout asks for other convolutions (the patch ones for clients side by side
    on a GPU, forced here on the CPU), ``build`` traces local training with them, which
    gives the round of the platform's own within float tolerance; evaluation keeps the
    configured ones. One model, traced under each."""
    from fedjax_rcl import experiment

    made = []
    real_model_fns = experiment.model_fns

    def spy(module, **kw):
        made.append(kw.get("conv_impl"))
        return real_model_fns(module, **kw)

    cfg = _cfg(batch_size=8)
    base = experiment.build(cfg, toy)
    monkeypatch.setattr(experiment, "model_fns", spy)
    monkeypatch.setattr(experiment, "training_conv_impl", lambda *a, **k: "native")
    native = experiment.build(cfg, toy)
    monkeypatch.setattr(experiment, "training_conv_impl", lambda *a, **k: "patches")
    exp = experiment.build(cfg, toy)
    assert made == ["auto", "native", "auto", "patches"]
    assert exp.layout == "clients side by side, conv_impl=patches"
    assert base.layout == "clients side by side, conv_impl=cpu"
    # Which convolutions the round traced: XLA's under native, none under patches (nor under
    # the CPU's oneDNN or matmul ones).
    for e, convolutions in ((native, True), (exp, False), (base, False)):
        jaxpr = str(jax.make_jaxpr(e.run_round)(e.state, e.data))
        assert ("conv_general_dilated[" in jaxpr) == convolutions
    new_state, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    base_state, base_metrics = jax.jit(base.run_round)(base.state, base.data)
    chex.assert_trees_all_close(new_state.params, base_state.params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["client_loss"], base_metrics["client_loss"], rtol=1e-5)
    assert exp.model.conv_impl == "auto"  # evaluation: the configured convolutions


def test_weighted_mean_over_client_axis():
    """The mean reduces axis 0 only (a classic bug averages everything into one number)."""
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(3, 4, 2)), "b": rng.normal(size=(3,))}
    w = np.array([1.0, 2.0, 5.0])
    got = weighted_mean(jax.tree.map(jnp.asarray, tree), jnp.asarray(w))
    for k in tree:
        ref = sum(w[i] * tree[k][i] for i in range(3)) / w.sum()
        np.testing.assert_allclose(got[k], ref, rtol=1e-6)


def test_second_round_does_not_recompile(toy):
    exp = build(_cfg(eval_every=3, rounds=5), toy)
    # chex fails the second trace (a trace runs the Python body; an execution does not).
    run = jax.jit(chex.assert_max_traces(make_run_rounds(exp.run_round, 3), n=1))
    state = exp.state
    for n in (3, 2, 1, 3):  # different chunk lengths share the executable
        state, _ = run(state, exp.data, jnp.int32(n))
    assert int(state.round) == 9
    assert run._cache_size() == 1


@pytest.mark.slow
def test_fused_rounds_equal_single_rounds(toy):
    """Three rounds fused in one call equal three separate round calls."""
    exp = build(_cfg(eval_every=3), toy)
    fused, metrics = jax.jit(make_run_rounds(exp.run_round, 3))(exp.state, exp.data,
                                                                jnp.int32(3))
    one = jax.jit(exp.run_round)
    state, losses = exp.state, []
    for _ in range(3):
        before, (state, m) = state, one(state, exp.data)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(np.asarray(metrics["loss"]), losses, rtol=1e-4)
    # Two programs compiled apart may associate their float sums differently (1e-8 on the
    # weights after one round), and a ReLU input that sits at 0 can turn that into 1e-5 to 2e-4
    # on a few weights two rounds later (seen at XLA:CPU's optimisation level 0; how much
    # depends on where the rounding falls, so no fixed tolerance is safe). A skipped, repeated
    # or mis-keyed round moves the weights by about a round's training, so the bound is a
    # fifth of what the last round moved them (measured: 2.0e-4 against 1.8e-2).
    def largest(a, b):
        return max(float(jnp.max(jnp.abs(x - y)))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    moved = largest(state.params, before.params)
    assert moved > 1e-2, moved
    assert largest(fused.params, state.params) < moved / 5, (
        largest(fused.params, state.params), moved)


def test_sampling_depends_only_on_seed_round_client():
    key = jax.random.PRNGKey(3)
    a = sample_clients(key, jnp.int32(7), 100, 5)
    assert len(set(np.asarray(a).tolist())) == 5  # without replacement
    np.testing.assert_array_equal(a, sample_clients(key, jnp.int32(7), 100, 5))
    assert not np.array_equal(a, sample_clients(key, jnp.int32(8), 100, 5))
    k1 = client_keys(key, jnp.int32(7), jnp.asarray([4, 9]))
    k2 = client_keys(key, jnp.int32(7), jnp.asarray([9]))
    np.testing.assert_array_equal(k1[1], k2[0])  # a client's key ignores who else was sampled


def test_floyd_sampler_is_uniform_over_subsets_and_keyed_by_round():
    """``sampling_version=2``: distinct ids in range, the same for the same (seed, round), and
    every m-subset equally likely (5 binomial standard errors over 20,000 rounds)."""
    import itertools
    import math

    key = jax.random.PRNGKey(5)
    n, m, trials = 6, 3, 20000
    draws = np.asarray(jax.jit(jax.vmap(
        lambda r: sample_clients(key, r, n, m, 2)))(jnp.arange(trials, dtype=jnp.int32)))
    assert draws.dtype == np.int32 and draws.min() >= 0 and draws.max() < n
    assert all(len(set(d)) == m for d in draws.tolist())
    freq = {}
    for d in draws.tolist():
        freq[frozenset(d)] = freq.get(frozenset(d), 0) + 1
    p = 1 / math.comb(n, m)
    assert set(freq) == {frozenset(c) for c in itertools.combinations(range(n), m)}
    for f in freq.values():
        assert abs(f / trials - p) <= 5 * math.sqrt(p * (1 - p) / trials), (f, p)
    a = sample_clients(key, jnp.int32(7), 10**6, 100, 2)
    assert len(set(np.asarray(a).tolist())) == 100
    np.testing.assert_array_equal(a, sample_clients(key, jnp.int32(7), 10**6, 100, 2))
    assert not np.array_equal(a, sample_clients(key, jnp.int32(8), 10**6, 100, 2))
    with pytest.raises(ValueError, match="sampling version 3"):
        sample_clients(key, jnp.int32(0), 10, 2, 3)


@pytest.mark.slow
def test_the_round_with_the_floyd_sampler_equals_sequential_clients(toy):
    exp = build(_cfg(sampling_version=2, num_clients=8, participation=0.5), toy)
    expected_params, clients, losses = sequential_round(exp, exp.state)
    new_state, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    np.testing.assert_array_equal(np.asarray(metrics["clients"]), clients)
    np.testing.assert_allclose(np.asarray(metrics["client_loss"]), losses, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state.params, expected_params, rtol=1e-5, atol=1e-5)
    v1 = build(_cfg(num_clients=8, participation=0.5), toy)
    _, m1 = jax.jit(v1.run_round)(v1.state, v1.data)
    assert not np.array_equal(np.asarray(m1["clients"]), clients)  # another draw


def test_learning_rate_schedule_decays_per_round_and_epoch(toy):
    exp = build(_cfg(lr=0.1, lr_decay=0.5), toy)
    lr = exp.settings.lr_fn
    assert float(lr(jnp.int32(0), jnp.int32(0))) == pytest.approx(0.1)
    assert float(lr(jnp.int32(2), jnp.int32(1))) == pytest.approx(0.1 * 0.5**3)



@pytest.mark.slow
def test_dropout_gets_its_key_from_the_engine(toy):
    """A model with dropout trains inside the compiled round (the engine passes the "dropout"
    key every local step): the round is reproducible, and it differs from the same model with
    its dropout rates at 0 (same initialisation), so the masks are really applied."""
    from fedjax_rcl import registry
    from fedjax_rcl.models.pfl_cnn import PflCNN

    registry.register_model(
        "test_pfl_cnn_no_dropout",
        lambda n, **_: PflCNN(n, dropout=(0.0, 0.0)),
        num_levels=3)
    try:
        runs, inits = {}, {}
        for name in ("pfl_cnn", "test_pfl_cnn_no_dropout"):
            exp = build(_cfg(model=name, algorithm="fedavg", rounds=1), toy)
            step = jax.jit(exp.run_round)
            inits[name] = exp.state.params
            runs[name] = [step(exp.state, exp.data)[0].params for _ in range(2)]
    finally:
        registry.MODELS.pop("test_pfl_cnn_no_dropout")
    chex.assert_trees_all_equal(inits["pfl_cnn"], inits["test_pfl_cnn_no_dropout"])
    with_dropout, without = runs["pfl_cnn"], runs["test_pfl_cnn_no_dropout"]
    chex.assert_trees_all_equal(with_dropout[0], with_dropout[1])
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(with_dropout[0]), jax.tree.leaves(without[0]), strict=True))
    assert diff > 1e-4
