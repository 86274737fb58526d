"""In-graph image augmentation, per sample, in the FedRCL reference's order.

Train: random rotation in ``[-max_degrees, max_degrees]`` (nearest neighbour, zero fill) ->
random crop back to ``H x W`` from the image zero-padded by ``crop_padding`` -> horizontal flip
with probability 1/2 -> normalize. Test: normalize only. ``pad_mode="reflect"`` pads the crop
by reflection instead of zeros (MOON's CIFAR-10 transform: reflect-pad 4, random crop, flip; no
rotation there).

The three geometric steps are composed into one inverse coordinate map, so a batch costs a
single gather: output pixel ``(y, x)`` reads the source pixel

.. math::
    x_f = \\begin{cases} W-1-x & \\text{flip} \\\\ x \\end{cases},\\quad
    (u, v) = (y + o_y - p,\\; x_f + o_x - p),\\quad
    (r, c) = \\operatorname{round}\\big(R_{-\\theta}((u, v) - \\kappa) + \\kappa\\big)

with crop offsets ``o ~ U{0..2p}``, a positive angle rotating counter-clockwise (as PIL and
torchvision), rotation centre ``kappa = ((H-1)/2, (W-1)/2)``, and reads 0
when ``(u, v)`` falls in the crop padding or ``(r, c)`` falls outside the image. This equals
applying rotation, then padded crop, then flip one after the other (tested against that).

On a CPU ``augment_batch`` runs the map, the gather and the normalisation as one C++ pass
(``csrc/augment.cc``, built with the oneDNN convolutions by ``fedjax_rcl.nn.onednn``): XLA
compiles them as a gather fusion that recomputes the coordinate for every channel of every pixel
and reads one byte at a time, a tenth of a small CNN's round. The kernel takes the per-sample
draws (and the rotation's cosine and sine) from this module's XLA code and gives bitwise the
same images (tested); ``KERNEL = "off"`` keeps XLA's gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import onednn


class Transforms(NamedTuple):
    """A training pipeline's geometry and, where it fixes them, its normalisation constants.

    Attributes:
      max_degrees: rotation range (0: none).
      crop_padding: the random crop's padding.
      pad_mode: ``"zero"`` or ``"reflect"``.
      mean, std: per-channel constants in [0, 1] pixel units; None: the dataset's own.
    """

    max_degrees: float
    crop_padding: int
    pad_mode: str
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


# ``transforms=`` by name. ``fedrcl``: the FedRCL reference's (rotation 10 degrees, zero-padded
# crop 4, flip) with the dataset's constants. ``moon``: MOON's CIFAR-10 pipeline in its authors'
# code (reflect-pad 4, random crop 32, flip, normalised with mean (125.3, 123.0, 113.9) / 255
# and std (63.0, 62.1, 66.7) / 255, the same for training and test).
TRANSFORMS = {
    "fedrcl": Transforms(10.0, 4, "zero"),
    "moon": Transforms(0.0, 4, "reflect", tuple(x / 255.0 for x in (125.3, 123.0, 113.9)),
                       tuple(x / 255.0 for x in (63.0, 62.1, 66.7))),
}


def normalize(images: jax.Array, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    """``uint8 [..., C]`` in 0..255 -> ``float32 (x/255 - mean)/std``."""
    mean = jnp.asarray(mean, jnp.float32)
    std = jnp.asarray(std, jnp.float32)
    return (images.astype(jnp.float32) / 255.0 - mean) / std


def augment_params(key: jax.Array, *, max_degrees: float, crop_padding: int,
                   hflip: bool) -> dict[str, jax.Array]:
    """Draws one sample's augmentation: angle (radians), crop offsets and flip flag."""
    k_rot, k_y, k_x, k_flip = jax.random.split(key, 4)
    angle = jnp.deg2rad(jax.random.uniform(k_rot, (), minval=-max_degrees, maxval=max_degrees))
    oy = jax.random.randint(k_y, (), 0, 2 * crop_padding + 1)
    ox = jax.random.randint(k_x, (), 0, 2 * crop_padding + 1)
    flip = jax.random.bernoulli(k_flip) if hflip else jnp.zeros((), bool)
    return {"angle": angle, "oy": oy, "ox": ox, "flip": flip}


def _reflect(i: jax.Array, n: int) -> jax.Array:
    """Index ``i`` in ``[-n+1, 2n-2]`` reflected into ``[0, n)`` without repeating the edge
    (``numpy.pad(mode="reflect")``, PyTorch's ``F.pad(mode="reflect")``)."""
    i = jnp.abs(i)
    return jnp.where(i > n - 1, 2 * (n - 1) - i, i)


