"""MFCL's phase 1: clients train the client module by reconstruction; and MFCL's settings.

Motamedi & Kim, "Modular Federated Contrastive Learning with Twin Normalization for
Resource-limited Clients" (MFCL), TMLR. Resource-limited clients train only a small client
module (ResNet-18's first two 3x3 convolutions with a mirrored decoder) by reconstruction; the
server then trains the rest of the network on the clients' representations with a contrastive
loss (``fedjax_rcl.mfcl``). This module is phase 1's local objective, binary cross-entropy
between the reconstruction and the input pixels in [0, 1]:

.. math::
    \\ell(w) = \\frac{1}{2K\\,HWC} \\sum_{i, p}
      -\\big[x_{i,p} \\log \\sigma(\\hat x_{i,p})
      + (1 - x_{i,p}) \\log (1 - \\sigma(\\hat x_{i,p}))\\big]

over the 2K rows of a batch of K view pairs (Twin Normalization needs the pairs), and
the ``mfcl`` config section (phase 2, the probe, the client module's group size). The engine
runs phase 1 as any client algorithm (clients vmapped, local steps scanned, one program per
round); ``algorithm=mfcl`` is therefore refused by ``train`` and run by ``fedjax-rcl mfcl``.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from fedjax_rcl import registry
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.fields import setting
from fedjax_rcl.validation import CheckContext, finite, one_of


def reconstruction_bce(logits: jax.Array, images: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of ``sigmoid(logits)`` against pixels ``images`` in [0, 1]
    (any shape; numerically stable form, optax's ``sigmoid_binary_cross_entropy``)."""
    return optax.sigmoid_binary_cross_entropy(logits, images).mean()


# The default penalties of the L-BFGS probe, 1e-6 to 10 in decades.
PROBE_L2_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
PROBES = ("lbfgs", "adam")
BN_STATISTICS = ("running", "batch", "client")
TN_VARIANCES = ("pooled", "views")


