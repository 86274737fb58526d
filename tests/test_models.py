"""Model structure: parameter counts, levels, PyTorch padding and initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import Compiled
from jax import lax

from fedjax_rcl.models import get_model
from fedjax_rcl.nn import conv


@pytest.fixture(autouse=True)
def _patch_convolutions():
    """The models here are traced directly (Flax's ``init`` and ``apply``), with the patch
    convolutions."""
    with conv.implementation("patches"):
        yield


def _init(name, classes=10, shape=(2, 32, 32, 3)):
    model = Compiled(get_model(name, num_classes=classes))
    x = jax.random.uniform(jax.random.PRNGKey(0), shape)
    return model, model.init(jax.random.PRNGKey(1), x)["params"], x


@pytest.mark.slow
def test_resnet18_matches_reference_structure():
    model, params, x = _init("resnet18")
    # The reference ResNet18_base has 11,173,962 parameters for 10 classes.
    assert sum(p.size for p in jax.tree.leaves(params)) == 11_173_962
    out = model.apply({"params": params}, x)
    assert out.logits.shape == (2, 10)
    # Levels: stem (after GN) and the four stages, pooled to [B, C].
    assert [f.shape for f in out.features] == [(2, 64), (2, 64), (2, 128), (2, 256), (2, 512)]
    assert out.embedding.shape == (2, 512)
    # GroupNorm: 2 groups, eps 1e-5; no conv bias anywhere.
    gn = params["stem_norm"]["gn"]
    assert set(gn) == {"scale", "bias"}
    assert all("bias" not in v for k, v in params["stage2_block1"].items() if "conv" in k)


def test_cnn_matches_moon_structure():
    model, params, x = _init("cnn")
    shapes = {k: v["kernel"].shape for k, v in params.items()}
    assert shapes == {"conv1": (5, 5, 3, 6), "conv2": (5, 5, 6, 16), "fc1": (400, 120),
                      "fc2": (120, 84), "head": (84, 10)}
    out = model.apply({"params": params}, x)
    assert [f.shape for f in out.features] == [(2, 6), (2, 16), (2, 120), (2, 84)]


def test_moon_cnn_classifies_the_projection_like_moons_model_fed_con():
    """MOON's ``ModelFedCon(simple-cnn)``: features -> l1 (84) -> ReLU -> l2 (256) -> l3
    (classes); the logits are the classifier applied to the projection, for every method."""
    model, params, x = _init("moon_cnn")
    shapes = {k: v["kernel"].shape for k, v in params.items() if "kernel" in v}
    assert shapes["head"] == (256, 10)
    assert {k: v["kernel"].shape for k, v in params["projection"].items()} == {
        "proj1": (84, 84), "proj2": (84, 256)}
    out = model.apply({"params": params}, x)
    head = params["head"]
    np.testing.assert_allclose(out.logits, out.projection @ head["kernel"] + head["bias"],
                               rtol=1e-5, atol=1e-6)
    z = np.maximum(out.embedding @ params["projection"]["proj1"]["kernel"]
                   + params["projection"]["proj1"]["bias"], 0)
    np.testing.assert_allclose(out.projection, z @ params["projection"]["proj2"]["kernel"]
                               + params["projection"]["proj2"]["bias"], rtol=1e-5, atol=1e-5)
    # The plain CNN with MOON's head keeps its classifier on the embedding.
    plain = Compiled(get_model("cnn", num_classes=10, projection_dim=256))
    assert plain.init(jax.random.PRNGKey(1), x)["params"]["head"]["kernel"].shape == (84, 10)


def test_pfl_cnn_matches_pfl_researchs_structure():
    model, params, x = _init("pfl_cnn")
    # pfl-research's CIFAR-10 CNN, by hand: conv 3*32*9 + 32, conv 32*64*9 + 64,
    # dense (14*14*64)*128 + 128 (valid convs 32 -> 30 -> 28, pool -> 14), dense 128*10 + 10.
    assert sum(p.size for p in jax.tree.leaves(params)) == (
        (3 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (14 * 14 * 64 * 128 + 128) + (128 * 10 + 10)
    ) == 1_626_442
    out = model.apply({"params": params}, x, train=False)
    assert out.logits.shape == (2, 10)
    assert [f.shape for f in out.features] == [(2, 32), (2, 64), (2, 128)]
    assert [b.shape for b in out.blocks] == [(2, 30, 30, 32), (2, 14, 14, 64), (2, 128)]
    # Dropout: off in evaluation, drawn from the "dropout" key in training.
    again = model.apply({"params": params}, x, train=False)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(again.logits))
    a, b = (model.apply({"params": params}, x, train=True,
                        rngs={"dropout": jax.random.PRNGKey(k)}).logits for k in (1, 2))
    assert float(jnp.abs(a - b).max()) > 0
    with pytest.raises(Exception, match="dropout"):
        model.apply({"params": params}, x, train=True)


@pytest.mark.slow
def test_levels_are_pre_relu():
    """Pre-ReLU features can be negative; post-ReLU could not."""
    model, params, x = _init("resnet18", shape=(4, 32, 32, 3))
    out = model.apply({"params": params}, x)
    # Pooled pre-ReLU GN outputs have channels with negative means.
    assert all(float(jnp.min(f)) < 0 for f in out.features)


def test_stride2_padding_is_symmetric_like_pytorch():
    """A stride-2 3x3 conv like ResNet-18's first of stage 2 equals lax.conv with padding
    (1, 1), not Flax 'SAME'."""
    w = jax.random.normal(jax.random.PRNGKey(4), (3, 3, 64, 128)) * 0.05
    x = jax.random.normal(jax.random.PRNGKey(5), (1, 32, 32, 64))
    from fedjax_rcl.nn.conv import torch_conv

    layer = torch_conv(64, 128, 3, stride=2, padding=1, use_bias=False)
    y = layer.apply({"params": {"kernel": w}}, x)
    dn = ("NHWC", "HWIO", "NHWC")
    sym = lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=dn)
    same = lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=dn)
    np.testing.assert_allclose(y, sym, atol=1e-5)
    assert not np.allclose(y, same, atol=1e-3)


@pytest.mark.parametrize("name", ["cnn", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_pytorch_default_initialisation(name):
    """Kernels and dense biases are U(+-1/sqrt(fan_in)); norm scale 1, bias 0."""
    _, params, _ = _init(name)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    kernels = {jax.tree_util.keystr(p[:-1]): v for p, v in flat if p[-1].key == "kernel"}
    for path, v in flat:
        leaf, owner = path[-1].key, jax.tree_util.keystr(path[:-1])
        if leaf == "kernel" or (leaf == "bias" and owner in kernels):
            k = kernels[owner]
            bound = 1 / np.sqrt(np.prod(k.shape[:-1]))
            v = np.asarray(v)
            assert np.abs(v).max() <= bound + 1e-7, owner
            if v.size > 1000:  # uniform, so it nearly reaches the bound and has mean ~0
                assert np.abs(v).max() > 0.95 * bound, owner
                assert abs(v.std() - bound / np.sqrt(3)) < 0.05 * bound, owner
        elif leaf == "scale":
            assert np.all(np.asarray(v) == 1.0)
        elif leaf == "bias":
            assert np.all(np.asarray(v) == 0.0)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="model='vgg'"):
        get_model("vgg", num_classes=10)


def _basic_resnet_params(stage_sizes, width, classes=10):
    """Hand count of a CIFAR BasicBlock ResNet with GroupNorm (scale + bias per channel)."""
    widths = [width * 2**s for s in range(4)]
    n = 3 * 3 * 3 * width + 2 * width  # stem conv (no bias) + GN
    cin = width
    for s, (blocks, c) in enumerate(zip(stage_sizes, widths, strict=True)):
        for b in range(blocks):
            n += 9 * cin * c + 2 * c + 9 * c * c + 2 * c
            if (s > 0 and b == 0) or cin != c:
                n += cin * c + 2 * c  # 1x1 projection shortcut + GN
            cin = c
    return n + widths[-1] * classes + classes


def test_hand_count_reproduces_the_reference_resnet18():
    assert _basic_resnet_params((2, 2, 2, 2), 64) == 11_173_962


@pytest.mark.parametrize("name,stages,width", [
    # One in the default step, the others in the slow step.
    pytest.param("resnet10", (1, 1, 1, 1), 64, marks=pytest.mark.slow),
    ("resnet10", (1, 1, 1, 1), 16),
    pytest.param("resnet18", (2, 2, 2, 2), 16, marks=pytest.mark.slow),
    pytest.param("resnet18", (2, 2, 2, 2), 8, marks=pytest.mark.slow),
])
def test_narrow_and_shallow_resnets(name, stages, width):
    """``width`` scales every stage; ``resnet10`` has one block per stage; same five levels."""
    model = Compiled(get_model(name, num_classes=10, width=width))
    x = jax.random.uniform(jax.random.PRNGKey(0), (2, 32, 32, 3))
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    assert sum(p.size for p in jax.tree.leaves(params)) == _basic_resnet_params(stages, width)
    out = model.apply({"params": params}, x)
    w = width
    assert [f.shape for f in out.features] == [(2, w), (2, w), (2, 2 * w), (2, 4 * w),
                                               (2, 8 * w)]
    assert out.logits.shape == (2, 10) and out.embedding.shape == (2, 8 * w)
    blocks = {k for k in params if k.startswith("stage")}
    assert len(blocks) == sum(stages)


def test_width_is_refused_for_the_cnn():
    with pytest.raises(ValueError, match="fixed width"):
        get_model("cnn", num_classes=10, width=16)


@pytest.mark.parametrize("partitionable", [False, True])
def test_model_fns_init_uses_the_chosen_threefry_layout(partitionable):
    """``init_threefry_partitionable=true`` reproduces the initial weights of runs started
    started with JAX's default layout (this repository's earlier runs); the default is the
    non-partitionable one."""
    import chex

    from fedjax_rcl.models.base import model_fns

    module = get_model("cnn", num_classes=10)
    key, sample = jax.random.PRNGKey(3), np.zeros((1, 32, 32, 3), np.float32)
    params, _ = model_fns(module, partitionable_init=partitionable).init(key, sample)
    with jax.threefry_partitionable(partitionable):
        expected = jax.jit(lambda k, s: module.init(k, s, train=False))(key, sample)["params"]
    with jax.threefry_partitionable(not partitionable):
        other = jax.jit(lambda k, s: module.init(k, s, train=False))(key, sample)["params"]
    chex.assert_trees_all_equal(params, expected)
    assert not np.allclose(jax.tree.leaves(params)[0], jax.tree.leaves(other)[0])


def _builtin_models():
    from fedjax_rcl import builtins, registry

    builtins.load()
    return [n for n, e in registry.MODELS.items() if e.build.__module__.startswith("fedjax_rcl.")]


def _feature_maps(name: str, size: int):
    """The shapes of every array the model returns for ``[2, size, size, 3]`` images (traced
    only, nothing is run)."""
    module = get_model(name, num_classes=10)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    out = jax.eval_shape(
        lambda x: module.init_with_output(jax.random.PRNGKey(0), x, train=False)[0], x)
    return [leaf.shape for leaf in jax.tree_util.tree_leaves(out)]


@pytest.mark.parametrize("name", _builtin_models())
def test_each_model_states_the_smallest_input_it_takes(name):
    """The stated minimum traces to non-empty outputs; one pixel less does not (a layer that
    does not fit raises, or a pool leaves an empty map whose mean is NaN)."""
    from fedjax_rcl import registry

    smallest = registry.model(name).min_input_size
    assert isinstance(smallest, int) and smallest >= 1
    assert all(0 not in shape for shape in _feature_maps(name, smallest))
    if smallest > 1:
        try:
            shapes = _feature_maps(name, smallest - 1)
        except (ValueError, TypeError, ZeroDivisionError):
            return
        assert any(0 in shape for shape in shapes), shapes


def test_validating_model_and_norm_imports_no_model_module():
    """The config checks ``model=`` and ``norm=`` against the models' registry entries, which
    the models package declares without importing any model's code (a fresh process: this
    one has imported them)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from fedjax_rcl.config import load_config\n"
            "load_config(None, ['model=resnet18', 'norm=batch'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('fedjax_rcl.models')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["['fedjax_rcl.models',", "'fedjax_rcl.models.base']"]


