"""In-graph SimCLR augmentations for contrastive views (MFCL), per sample, pure JAX.

MFCL (Motamedi & Kim, TMLR) trains with SimCLR's augmentations (Chen et al. 2020, "A Simple
Framework for Contrastive Learning of Visual Representations", arXiv 2002.05709, appendix A),
written the torchvision way. One view applies, in this order:

1. random resized crop: area fraction ``~ U(scale)`` with ``scale = (0.08, 1.0)``, aspect ratio
   log-uniform in ``(3/4, 4/3)``, 10 tries then torchvision's centre-crop fallback; the box is
   resized back to ``H x W`` bilinearly (:func:`crop_and_resize` states the pixel convention);
2. horizontal flip with probability 1/2;
3. colour jitter with probability 0.8: brightness, contrast, saturation (0.4 each) and hue (0.1),
   factors uniform in ``[max(0, 1-s), 1+s]`` (hue ``[-h, h]``), the four ops in a random order;
4. grayscale with probability 0.2;
5. only with ``blur=True`` (Tiny-ImageNet): Gaussian blur with probability 1/2, sigma
   ``~ U(0.1, 2.0)``, kernel about 10% of the image side (odd), reflect padding.

Images are ``float32 [H, W, 3]`` in [0, 1] and stay there: every colour op clamps to [0, 1] as
torchvision's float path does. Every function takes one image; batches go through ``jax.vmap``
with one key per sample (:func:`two_views`). Shapes are static and random choices are selects,
so everything jits and vmaps; a random choice costs computing both sides, which for images this
small is cheaper than any control flow a batch would need under ``vmap`` anyway.

Randomness: each call draws ONE vector of uniforms from its key and carves every random choice
out of it (a Bernoulli(p) is ``u < p``, the jitter order is ``argsort`` of 4 uniforms, the crop
tries take 40). Each ``jax.random`` call is a separate threefry instance that XLA compiles
separately (about half a second each on CPU), so one draw per view instead of a dozen keeps the
compile time of a round small. Probabilities, crop ``scale``/``ratio`` and the blur sigma range
are plain numbers in the graph and may be traced; the jitter strengths are static (a zero
strength removes its op, as in torchvision).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ITU-R 601-2 luma, as PIL's ``convert("L")``. torchvision's tensor path uses 0.2989 for red;
# the 1e-4 difference is below one uint8 step.
_LUMA = (0.299, 0.587, 0.114)

# torchvision's ColorJitter op indices; a random permutation of these is the application order.
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------
# Colour ops (deterministic), torchvision's definitions for float images.
# --------------------------------------------------------------------------------------------


def _gray(img: jax.Array) -> jax.Array:
    """``[H, W, 3] -> [H, W, 1]`` luma."""
    return (_LUMA[0] * img[..., 0:1] + _LUMA[1] * img[..., 1:2] + _LUMA[2] * img[..., 2:3])


def _blend(img: jax.Array, other: jax.Array, factor: jax.Array) -> jax.Array:
    # torchvision's _blend: ratio * img1 + (1 - ratio) * img2, clamped to the float range.
    return jnp.clip(factor * img + (1.0 - factor) * other, 0.0, 1.0)


def to_grayscale(img: jax.Array) -> jax.Array:
    """``0.299 R + 0.587 G + 0.114 B`` replicated to 3 channels."""
    return jnp.broadcast_to(_gray(img), img.shape)


def adjust_brightness(img: jax.Array, factor: jax.Array | float) -> jax.Array:
    """``clip(factor * img)``: a blend with black."""
    return _blend(img, jnp.zeros_like(img), factor)


def adjust_contrast(img: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Blend with the (scalar) mean of the grayscale image."""
    return _blend(img, jnp.mean(_gray(img)), factor)


