"""MFCL's networks (``fedjax_rcl.models.mfcl``): shapes, parameter counts, what each
normalisation lets a row depend on (Twin Norm: its view partner only), BatchNorm state on the
server, registration, and gradients of the reconstruction loss.

Everything runs on tiny images (8x8) with XLA's native convolutions, so the file stays fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from fedjax_rcl import registry
from fedjax_rcl.models import ModelOutput, get_model, model_fns
from fedjax_rcl.models.mfcl import (
    Autoencoder,
    ClientModule,
    Decoder,
    MfclProjectionHead,
    ServerModel,
    ServerNetwork,
)
from fedjax_rcl.nn import conv
from fedjax_rcl.nn.twin_norm import twin_norm

NORMS = ("twin", "group", "batch")
IMPL = "native"


@pytest.fixture(autouse=True)
def _native_convolutions():
    """The modules here are traced directly (Flax's ``init`` and ``apply``), with ``IMPL``."""
    with conv.implementation(IMPL):
        yield


def _images(n=4, size=8, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(size=(n, size, size, 3)), jnp.float32)


def _count(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def _init(module, x, seed=0):
    """Variables of ``module`` for inputs like ``x``, drawn with NumPy into the shapes that
    ``init`` gives: compiling the Flax initialisers (threefry) takes seconds on a CPU, these
    take none. Kernels ~ N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2), biases N(0, 0.1^2),
    BatchNorm statistics as ``init`` leaves them (mean 0, variance 1)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path[-1:])
        if "kernel" in name:
            fan_in = int(np.prod(leaf.shape[:-1]))
            return jnp.asarray(rng.normal(0, fan_in ** -0.5, leaf.shape), leaf.dtype)
        if "scale" in name:
            return jnp.asarray(1 + rng.normal(0, 0.1, leaf.shape), leaf.dtype)
        if "bias" in name:
            return jnp.asarray(rng.normal(0, 0.1, leaf.shape), leaf.dtype)
        if "mean" in name:
            return jnp.zeros(leaf.shape, leaf.dtype)
        if "var" in name:
            return jnp.ones(leaf.shape, leaf.dtype)
        raise AssertionError(f"unexpected variable {jax.tree_util.keystr(path)}")

    return jax.tree_util.tree_map_with_path(draw, _shapes(module, x))


def _shapes(module, x):
    """The variables' shapes, traced only (nothing computed)."""
    return jax.eval_shape(lambda x: module.init(jax.random.PRNGKey(0), x, train=False), x)


def _apply(module, variables, x, *, train):
    """Applies in training with the BatchNorm statistics mutable when there are any."""
    if train and "batch_stats" in variables:
        return module.apply(variables, x, train=True, mutable=["batch_stats"])[0]
    return module.apply(variables, x, train=train)


def _runner(module, *, train):
    """``(variables, x) -> output``, jitted."""
    return jax.jit(lambda v, x: _apply(module, v, x, train=train))


def _run(module, variables, x, *, train):
    return _runner(module, train=train)(variables, x)


@pytest.mark.parametrize("norm", NORMS)
def test_client_decoder_autoencoder_shapes(norm):
    x = _images()
    r = jnp.ones((4, 4, 4, 64))
    client, decoder = ClientModule(norm), Decoder(norm)
    assert jax.eval_shape(lambda: client.init_with_output(
        jax.random.PRNGKey(0), x, train=False)[0]).shape == (4, 4, 4, 64)
    assert jax.eval_shape(lambda: decoder.init_with_output(
        jax.random.PRNGKey(0), r, train=False)[0]).shape == x.shape

    # The autoencoder's output, with values, in test_reconstruction_gradients_...
    out = jax.eval_shape(lambda: Autoencoder(norm).init_with_output(
        jax.random.PRNGKey(0), x, train=False)[0])
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == x.shape and out.logits.dtype == jnp.float32
    assert len(out.features) == 1 and out.features[0].shape == (4, 64)
    assert out.embedding.shape == (4, 64) and out.projection is None


def test_decoder_restores_even_sizes_and_autoencoder_refuses_odd_ones():
    for h, w in ((4, 4), (8, 12), (16, 16)):
        r = jnp.ones((2, h // 2, w // 2, 64))
        y = jax.eval_shape(lambda r=r: Decoder("group").init_with_output(
            jax.random.PRNGKey(0), r, train=False)[0])
        assert y.shape == (2, h, w, 3)
    grey = jnp.ones((2, 8, 8, 1))  # the decoder gives back the input's channels
    out = jax.eval_shape(lambda: Autoencoder("group").init_with_output(
        jax.random.PRNGKey(0), grey, train=False)[0])
    assert out.logits.shape == grey.shape
    with pytest.raises(ValueError, match="even"):
        _shapes(Autoencoder("group"), jnp.ones((2, 9, 8, 3)))


def test_server_network_model_and_head_shapes():
    r = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4, 4, 64)), jnp.float32)
    for width in (8, 16):
        h = jax.eval_shape(lambda width=width: ServerNetwork(width)
                           .init_with_output(jax.random.PRNGKey(0), r, train=False)[0])
        assert h.shape == (4, 8 * width)
    # ServerModel runs in test_server_batchnorm_statistics_...
    h, z = jax.eval_shape(lambda: ServerModel(8, projection_dim=16)
                          .init_with_output(jax.random.PRNGKey(0), r, train=False)[0])
    assert h.shape == (4, 64) and z.shape == (4, 16)
    # The head's hidden layers default to the embedding's size, its output to 128.
    shapes = jax.tree.map(jnp.shape, _shapes(MfclProjectionHead(), h)["params"])
    assert shapes["dense1"]["kernel"] == (64, 64) and shapes["dense2"]["kernel"] == (64, 64)
    assert shapes["dense3"]["kernel"] == (64, 128)


@pytest.mark.parametrize("norm", NORMS)
def test_parameter_counts_match_hand_counts(norm):
    x = _images(2)
    convs = 3 * 3 * 3 * 64 + 3 * 3 * 64 * 64
    norms = 2 * (64 + 64)  # scale and shift per channel, two layers
    params = _shapes(ClientModule(norm), x)["params"]
    assert _count(params) == convs + norms == 38_848
    dec = _shapes(Decoder(norm), jnp.ones((2, 4, 4, 64)))["params"]
    # transposed conv and conv (no bias) + two norms + the output conv with its bias
    assert _count(dec) == 2 * 3 * 3 * 64 * 64 + 2 * 128 + 3 * 3 * 64 * 3 + 3 == 75_715


def test_server_parameter_counts():
    r = jnp.ones((2, 4, 4, 64))
    params = _shapes(ServerNetwork(64), r)["params"]
    # ResNet-18 for 10 classes (11,173,962) less its stem conv + norm and its classifier.
    assert _count(params) == 11_173_962 - 3 * 3 * 3 * 64 - 128 - (512 * 10 + 10) == 11_166_976
    head = _shapes(MfclProjectionHead(), jnp.ones((2, 512)))["params"]
    assert _count(head) == 2 * 512 * 512 + 512 * 128 + 2 * (512 + 512 + 128) == 592_128


@pytest.mark.parametrize("norm, changed", [
    ("twin", {0, 2}),  # row 2's view partner, row 0, shares its statistics
    ("group", {2}),  # each row alone
    ("batch", {0, 1, 2, 3}),  # batch statistics in training
])
def test_which_rows_depend_on_the_second_view_of_sample_0(norm, changed):
    """Rows i and i + K are two views of sample i (K = 2): replacing row 2 (sample 0's second
    view) changes exactly the rows whose statistics it enters."""
    x = _images(4)
    other = x.at[2].set(_images(1, seed=7)[0])
    client = ClientModule(norm, group_size=16)
    v = _init(client, x, seed=1)
    run = _runner(client, train=True)
    before, after = np.asarray(run(v, x)), np.asarray(run(v, other))
    differs = {i for i in range(4) if np.abs(before[i] - after[i]).max() > 1e-6}
    assert differs == changed


def _reference_twin_client(params, x, group_size):
    """The client module written out with ``twin_norm``: conv -> TN -> ReLU, twice, max-pool."""
    for i in (1, 2):
        w = params[f"conv{i}"]["kernel"]
        x = lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        tn = params[f"norm{i}"]["tn"]
        x = jax.nn.relu(twin_norm(x, group_size=group_size) * tn["scale"] + tn["bias"])
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def test_twin_client_module_equals_twin_norm_reference():
    x = _images(6)
    client = ClientModule("twin", group_size=16)
    params = _init(client, x, seed=1)["params"]  # scales and shifts not 1 and 0: used too

    @jax.jit
    def outputs(params, x):
        v = {"params": params}
        return (client.apply(v, x, train=True), _reference_twin_client(params, x, 16),
                client.apply(v, jnp.concatenate([x, x]), train=True),
                client.apply(v, x, train=False))

    got, want, pair, single = outputs(params, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # Evaluation normalises each image alone: the same as training on the pair (x, x).
    np.testing.assert_allclose(single, pair[:6], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(single, pair[6:], rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(single) - np.asarray(got)).max() > 1e-3  # pairs do matter
    # The default group size, 32, is 2 groups of the 64 channels; 48 divides nothing here.
    with pytest.raises(ValueError, match="group_size"):
        _shapes(ClientModule("twin", group_size=48), x)


def test_twin_norm_needs_view_pairs_in_training_only():
    x = _images(3)
    for module in (ClientModule("twin"), Autoencoder("twin")):
        v = _shapes(module, x)  # init runs in evaluation mode: any batch
        with pytest.raises(ValueError, match="view pairs"):
            jax.eval_shape(lambda v, x, m=module: m.apply(v, x, train=True), v, x)
        jax.eval_shape(lambda v, x, m=module: m.apply(v, x, train=False), v, x)


def test_server_batchnorm_statistics_are_state_updated_in_training():
    r = jnp.asarray(np.random.default_rng(0).normal(1.0, 1.0, (4, 4, 4, 64)), jnp.float32)
    model = ServerModel(8, projection_dim=16)
    v = _init(model, r, seed=1)
    assert set(v) == {"params", "batch_stats"}
    assert {"network", "head"} <= set(v["batch_stats"])
    (h, z), updates = jax.jit(lambda v, r: model.apply(v, r, train=True,
                                                       mutable=["batch_stats"]))(v, r)
    assert h.shape == (4, 64) and z.shape == (4, 16)
    assert np.isfinite(np.asarray(h)).all() and np.isfinite(np.asarray(z)).all()
    assert float(np.asarray(h).min()) >= 0.0  # pooled after the last ReLU
    old, new = jax.tree.leaves(v["batch_stats"]), jax.tree.leaves(updates["batch_stats"])
    assert len(old) == len(new) > 0
    assert all(not np.allclose(a, b) for a, b in zip(old, new, strict=True))
    # Evaluation reads the running statistics without mutating them; training must be allowed
    # to update them.
    jax.eval_shape(lambda v, r: model.apply(v, r, train=False), v, r)
    with pytest.raises(Exception, match="batch_stats"):
        jax.eval_shape(lambda v, r: model.apply(v, r, train=True), v, r)


def test_registered_and_built_by_get_model():
    entry = registry.MODELS["mfcl_autoencoder"]  # registered by fedjax_rcl.models
    assert entry.num_levels == 1 and entry.norms == ("twin", "group", "batch")
    module = get_model("mfcl_autoencoder", num_classes=10, norm="group")
    assert isinstance(module, Autoencoder) and module.norm == "group"
    assert entry.build(10).norm == "twin"
    # The engine's functional pair (init in evaluation mode on one image) works for it. (An
    # RngBitGenerator key: the default threefry initialisers take seconds to compile on a CPU.)
    fns = model_fns(get_model("mfcl_autoencoder", num_classes=10, norm="twin"), conv_impl=IMPL)
    x = _images(4)
    params, state = fns.init(jax.random.key(0, impl="rbg"), x[:1])
    assert state == {}
    out, _ = jax.jit(lambda p, x: fns.apply(p, state, x, train=True))(params, x)
    assert out.logits.shape == x.shape and out.features[0].shape == (4, 64)


def test_conv_impl_reaches_the_convolutions():
    """The implementation in force when the autoencoder is traced runs all its convolutions,
    the decoder's upsampling one included: XLA's under ``native``, none under ``patches``."""
    x = _images(2)
    ae = Autoencoder("group")
    v = _init(ae, x)
    want = _run(ae, v, x, train=False).logits
    with conv.implementation("patches"):
        got = _run(ae, v, x, train=False).logits
        patches = str(jax.make_jaxpr(lambda v, x: _apply(ae, v, x, train=False))(v, x))
    native = str(jax.make_jaxpr(lambda v, x: _apply(ae, v, x, train=False))(v, x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert native.count("conv_general_dilated[") == 5 and "conv_general_dilated[" not in patches


@pytest.mark.parametrize("norm", NORMS)
def test_reconstruction_gradients_reach_every_parameter(norm):
    x = _images(4)
    ae = Autoencoder(norm)
    v = _init(ae, x)
    params, state = v["params"], {k: s for k, s in v.items() if k != "params"}

    def loss(p):
        out = _apply(ae, {"params": p, **state}, x, train=True)
        return optax.sigmoid_binary_cross_entropy(out.logits, x).mean(), out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert np.isfinite(float(value))
    assert out.logits.shape == x.shape and np.isfinite(np.asarray(out.logits)).all()
    assert float(out.embedding.min()) >= 0.0  # pooled post-ReLU representation
    np.testing.assert_array_equal(out.features[0], out.embedding)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert len(flat) == len(jax.tree.leaves(params))
    for path, g in flat:
        g = np.asarray(g)
        assert np.isfinite(g).all(), jax.tree_util.keystr(path)
        assert np.abs(g).max() > 0, jax.tree_util.keystr(path)
