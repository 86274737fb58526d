"""SimCLR augmentations: each op against a float64 NumPy reference of torchvision's formula."""

import colorsys
import functools
import inspect
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.data.contrastive_augment import (
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    apply_jitter,
    blur_with_sigma,
    color_jitter,
    crop_and_resize,
    crop_params,
    gaussian_blur,
    jitter_params,
    random_resized_crop,
    select_crop_box,
    simclr_kernel_size,
    simclr_view,
    to_grayscale,
    two_views,
)

TOL = 1e-5


def rand_img(seed, h=8, w=8):
    return np.random.default_rng(seed).random((h, w, 3)).astype(np.float32)


# ---- NumPy references (float64) -------------------------------------------------------------


def np_gray(x):
    x = x.astype(np.float64)
    return 0.299 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]


def np_brightness(x, f):
    return np.clip(f * x.astype(np.float64), 0, 1)


def np_contrast(x, f):
    return np.clip(f * x.astype(np.float64) + (1 - f) * np_gray(x).mean(), 0, 1)


def np_saturation(x, f):
    return np.clip(f * x.astype(np.float64) + (1 - f) * np_gray(x)[..., None], 0, 1)


def np_hue(x, d):
    out = np.empty(x.shape, np.float64)
    for idx in np.ndindex(x.shape[:-1]):
        h, s, v = colorsys.rgb_to_hsv(*map(float, x[idx]))
        out[idx] = colorsys.hsv_to_rgb((h + d) % 1.0, s, v)
    return out


NP_OPS = {0: np_brightness, 1: np_contrast, 2: np_saturation, 3: np_hue}
PARAM_NAMES = {0: "brightness", 1: "contrast", 2: "saturation", 3: "hue"}


def np_crop_resize(img, top, left, bh, bw, out_h, out_w):
    """PyTorch's upsample_bilinear2d (align_corners=False), pixel by pixel, on the box."""
    box = img[top:top + bh, left:left + bw].astype(np.float64)

    def taps(o, n_in, n_out):
        src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        return i0, i1, src - i0

    out = np.empty((out_h, out_w, img.shape[2]))
    for y in range(out_h):
        y0, y1, ly = taps(y, bh, out_h)
        for x in range(out_w):
            x0, x1, lx = taps(x, bw, out_w)
            out[y, x] = ((1 - ly) * ((1 - lx) * box[y0, x0] + lx * box[y0, x1])
                         + ly * ((1 - lx) * box[y1, x0] + lx * box[y1, x1]))
    return out


def np_blur(img, sigma, k):
    half = (k - 1) / 2
    x = np.linspace(-half, half, k)
    kern = np.exp(-0.5 * (x / sigma) ** 2)
    kern /= kern.sum()
    r = k // 2
    p = np.pad(img.astype(np.float64), ((r, r), (r, r), (0, 0)), mode="reflect")
    h, w = img.shape[:2]
    out = np.zeros((h, w, img.shape[2]))
    for y in range(h):
        for xx in range(w):
            patch = p[y:y + k, xx:xx + k]
            out[y, xx] = np.einsum("i,j,ijc->c", kern, kern, patch)
    return out


