"""The networks of MFCL: a small client module with a decoder, and the server's ResNet.

Paper: Motamedi & Kim, "Modular Federated Contrastive Learning with Twin Normalization for
Resource-limited Clients", TMLR (MFCL). A CIFAR ResNet-18 is cut after its first two
convolutions: resource-limited clients train only that cut, the *client module*, as the encoder
of a small autoencoder; the server trains the rest of the network contrastively (SimCLR) on the
representations the clients send, with BatchNorm, since the server sees large batches.

- ``ClientModule``: ResNet-18's first two 3x3 convolutions (64 channels, stride 1, padding 1, no
  bias), each followed by a normalisation (``norm``: twin, group or batch) and ReLU, then a 2x2
  max-pool: ``[N, H, W, 3] -> [N, H/2, W/2, 64]``.
- ``Decoder``: its mirror, a stride-2 transposed 3x3 convolution (2x upsampling) + norm + ReLU,
  a 3x3 convolution + norm + ReLU, and a 3x3 convolution to per-pixel logits:
  ``[N, H/2, W/2, 64] -> [N, H, W, 3]``; the reconstruction loss applies the sigmoid (BCE).
- ``Autoencoder``: the two, as a ``ModelOutput`` (registered as ``mfcl_autoencoder``).
- ``ServerNetwork``: the rest of ResNet-18 with BatchNorm: four stages of two BasicBlocks
  (widths w, 2w, 4w, 8w, strides 1, 2, 2, 2), ReLU, global average pool:
  ``[N, H/2, W/2, 64] -> [N, 8w]``.
- ``MfclProjectionHead``: SimCLR's head, (Dense -> BN -> ReLU) x 2, Dense -> BN.
- ``ServerModel``: ``ServerNetwork`` + ``MfclProjectionHead``, returning both outputs.

Normalisation in the client module and decoder: MFCL specifies GroupNorm and Twin Norm by their
*group size* (channels per group); ``group_size=32`` gives 2 groups of the 64 channels, the
setting of MFCL's comparison of normalisations. Twin Norm (``fedjax_rcl.nn.twin_norm``) in
training needs batches of view pairs, rows i and i+K being two augmented views of sample i
(building them is the caller's job; an odd batch raises ``ValueError``); in evaluation each
image is normalised alone.

Spatial sizes must be even: the max-pool floors an odd size, which the decoder's exact 2x
upsampling cannot give back (``Autoencoder`` refuses odd sizes).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import stages
from fedjax_rcl.models.resnet import BasicBlock, resnet_stages
from fedjax_rcl.nn.conv import torch_conv, torch_kernel_init
from fedjax_rcl.nn.norm import Norm
from fedjax_rcl.nn.pool import max_pool


def _num_groups(channels: int, group_size: int) -> int:
    """``Norm``'s group count for MFCL's channels-per-group setting."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if channels % group_size:
        raise ValueError(f"group_size={group_size} must divide the {channels} channels")
    return channels // group_size


class ClientModule(nn.Module):
    """ResNet-18's first two convolutions, each + norm + ReLU, then a 2x2 max-pool.

    Attributes:
      norm: ``"twin"`` (MFCL's), ``"group"`` or ``"batch"``.
      group_size: channels per group for twin and group normalisation (32: 2 groups of 64).
      channels: output channels of both convolutions (ResNet-18's 64).
      tn_variance: Twin Normalization's variance (``fedjax_rcl.nn.twin_norm``): ``"pooled"``
        (MFCL's Eq. 2) or ``"views"`` (its code listing).
    """

    norm: str = "twin"
    group_size: int = 32
    channels: int = 64
    tn_variance: str = "pooled"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        """``[N, H, W, C] -> [N, H/2, W/2, channels]`` (post-ReLU, pooled)."""
        groups = _num_groups(self.channels, self.group_size)
        cin = x.shape[-1]
        for i in (1, 2):
            x = torch_conv(cin, self.channels, 3, padding=1, use_bias=False,
                           name=f"conv{i}")(x)
            x = nn.relu(Norm(self.norm, groups, self.tn_variance, name=f"norm{i}")(
                x, train=train))
            cin = self.channels
        return max_pool(x, 2)


class Decoder(nn.Module):
    """The client module's mirror: 2x upsampling back to the image, as pixel logits.

    The hidden width is the representation's channel count.

    Attributes:
      norm: as ``ClientModule.norm``.
      group_size: as ``ClientModule.group_size``.
      out_channels: channels of the reconstructed image.
      tn_variance: as ``ClientModule.tn_variance``.
    """

    norm: str = "twin"
    group_size: int = 32
    out_channels: int = 3
    tn_variance: str = "pooled"

    @nn.compact
    def __call__(self, r: jax.Array, *, train: bool) -> jax.Array:
        """``[N, h, w, C] -> [N, 2h, 2w, out_channels]`` logits (no sigmoid)."""
        c = r.shape[-1]
        groups = _num_groups(c, self.group_size)
        # PyTorch's ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=1) is a 3x3
        # convolution over the input with zeros inserted between rows and columns (2h - 1 rows),
        # padded 1 before and 2 after: exactly 2h output rows. Written that way -- zeros
        # inserted up to 2h rows, then a padding-1 convolution -- it runs on the project's fast
        # CPU convolutions (nn.conv) instead of XLA's native transposed convolution, whose
        # gradients are slow on CPU (NOTES.md). The kernel is the transposed one's, flipped:
        # the same family of functions and the same init.
        n, h, w, _ = r.shape
        up = jnp.zeros((n, 2 * h, 2 * w, c), r.dtype).at[:, ::2, ::2, :].set(r)
        y = torch_conv(c, c, 3, padding=1, use_bias=False, name="upconv")(up)
        y = nn.relu(Norm(self.norm, groups, self.tn_variance, name="norm1")(y, train=train))
        y = torch_conv(c, c, 3, padding=1, use_bias=False, name="conv")(y)
        y = nn.relu(Norm(self.norm, groups, self.tn_variance, name="norm2")(y, train=train))
        # No normalisation after the last layer, so it keeps its bias: the pixel logits.
        return torch_conv(c, self.out_channels, 3, padding=1, name="out_conv")(y)


