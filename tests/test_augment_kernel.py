"""The CPU augmentation kernel (``csrc/augment.cc`` behind ``fedjax_rcl.data.augment``).

Bitwise the images of XLA's gather as XLA:CPU compiles it by default (the kernel fuses the
multiply-adds XLA's code generator fuses), checked in processes of their own with XLA's default
flags (the tests' own flags compile at optimisation level 0, without those fusions): the FedRCL
transform (rotation, zero-padded crop, flip), MOON's (reflect-padded crop, flip), none, one
channel and three, widths that fill the kernel's eight-pixel blocks or leave a remainder, under
vmap (one call for every client) inside ``lax.scan``; and its compilation without hardware fused
multiply-adds. In this process: against XLA's gather within rounding, where it applies,
refusals. ``tests/test_augment.py`` checks the map itself against step-by-step NumPy transforms.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.data import augment
from fedjax_rcl.nn import onednn

pytestmark = pytest.mark.skipif(
    not onednn.available(), reason=f"no CPU kernels here: {onednn.unavailable_reason()}")

MEAN3, STD3 = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)
# (image shape, transform): CIFAR's 32 x 32 (four blocks of eight) with FedRCL's and MOON's
# transforms, no augmentation, a small crop with rotation only, a 28 x 28 single channel
# (FEMNIST-like, a remainder of four), an odd 13 x 19.
CASES = [
    ((32, 32, 3), dict(max_degrees=10.0, crop_padding=4, hflip=True, pad_mode="zero")),
    ((32, 32, 3), dict(max_degrees=0.0, crop_padding=4, hflip=True, pad_mode="reflect")),
    ((32, 32, 3), dict(max_degrees=0.0, crop_padding=0, hflip=False, pad_mode="zero")),
    ((32, 32, 3), dict(max_degrees=30.0, crop_padding=2, hflip=False, pad_mode="zero")),
    ((28, 28, 1), dict(max_degrees=10.0, crop_padding=4, hflip=True, pad_mode="zero")),
    ((13, 19, 3), dict(max_degrees=15.0, crop_padding=3, hflip=True, pad_mode="reflect")),
]


_BITWISE_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from fedjax_rcl.data import augment
cases, seeds = json.loads(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
mean3, std3 = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)

def programs(fn, *args):
    out = []
    for mode in ("off", "auto"):
        augment.KERNEL = mode  # read when the program is traced: a new function, a new trace
        out.append(jax.jit(lambda *a: fn(*a)).lower(*args).compile())
    return out

same = []
for shape, transform in cases:
    images = jnp.asarray(rng.integers(0, 256, (64, *shape), dtype=np.uint8))
    c = shape[-1]
    f = lambda k, x: augment.augment_batch(k, x, mean=mean3[:c], std=std3[:c], **transform)
    xla, kernel = programs(f, jax.random.key(0), images)
    keys = [jax.random.key(s) for s in range(seeds)]
    same.append(all(np.array_equal(xla(k, images), kernel(k, images)) for k in keys))

# Ten clients side by side gathering their batches by index inside a scan over steps
# (engine.client's pattern): one kernel call a step for every client.
data = jnp.asarray(rng.integers(0, 256, (300, 32, 32, 3), dtype=np.uint8))
idx = jnp.asarray(rng.integers(0, 300, (3, 10, 16)), jnp.int32)

def run(key, idx, data):
    def step(carry, t):
        keys = jax.random.split(jax.random.fold_in(key, t), idx.shape[1])
        return carry, jax.vmap(lambda k, i: augment.augment_batch(
            k, data[i], mean=mean3, std=std3, max_degrees=10.0, crop_padding=4))(keys, idx[t])
    return jax.lax.scan(step, 0, jnp.arange(idx.shape[0]))[1]

args = (jax.random.key(3), idx, data)
xla, kernel = programs(run, *args)
same.append(bool(np.array_equal(xla(*args), kernel(*args))))
augment.KERNEL = "auto"
calls = jax.jit(lambda *a: run(*a)).lower(*args).as_text().count("fedjax_augment_images")
print(json.dumps({"same": same, "calls": calls}))
"""