def source_coordinates(params: dict[str, jax.Array], height: int, width: int,
                       crop_padding: int, pad_mode: str = "zero"
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The composed inverse map: ``(rows, cols, valid)``, each ``[H, W]``."""
    y = jnp.arange(height)[:, None]
    x = jnp.arange(width)[None, :]
    xf = jnp.where(params["flip"], width - 1 - x, x)
    u = y + params["oy"] - crop_padding
    v = xf + params["ox"] - crop_padding
    if pad_mode == "reflect":  # the padding holds the image's reflection: every pixel valid
        u, v = _reflect(u, height), _reflect(v, width)
    elif pad_mode != "zero":
        raise ValueError(f"pad_mode={pad_mode!r}: must be 'zero' or 'reflect'")
    in_crop = (u >= 0) & (u < height) & (v >= 0) & (v < width)
    cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
    cos, sin = jnp.cos(params["angle"]), jnp.sin(params["angle"])
    du, dv = u - cy, v - cx
    # Inverse rotation of the output coordinate gives the source coordinate.
    r = jnp.round(cos * du + sin * dv + cy).astype(jnp.int32)
    c = jnp.round(-sin * du + cos * dv + cx).astype(jnp.int32)
    in_image = (r >= 0) & (r < height) & (c >= 0) & (c < width)
    valid = in_crop & in_image
    return jnp.clip(r, 0, height - 1), jnp.clip(c, 0, width - 1), valid


def augment_image(key: jax.Array, image: jax.Array, *, max_degrees: float = 10.0,
                  crop_padding: int = 4, hflip: bool = True, pad_mode: str = "zero") -> jax.Array:
    """One ``uint8 [H, W, C]`` image -> augmented ``uint8 [H, W, C]`` (before normalization)."""
    h, w = image.shape[0], image.shape[1]
    p = augment_params(key, max_degrees=max_degrees, crop_padding=crop_padding, hflip=hflip)
    rows, cols, valid = source_coordinates(p, h, w, crop_padding, pad_mode)
    out = image[rows, cols]
    return jnp.where(valid[..., None], out, jnp.zeros_like(out))


# "auto": the CPU kernel (``csrc/augment.cc``) where it applies; "off": XLA's gather everywhere.
# Read when a program is traced.
KERNEL = "auto"


def resolve() -> str:
    """``"kernel"`` or ``"xla"``: what ``augment_batch`` runs uint8 images through in programs
    traced now (the kernel on a CPU backend where the extension builds, unless ``KERNEL`` is
    ``"off"``)."""
    on_cpu = jax.default_backend() == "cpu"
    return "kernel" if KERNEL == "auto" and on_cpu and onednn.available() else "xla"


def kernel_applies(images: jax.Array, mean, std) -> bool:
    """Whether ``augment_batch`` runs these operands through the CPU kernel: uint8 ``[B, H, W,
    C]`` images, constant normalisation (the kernel takes it as attributes), and ``resolve()``
    says ``"kernel"``."""
    traced = any(isinstance(v, jax.core.Tracer) for v in (mean, std))
    return (images.dtype == jnp.uint8 and images.ndim == 4 and not traced
            and resolve() == "kernel")


def _kernel_batch(keys, images, mean, std, max_degrees, crop_padding, hflip, pad_mode):
    """``augment_batch`` with the map, the gather and the normalisation in the CPU kernel
    (``csrc/augment.cc``); the draws and the rotation's cosine and sine are this module's XLA
    code, and the kernel's float32 arithmetic is what XLA compiles ``source_coordinates`` and
    ``normalize`` into, so that the images are bitwise the same."""
    if pad_mode not in ("zero", "reflect"):
        raise ValueError(f"pad_mode={pad_mode!r}: must be 'zero' or 'reflect'")
    p = jax.vmap(lambda k: augment_params(k, max_degrees=max_degrees, crop_padding=crop_padding,
                                          hflip=hflip))(keys)
    f32, i32 = np.float32, jnp.int32
    # The reciprocals XLA folds ``normalize``'s divisions by constants into.
    return onednn.call(
        "fedjax_augment_images", jax.ShapeDtypeStruct(images.shape, jnp.float32), images,
        jnp.cos(p["angle"]), jnp.sin(p["angle"]), p["oy"].astype(i32), p["ox"].astype(i32),
        p["flip"].astype(i32), vmap_method="broadcast_all",  # under vmap: every client at once
        neg_mean=-np.asarray(mean, f32), inv_std=f32(1) / np.asarray(std, f32),
        inv_255=f32(1) / f32(255), pad=np.int64(crop_padding),
        reflect=np.int64(pad_mode == "reflect"))


def augment_batch(key: jax.Array, images: jax.Array, *, mean: Sequence[float],
                  std: Sequence[float], max_degrees: float = 10.0, crop_padding: int = 4,
                  hflip: bool = True, pad_mode: str = "zero") -> jax.Array:
    """Augments and normalizes a batch; each sample gets its own key.

    Args:
      key: PRNG key for this batch.
      images: ``uint8 [B, H, W, C]``.
      mean, std: per-channel normalization constants in [0, 1] pixel units.
      max_degrees: rotation range; 0 disables rotation.
      crop_padding: zero padding of the random crop; 0 disables cropping.
      hflip: whether to flip horizontally with probability 1/2.
      pad_mode: ``"zero"`` or ``"reflect"``: what the crop's padding holds.

    Returns:
      ``float32 [B, H, W, C]``.
    """
    keys = jax.random.split(key, images.shape[0])
    if kernel_applies(images, mean, std):
        return _kernel_batch(keys, images, mean, std, max_degrees, crop_padding, hflip, pad_mode)
    out = jax.vmap(
        lambda k, im: augment_image(k, im, max_degrees=max_degrees, crop_padding=crop_padding,
                                    hflip=hflip, pad_mode=pad_mode)
    )(keys, images)
    return normalize(out, mean, std)