class Autoencoder(nn.Module):
    """``ClientModule`` as encoder + ``Decoder``: what an MFCL client trains.

    Attributes:
      norm: as ``ClientModule.norm``.
      group_size: as ``ClientModule.group_size``.
      tn_variance: as ``ClientModule.tn_variance``.
    """

    norm: str = "twin"
    group_size: int = 32
    tn_variance: str = "pooled"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True) -> ModelOutput:
        """Images ``[N, H, W, C]`` (H, W even) to a ``ModelOutput``:

        - ``logits``: the per-pixel reconstruction logits ``[N, H, W, C]`` -- for this model
          *not* class logits; the reconstruction loss is BCE of their sigmoid against ``x``;
        - ``features``: one level, the client representation (post-ReLU, pooled) spatially
          averaged, ``[N, 64]``;
        - ``embedding``: that same pooled representation; ``projection``: None.
        """
        h, w = x.shape[1:3]
        if h % 2 or w % 2:
            raise ValueError(f"mfcl_autoencoder needs even image sizes (the 2x2 max-pool drops an "
                             f"odd last row/column the decoder cannot restore); got {h}x{w}")
        r = ClientModule(self.norm, self.group_size, tn_variance=self.tn_variance,
                         name="client")(x, train=train)
        logits = Decoder(self.norm, self.group_size, x.shape[-1], tn_variance=self.tn_variance,
                         name="decoder")(r, train=train)
        pooled = r.mean(axis=(1, 2))
        return ModelOutput(logits=logits, features=(pooled,), embedding=pooled, projection=None)


class ServerNetwork(nn.Module):
    """ResNet-18 after the client module, with BatchNorm: ``[N, h, w, C] -> [N, 8 * width]``.

    The statistics live in the ``"batch_stats"`` collection (``apply(..., mutable=
    ["batch_stats"])`` in training).

    Attributes:
      width: first-stage channels (stages ``w, 2w, 4w, 8w``; 64: ResNet-18's). With a width
        other than the representation's 64 channels the first block projects its shortcut.
    """

    width: int = 64

    @nn.compact
    def __call__(self, r: jax.Array, *, train: bool) -> jax.Array:
        # BasicBlock returns its sum before the ReLU. The stages' levels go unused.
        x = stages(r, resnet_stages((2, 2, 2, 2), self.width),
                   functools.partial(BasicBlock, norm="batch"), train=train, levels=[],
                   blocks=[], activation=nn.relu)
        return x.mean(axis=(1, 2))


class MfclProjectionHead(nn.Module):
    """SimCLR's projection head as MFCL uses it: (Dense -> BN -> ReLU) x 2, Dense -> BN.

    The Dense layers have no bias: the BatchNorm after each adds its own shift.

    Attributes:
      hidden: width of the two hidden layers; None: the embedding's size.
      features: output size (128, SimCLR's).
    """

    hidden: int | None = None
    features: int = 128

    @nn.compact
    def __call__(self, h: jax.Array, *, train: bool) -> jax.Array:
        hidden = self.hidden or h.shape[-1]
        for i, (size, last) in enumerate(((hidden, False), (hidden, False),
                                          (self.features, True)), 1):
            h = nn.Dense(size, use_bias=False, kernel_init=torch_kernel_init,
                         name=f"dense{i}")(h)
            h = Norm("batch", name=f"bn{i}")(h, train=train)
            if not last:
                h = nn.relu(h)
        return h


class ServerModel(nn.Module):
    """``ServerNetwork`` + ``MfclProjectionHead``: ``r -> (embedding, projection)``.

    Attributes:
      width: as ``ServerNetwork.width``.
      projection_dim: the head's output size.
    """

    width: int = 64
    projection_dim: int = 128

    @nn.compact
    def __call__(self, r: jax.Array, *, train: bool) -> tuple[jax.Array, jax.Array]:
        embedding = ServerNetwork(self.width, name="network")(r, train=train)
        z = MfclProjectionHead(features=self.projection_dim, name="head")(embedding,
                                                                          train=train)
        return embedding, z


def build(num_classes, *, norm="twin", projection_dim=None, group_size=32,
          tn_variance="pooled"):
    """The builder of ``model=mfcl_autoencoder`` (registered by ``fedjax_rcl.models``;
    ``group_size`` and ``tn_variance`` from the ``mfcl`` section);
    an autoencoder has no classes or projection head."""
    del num_classes, projection_dim
    return Autoencoder(norm=norm, group_size=group_size, tn_variance=tn_variance)