def np_torchvision_crop_box(area_frac, log_ratio, u_top, u_left, height, width, ratio):
    """torchvision's get_params loop with given draws."""
    for a, lr, ut, ul in zip(area_frac, log_ratio, u_top, u_left, strict=True):
        target = a * height * width
        ar = math.exp(lr)
        w = int(round(math.sqrt(target * ar)))
        h = int(round(math.sqrt(target / ar)))
        if 0 < w <= width and 0 < h <= height:
            return int(ut * (height - h + 1)), int(ul * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


# ---- Jitted entry points, compiled once per shape (each eager op would compile on its own) ----

J_BRIGHT = jax.jit(adjust_brightness)
J_CONTRAST = jax.jit(adjust_contrast)
J_SAT = jax.jit(adjust_saturation)
J_HUE = jax.jit(adjust_hue)
J_GRAY = jax.jit(to_grayscale)
J_CROP_RESIZE = jax.jit(crop_and_resize, static_argnames=("size",))


@jax.jit
@functools.partial(jax.vmap, in_axes=(0, None, None, None))
def crops_and_boxes(key, img, scale, ratio):
    """Crops of one image under many keys, with the boxes drawn; scale and ratio traced."""
    h, w = img.shape[:2]
    box = crop_params(key, h, w, scale=scale, ratio=ratio)
    return random_resized_crop(key, img, scale=scale, ratio=ratio), box


J_BLUR = jax.jit(blur_with_sigma, static_argnums=2)
J_GBLUR = jax.jit(gaussian_blur, static_argnames=("kernel_size",))
# Saturation 1.5 checks the lower end of the factor range is clipped at 0.
STRENGTHS = dict(brightness=0.4, contrast=0.4, saturation=1.5, hue=0.1)
# Jittered image and the drawn parameters, for many keys at once: one compile.
J_JITTER = jax.jit(jax.vmap(lambda k, x: (color_jitter(k, x, **STRENGTHS),
                                          jitter_params(k, **STRENGTHS)), in_axes=(0, None)))
KEYS = jax.random.split(jax.random.key(0), 600)

# Every knob of a view that may be traced; one compiled program serves all their settings.
KNOBS = dict(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip_p=0.5, jitter_p=0.8,
             grayscale_p=0.2, blur_p=0.5, blur_sigma=(0.1, 2.0))
OFF = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip_p=0.0, jitter_p=0.0, grayscale_p=0.0,
           blur_p=0.0)


@jax.jit
def _views(key, images, knobs):
    return two_views(key, images, blur=True, kernel_size=3, **knobs)


def views(key, images, **overrides):
    return np.asarray(_views(key, images, {**KNOBS, **overrides}))


def test_knob_defaults_are_the_library_defaults():
    """So that views(...) with no overrides is the SimCLR setting simclr_view defaults to."""
    params = inspect.signature(simclr_view).parameters
    assert {name: params[name].default for name in KNOBS} == KNOBS


def batch16(seed=16, n=4):
    return jnp.asarray(np.random.default_rng(seed).random((n, 16, 16, 3)), jnp.float32)


# ---- Colour ops -----------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.0, 0.37, 1.0, 1.6])
def test_adjust_ops_match_torchvision_formulas(factor):
    img = rand_img(1)
    for fn, ref in [(J_BRIGHT, np_brightness), (J_CONTRAST, np_contrast),
                    (J_SAT, np_saturation)]:
        np.testing.assert_allclose(np.asarray(fn(jnp.asarray(img), factor)), ref(img, factor),
                                   atol=TOL)


def test_grayscale():
    img = rand_img(2)
    out = np.asarray(J_GRAY(jnp.asarray(img)))
    assert out.shape == img.shape
    np.testing.assert_allclose(out, np.repeat(np_gray(img)[..., None], 3, -1), atol=TOL)
    np.testing.assert_allclose(np.asarray(J_SAT(jnp.asarray(img), 0.0)), out, atol=TOL)


@pytest.mark.parametrize("delta", [-0.5, -0.23, 0.07, 0.41])
def test_adjust_hue_matches_colorsys(delta):
    img = rand_img(3)
    # Grey pixels and ties between channels exercise the branch order.
    img[0, 0] = 0.5
    img[0, 1] = [0.8, 0.8, 0.1]
    img[0, 2] = [0.2, 0.9, 0.9]
    img[0, 3] = [0.0, 0.0, 0.0]
    img[0, 4] = [1.0, 0.0, 1.0]
    img[0, 5] = [0.3, 0.7, 0.3]
    np.testing.assert_allclose(np.asarray(J_HUE(jnp.asarray(img), delta)), np_hue(img, delta),
                               atol=TOL)