@dataclasses.dataclass
class MfclConfig:
    """MFCL's settings besides the core keys (which set phase 1: ``rounds``, ``local_epochs``,
    ``batch_size`` = K view pairs, ``lr`` of Adam, ``num_clients`` = M, ``alpha`` = xi,
    ``norm`` = bn | gn | tn of the client module).

    Defaults follow MFCL / SimCLR where they say (LARS, cosine schedule from lr 1.0, NT-Xent
    temperature 0.5, projection to 128) and are CPU-sized where they are a budget (server
    epochs, width).

    Attributes:
      group_size: channels per group of GN / TN in the client module and its decoder (2
        groups of 64 channels by default).
      rho: augmented view pairs each client sends per sample in phase 2.
      delta: the probability that a client drops out of phase 2.
      server_epochs: phase 2's passes over the representations the server received.
      server_batch_size: view pairs per server step.
      server_lr: LARS's peak learning rate (cosine decay to 0 over phase 2).
      server_weight_decay: LARS's weight decay.
      server_width: the server ResNet-18's first-stage channels (w, 2w, 4w, 8w).
      projection_dim: the output size of the server's projection head.
      temperature: the NT-Xent temperature.
      blur: Gaussian blur among the augmentations (MFCL uses it for Tiny-ImageNet).
      probe: the linear probe on the frozen features (``fedjax_rcl.mfcl.probe``):
        ``lbfgs``, L2-penalised multinomial logistic regression solved to convergence by
        full-batch L-BFGS, its penalty chosen on held-out training rows; ``adam``, no penalty,
        Adam for ``probe_epochs`` epochs (not converged).
      probe_l2_grid: the penalties lambda (of ``lambda / 2 * ||W||^2``) the ``lbfgs`` probe
        chooses from by held-out accuracy; one value: no selection.
      probe_holdout: the fraction of the training set held out to choose lambda (seeded by
        ``seed``); the chosen probe is refitted on the whole training set.
      probe_max_iter: the ``lbfgs`` probe's iteration limit per fit.
      probe_tol: the ``lbfgs`` probe stops when the largest entry of the objective's gradient
        is below this.
      probe_controls: also probe, in the same run and with the same probe, a randomly
        initialised server network on the same client-module outputs and the raw pixels:
        the baselines the trained features must beat.
      probe_projection: also probe the projection head's output (evaluation form), the
        features MFCL's linear evaluation reads (its dense layer sits on top of the
        projection layers, its Table 11), besides the embedding before the head (SimCLR's
        choice, the default figure); recorded as ``projection_probe_*`` and, with
        ``probe_controls``, ``control_random_server_projection_*``.
      probe_epochs: epochs of Adam of the ``adam`` probe.
      probe_lr: the ``adam`` probe's learning rate.
      probe_batch_size: the ``adam`` probe's batch size.
      train_samples: train on a random subset of this many training samples (seeded by
        ``seed``); 0: all.
      bn_statistics: which statistics a BatchNorm client module (``norm=batch``) normalises
        the phase-2 representations with. ``running``: the running statistics of the
        federated model (averaged by the server with the weights), BatchNorm's evaluation
        form, each sample on its own (as TN and GN are batch-independent). This is the form
        MFCL describes: it does not name the statistics, but writes a client's
        representations as a function of the final federated parameters alone,
        ``z = f_theta_T(x)`` (its Algorithm 1), which a BatchNorm module is in its evaluation
        form with the running statistics among those parameters (as FedAvg over a Keras
        model's weights averages them; MFCL's implementation is TensorFlow). ``batch``: as in
        training, each client normalising batches of ``batch_size`` of its own view pairs by
        their statistics (MFCL's "contrastive client representation mini-batches" read as
        batches in BatchNorm's training form). ``client``: each client's own population
        statistics, the mean and variance of each BatchNorm input over all the views it
        sends, layer by layer with the final phase-1 weights, as a client recomputing
        BatchNorm's statistics on its own data before sending would: free of the batch
        composition of ``batch`` and of the other clients' data in ``running``.
      tn_variance: the variance of a Twin Normalization client module (``norm=twin``).
        ``pooled``: MFCL's Eq. 2, over all values of both views of a sample about their joint
        mean. ``views``: MFCL's code listing (its Table 18), the average of the two views' own
        variances (the same mean); smaller than the pooled one by a quarter of the squared
        difference of the views' means (``fedjax_rcl.nn.twin_norm``).
    """

    group_size: int = 32
    rho: int = 1
    delta: float = 0.0
    server_epochs: int = 20
    server_batch_size: int = 256
    server_lr: float = 1.0
    server_weight_decay: float = 1e-6
    server_width: int = 64
    projection_dim: int = 128
    temperature: float = 0.5
    blur: bool = False
    probe: str = setting("lbfgs", digest_neutral=True)
    probe_l2_grid: list[float] = setting(default_factory=lambda: list(PROBE_L2_GRID),
                                         digest_neutral=True)
    probe_holdout: float = setting(0.1, digest_neutral=True)
    probe_max_iter: int = setting(1000, digest_neutral=True)
    probe_tol: float = setting(1e-5, digest_neutral=True)
    probe_controls: bool = setting(True, digest_neutral=True)
    probe_projection: bool = setting(False, digest_neutral=True)
    probe_epochs: int = 30
    probe_lr: float = 1e-3
    probe_batch_size: int = 256
    train_samples: int = 0
    bn_statistics: str = setting("running", digest_neutral=True)
    tn_variance: str = setting("pooled", digest_neutral=True)

    def check(self, ctx: CheckContext) -> list[str]:
        p = []
        if self.group_size < 1 or 64 % self.group_size:
            p.append(f"group_size={self.group_size!r}: must divide the client module's 64 "
                     "channels (1, 2, 4, 8, 16, 32 or 64)")
        if self.rho < 1:
            p.append(f"rho={self.rho!r}: must be >= 1")
        if not (finite(self.delta) and 0 <= self.delta < 1):
            p.append(f"delta={self.delta!r}: must be in [0, 1)")
        for name in ("server_epochs", "server_batch_size", "projection_dim", "probe_epochs",
                     "probe_batch_size", "probe_max_iter"):
            if getattr(self, name) < 1:
                p.append(f"{name}={getattr(self, name)!r}: must be >= 1")
        if self.server_width < 2 or self.server_width % 2:
            p.append(f"server_width={self.server_width!r}: must be an even number >= 2")
        for name in ("server_lr", "temperature", "probe_lr", "probe_tol"):
            v = getattr(self, name)
            if not (finite(v) and v > 0):
                p.append(f"{name}={v!r}: must be a finite number > 0")
        if not (finite(self.server_weight_decay) and self.server_weight_decay >= 0):
            p.append(f"server_weight_decay={self.server_weight_decay!r}: must be >= 0")
        if self.train_samples < 0:
            p.append(f"train_samples={self.train_samples!r}: must be >= 0 (0: all)")
        one_of(p, "probe", self.probe, PROBES)
        grid = list(self.probe_l2_grid)
        if not grid or not all(finite(v) and v > 0 for v in grid):
            p.append(f"probe_l2_grid={grid!r}: must be a non-empty list of finite numbers > 0")
        if not (finite(self.probe_holdout) and 0 <= self.probe_holdout < 1):
            p.append(f"probe_holdout={self.probe_holdout!r}: must be in [0, 1)")
        one_of(p, "bn_statistics", self.bn_statistics, BN_STATISTICS)
        if (self.bn_statistics in BN_STATISTICS and self.bn_statistics != "running"
                and ctx.algorithm == "mfcl" and ctx.norm != "batch"):
            p.append(f"bn_statistics={self.bn_statistics!r} applies to a BatchNorm client "
                     f"module; norm={ctx.norm!r} has no batch statistics (set norm=batch or "
                     "leave it out)")
        one_of(p, "tn_variance", self.tn_variance, TN_VARIANCES)
        if (self.tn_variance in TN_VARIANCES and self.tn_variance != "pooled"
                and ctx.algorithm == "mfcl" and ctx.norm != "twin"):
            p.append(f"tn_variance={self.tn_variance!r} applies to a Twin Normalization client "
                     f"module; norm={ctx.norm!r} is not one (set norm=twin or leave it out)")
        if ctx.algorithm == "mfcl" and ctx.model != "mfcl_autoencoder":
            p.append(f"model={ctx.model!r}: MFCL's phase 1 trains model=mfcl_autoencoder")
        return p


