"""In-graph augmentation: shapes, ranges, and equality with step-by-step NumPy transforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.data.augment import (
    augment_batch,
    augment_image,
    augment_params,
    normalize,
    source_coordinates,
)


def np_rotate(img, angle):
    """Nearest-neighbour rotation about the pixel-grid centre, zero fill (inverse mapping)."""
    h, w = img.shape[:2]
    out = np.zeros_like(img)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    for u in range(h):
        for v in range(w):
            r = round(np.cos(angle) * (u - cy) + np.sin(angle) * (v - cx) + cy)
            c = round(-np.sin(angle) * (u - cy) + np.cos(angle) * (v - cx) + cx)
            if 0 <= r < h and 0 <= c < w:
                out[u, v] = img[r, c]
    return out


def np_pad_crop(img, oy, ox, pad):
    h, w = img.shape[:2]
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)))
    return padded[oy:oy + h, ox:ox + w]


def test_composed_map_equals_rotate_then_crop_then_flip():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    params = jax.jit(functools.partial(augment_params, max_degrees=10.0, crop_padding=4,
                                       hflip=True))
    image = jax.jit(augment_image)
    for i in range(20):
        p = jax.device_get(params(jax.random.PRNGKey(i)))
        got = np.asarray(image(jax.random.PRNGKey(i), jnp.asarray(img)))
        ref = np_pad_crop(np_rotate(img, float(p["angle"])), int(p["oy"]), int(p["ox"]), 4)
        if p["flip"]:
            ref = ref[:, ::-1]
        np.testing.assert_array_equal(got, ref)


def test_reflect_padding_equals_numpy_reflect_pad_then_crop_then_flip():
    """MOON's transform (``transforms=moon``): reflect-pad 4, random crop, flip; no rotation."""
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)
    flips = set()
    params = jax.jit(functools.partial(augment_params, max_degrees=0.0, crop_padding=4,
                                       hflip=True))
    image = jax.jit(functools.partial(augment_image, max_degrees=0.0, crop_padding=4,
                                      pad_mode="reflect"))
    for i in range(30):
        p = jax.device_get(params(jax.random.PRNGKey(i)))
        got = np.asarray(image(jax.random.PRNGKey(i), jnp.asarray(img)))
        padded = np.pad(img, ((4, 4), (4, 4), (0, 0)), mode="reflect")
        ref = padded[int(p["oy"]):int(p["oy"]) + 10, int(p["ox"]):int(p["ox"]) + 12]
        if p["flip"]:
            ref = ref[:, ::-1]
        flips.add(bool(p["flip"]))
        np.testing.assert_array_equal(got, ref)
    assert flips == {True, False}
    with pytest.raises(ValueError, match="pad_mode='wrap'"):
        augment_image(jax.random.PRNGKey(0), jnp.asarray(img), pad_mode="wrap")


def test_rotation_by_90_degrees_is_rot90():
    """Fixes the rotation centre and direction (positive = counter-clockwise, as PIL and
    torchvision) independently of the reference above."""
    img = np.arange(5 * 5).reshape(5, 5, 1)
    p = {"angle": jnp.float32(np.pi / 2), "oy": 0, "ox": 0, "flip": False}
    r, c, valid = source_coordinates(p, 5, 5, 0)
    assert bool(jnp.all(valid))
    np.testing.assert_array_equal(img[np.asarray(r), np.asarray(c)], np.rot90(img, k=1))


def test_identity_when_disabled():
    img = jnp.asarray(np.random.default_rng(1).integers(0, 256, (3, 8, 8, 3)), jnp.uint8)
    out = jax.jit(functools.partial(augment_batch, mean=(0.5,) * 3, std=(0.25,) * 3,
                                    max_degrees=0.0, crop_padding=0, hflip=False))(
        jax.random.PRNGKey(0), img)
    np.testing.assert_allclose(out, (np.asarray(img) / 255 - 0.5) / 0.25, atol=1e-6)


def test_shapes_ranges_and_randomness():
    imgs = jnp.full((256, 32, 32, 3), 255, jnp.uint8)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
    out = jax.jit(lambda k, x: augment_batch(k, x, mean=mean, std=std))(jax.random.PRNGKey(0),
                                                                       imgs)
    assert out.shape == imgs.shape and out.dtype == jnp.float32
    lo = (0 - np.array(mean)) / np.array(std)
    hi = (1 - np.array(mean)) / np.array(std)
    assert np.all(np.asarray(out) >= lo - 1e-5) and np.all(np.asarray(out) <= hi + 1e-5)
    # Zero fill from padding/rotation appears in most samples, never everywhere.
    zero_frac = np.mean(np.isclose(np.asarray(out), lo, atol=1e-5).all(-1), axis=(1, 2))
    assert 0.5 < np.mean(zero_frac > 0) and np.all(zero_frac < 0.6)
    # Samples differ from one another (per-sample keys).
    assert len({np.asarray(o).tobytes() for o in out}) > 200


def test_parameter_distributions():
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    p = jax.vmap(lambda k: augment_params(k, max_degrees=10.0, crop_padding=4, hflip=True))(keys)
    deg = np.rad2deg(np.asarray(p["angle"]))
    assert deg.min() >= -10 and deg.max() <= 10 and abs(deg.mean()) < 0.5
    assert set(np.asarray(p["oy"]).tolist()) == set(range(9))
    assert 0.45 < float(np.mean(p["flip"])) < 0.55
    no_flip = augment_params(keys[0], max_degrees=10.0, crop_padding=4, hflip=False)
    assert not bool(no_flip["flip"])


@pytest.mark.parametrize("dtype", [np.uint8])
def test_normalize(dtype):
    x = np.array([[0, 128, 255]], dtype).reshape(1, 1, 3)
    np.testing.assert_allclose(normalize(x, (0.5, 0.5, 0.5), (0.5, 0.25, 1.0)),
                               ((x / 255) - 0.5) / np.array([0.5, 0.25, 1.0]), atol=1e-6)
