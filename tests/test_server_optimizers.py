"""Server optimizers against NumPy loops of their equations, and FedACG's broadcast through
the compiled round."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_reference import sequential_local_updates

from fedjax_rcl.config import ConfigError, load_config
from fedjax_rcl.experiment import build
from fedjax_rcl.server import fedacg, fedadam, fedavg, fedavgm, server_optimizer
from fedjax_rcl.server.fedacg import FedACGConfig
from fedjax_rcl.server.optimizers import FedAdamConfig, FedAvgMConfig

ROUNDS = 6


def _problem(seed=0):
    """A two-leaf model and, per round, a client update that depends on where clients start:
    ``mean_k theta_k = start - 0.3 * (start - target) + noise_r``."""
    rng = np.random.default_rng(seed)
    theta0 = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    target = {k: rng.normal(size=v.shape) for k, v in theta0.items()}
    noise = [{k: 0.1 * rng.normal(size=v.shape) for k, v in theta0.items()}
             for _ in range(ROUNDS)]

    def clients(start, r):
        return {k: start[k] - 0.3 * (start[k] - target[k]) + noise[r][k] for k in start}

    return theta0, clients


def _run_optax(sopt, theta0, clients):
    """The engine's server step: clients start at ``sopt.start``, ``g = theta - mean``."""
    params = jax.tree.map(jnp.float32, theta0)
    opt_state = sopt.tx.init(params)
    history = []
    for r in range(ROUNDS):
        start = jax.tree.map(np.asarray, sopt.start(params, opt_state))
        mean = clients({k: np.float64(v) for k, v in start.items()}, r)
        g = jax.tree.map(lambda p, m: p - jnp.float32(m), params, mean)
        updates, opt_state = sopt.tx.update(g, opt_state, params)
        params = jax.tree.map(jnp.add, params, updates)
        history.append(jax.tree.map(np.asarray, params))
    return history


def _assert_close(got, want):
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_fedavg_is_the_clients_mean_at_lr_one(lr):
    theta0, clients = _problem(1)
    theta, want = dict(theta0), []
    for r in range(ROUNDS):
        mean = clients(theta, r)
        theta = {k: theta[k] + lr * (mean[k] - theta[k]) for k in theta}
        want.append(theta)
    _assert_close(_run_optax(fedavg(lr), theta0, clients), want)


@pytest.mark.parametrize("beta,lr", [(0.4, 1.0), (0.9, 0.7)])
def test_fedavgm_matches_spec_loop(beta, lr):
    theta0, clients = _problem(2)
    theta, m, want = dict(theta0), {k: 0.0 * v for k, v in theta0.items()}, []
    for r in range(ROUNDS):
        mean = clients(theta, r)
        for k in theta:
            d = mean[k] - theta[k]
            m[k] = beta * m[k] + d
            theta[k] = theta[k] + lr * m[k]
        want.append(dict(theta))
    _assert_close(_run_optax(fedavgm(lr, FedAvgMConfig(beta=beta)), theta0, clients), want)


@pytest.mark.parametrize("lr,tau", [(0.01, 1e-3), (0.1, 0.05)])
def test_fedadam_matches_spec_loop_without_bias_correction(lr, tau):
    b1, b2 = 0.9, 0.99
    theta0, clients = _problem(3)
    theta = dict(theta0)
    m = {k: np.zeros_like(v) for k, v in theta0.items()}
    v = {k: np.full_like(x, tau**2) for k, x in theta0.items()}
    want = []
    for r in range(ROUNDS):
        mean = clients(theta, r)
        for k in theta:
            d = mean[k] - theta[k]
            m[k] = b1 * m[k] + (1 - b1) * d
            v[k] = b2 * v[k] + (1 - b2) * d * d
            theta[k] = theta[k] + lr * m[k] / (np.sqrt(v[k]) + tau)
        want.append(dict(theta))
    sopt = fedadam(lr, FedAdamConfig(b1=b1, b2=b2, tau=tau))
    _assert_close(_run_optax(sopt, theta0, clients), want)
    # Bias correction would make the first step lr * sign(d)-like (|step| ~ lr); without it the
    # first step is (1 - b1) * d / (|d| sqrt(1 - b2) + tau) ~ lr: check it is not optax.adam.
    import optax

    adam = optax.adam(lr, b1=b1, b2=b2, eps=tau)
    p = jax.tree.map(jnp.float32, theta0)
    upd, _ = adam.update(jax.tree.map(lambda x: -x, clients(theta0, 0)), adam.init(p), p)
    assert not np.allclose(np.asarray(upd["w"]), want[0]["w"] - theta0["w"], atol=1e-4)


