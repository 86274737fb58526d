"""FedRCL's Table C backbones (VGG-9, MobileNetV2, SqueezeNet) and ResNet-50: parameter counts
against hand counts, levels and blocks as their docstrings say, entering after each block
reproduces the forward pass, and the depthwise convolutions agree with XLA's."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl import registry
from fedjax_rcl.models import get_model, model_fns


def _vgg9(classes=10):
    widths, cin, n = (32, 64, 128, 128, 256, 256), 3, 0
    for c in widths:
        n += 9 * cin * c + c + 2 * c  # conv with bias + GroupNorm
        cin = c
    return n + (4 * 4 * 256 * 512 + 512) + (512 * 512 + 512) + (512 * classes + classes)


def _mobilenet_v2(classes=10):
    n, cin = 3 * 32 + 32 + 2 * 32, 32  # 1x1 stem conv with bias + GN
    for repeats, cout, _, t in ((1, 16, 1, 1), (2, 24, 2, 6), (3, 32, 2, 6), (4, 64, 2, 6),
                                (3, 96, 1, 6), (3, 160, 1, 6), (1, 320, 1, 6)):
        for _ in range(repeats):
            h = cin * t
            n += (cin * h + h + 2 * h) + (9 * h + h + 2 * h) + (h * cout + cout + 2 * cout)
            cin = cout
    return n + (320 * 1280 + 1280 + 2 * 1280) + (1280 * classes + classes)


def _squeezenet(classes=10):
    n, cin = 9 * 3 * 96 + 96 + 2 * 96, 96
    for out, sq in ((128, 16), (128, 16), (256, 32), (256, 32), (384, 48), (384, 48),
                    (512, 64), (512, 64)):
        half = out // 2
        n += (cin * sq + sq + 2 * sq) + (sq * half + half + 2 * half)
        n += 9 * sq * half + half + 2 * half
        cin = out
    return n + 512 * classes + classes


def _shufflenet(groups=3, classes=10):
    n, cin = 9 * 3 * 24 + 24 + 2 * 24, 24
    for units, cout in ((4, 240), (8, 480), (4, 960)):
        for u in range(units):
            mid, out = cout // 4, (cout - cin if u == 0 else cout)  # stride-2 units concatenate
            n += (cin // groups) * mid + mid + 2 * mid  # grouped 1x1 + GN
            n += 9 * mid + mid + 2 * mid  # depthwise 3x3 + GN
            n += (mid // groups) * out + out + 2 * out  # grouped 1x1 + GN
            cin = cout
    return n + 960 * classes + classes


def _shufflenet_v2(classes=10):
    n, cin = 9 * 3 * 24 + 2 * 24, 24  # convolutions without bias here
    for units, out in ((4, 116), (8, 232), (4, 464)):
        half = out // 2
        for u in range(units):
            if u == 0:  # stride 2: both branches see the whole input
                n += 9 * cin + 2 * cin + cin * half + 2 * half
                n += cin * half + 2 * half + 9 * half + 2 * half + half * half + 2 * half
            else:  # stride 1: one half passes, the other is transformed
                n += half * half + 2 * half + 9 * half + 2 * half + half * half + 2 * half
            cin = out
    return n + 464 * 1024 + 2 * 1024 + 1024 * classes + classes


def _resnet50(width=64, classes=10):
    n, cin = 9 * 3 * width + 2 * width, width
    for s, blocks in enumerate((3, 4, 6, 3)):
        w = width * 2**s
        for b in range(blocks):
            n += cin * w + 2 * w + 9 * w * w + 2 * w + w * 4 * w + 2 * 4 * w
            if b == 0:  # every stage's first block changes the channels (or the stride)
                n += cin * 4 * w + 2 * 4 * w
            cin = 4 * w
    return n + cin * classes + classes


CASES = {  # name: (kw, hand count, level widths)
    "vgg9": ({}, _vgg9(), [32, 64, 128, 128, 256, 256]),
    "mobilenet_v2": ({}, _mobilenet_v2(), [32, 16, 24, 32, 64, 96, 160]),
    "squeezenet": ({}, _squeezenet(), [96, 128, 128, 256, 256, 384, 384, 512]),
    "resnet50": ({"width": 8}, _resnet50(8), [8, 32, 64, 128, 256]),
    "shufflenet": ({}, _shufflenet(), [24, 240, 480, 960]),
    "shufflenet_v2": ({}, _shufflenet_v2(), [24, 116, 232, 464]),
}


def test_known_counts():
    assert _vgg9() == 3_493_258
    assert _resnet50() == 23_520_842  # the usual CIFAR ResNet-50 (torchvision blocks)


# The large backbones' structure checks (the longest here: seconds to compile each) run in the
# slow step.
_SLOW_BACKBONES = {"mobilenet_v2", "resnet50", "shufflenet", "shufflenet_v2", "squeezenet"}


def _drawn_like(shapes, seed=0):
    """Weights of the initialiser's shapes drawn with NumPy (He-scaled kernels, vectors near 1).
    The structure checks need weights that make every block matter, not the initialiser's
    values; the initialiser is traced (``eval_shape``: every layer's shapes and the count), not
    compiled, which for these backbones was most of each check's time."""
    rng = np.random.default_rng(seed)

    def one(s):
        if len(s.shape) >= 2:
            fan_in = int(np.prod(s.shape[:-1]))
            return (rng.standard_normal(s.shape) * np.sqrt(2.0 / fan_in)).astype(s.dtype)
        return (1.0 + 0.1 * rng.standard_normal(s.shape)).astype(s.dtype)

    return jax.tree.map(one, shapes)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_BACKBONES else n for n in sorted(CASES)])