def test_the_cnns_compile_without_ynnpack_fusions_on_a_cpu_unless_the_user_says():
    """A model entry's ``cpu_xla_options`` are what its runs compile with on a CPU, not
    elsewhere, not where XLA_FLAGS sets the option: the two small CNNs without YNNPACK fusions
    (which ran MOON's CNN's max-pools at 1-4 GB/s), pfl's CNN and the ResNets with XLA's
    default; the option XLA takes by that name has that effect."""
    from fedjax_rcl.experiment import compile_options
    from fedjax_rcl.nn.pool import max_pool

    off = {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert compile_options("cnn", "cpu", "") == compile_options("moon_cnn", "cpu", "") == off
    assert compile_options("resnet18", "cpu", "") == compile_options("pfl_cnn", "cpu", "") == {}
    assert compile_options("cnn", "gpu", "") == {}
    assert compile_options("cnn", "cpu", "--xla_cpu_experimental_ynn_fusion_type="
                                         "LIBRARY_FUSION_TYPE_REDUCE") == {}
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 28, 28, 6))
    lowered = jax.jit(jax.grad(lambda x: jnp.sum(max_pool(jax.nn.relu(x), 2) ** 2))).lower(x)
    fusions = lambda compiled: sum(" fusion(" in line and "%ynn_fusion" in line
                                   for line in compiled.as_text().splitlines())
    assert fusions(lowered.compile(off)) == 0
    with_ynn = lowered.compile({"xla_cpu_experimental_ynn_fusion_type":
                                "LIBRARY_FUSION_TYPE_REDUCE"})
    assert fusions(with_ynn) > 0  # the pool is a YNNPACK fusion when they are on
    np.testing.assert_array_equal(with_ynn(x), lowered.compile(off)(x))