def test_hue_identities():
    img = jnp.asarray(rand_img(4))
    np.testing.assert_allclose(np.asarray(J_HUE(img, 0.0)), np.asarray(img), atol=1e-6)
    back = J_HUE(J_HUE(img, 0.3), -0.3)
    np.testing.assert_allclose(np.asarray(back), np.asarray(img), atol=1e-5)
    # And a nonzero rotation actually changes the image.
    assert np.abs(np.asarray(J_HUE(img, 0.3)) - np.asarray(img)).max() > 0.1


# ---- Colour jitter --------------------------------------------------------------------------


def test_color_jitter_equals_ops_in_drawn_order():
    img = rand_img(5)
    outs, ps = jax.device_get(J_JITTER(KEYS, jnp.asarray(img)))
    orders = set()
    for i in range(6):
        order = [int(v) for v in ps["order"][i]]
        orders.add(tuple(order))
        ref = img.astype(np.float64)
        for op in order:
            ref = NP_OPS[op](ref, float(ps[PARAM_NAMES[op]][i]))
        np.testing.assert_allclose(outs[i], ref, atol=TOL)
        # The order matters on this input, so an implementation ignoring it would fail above.
        rev = img.astype(np.float64)
        for op in order[::-1]:
            rev = NP_OPS[op](rev, float(ps[PARAM_NAMES[op]][i]))
        assert np.abs(rev - ref).max() > 1e-3
    assert len(orders) > 1


def test_jitter_params_cover_all_orders_and_ranges():
    _, ps = jax.device_get(J_JITTER(KEYS, jnp.asarray(rand_img(5))))
    perms = {tuple(int(v) for v in row) for row in ps["order"]}
    assert perms == set(itertools.permutations(range(4)))
    for name, lo, hi in [("brightness", 0.6, 1.4), ("contrast", 0.6, 1.4),
                         ("saturation", 0.0, 2.5), ("hue", -0.1, 0.1)]:
        v = ps[name]
        assert v.min() >= lo and v.max() <= hi, name
        assert v.min() < lo + 0.05 and v.max() > hi - 0.05, name  # covers the range


def test_zero_strength_jitter_is_identity():
    img = jnp.asarray(rand_img(7))
    p = {"order": jnp.array([3, 1, 0, 2]), "brightness": 1.3, "contrast": 0.5,
         "saturation": 1.4, "hue": 0.2}
    out = apply_jitter(img, p, brightness=0, contrast=0, saturation=0, hue=0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(img))
    # Only the disabled op is skipped: with hue on, the result is the hue rotation.
    out = apply_jitter(img, p, brightness=0, contrast=0, saturation=0, hue=0.3)
    np.testing.assert_allclose(np.asarray(out), np_hue(np.asarray(img), 0.2), atol=TOL)


# ---- Random resized crop --------------------------------------------------------------------


@pytest.mark.parametrize("box,size", [((2, 3, 5, 7), None), ((0, 0, 12, 10), (5, 4)),
                                      ((4, 1, 1, 9), None), ((6, 0, 6, 10), (9, 3)),
                                      ((0, 0, 12, 10), None), ((7, 2, 3, 4), None)])
def test_crop_and_resize_matches_pytorch_bilinear(box, size):
    """The box is traced (jit arguments), as it is inside random_resized_crop."""
    img = rand_img(8, 12, 10)
    out_h, out_w = size if size else img.shape[:2]
    out = J_CROP_RESIZE(jnp.asarray(img), *box, size=size)
    assert out.shape == (out_h, out_w, 3)
    np.testing.assert_allclose(np.asarray(out), np_crop_resize(img, *box, out_h, out_w),
                               atol=TOL)


def test_full_crop_is_identity():
    img = jnp.asarray(rand_img(10))
    out, _ = crops_and_boxes(KEYS, img, (1.0, 1.0), (1.0, 1.0))
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(img, out.shape), atol=1e-6)