def _default_xla_process(isa: str | None, cases, seeds: int) -> dict:
    """Runs ``_BITWISE_SCRIPT`` with XLA's default flags (and the kernel's path capped to
    ``isa``)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        flags = flags.replace(flag, "")
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    env.pop("FEDJAX_AUGMENT_ISA", None)
    if isa:
        env["FEDJAX_AUGMENT_ISA"] = isa
    proc = subprocess.run([sys.executable, "-c", _BITWISE_SCRIPT,
                           json.dumps([[list(s), t] for s, t in cases]), str(seeds)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_bitwise_xla_gather_at_xla_defaults():
    out = _default_xla_process(None, CASES, seeds=6)
    assert out == {"same": [True] * (len(CASES) + 1), "calls": 1}


@pytest.mark.slow
def test_path_without_fused_multiply_adds_is_bitwise_the_same():
    """``$FEDJAX_AUGMENT_ISA=baseline``: the kernel's other compilation (``std::fma`` a library
    call, coordinates one pixel at a time), against XLA's images and, at the ties, against the
    formulas (this file's arithmetic tests, in a process of their own)."""
    cases = [CASES[0], CASES[1], CASES[4], CASES[5]]
    out = _default_xla_process("baseline", cases, seeds=2)
    assert out["same"] == [True] * (len(cases) + 1)
    env = {**os.environ, "FEDJAX_AUGMENT_ISA": "baseline"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", __file__,
                           "-k", "rounds_with or normalisation_is"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "3 passed" in proc.stdout


def _both(fn, *args):
    """``fn(*args)`` compiled with XLA's gather and with the kernel (``KERNEL`` is read when
    the program is traced, so each is lowered under its own setting)."""
    out = {}
    for mode in ("off", "auto"):
        augment.KERNEL = mode
        try:
            # a new function each time: jax.jit would reuse the other setting's trace
            out[mode] = np.asarray(jax.jit(lambda *a: fn(*a)).lower(*args).compile()(*args))
        finally:
            augment.KERNEL = "auto"
    return out["off"], out["auto"]


def _norm(c):
    return (MEAN3[:c], STD3[:c])


@pytest.mark.parametrize("shape,transform", CASES)
def test_within_rounding_of_xla_gather_under_the_tests_flags(shape, transform):
    """Compiled at optimisation level 0, XLA rounds the normalisation's multiply and add apart
    (one float32 rounding more) and, at a rotation's exact half-pixel ties, may pick the other
    neighbour: values within 1e-6 relative, all but a few pixels in a million."""
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.integers(0, 256, (64, *shape), dtype=np.uint8))
    mean, std = _norm(shape[-1])
    fn = functools.partial(augment.augment_batch, mean=mean, std=std, **transform)
    for seed in range(3):
        xla, kernel = _both(fn, jax.random.key(seed), images)
        assert kernel.dtype == np.float32 and kernel.shape == images.shape
        close = np.isclose(kernel, xla, rtol=1e-6, atol=1e-6).all(axis=-1)
        assert close.mean() >= 1 - 1e-5, (seed, int((~close).sum()))
        if transform["max_degrees"] == 0:  # integer coordinates: every pixel the same one
            assert close.all()


def test_where_it_applies():
    u8 = jnp.zeros((2, 8, 8, 3), jnp.uint8)
    assert augment.resolve() == "kernel"  # the tests run on a CPU where the extension builds
    assert augment.kernel_applies(u8, MEAN3, STD3)
    assert not augment.kernel_applies(u8.astype(jnp.float32), MEAN3, STD3)  # uint8 only
    assert not augment.kernel_applies(u8[0], MEAN3, STD3)  # a batch of images

    def traced_mean(mean):  # normalisation constants traced: XLA's path (the kernel's are
        return augment.kernel_applies(u8, mean, STD3)  # attributes)
    assert jax.jit(lambda m: jnp.asarray(traced_mean(m)))(jnp.asarray(MEAN3)).item() is False
    augment.KERNEL = "off"
    try:
        assert augment.resolve() == "xla" and not augment.kernel_applies(u8, MEAN3, STD3)
    finally:
        augment.KERNEL = "auto"


def test_bad_pad_mode_is_refused_on_both_paths():
    images = jnp.zeros((2, 8, 8, 3), jnp.uint8)
    for mode in ("off", "auto"):
        augment.KERNEL = mode
        try:
            with pytest.raises(ValueError, match="pad_mode='wrap'"):
                augment.augment_batch(jax.random.key(0), images, mean=MEAN3, std=STD3,
                                      pad_mode="wrap")
        finally:
            augment.KERNEL = "auto"


def _f32_of(x: Fraction) -> np.float32:
    """``x`` rounded once to float32, to nearest, ties to even."""
    f = np.float32(float(x))
    best = None
    for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        key = (abs(Fraction(float(c)) - x), int(np.float32(c).view(np.int32)) & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return np.float32(best[1])


def _fma32(a, b, c) -> np.float32:
    return _f32_of(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _call_kernel(images, cos, sin, *, neg_mean, inv_std, inv_255, pad=0, reflect=0):
    n = images.shape[0]
    zeros = jnp.zeros((n,), jnp.int32)
    return np.asarray(onednn.call(
        "fedjax_augment_images", jax.ShapeDtypeStruct(images.shape, jnp.float32),
        jnp.asarray(images), jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32),
        zeros, zeros, zeros, neg_mean=np.asarray(neg_mean, np.float32),
        inv_std=np.asarray(inv_std, np.float32), inv_255=np.float32(inv_255),
        pad=np.int64(pad), reflect=np.int64(reflect)))


@pytest.mark.parametrize("size", [32, 29])  # rows of four blocks of eight; of three and five
def test_rotation_rounds_with_the_multiply_add_fused_as_xla_does(size):
    """At the rare rotations where it matters (the rounded coordinate lands on the other side of
    a half-pixel tie), the kernel's source row is round(fma(sin, dv, cos * du) + cy) and its
    column round(fma(cos, dv, -sin * du) + cx), exactly, not the unfused sums: NumPy searches
    such (rotation, pixel) pairs, an image whose pixels hold their own coordinates reads them."""
    h = w = size
    cy = cx = np.float32((size - 1) / 2)
    # Decimal "cosines" and "sines" (the kernel takes any two numbers): at half-pixel positions
    # their sums fall on exact half-pixel ties in real arithmetic, which float32 then breaks.
    vals = [k / 10 for k in range(1, 10)] + [k / 100 for k in (3, 7, 13, 17, 33, 67, 93, 97)]
    pairs = [(c, s) for c in vals for s in vals]
    pairs += [(c, -s) for c, s in pairs]
    cos, sin = (np.array(v, np.float32) for v in zip(*pairs, strict=True))
    d = np.arange(h, dtype=np.float32) - cy  # du over rows, dv over columns
    du, dv = d[None, :, None], d[None, None, :]
    c3, s3 = cos[:, None, None], sin[:, None, None]

    def fused(a, b, addend):  # float32(a * b + addend), one rounding (the search's; exact below)
        return (a.astype(np.float64) * b + addend.astype(np.float64)).astype(np.float32)

    rows = np.rint(fused(s3, dv, c3 * du) + cy) != np.rint((c3 * du + s3 * dv) + cy)
    cols = np.rint(fused(c3, dv, -s3 * du) + cx) != np.rint((-s3 * du + c3 * dv) + cx)
    found = np.concatenate([np.argwhere(rows)[::6], np.argwhere(cols)[::6]])
    assert rows.sum() >= 20 and cols.sum() >= 20  # the search finds ties to test
    image = np.zeros((h, w, 3), np.uint8)
    image[..., 0], image[..., 1], image[..., 2] = np.arange(h)[:, None], np.arange(w), 200
    out = _call_kernel(np.broadcast_to(image, (len(found), h, w, 3)).copy(),
                       cos[found[:, 0]], sin[found[:, 0]], neg_mean=(0,) * 3,
                       inv_std=(1,) * 3, inv_255=1.0)
    for j, (a, y, x) in enumerate(found):
        r = np.rint(_fma32(sin[a], d[x], np.float32(cos[a] * d[y])) + cy)
        q = np.rint(_fma32(cos[a], d[x], np.float32(-sin[a] * d[y])) + cx)
        inside = 0 <= r < h and 0 <= q < w
        got = out[j, y, x]
        assert (got[2] == 200) == inside, (a, y, x)
        if inside:
            assert (got[0], got[1]) == (r, q), (a, y, x)


def test_normalisation_is_the_fused_multiply_add_then_the_reciprocal():
    """Every byte of every channel: fma(byte, 1/255, -mean) * (1/std), exactly (XLA folds the
    divisions by constants into reciprocals and fuses the multiply and the add)."""
    mean, std = np.float32([0.49, 0.48, 0.45]), np.float32([0.2, 0.21, 0.22])
    inv_255, inv_std = np.float32(1) / np.float32(255), np.float32(1) / std
    levels = np.arange(256, dtype=np.uint8)
    images = np.broadcast_to(levels[:, None, None, None], (256, 1, 8, 3)).copy()
    out = _call_kernel(images, np.ones(256), np.zeros(256), neg_mean=-mean, inv_std=inv_std,
                       inv_255=inv_255)
    want = np.array([[_fma32(np.float32(v), inv_255, -mean[k]) * inv_std[k] for k in range(3)]
                     for v in range(256)], np.float32)
    np.testing.assert_array_equal(out[:, 0, 0], want)
    unfused = (levels[:, None].astype(np.float32) * inv_255 - mean) * inv_std
    assert (unfused != want).any()  # the test tells the two apart
    np.testing.assert_array_equal(out, np.broadcast_to(want[:, None, None], out.shape))
