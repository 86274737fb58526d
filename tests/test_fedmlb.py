"""FedMLB's client: the models can be entered after any block, its hybrid pathways equal
forward passes of models spliced from local and global blocks (values and gradients), and its
section is validated (a model that cannot be entered in the middle is refused)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled_fns

from fedjax_rcl import registry
from fedjax_rcl.algorithms import ALGORITHMS, Batch, LocalContext
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.algorithms.fedmlb import FedMLBConfig, fedmlb
from fedjax_rcl.config import ConfigError, load_config
from fedjax_rcl.models import get_model, model_fns

# Each model's blocks, in order, as the top-level parameter names they own.
BLOCKS = {
    "cnn": [["conv1"], ["conv2"], ["fc1"], ["fc2"]],
    "pfl_cnn": [["conv1"], ["conv2"], ["fc1"]],
    "resnet10": [["stem_conv", "stem_norm"]] + [[f"stage{s}_block1"] for s in (1, 2, 3, 4)],
    "resnet18": [["stem_conv", "stem_norm"]]
    + [[f"stage{s}_block1", f"stage{s}_block2"] for s in (1, 2, 3, 4)],
}


def _splice(local, glob, name, m):
    """The parameters of hybrid pathway m: local blocks 1..m, global blocks after and head."""
    mine = {k for block in BLOCKS[name][:m] for k in block}
    return {k: (local[k] if k in mine else glob[k]) for k in glob}


def _setup(name, size):
    kw = {"width": 4} if name.startswith("resnet") else {}
    model = model_fns(get_model(name, num_classes=5, **kw), conv_impl="patches")
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(6, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, 6), jnp.int32)
    local, ms = model.init(jax.random.PRNGKey(0), images[:1])
    glob, _ = model.init(jax.random.PRNGKey(1), images[:1])
    return compiled_fns(model), Batch(images, labels), local, glob, ms


@pytest.mark.parametrize("name,size", [
    ("cnn", 32), ("pfl_cnn", 16), pytest.param("resnet10", 8, marks=pytest.mark.slow),
    pytest.param("resnet18", 8, marks=pytest.mark.slow)])
def test_entering_after_each_block_reproduces_the_forward_pass(name, size):
    model, batch, local, _, ms = _setup(name, size)
    out, _ = model.apply(local, ms, batch.images, train=False)
    assert len(out.blocks) == len(BLOCKS[name]) == registry.model(name).num_blocks
    assert sorted([k for b in BLOCKS[name] for k in b] + ["head"]) == sorted(local)
    for k in range(1, len(out.blocks) + 1):
        tail = model.apply_from(local, ms, out.blocks[k - 1], start=k)
        np.testing.assert_allclose(np.asarray(tail.logits), np.asarray(out.logits),
                                   rtol=1e-5, atol=1e-6)
        assert len(tail.blocks) == len(out.blocks) - k


def _reference_loss(model, local, glob, ms, batch, name, lambda1, lambda2):
    """CE + lambda1 mean_m CE(z_m) + lambda2 mean_m KL(p_m || p), with z_m from spliced models'
    ordinary forward passes (float64 arithmetic on their logits)."""
    z = np.asarray(model.apply(local, ms, batch.images, train=False)[0].logits, np.float64)
    y = np.asarray(batch.labels)
    logp = lambda v: v - v.max(-1, keepdims=True) - np.log(
        np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True))
    ce = lambda v: -np.mean(logp(v)[np.arange(len(y)), y])
    hyb_ce, hyb_kl = [], []
    for m in range(1, len(BLOCKS[name]) + 1):
        zm = np.asarray(model.apply(_splice(local, glob, name, m), ms, batch.images,
                                    train=False)[0].logits, np.float64)
        hyb_ce.append(ce(zm))
        hyb_kl.append(np.mean(np.sum(np.exp(logp(zm)) * (logp(zm) - logp(z)), -1)))
    return ce(z) + lambda1 * np.mean(hyb_ce) + lambda2 * np.mean(hyb_kl)


@pytest.mark.parametrize("name,size,lambda1,lambda2",
                         [("cnn", 32, 1.0, 1.0),
                          pytest.param("resnet10", 8, 0.5, 2.0, marks=pytest.mark.slow)])
def test_objective_equals_spliced_models(name, size, lambda1, lambda2):
    model, batch, local, glob, ms = _setup(name, size)
    algorithm = fedmlb(model, FedMLBConfig(lambda1=lambda1, lambda2=lambda2))
    ctx = LocalContext(glob, ms, (), jax.random.PRNGKey(2))
    out, _ = model.apply(local, ms, batch.images, train=True)
    loss, terms = algorithm.objective(out, local, batch, ctx)
    want = _reference_loss(model, local, glob, ms, batch, name, lambda1, lambda2)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(terms["hybrid_kl"]) > 0  # two different models: the term is live
    assert set(terms) == {"ce", "hybrid_ce", "hybrid_kl"}


@pytest.mark.slow
def test_gradient_flows_through_the_global_blocks_into_the_local_ones():
    """d/d local of the objective = d/d local of CE(local) + mean_m CE(spliced_m(local, g)):
    every local block is trained through the frozen global blocks after it."""
    name = "resnet10"
    model, batch, local, glob, ms = _setup(name, 8)
    algorithm = fedmlb(model, FedMLBConfig(lambda1=1.0, lambda2=0.0))
    ctx = LocalContext(glob, ms, (), jax.random.PRNGKey(2))

    def objective(p):
        out, _ = model.apply(p, ms, batch.images, train=False)
        return algorithm.objective(out, p, batch, ctx)[0]

    def spliced(p):
        ces = [cross_entropy(model.apply(_splice(p, glob, name, m), ms, batch.images,
                                         train=False)[0].logits, batch.labels)
               for m in range(1, 6)]
        main = model.apply(p, ms, batch.images, train=False)[0].logits
        return cross_entropy(main, batch.labels) + jnp.mean(jnp.stack(ces))

    got, want = jax.jit(jax.grad(objective))(local), jax.jit(jax.grad(spliced))(local)
    chex.assert_trees_all_close(got, want, rtol=2e-4, atol=1e-6)
    assert float(jnp.abs(got["stem_conv"]["kernel"]).max()) > 0


def test_registered_with_a_validated_section():
    assert "fedmlb" in ALGORITHMS
    cfg = load_config(None, ["algorithm=fedmlb"])
    assert (cfg.fedmlb.lambda1, cfg.fedmlb.lambda2, cfg.fedmlb.tau) == (1.0, 1.0, 1.0)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm=fedmlb", "fedmlb.lambda1=-1", "fedmlb.tau=0"])
    assert "fedmlb.lambda1=-1.0: must be >= 0" in str(e.value)
    assert "fedmlb.tau=0.0: must be > 0" in str(e.value)


def test_a_model_without_blocks_is_refused_only_for_fedmlb():
    build = registry.model("cnn").build
    registry.register_model("test_mlb_no_blocks", build, num_levels=4)
    try:
        load_config(None, ["model=test_mlb_no_blocks"])  # fedavg: fine
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model=test_mlb_no_blocks", "algorithm=fedmlb"])
        assert "model=test_mlb_no_blocks cannot be entered after a block" in str(e.value)
    finally:
        registry.MODELS.pop("test_mlb_no_blocks")
