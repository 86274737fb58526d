"""MOON's client: cross-entropy plus the model-contrastive loss, with per-client state.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (arXiv 2103.16257).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\mu\\, \\mathcal L_{MOON}(z_w, z_{w_g}, z_{w_{prev}})

``z`` is the 256-d output of a 2-layer MLP projection head on the model's embedding; ``z`` of
the round's global model and of this client's previous local model are computed without
gradient (evaluation mode). Each client keeps its last local model as state between the rounds
in which it takes part; a client that never trained uses the initial global model. The engine
gathers the sampled clients' rows of the ``[num_clients, ...]`` state table before local
training and scatters the trained models back after it.
"""

from __future__ import annotations

import dataclasses

import jax

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses import moon_loss
from fedjax_rcl.models.base import ModelFns
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class MoonConfig:
    """``algorithm=moon``.

    Attributes:
      mu: the weight of the model-contrastive term (5 for CIFAR-10 in MOON, 1 in FedRCL's
        tables).
      temperature: its temperature.
      projection_dim: the output size of the projection head the term compares.
    """

    mu: float = 1.0
    temperature: float = 0.5
    projection_dim: int = 256

    def check(self, ctx) -> list[str]:
        p = []
        if not (finite(self.mu) and self.mu >= 0):
            p.append(f"mu={self.mu!r}: must be >= 0")
        if not (finite(self.temperature) and self.temperature > 0):
            p.append(f"temperature={self.temperature!r}: must be > 0")
        if self.projection_dim < 1:
            p.append(f"projection_dim={self.projection_dim!r}: must be >= 1")
        return p


def moon(model: ModelFns, settings: MoonConfig | None = None) -> ClientAlgorithm:
    """MOON's local objective with the section's ``mu`` and ``temperature`` (None: the
    defaults; mu: 5 on CIFAR-10 in MOON, 1 in FedRCL's tables)."""
    s = settings or MoonConfig()
    mu, temperature = s.mu, s.temperature

    def projection(params, model_state, images):
        out, _ = model.apply(params, model_state, images, train=False)
        return jax.lax.stop_gradient(out.projection)

    def objective(out, params, batch, ctx):
        del params
        if out.projection is None:
            raise ValueError("moon needs a model with a projection head (projection_dim)")
        ce = cross_entropy(out.logits, batch.labels)
        z_global = projection(ctx.global_params, ctx.global_model_state, batch.images)
        prev_params, prev_model_state = ctx.client_state
        z_prev = projection(prev_params, prev_model_state, batch.images)
        con = moon_loss(out.projection, z_global, z_prev, temperature=temperature)
        return ce + mu * con, {"ce": ce, "moon": con}

    return ClientAlgorithm(
        objective,
        init_client_state=lambda params, model_state: (params, model_state),
        update_client_state=lambda state, params, model_state, ctx: (params, model_state),
    )


registry.register_algorithm(
    "moon", lambda s, model: moon(model, s),
    config=MoonConfig, model_kwargs=lambda s: {"projection_dim": s.projection_dim})
