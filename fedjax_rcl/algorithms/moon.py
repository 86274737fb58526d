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

import jax

from fedjax_rcl.algorithms.base import ClientAlgorithm
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.losses import moon_loss
from fedjax_rcl.models.base import ModelFns


def moon(model: ModelFns, *, mu: float = 1.0, temperature: float = 0.5) -> ClientAlgorithm:
    """MOON's local objective (mu: 5 on CIFAR-10 in MOON, 1 in FedRCL's tables)."""

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
        name="moon",
        objective=objective,
        init_client_state=lambda params, model_state: (params, model_state),
        update_client_state=lambda state, params, model_state: (params, model_state),
    )