def test_select_crop_box_matches_torchvision_loop():
    rng = np.random.default_rng(11)
    sel = jax.jit(select_crop_box)  # all traced, image size included: one compile
    n_fallback = 0
    for trial in range(60):
        height, width = [(8, 16), (16, 8), (12, 12)][trial % 3]
        ratio = [(3 / 4, 4 / 3), (0.2, 5.0)][trial % 2]
        scale = [(0.08, 1.0), (0.6, 1.6)][(trial // 2) % 2]
        draws = [rng.uniform(*scale, 10), rng.uniform(math.log(ratio[0]), math.log(ratio[1]), 10),
                 rng.random(10), rng.random(10)]
        draws = [d.astype(np.float32) for d in draws]
        got = tuple(int(v) for v in sel(*draws, height, width, ratio))
        want = np_torchvision_crop_box(*draws, height, width, ratio)
        assert got == want, (trial, got, want)
        n_fallback += got == np_torchvision_crop_box([9.0], [0.0], [0.0], [0.0], height, width,
                                                     ratio)
    assert 0 < n_fallback < 60


def test_crop_fallback_is_torchvision_centre_crop():
    # Area > image never fits; 8x8 is narrower than ratio 1.5, so the fallback box is
    # w = 8, h = round(8 / 1.5) = 5, centred: top = 1.
    img = jnp.asarray(rand_img(12))
    out, _ = crops_and_boxes(KEYS, img, (2.0, 3.0), (1.5, 2.0))
    want = np_crop_resize(np.asarray(img), 1, 0, 5, 8, 8, 8)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(want, out.shape), atol=TOL)


def test_random_crop_boxes_fit_and_vary():
    img = rand_img(17)
    out, (top, left, h, w) = jax.device_get(crops_and_boxes(KEYS, jnp.asarray(img), (0.08, 1.0),
                                                  (3 / 4, 4 / 3)))
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= 8).all() and (left + w <= 8).all()
    frac = h * w / 64
    assert frac.min() < 0.2 and frac.max() > 0.8
    assert len(set(zip(top, left, h, w, strict=True))) > 100
    # Each crop is the drawn box resized back.
    for i in range(3):
        want = np_crop_resize(img, int(top[i]), int(left[i]), int(h[i]), int(w[i]), 8, 8)
        np.testing.assert_allclose(out[i], want, atol=TOL)


# ---- Gaussian blur --------------------------------------------------------------------------


@pytest.mark.parametrize("sigma,k", [(0.7, 3), (1.9, 7)])
def test_blur_matches_numpy_reflect_convolution(sigma, k):
    img = rand_img(13, 9, 8)
    np.testing.assert_allclose(np.asarray(J_BLUR(jnp.asarray(img), sigma, k)),
                               np_blur(img, sigma, k), atol=TOL)


def test_random_blur_draws_sigma_in_range():
    img = rand_img(13, 9, 8)
    # A degenerate range is exactly that sigma.
    out = J_GBLUR(KEYS[0], jnp.asarray(img), kernel_size=5, sigma=(1.3, 1.3))
    np.testing.assert_allclose(np.asarray(out), np_blur(img, 1.3, 5), atol=TOL)
    # Otherwise the output is the blur for some sigma in the range (found by a grid search over
    # sigma with a vectorised NumPy reference), and different keys draw different sigmas.
    a = np.asarray(J_GBLUR(KEYS[1], jnp.asarray(img), kernel_size=5, sigma=(0.1, 2.0)))
    b = np.asarray(J_GBLUR(KEYS[2], jnp.asarray(img), kernel_size=5, sigma=(0.1, 2.0)))
    assert np.abs(a - b).max() > 1e-4
    grid = np.arange(0.1, 2.0 + 1e-9, 5e-4)
    x = np.arange(5) - 2.0
    kern = np.exp(-0.5 * (x[None] / grid[:, None]) ** 2)
    kern /= kern.sum(1, keepdims=True)  # [S, 5]
    p = np.pad(img.astype(np.float64), ((2, 2), (2, 2), (0, 0)), mode="reflect")
    rows = np.einsum("sk,kyxc->syxc", kern, np.stack([p[i:i + 9] for i in range(5)]))
    cand = np.einsum("sk,ksyxc->syxc", kern, np.stack([rows[:, :, i:i + 8] for i in range(5)]))
    best = []
    for out in (a, b):
        err = np.abs(cand - out).max(axis=(1, 2, 3))
        assert err.min() < 1e-4
        best.append(grid[err.argmin()])
    assert abs(best[0] - best[1]) > 1e-2


