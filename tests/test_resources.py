"""Analytic MFCL resource counts (fedjax_rcl.mfcl.resources) against hand counts."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.mfcl.resources import (
    client_module_flops,
    client_module_layers,
    conv_flops,
    conv_transpose_flops,
    count_params,
    decoder_flops,
    decoder_layers,
    dense_flops,
    format_resources,
    mfcl_resources,
    resnet18_layers,
)
from fedjax_rcl.nn.twin_norm import TwinNorm

TINY = dict(num_samples_per_client=[3, 5], image_hw=(4, 4), channels=2, phase1_rounds=2,
            local_epochs=1, rho=1, delta=0, bits=32, batch_size=2)
CIFAR = dict(num_samples_per_client=[5000] * 10, phase1_rounds=15, local_epochs=1, rho=1,
             delta=0, batch_size=64)


def hand_params(c):
    """Client module and decoder, counted by hand: conv weights (+ final bias) + 2C per norm."""
    encoder = 3 * c * 9 + 2 * c + c * c * 9 + 2 * c
    decoder = c * c * 9 + 2 * c + c * c * 9 + 2 * c + c * 3 * 9 + 3
    return encoder, decoder


def test_conv_counts_by_hand():
    # 2 FLOPs per multiply-add: 5*6 outputs x 7 channels, each 4 inputs x 3*3 taps.
    assert conv_flops(5, 6, 4, 7, 3) == 2 * 5 * 6 * 7 * 4 * 9 == 15120
    assert conv_flops(5, 6, 4, 7, 3, bias=True) == 15120 + 5 * 6 * 7
    assert conv_transpose_flops(2, 2, 2, 2, 3) == 2 * 4 * 2 * 2 * 9 == 288
    assert dense_flops(3, 4) == 2 * 12 + 4
    assert client_module_flops((32, 32), 64) == 18 * 32 * 32 * 64 * (64 + 3) == 79_036_416
    assert decoder_flops((32, 32), 64) == (2 * 16 * 16 * 64 * 64 * 9 + 2 * 32 * 32 * 64 * 64 * 9
                                           + 2 * 32 * 32 * 3 * 64 * 9 + 32 * 32 * 3)


def test_tiny_configuration_by_hand():
    d = mfcl_resources(**TINY)
    m = d["mfcl"]
    # Params: encoder 54 + 4 + 36 + 4 = 98; decoder 36 + 4 + 36 + 4 + 54 + 3 = 137.
    assert (m["params"]["client_module"], m["params"]["decoder"]) == (98, 137)
    assert m["params"]["representation_values_per_view"] == 2 * 2 * 2
    # Forward FLOPs: encoder 1728 + 1152; decoder 288 + 1152 + (1728 + 48).
    assert m["flops"]["forward_per_image"] == {"client_module": 2880, "decoder": 3216}
    # Phase 1 bits: (2 rounds x (down + up) x 235 + final 98 down) x 32, for every client.
    phase1 = (2 * 2 * 235 + 98) * 32
    assert m["communication_bits"]["phase1"] == {"mean": phase1, "max": phase1}
    # Phase 2 bits: n_k samples x 2 views x 8 values x 32 bits -> 1536 and 2560.
    assert m["communication_bits"]["phase2"] == {"mean": 2048, "max": 2560}
    assert m["communication_bits"]["total"] == {"mean": phase1 + 2048, "max": phase1 + 2560}
    # FLOPs: phase 1 = 3 x 2 rounds x 1 epoch x n_k x 2 views x 6096; phase 2 = n_k x 2 x 2880.
    f1 = [3 * 2 * 1 * n * 2 * 6096 for n in (3, 5)]
    f2 = [n * 2 * 2880 for n in (3, 5)]
    assert m["flops"]["phase1"] == {"mean": sum(f1) / 2, "max": f1[1]}
    assert m["flops"]["phase2"] == {"mean": sum(f2) / 2, "max": f2[1]}
    assert m["per_client"]["flops"] == [f1[0] + f2[0], f1[1] + f2[1]]
    # Training memory: 235 params x 4 copies (weights, grads, Adam m, v) x 4 bytes, plus
    # activations: input 48 + encoder 6 x 32 + 8 + decoder 6 x 32 + 48 = 488 values per image,
    # 2 samples x 2 views = 4 images, 4 bytes each.
    mem1 = m["memory_bytes"]["phase1_training"]
    assert mem1["parameters"] + mem1["gradients"] + mem1["optimizer"] == 235 * 4 * 4
    assert mem1["activations"] == 488 * 4 * 4
    assert mem1["total"] == 3760 + 7808
    # Inference: 98 params x 4 bytes + largest in+out (input 48 + conv1 32) x 4 images x 4 bytes.
    assert m["memory_bytes"]["phase2_inference"]["total"] == 98 * 4 + 80 * 4 * 4
    assert m["memory_bytes"]["peak"] == 11568


@pytest.mark.parametrize("c", [2, 64])
def test_communicated_params_equal_direct_count(c):
    enc, dec = hand_params(c)
    assert count_params(client_module_layers((8, 8), c)) == (enc, 0)
    assert count_params(decoder_layers((8, 8), c)) == (dec, 0)
    d = mfcl_resources(**{**TINY, "image_hw": (8, 8), "channels": c})
    assert d["mfcl"]["params"]["communicated_per_exchange"] == enc + dec
    assert d["mfcl"]["communication_bits"]["phase1"]["mean"] == (4 * (enc + dec) + enc) * 32
    if c == 64:
        assert (enc, dec) == (38_848, 75_715)


def _leaf_count(tree):
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


class _Encoder(nn.Module):
    c: int

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.Conv(self.c, (3, 3), padding=1, use_bias=False)(x)
            x = nn.relu(TwinNorm(num_groups=1)(x))
        return nn.max_pool(x, (2, 2), (2, 2))


class _Decoder(nn.Module):
    c: int

    @nn.compact
    def __call__(self, x):
        x = nn.ConvTranspose(self.c, (3, 3), strides=(2, 2), padding="SAME", use_bias=False)(x)
        x = nn.relu(TwinNorm(num_groups=1)(x))
        x = nn.relu(TwinNorm(num_groups=1)(nn.Conv(self.c, (3, 3), padding=1,
                                                   use_bias=False)(x)))
        return nn.Conv(3, (3, 3), padding=1)(x)


def test_params_and_shapes_match_flax_modules():
    key = jax.random.key(0)
    x = jnp.zeros((2, 8, 8, 3))
    enc = jax.eval_shape(_Encoder(4).init, key, x)
    h = jax.ShapeDtypeStruct((2, 4, 4, 4), jnp.float32)
    dec = jax.eval_shape(_Decoder(4).init, key, h)
    assert _leaf_count(enc) == count_params(client_module_layers((8, 8), 4))[0]
    assert _leaf_count(dec) == count_params(decoder_layers((8, 8), 4))[0]
    assert jax.eval_shape(_Encoder(4).apply, enc, x).shape == (2, *client_module_layers(
        (8, 8), 4)[-1].out_shape)
    assert jax.eval_shape(_Decoder(4).apply, dec, h).shape == (2, 8, 8, 3)


def test_baseline_matches_project_resnet18():
    from fedjax_rcl.models.resnet import resnet18

    model = resnet18(10, width=8, projection_dim=16)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)),
                               train=False)
    params = dict(variables["params"])
    head = _leaf_count(params.pop("projection"))
    params.pop("head")  # the classifier
    layers = resnet18_layers((8, 8), 8, head=(64, 16))
    assert count_params(layers) == (_leaf_count(params) + head, 0)
    # Width 64, GroupNorm: the project's 11,173,962 minus its 10-class classifier (5,130).
    assert count_params(resnet18_layers((32, 32), 64, head=()))[0] == 11_173_962 - 5_130


def test_batch_norm_state_is_communicated_not_trained():
    twin = mfcl_resources(**TINY)["mfcl"]
    batch = mfcl_resources(**{**TINY, "norm": "batch"})["mfcl"]
    # 4 norm layers x (running mean + variance) x C=2 values.
    assert batch["params"]["state"] == 4 * 2 * 2
    assert (batch["params"]["communicated_per_exchange"]
            == twin["params"]["communicated_per_exchange"] + 16)
    mem_t, mem_b = twin["memory_bytes"]["phase1_training"], batch["memory_bytes"][
        "phase1_training"]
    assert mem_b["optimizer"] == mem_t["optimizer"] and mem_b["state"] == 16 * 4


def test_phase2_scaling():
    def phase2(**kw):
        d = mfcl_resources(**{**CIFAR, **kw})["mfcl"]
        return d["communication_bits"]["phase2"]["mean"], d["communication_bits"]["phase1"][
            "mean"]

    base, p1 = phase2()
    assert base == 5000 * 2 * 16 * 16 * 64 * 32
    for rho in (0, 0.5, 2, 3):
        assert phase2(rho=rho) == (pytest.approx(rho * base), p1)
    for delta in (0.25, 0.5, 0.9):
        assert phase2(delta=delta) == (pytest.approx((1 - delta) * base), p1)
    assert phase2(rho=2, delta=0.5)[0] == pytest.approx(base)
    assert phase2(num_samples_per_client=[10_000] * 10)[0] == 2 * base
    assert phase2(bits=8)[0] == base / 4
    # Phase-2 FLOPs scale the same way; phase 1 does not depend on rho or delta.
    a = mfcl_resources(**CIFAR)["mfcl"]["flops"]
    b = mfcl_resources(**{**CIFAR, "rho": 2, "delta": 0.5,
                          "num_samples_per_client": [5000] * 10})["mfcl"]["flops"]
    assert b["phase2"] == a["phase2"] and b["phase1"] == a["phase1"]


def test_mean_and_max_over_unequal_clients():
    n = np.array([100, 300, 200])
    d = mfcl_resources(**{**CIFAR, "num_samples_per_client": n})
    per_view = 16 * 16 * 64 * 32 * 2
    assert d["mfcl"]["communication_bits"]["phase2"] == {"mean": 200 * per_view,
                                                         "max": 300 * per_view}
    assert d["config"]["num_clients"] == 3


def test_cifar_example_and_format():
    d = mfcl_resources(**CIFAR)
    m, b = d["mfcl"], d["end_to_end"]
    assert m["communication_bits"]["phase1"]["mean"] == (30 * 114_563 + 38_848) * 32
    assert b["communication_bits"]["total"]["mean"] == 30 * (11_168_832 + 328_320) * 32
    assert 1.1e9 < b["flops"]["forward_per_image"] < 1.12e9  # ResNet-18 on CIFAR: 0.56 GMAC
    assert d["ratios"]["flops"] > 1 and d["ratios"]["memory"] > 1
    text = format_resources(d)
    for s in ("MB", "GFLOP", "MiB", "669.26 MB", "End-to-end", "derived"):
        assert s in text


@pytest.mark.parametrize("kw, name", [
    ({"rho": -1}, "rho"),
    ({"rho": float("nan")}, "rho"),
    ({"delta": 1.0}, "delta"),
    ({"delta": -0.1}, "delta"),
    ({"delta": 1.5}, "delta"),
    ({"num_samples_per_client": []}, "num_samples_per_client"),
    ({"num_samples_per_client": [5, -1]}, "num_samples_per_client"),
    ({"num_samples_per_client": [5.5]}, "num_samples_per_client"),
    ({"image_hw": (5, 4)}, "image_hw"),
    ({"image_hw": 4}, "image_hw"),
    ({"norm": "layer"}, "norm"),
    ({"phase1_rounds": 0}, "phase1_rounds"),
    ({"local_epochs": 1.5}, "local_epochs"),
    ({"bits": 0}, "bits"),
    ({"batch_size": 0}, "batch_size"),
    ({"channels": True}, "channels"),
    ({"phase1_views": 1}, "phase1_views"),  # twin norm needs view pairs
])
def test_bad_inputs_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        mfcl_resources(**{**TINY, **kw})


def test_single_view_phase1_with_group_norm():
    one = mfcl_resources(**{**TINY, "norm": "group", "phase1_views": 1})["mfcl"]
    two = mfcl_resources(**{**TINY, "norm": "group"})["mfcl"]
    assert 2 * one["flops"]["phase1"]["max"] == two["flops"]["phase1"]["max"]


def _traced_flops(module, shape) -> float:
    """``engine.layout``'s count, from the module's traced forward program on one image."""
    from fedjax_rcl.engine import layout

    x = jnp.zeros((1, *shape), jnp.float32)
    variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x, train=False))
    jaxpr = jax.make_jaxpr(lambda v, x: module.apply(v, x, train=False, mutable=True))(
        variables, x)
    return layout.jaxpr_flops(jaxpr)


def test_the_layer_table_against_the_traced_count_of_the_models():
    """The one FLOP counter the engine has (``engine.layout``, from the traced program) and the
    layer table agree on every convolution and matrix product of the client module and of
    ResNet-18; the table stays for what the traced count cannot give or counts otherwise:
    the memory figures need each layer's output, its convention counts bias adds, and the
    decoder's transposed convolution, which the model computes as a convolution over the
    zero-upsampled representation, is counted as a transposed convolution (without the
    zeros' multiply-adds), as fvcore and thop count it."""
    from fedjax_rcl.models import get_model
    from fedjax_rcl.models.mfcl import ClientModule, Decoder

    assert _traced_flops(ClientModule(), (32, 32, 3)) == client_module_flops()
    zeros = conv_flops(32, 32, 64, 64, 3) - conv_transpose_flops(16, 16, 64, 64, 3)
    bias_adds = 32 * 32 * 3
    assert _traced_flops(Decoder(), (16, 16, 64)) == decoder_flops() + zeros - bias_adds
    resnet = get_model("resnet18", num_classes=10, norm="group")
    backbone = sum(x.flops for x in resnet18_layers(head=()))
    assert _traced_flops(resnet, (32, 32, 3)) == backbone + dense_flops(512, 10, bias=False)