def test_structure_levels_and_blocks(name):
    kw, count, level_widths = CASES[name]
    model = model_fns(get_model(name, num_classes=10, **kw), conv_impl="native")
    x = jax.random.uniform(jax.random.PRNGKey(0), (2, 32, 32, 3))
    shapes, state_shapes = jax.eval_shape(model.init, jax.random.PRNGKey(1), x[:1])
    assert sum(p.size for p in jax.tree.leaves(shapes)) == count
    params, state = _drawn_like(shapes), _drawn_like(state_shapes, seed=1)
    entry = registry.model(name)

    @jax.jit
    def forward_and_tails(p, x):
        """The forward pass, and the pass entered after each block from that block's output."""
        out, _ = model.apply(p, state, x, train=False)
        return out, [model.apply_from(p, state, out.blocks[k - 1], start=k).logits
                     for k in range(1, entry.num_blocks + 1)]

    out, tails = forward_and_tails(params, x)
    assert out.logits.shape == (2, 10)
    assert np.all(np.isfinite(np.asarray(out.logits))) and np.ptp(np.asarray(out.logits)) > 0
    assert [f.shape for f in out.features] == [(2, w) for w in level_widths]
    assert len(out.features) == entry.num_levels and len(out.blocks) == entry.num_blocks
    for tail in tails:
        np.testing.assert_allclose(np.asarray(tail), np.asarray(out.logits),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cin,features,stride", [(16, 16, 1), (16, 24, 2)])
def test_mobilenet_depthwise_path_equals_xla_grouped_convolution(cin, features, stride):
    """The CPU path (depthwise convolutions as shifted slices) and XLA's grouped convolution
    give the same linear bottleneck, forward and gradient, with its residual (stride 1) and
    without (stride 2). MobileNetV2 is a stack of these between 1x1 convolutions, so the
    model-level equality follows; the block keeps the check off the slow step."""
    from fedjax_rcl.models.mobilenet import LinearBottleneck
    from fedjax_rcl.nn import conv

    x = jax.random.uniform(jax.random.PRNGKey(0), (2, 16, 16, cin))
    block = LinearBottleneck(features, stride, 6)
    params = block.init(jax.random.PRNGKey(1), x[:1], train=True)
    outs = {}
    for impl in ("patches", "native"):
        def loss(p, impl=impl):
            with conv.implementation(impl):
                return jnp.mean(block.apply(p, x, train=True) ** 2)

        outs[impl] = jax.jit(jax.value_and_grad(loss))(params)
    (a, ga), (b, gb) = outs["patches"], outs["native"]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    chex.assert_trees_all_close(ga, gb, rtol=1e-3, atol=1e-5)


def test_channel_shuffle_and_average_pool_match_pytorch_semantics():
    from fedjax_rcl.models.shufflenet import avg_pool_3x3_s2, channel_shuffle

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 7, 6)).astype(np.float32)  # NHWC
    # PyTorch on NCHW: view(B, g, n, H, W).transpose(1, 2).reshape(B, C, H, W)
    nchw = x.transpose(0, 3, 1, 2)
    want = nchw.reshape(2, 3, 2, 5, 7).transpose(0, 2, 1, 3, 4).reshape(2, 6, 5, 7)
    np.testing.assert_array_equal(np.asarray(channel_shuffle(jnp.asarray(x), 3)),
                                  want.transpose(0, 2, 3, 1))
    # AvgPool2d(3, stride=2, padding=1), count_include_pad=True, as a loop
    pooled = np.zeros((2, 3, 4, 6))
    for i in range(3):
        for j in range(4):
            for u in range(3):
                for v in range(3):
                    r, c = 2 * i + u - 1, 2 * j + v - 1
                    if 0 <= r < 5 and 0 <= c < 7:
                        pooled[:, i, j] += x[:, r, c] / 9
    np.testing.assert_allclose(np.asarray(avg_pool_3x3_s2(jnp.asarray(x))), pooled,
                               rtol=1e-6, atol=1e-7)