def test_simclr_kernel_size():
    assert [simclr_kernel_size(s) for s in (16, 32, 64, 224)] == [1, 3, 7, 23]


# ---- The view and pairs ---------------------------------------------------------------------


def test_view_wiring():
    imgs = batch16(14)
    both = np.concatenate([np.asarray(imgs)] * 2)
    key = jax.random.key(5)
    np.testing.assert_allclose(views(key, imgs, **OFF), both, atol=1e-6)
    np.testing.assert_allclose(views(key, imgs, **dict(OFF, hflip_p=1.0)), both[:, :, ::-1],
                               atol=1e-6)
    gray = np.repeat(np_gray(both)[..., None], 3, -1)
    np.testing.assert_allclose(views(key, imgs, **dict(OFF, grayscale_p=1.0)), gray, atol=TOL)
    blurred = views(key, imgs, **dict(OFF, blur_p=1.0, blur_sigma=(1.2, 1.2)))
    for i in (0, 5):
        np.testing.assert_allclose(blurred[i], np_blur(both[i], 1.2, 3), atol=TOL)
    jittered = views(key, imgs, **dict(OFF, jitter_p=1.0))
    assert (np.abs(jittered - both).max(axis=(1, 2, 3)) > 1e-3).all()
    cropped = views(key, imgs, **dict(OFF, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)))
    assert (np.abs(cropped - both).max(axis=(1, 2, 3)) > 1e-3).all()


def test_grayscale_probability():
    imgs = batch16(15)
    n_gray = 0
    for seed in range(40):
        v = views(jax.random.key(seed), imgs, **dict(OFF, grayscale_p=0.2))
        n_gray += int((np.abs(v - v[..., :1]).max(axis=(1, 2, 3)) < 1e-7).sum())
    assert 0.2 - 0.06 < n_gray / 320 < 0.2 + 0.06  # 320 views, sd 0.022


def test_two_views():
    imgs = batch16(0)
    key = jax.random.key(0)
    out = views(key, imgs)
    assert out.shape == (8, 16, 16, 3) and out.dtype == np.float32
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    for i in range(4):
        assert np.abs(out[i] - out[i + 4]).max() > 1e-3
    np.testing.assert_array_equal(views(key, imgs), out)
    assert np.abs(views(jax.random.key(1), imgs) - out).max() > 1e-3


def test_two_views_default_chain_under_vmap():
    """vmap over batches (e.g. clients) of the default chain (blur=False, constants folded)."""
    imgs = batch16(1)
    bkeys = KEYS[:2]
    stacked = np.asarray(jax.jit(jax.vmap(two_views))(bkeys, jnp.stack([imgs, imgs])))
    assert stacked.shape == (2, 8, 16, 16, 3)
    assert stacked.min() >= 0.0 and stacked.max() <= 1.0
    assert np.abs(stacked[0] - stacked[1]).max() > 1e-3
    # Same uniforms and steps as the traced-knob program with the blur never taken.
    for b in range(2):
        np.testing.assert_allclose(stacked[b], views(bkeys[b], imgs, blur_p=0.0), atol=1e-6)


def test_whole_chain_jits_on_a_batch():
    """Every default SimCLR step plus the blur, batch of 4 16x16 images, under jax.jit."""
    out = views(jax.random.key(2), batch16(), **KNOBS)
    assert out.shape == (8, 16, 16, 3)
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    assert np.abs(out[:4] - out[4:]).max() > 1e-3
