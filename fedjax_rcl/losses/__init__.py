"""Pure loss functions: supervised contrastive (SCL/RCL), NT-Xent, MOON and the baselines'
(FedLC, FedNTD, FedDecorr, FitNet, FedProc).

Each takes features ``[B, ...]`` (pooled to ``[B, C]`` over the middle axes), L2-normalises them
and works on cosine similarities; all are ``jit``/``vmap``-safe and return a scalar.
"""

from fedjax_rcl.losses.baselines import (
    class_prototypes,
    decorrelation_loss,
    feature_hint_loss,
    logit_calibrated_cross_entropy,
    not_true_distillation,
    prototype_contrastive_loss,
    prototypes_from_sums,
)
from fedjax_rcl.losses.contrastive import (
    l2_normalize,
    multilevel_rcl_loss,
    nt_xent_loss,
    pool_features,
    rcl_loss,
    rcl_loss_terms,
    supcon_loss,
)
from fedjax_rcl.losses.moon import moon_loss

__all__ = [
    "class_prototypes",
    "decorrelation_loss",
    "feature_hint_loss",
    "logit_calibrated_cross_entropy",
    "not_true_distillation",
    "prototype_contrastive_loss",
    "prototypes_from_sums",
    "l2_normalize",
    "moon_loss",
    "multilevel_rcl_loss",
    "nt_xent_loss",
    "pool_features",
    "rcl_loss",
    "rcl_loss_terms",
    "supcon_loss",
]