@pytest.mark.parametrize("lam", [0.85, 0.5])
def test_fedacg_matches_spec_loop(lam):
    theta0, clients = _problem(4)
    theta, m, want = dict(theta0), {k: 0.0 * v for k, v in theta0.items()}, []
    for r in range(ROUNDS):
        look = {k: theta[k] + lam * m[k] for k in theta}
        mean = clients(look, r)
        for k in theta:
            d = mean[k] - look[k]
            m[k] = lam * m[k] + d
            theta[k] = theta[k] + m[k]
        np.testing.assert_allclose(theta["w"], mean["w"], rtol=1e-12)  # the new model is the mean
        want.append(dict(theta))
    _assert_close(_run_optax(fedacg(settings=FedACGConfig(lookahead=lam)), theta0, clients), want)


def test_fedacg_client_penalty_is_beta_squared_distance_without_gradient_to_start():
    rng = np.random.default_rng(5)
    w = {"a": jnp.asarray(rng.normal(size=(4, 3))), "b": jnp.asarray(rng.normal(size=(3,)))}
    s = {"a": jnp.asarray(rng.normal(size=(4, 3))), "b": jnp.asarray(rng.normal(size=(3,)))}
    sopt = fedacg(settings=FedACGConfig(beta=0.01))
    want = 0.01 * sum(np.sum((np.asarray(w[k]) - np.asarray(s[k])) ** 2) for k in w)
    np.testing.assert_allclose(float(sopt.client_penalty(w, s)), want, rtol=1e-5)
    g_start = jax.grad(lambda s: sopt.client_penalty(w, s))(s)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(g_start))


def _toy_cfg(*overrides):
    """A validated config on the tests' toy dataset (which the config cannot name)."""
    cfg = load_config(None, ["model=cnn", "num_clients=8", "participation=0.5",
                              "partition=iid", "local_epochs=1", "batch_size=16", "rounds=3",
                              "algorithm=fedavg", *overrides])
    return dataclasses.replace(cfg, dataset="toy")


@pytest.mark.slow
def test_fedacg_round_broadcasts_the_look_ahead_and_adds_the_client_term(toy):
    """Round 2 of the compiled program equals clients trained one by one from
    ``theta + lambda m`` with the ``beta ||w - look-ahead||^2`` term, then the mean."""
    exp = build(_toy_cfg("server.optimizer=fedacg", "server.fedacg.beta=0.5"), toy)
    step = jax.jit(exp.run_round)
    state, _ = step(exp.state, exp.data)
    m = jax.tree.map(np.asarray, state.opt_state[1].last)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(m)) > 0
    look = jax.tree.map(lambda p, x: np.asarray(p) + 0.85 * x, state.params, m)
    _, results = sequential_local_updates(exp, state.replace(params=look))
    mean = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *[r[0] for r in results])
    new_state, metrics = step(state, exp.data)
    chex.assert_trees_all_close(new_state.params, mean, rtol=1e-5, atol=1e-5)
    assert float(metrics["acg"]) > 0
    # The client term changes training: without it the clients end elsewhere.
    plain = build(_toy_cfg("server.optimizer=fedacg", "server.fedacg.beta=0"), toy)
    _, plain_results = sequential_local_updates(plain, state.replace(params=look))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(results[0][0]), jax.tree.leaves(plain_results[0][0]), strict=True))
    assert diff > 1e-6


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam", "fedacg"])
def test_every_server_optimizer_builds_from_config_with_its_defaults(name):
    cfg = _toy_cfg(f"server.optimizer={name}")
    sopt = server_optimizer(cfg)
    params = {"w": jnp.ones((2,))}
    state = sopt.tx.init(params)
    upd, _ = sopt.tx.update({"w": jnp.full((2,), 0.5)}, state, params)
    assert np.all(np.asarray(upd["w"]) < 0)  # a step toward the clients' mean