def adjust_saturation(img: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Blend with the grayscale image; 0 gives grayscale, 1 the image."""
    return _blend(img, _gray(img), factor)


def rgb_to_hsv(img: jax.Array) -> jax.Array:
    """``[..., 3]`` RGB -> HSV (``h`` in [0, 1) turns, ``s, v`` in [0, 1]); torchvision's.

    Grey pixels (max == min) get hue 0 and saturation 0; the divisors are replaced by 1 there so
    no NaN is ever formed (a NaN in the unused branch of a ``where`` would still poison grads).
    """
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    # Elementwise over the three channels rather than a reduction over a size-3 axis: XLA then
    # fuses the whole conversion into one loop, which compiles several times faster on CPU.
    maxc = jnp.maximum(jnp.maximum(r, g), b)
    minc = jnp.minimum(jnp.minimum(r, g), b)
    eqc = maxc == minc
    cr = maxc - minc
    s = cr / jnp.where(eqc, 1.0, maxc)
    crd = jnp.where(eqc, 1.0, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    # Ties go to red, then green, as torchvision (and colorsys).
    is_r = maxc == r
    is_g = (maxc == g) & ~is_r
    h = jnp.where(is_r, bc - gc, jnp.where(is_g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = jnp.mod(h / 6.0 + 1.0, 1.0)
    return jnp.stack([h, s, maxc], axis=-1)


def hsv_to_rgb(hsv: jax.Array) -> jax.Array:
    """``[..., 3]`` HSV -> RGB, equal to torchvision's ``_hsv2rgb`` for ``s, v`` in [0, 1].

    torchvision picks ``(r, g, b)`` from the sector table ``i = floor(6h) mod 6`` over
    ``v, p = v(1-s), q = v(1-sf), t = v(1-s(1-f))``. The closed form used here,
    ``c_n = v - v s clip(min(k, 4 - k), 0, 1)`` with ``k = (n + 6h) mod 6`` and ``n = 5, 3, 1``
    for red, green, blue, gives the same entry in every sector (e.g. red: ``v, q, p, p, t, v``)
    with no table gather, so it fuses and compiles in a fraction of the time. It is continuous
    in ``h``, so ``h == 1.0`` (possible after a float mod) needs no special case.
    """
    h, s, v = hsv[..., 0:1], hsv[..., 1:2], hsv[..., 2:3]
    k = jnp.mod(jnp.asarray([5.0, 3.0, 1.0], hsv.dtype) + 6.0 * h, 6.0)
    return v - v * s * jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)


def adjust_hue(img: jax.Array, delta: jax.Array | float) -> jax.Array:
    """Rotates hue by ``delta`` turns (``delta`` in [-0.5, 0.5]) through HSV."""
    hsv = rgb_to_hsv(img)
    h = jnp.mod(hsv[..., 0] + delta, 1.0)
    return hsv_to_rgb(jnp.stack([h, hsv[..., 1], hsv[..., 2]], axis=-1))


# --------------------------------------------------------------------------------------------
# Random colour jitter.
# --------------------------------------------------------------------------------------------


def _factor_range(strength: float) -> tuple[float, float]:
    if strength < 0:
        raise ValueError(f"jitter strength must be >= 0, got {strength}")
    return max(0.0, 1.0 - strength), 1.0 + strength


JITTER_UNIFORMS = 8  # 4 for the order, 4 for the factors


def jitter_from_uniforms(u: jax.Array, *, brightness: float, contrast: float, saturation: float,
                         hue: float) -> dict[str, jax.Array]:
    """ColorJitter's order and factors from ``u``, ``[JITTER_UNIFORMS]`` uniforms in [0, 1).

    The order is ``argsort`` of 4 i.i.d. uniforms, a uniformly random permutation of the op
    indices (as ``torch.randperm(4)``); each factor is uniform on its range.
    """
    if not 0.0 <= hue <= 0.5:
        raise ValueError(f"hue must be in [0, 0.5], got {hue}")

    def scaled(v, lo_hi):
        return lo_hi[0] + (lo_hi[1] - lo_hi[0]) * v

    return {
        "order": jnp.argsort(u[:4]).astype(jnp.int32),
        "brightness": scaled(u[4], _factor_range(brightness)),
        "contrast": scaled(u[5], _factor_range(contrast)),
        "saturation": scaled(u[6], _factor_range(saturation)),
        "hue": scaled(u[7], (-hue, hue)),
    }


def jitter_params(key: jax.Array, *, brightness: float, contrast: float, saturation: float,
                  hue: float) -> dict[str, jax.Array]:
    """Draws ColorJitter's order (a permutation of the 4 op indices) and its 4 factors."""
    return jitter_from_uniforms(jax.random.uniform(key, (JITTER_UNIFORMS,)),
                                brightness=brightness, contrast=contrast,
                                saturation=saturation, hue=hue)


def apply_jitter(img: jax.Array, params: dict[str, jax.Array], *, brightness: float = 1.0,
                 contrast: float = 1.0, saturation: float = 1.0, hue: float = 1.0) -> jax.Array:
    """Applies the four ops in ``params["order"]``; a zero strength makes that op the identity.

    The strengths only matter as zero or not here (the factors are in ``params``). torchvision
    skips a disabled op rather than applying factor 1 / delta 0; skipping here too
    keeps a disabled hue op from adding the HSV round trip's rounding error.
    """
    ops = [
        (lambda x: adjust_brightness(x, params["brightness"])) if brightness else (lambda x: x),
        (lambda x: adjust_contrast(x, params["contrast"])) if contrast else (lambda x: x),
        (lambda x: adjust_saturation(x, params["saturation"])) if saturation else (lambda x: x),
        (lambda x: adjust_hue(x, params["hue"])) if hue else (lambda x: x),
    ]
    # Four steps, each a switch on the op index at that position of the permutation. Under vmap
    # the switch evaluates all four ops and selects, 16 op evaluations per image, versus 96 for
    # a switch over the 24 whole permutations.
    return jax.lax.fori_loop(0, 4, lambda i, x: jax.lax.switch(params["order"][i], ops, x), img)


def color_jitter(key: jax.Array, img: jax.Array, *, brightness: float = 0.4,
                 contrast: float = 0.4, saturation: float = 0.4, hue: float = 0.1) -> jax.Array:
    """torchvision's ``ColorJitter(brightness, contrast, saturation, hue)`` for one image."""
    p = jitter_params(key, brightness=brightness, contrast=contrast, saturation=saturation,
                      hue=hue)
    return apply_jitter(img, p, brightness=brightness, contrast=contrast, saturation=saturation,
                        hue=hue)


# --------------------------------------------------------------------------------------------
# Random resized crop.
# --------------------------------------------------------------------------------------------


def _source_positions(out_size: int, box_size: jax.Array) -> jax.Array:
    """Continuous source coordinates (box pixel units) of ``out_size`` output pixel centres."""
    scale = box_size.astype(jnp.float32) / out_size
    src = (jnp.arange(out_size, dtype=jnp.float32) + 0.5) * scale - 0.5
    # Clamping below at 0 is PyTorch's rule; clamping above at box-1 is the same as its
    # ``min(i0 + 1, n - 1)`` on the far neighbour (src < n - 0.5 always).
    return jnp.clip(src, 0.0, box_size.astype(jnp.float32) - 1.0)


def _bilinear_taps(out_size: int, start: jax.Array, box_size: jax.Array):
    pos = _source_positions(out_size, box_size)
    i0 = jnp.floor(pos)
    frac = pos - i0
    i0 = i0.astype(jnp.int32)
    i1 = jnp.minimum(i0 + 1, box_size - 1)
    return start + i0, start + i1, frac


def crop_and_resize(img: jax.Array, top: jax.Array | int, left: jax.Array | int,
                    height: jax.Array | int, width: jax.Array | int,
                    size: tuple[int, int] | None = None) -> jax.Array:
    """Crops rows ``top:top+height``, columns ``left:left+width`` and resizes them bilinearly.

    The box may be traced (its size is dynamic); the output is ``size`` (default: the input's
    ``H x W``). Convention: pixel centres, ``align_corners=False`` without antialiasing, as
    PyTorch's ``interpolate(mode="bilinear")`` and PIL's bilinear when upsampling: output pixel
    ``y`` reads source position ``s = (y + 0.5) * height / H - 0.5`` of the box, clamped to
    ``[0, height - 1]``, interpolating rows ``floor(s)`` and ``floor(s) + 1`` (likewise for
    columns). The box must lie inside the image; the taps never read outside it.

    In :func:`random_resized_crop` the box is never larger than the output, so every axis is
    upsampled (or copied) and antialiasing, torchvision's default, would change nothing.
    """
    out_h, out_w = size if size is not None else img.shape[:2]
    top, left = jnp.asarray(top, jnp.int32), jnp.asarray(left, jnp.int32)
    height, width = jnp.asarray(height, jnp.int32), jnp.asarray(width, jnp.int32)
    r0, r1, fy = _bilinear_taps(out_h, top, height)
    c0, c1, fx = _bilinear_taps(out_w, left, width)
    # Bilinear is separable: rows first (two row gathers), then columns.
    rows = img[r0] * (1.0 - fy)[:, None, None] + img[r1] * fy[:, None, None]
    return rows[:, c0] * (1.0 - fx)[None, :, None] + rows[:, c1] * fx[None, :, None]


def _fallback_box(height, width, ratio) -> tuple[jax.Array, ...]:
    """torchvision's centre crop after 10 failed tries: the largest box of the clamped ratio."""
    in_ratio = width / height
    lo = jnp.minimum(ratio[0], ratio[1])
    hi = jnp.maximum(ratio[0], ratio[1])
    narrow_h = jnp.round(width / lo).astype(jnp.int32)  # image narrower than the ratio range
    wide_w = jnp.round(height * hi).astype(jnp.int32)  # image wider than the ratio range
    h = jnp.where(in_ratio < lo, narrow_h, height)
    w = jnp.where(in_ratio < lo, width, jnp.where(in_ratio > hi, wide_w, width))
    return (height - h) // 2, (width - w) // 2, h, w


def select_crop_box(area_frac: jax.Array, log_ratio: jax.Array, u_top: jax.Array,
                    u_left: jax.Array, height, width, ratio) -> tuple[jax.Array, ...]:
    """``(top, left, h, w)`` from the tries' draws: the first try that fits, else the fallback.

    ``area_frac``, ``log_ratio``, ``u_top``, ``u_left`` are ``[tries]`` arrays (the last two
    uniform in [0, 1)); try ``t`` is torchvision's ``w = round(sqrt(A a)), h = round(sqrt(A / a))``
    with ``A = area_frac[t] * H * W`` and ``a = exp(log_ratio[t])``, and fits when
    ``0 < w <= W`` and ``0 < h <= H``. Its offset is ``floor(u * (H - h + 1))``, uniform over the
    valid positions like ``randint(0, H - h + 1)``. Everything, ``height`` and ``width``
    included, may be traced.
    """
    target = area_frac * (height * width)
    aspect = jnp.exp(log_ratio)
    # Python's round and jnp.round both round half to even.
    ws = jnp.round(jnp.sqrt(target * aspect)).astype(jnp.int32)
    hs = jnp.round(jnp.sqrt(target / aspect)).astype(jnp.int32)
    fits = (ws > 0) & (ws <= width) & (hs > 0) & (hs <= height)
    first = jnp.argmax(fits)  # index of the first True (0 when none, handled below)
    h, w = hs[first], ws[first]
    top = jnp.minimum(jnp.floor(u_top[first] * (height - h + 1)).astype(jnp.int32), height - h)
    left = jnp.minimum(jnp.floor(u_left[first] * (width - w + 1)).astype(jnp.int32), width - w)
    fb = _fallback_box(height, width, ratio)
    any_fit = jnp.any(fits)
    return tuple(jnp.where(any_fit, v, f).astype(jnp.int32)
                 for v, f in zip((top, left, h, w), fb, strict=True))


CROP_TRIES = 10


def crop_from_uniforms(u: jax.Array, height: int, width: int, *, scale=(0.08, 1.0),
                       ratio=(3 / 4, 4 / 3)) -> tuple[jax.Array, ...]:
    """``(top, left, h, w)`` from ``u``, ``[4 * CROP_TRIES]`` uniforms in [0, 1).

    Try ``t`` uses ``u[t]`` for the area fraction (uniform on ``scale``), ``u[T + t]`` for the
    log aspect ratio (uniform on ``log(ratio)``) and ``u[2T + t]``, ``u[3T + t]`` for the offsets.
    """
    t = CROP_TRIES
    log_lo, log_hi = jnp.log(ratio[0]), jnp.log(ratio[1])
    area_frac = scale[0] + (scale[1] - scale[0]) * u[:t]
    log_ratio = log_lo + (log_hi - log_lo) * u[t:2 * t]
    return select_crop_box(area_frac, log_ratio, u[2 * t:3 * t], u[3 * t:4 * t], height, width,
                           ratio)


def crop_params(key: jax.Array, height: int, width: int, *, scale=(0.08, 1.0),
                ratio=(3 / 4, 4 / 3)) -> tuple[jax.Array, ...]:
    """torchvision's ``RandomResizedCrop.get_params``, its 10 tries drawn at once."""
    u = jax.random.uniform(key, (4 * CROP_TRIES,))
    return crop_from_uniforms(u, height, width, scale=scale, ratio=ratio)


def random_resized_crop(key: jax.Array, img: jax.Array, *, scale=(0.08, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> jax.Array:
    """torchvision's ``RandomResizedCrop(size=(H, W))`` without antialiasing, for one image."""
    h, w = img.shape[:2]
    top, left, bh, bw = crop_params(key, h, w, scale=scale, ratio=ratio)
    return crop_and_resize(img, top, left, bh, bw)


# --------------------------------------------------------------------------------------------
# Gaussian blur.
# --------------------------------------------------------------------------------------------


def gaussian_kernel1d(kernel_size: int, sigma: jax.Array | float) -> jax.Array:
    """torchvision's kernel: ``exp(-x^2 / 2 sigma^2)`` on ``x = -(k-1)/2 .. (k-1)/2``, sum 1."""
    half = (kernel_size - 1) * 0.5
    x = jnp.linspace(-half, half, kernel_size, dtype=jnp.float32)
    pdf = jnp.exp(-0.5 * (x / sigma) ** 2)
    return pdf / jnp.sum(pdf)


def blur_with_sigma(img: jax.Array, sigma: jax.Array | float, kernel_size: int) -> jax.Array:
    """Separable Gaussian blur, reflect padding (edge pixel not repeated, as ``torch.pad``)."""
    if kernel_size % 2 != 1 or kernel_size < 1:
        raise ValueError(f"kernel_size must be odd and positive, got {kernel_size}")
    h, w = img.shape[:2]
    r = kernel_size // 2
    if r >= min(h, w):
        raise ValueError(f"kernel_size {kernel_size} too large for a {h}x{w} image")
    kern = gaussian_kernel1d(kernel_size, sigma)
    padded = jnp.pad(img, ((r, r), (r, r), (0, 0)), mode="reflect")
    # Kernel sizes are a few taps, so shifted sums beat a convolution call and vmap trivially.
    rows = sum(kern[i] * padded[i:i + h] for i in range(kernel_size))
    return sum(kern[i] * rows[:, i:i + w] for i in range(kernel_size))


def gaussian_blur(key: jax.Array, img: jax.Array, *, kernel_size: int,
                  sigma=(0.1, 2.0)) -> jax.Array:
    """torchvision's ``GaussianBlur(kernel_size, sigma)``: sigma ``~ U(sigma)`` per call."""
    s = sigma[0] + (sigma[1] - sigma[0]) * jax.random.uniform(key, ())
    return blur_with_sigma(img, s, kernel_size)


def simclr_kernel_size(size: int) -> int:
    """SimCLR's blur kernel: 10% of the side made odd, ``2 * ((size // 10) // 2) + 1``."""
    return 2 * ((size // 10) // 2) + 1


# --------------------------------------------------------------------------------------------
# The view and the batch of pairs.
# --------------------------------------------------------------------------------------------


# Layout of a view's uniforms: crop tries, then one each for the flip, the jitter coin, the
# grayscale coin, the blur coin and the blur sigma, then the jitter's.
_U_CROP = 4 * CROP_TRIES
_U_FLIP, _U_JITTER_P, _U_GRAY, _U_BLUR_P, _U_SIGMA = range(_U_CROP, _U_CROP + 5)
_U_JITTER = _U_CROP + 5
VIEW_UNIFORMS = _U_JITTER + JITTER_UNIFORMS


def simclr_view(key: jax.Array, img: jax.Array, *, blur: bool = False, scale=(0.08, 1.0),
                ratio=(3 / 4, 4 / 3), hflip_p=0.5, brightness: float = 0.4,
                contrast: float = 0.4, saturation: float = 0.4, hue: float = 0.1,
                jitter_p=0.8, grayscale_p=0.2, blur_p=0.5, blur_sigma=(0.1, 2.0),
                kernel_size: int | None = None) -> jax.Array:
    """One SimCLR view of one ``float32 [H, W, 3]`` image in [0, 1] (module docstring's order).

    ``blur``, ``kernel_size`` and the four jitter strengths are static; the probabilities,
    ``scale``, ``ratio`` and ``blur_sigma`` may be traced. ``kernel_size`` defaults to
    :func:`simclr_kernel_size` of ``min(H, W)``; a kernel of 1 (images under 20 pixels) makes
    the blur the identity.
    """
    h, w = img.shape[:2]
    u = jax.random.uniform(key, (VIEW_UNIFORMS,))
    top, left, bh, bw = crop_from_uniforms(u[:_U_CROP], h, w, scale=scale, ratio=ratio)
    x = crop_and_resize(img, top, left, bh, bw)
    x = jnp.where(u[_U_FLIP] < hflip_p, x[:, ::-1], x)
    strengths = dict(brightness=brightness, contrast=contrast, saturation=saturation, hue=hue)
    jit_params = jitter_from_uniforms(u[_U_JITTER:], **strengths)
    x = jnp.where(u[_U_JITTER_P] < jitter_p, apply_jitter(x, jit_params, **strengths), x)
    x = jnp.where(u[_U_GRAY] < grayscale_p, to_grayscale(x), x)
    if blur:
        ks = simclr_kernel_size(min(h, w)) if kernel_size is None else kernel_size
        sigma = blur_sigma[0] + (blur_sigma[1] - blur_sigma[0]) * u[_U_SIGMA]
        x = jnp.where(u[_U_BLUR_P] < blur_p, blur_with_sigma(x, sigma, ks), x)
    return jnp.clip(x, 0.0, 1.0)


def two_views(key: jax.Array, images: jax.Array, **view_kwargs) -> jax.Array:
    """``float32 [N, H, W, 3]`` -> ``[2N, H, W, 3]``: rows ``i`` and ``i + N`` view image ``i``.

    Each of the ``2N`` rows has its own key from ``jax.random.split``, so the two views of an
    image are independent. The ``i`` / ``i + N`` layout is the one Twin Normalization and the
    NT-Xent pairing expect. ``view_kwargs`` go to :func:`simclr_view`.
    """
    n = images.shape[0]
    keys = jax.random.split(key, 2 * n)
    both = jnp.concatenate([images, images], axis=0)
    return jax.vmap(lambda k, im: simclr_view(k, im, **view_kwargs))(keys, both)