def adam_client_optimizer(learning_rate: float, *, clip_norm: float | None,
                          weight_decay: float) -> optax.GradientTransformation:
    """MFCL's client optimizer, Adam (optax defaults b1 0.9, b2 0.999, eps 1e-8), after the
    configured clipping and weight decay (both off in MFCL's defaults); learning rate
    injectable per step."""

    def make(learning_rate):
        parts = []
        if clip_norm:
            parts.append(optax.clip_by_global_norm(clip_norm))
        if weight_decay:
            parts.append(optax.add_decayed_weights(weight_decay))
        return optax.chain(*parts, optax.adam(learning_rate))

    return optax.inject_hyperparams(make)(learning_rate=learning_rate)


def mfcl_reconstruction() -> ClientAlgorithm:
    """Phase 1's local objective: reconstruct both views of each sample (pixels in [0, 1]),
    trained with Adam."""

    def objective(out, params, batch, ctx):
        del params, ctx
        bce = reconstruction_bce(out.logits, batch.images)
        return bce, {"bce": bce}

    return ClientAlgorithm(objective, optimizer=adam_client_optimizer)


registry.register_algorithm(
    "mfcl", lambda settings, model: mfcl_reconstruction(), config=MfclConfig, num_views=2,
    model_kwargs=lambda s: {"group_size": s.group_size, "tn_variance": s.tn_variance},
    command="mfcl")

__all__ = ["BN_STATISTICS", "PROBES", "PROBE_L2_GRID", "TN_VARIANCES", "MfclConfig",
           "adam_client_optimizer", "mfcl_reconstruction", "reconstruction_bce"]
