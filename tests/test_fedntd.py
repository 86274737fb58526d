"""FedNTD's client objective: CE + beta * tau^2 * KL on the not-true classes, against a NumPy
float64 loop over the model's own logits; the global model gets no gradient; its section is
validated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled_fns

from fedjax_rcl.algorithms import ALGORITHMS, Batch, LocalContext
from fedjax_rcl.algorithms.fedntd import FedNTDConfig, fedntd
from fedjax_rcl.config import ConfigError, load_config
from fedjax_rcl.models import get_model, model_fns


def _reference(logits, global_logits, labels, beta, tau):
    """CE + beta * tau^2 * mean_i KL(q_g || q) over the classes other than y_i (float64)."""
    n, k = logits.shape
    ce = ntd = 0.0
    for i in range(n):
        z = logits[i] - logits[i].max()
        ce += -(z[labels[i]] - np.log(np.exp(z).sum()))
        others = [c for c in range(k) if c != labels[i]]
        p = np.exp(logits[i, others] / tau)
        p /= p.sum()
        q = np.exp(global_logits[i, others] / tau)
        q /= q.sum()
        ntd += np.sum(q * (np.log(q) - np.log(p)))
    return ce / n + beta * tau**2 * ntd / n, tau**2 * ntd / n


@pytest.fixture(scope="module")
def setup():
    model = compiled_fns(model_fns(get_model("cnn", num_classes=5), conv_impl="patches"))
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(12, 16, 16, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, 12), jnp.int32)
    local, ms = model.init(jax.random.PRNGKey(0), images[:1])
    glob, _ = model.init(jax.random.PRNGKey(1), images[:1])
    return model, Batch(images, labels), local, glob, ms


@pytest.mark.parametrize("beta,tau", [(0.3, 1.0), (1.0, 3.0)])
def test_objective_matches_numpy_on_the_models_logits(setup, beta, tau):
    model, batch, local, glob, ms = setup
    algorithm = fedntd(model, FedNTDConfig(beta=beta, tau=tau))
    ctx = LocalContext(glob, ms, (), jax.random.PRNGKey(2))
    out, _ = model.apply(local, ms, batch.images, train=True)
    loss, terms = algorithm.objective(out, local, batch, ctx)
    g_out, _ = model.apply(glob, ms, batch.images, train=False)
    want, want_ntd = _reference(np.asarray(out.logits, np.float64),
                                np.asarray(g_out.logits, np.float64), np.asarray(batch.labels),
                                beta, tau)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(terms["ntd"]), want_ntd, rtol=1e-4, atol=1e-7)
    assert want_ntd > 0  # two different models: the term is live


def test_no_gradient_reaches_the_global_model(setup):
    model, batch, local, glob, ms = setup
    algorithm = fedntd(model)

    def loss_of_global(g):
        out, _ = model.apply(local, ms, batch.images, train=True)
        return algorithm.objective(out, local, batch, LocalContext(g, ms, (),
                                                                   jax.random.PRNGKey(2)))[0]

    grads = jax.jit(jax.grad(loss_of_global))(glob)
    assert all(np.abs(np.asarray(x)).max() == 0.0 for x in jax.tree.leaves(grads))


def test_registered_with_a_validated_section():
    assert "fedntd" in ALGORITHMS
    cfg = load_config(None, ["algorithm=fedntd"])
    assert (cfg.fedntd.beta, cfg.fedntd.tau) == (0.3, 1.0)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm=fedntd", "fedntd.beta=-1", "fedntd.tau=0"])
    assert "fedntd.beta=-1.0: must be >= 0" in str(e.value)
    assert "fedntd.tau=0.0: must be > 0" in str(e.value)