def test_server_optimizer_sections_are_validated_with_field_names(tmp_path):
    # Every section's values are checked, the unused ones too (a file may set them all: a
    # run's config.yaml records every section; on the command line they are refused unread).
    sections = tmp_path / "sections.yaml"
    sections.write_text("server:\n  fedavgm:\n    beta: -0.1\n  fedacg:\n    lookahead: 2.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(sections), ["server.optimizer=fedadam", "server.fedadam.b1=1.5",
                                    "server.fedadam.tau=0", "server.lr=-1"])
    msg = str(e.value)
    for field in ("server.fedadam.b1=1.5", "server.fedadam.tau=0.0",
                  "server.fedavgm.beta=-0.1", "server.fedacg.lookahead=2.0", "server.lr=-1.0"):
        assert field in msg, msg
    with pytest.raises(ConfigError, match="server.optimizer='sgd': allowed: fedavg"):
        _toy_cfg("server.optimizer=sgd")
    with pytest.raises(ConfigError, match="server.fedadam.eps: unknown config key; allowed keys "
                                          "here: b1, b2, tau"):
        _toy_cfg("server.optimizer=fedadam", "server.fedadam.eps=1e-8")


def test_a_setting_of_a_server_optimizer_the_run_does_not_use_is_refused(tmp_path):
    """``server.fedadam.tau=0.1`` with the default ``server.optimizer=fedavg`` was accepted and
    changed nothing; on the command line (or as a sweep) it is refused with a line naming the
    optimizer, what it reads and who reads the key. A file may still set every section."""
    with pytest.raises(ConfigError) as e:
        _toy_cfg("server.fedadam.tau=0.1", "server.fedavgm.beta=[0.2,0.4]")
    assert e.value.problems == [
        "server.fedadam.tau: server optimizer fedavg does not read it (it reads no section of "
        "its own, only server.lr; server.fedadam.* is read by server.optimizer=fedadam)",
        "server.fedavgm.beta: server optimizer fedavg does not read it (it reads no section "
        "of its own, only server.lr; server.fedavgm.* is read by server.optimizer=fedavgm)"]
    with pytest.raises(ConfigError) as e:
        _toy_cfg("server.optimizer=fedavgm", "server.fedacg.beta=0.1")
    assert e.value.problems == [
        "server.fedacg.beta: server optimizer fedavgm does not read it (it reads: "
        "server.fedavgm.beta; server.fedacg.* is read by server.optimizer=fedacg)"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("sweep:\n  key: server.fedadam.tau\n  values: [0.1, 0.01]\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(sweep), [])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(
        "sweep.key='server.fedadam.tau': a sweep of a setting the run does not read "
        "trains identical runs; server.fedadam.tau: server optimizer fedavg does not read it")
    # What the run reads is accepted: its own section and server.lr, given in any order.
    cfg = _toy_cfg("server.fedadam.tau=0.1", "server.lr=0.5", "server.optimizer=fedadam")
    assert (cfg.server.optimizer, cfg.server.fedadam.tau, cfg.server.lr) == ("fedadam", 0.1, 0.5)
    both = tmp_path / "both.yaml"
    both.write_text("server:\n  optimizer: fedavgm\n  fedadam:\n    tau: 0.1\n")
    assert load_config(str(both), []).server.fedadam.tau == 0.1
