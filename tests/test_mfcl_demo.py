"""``fedjax-rcl mfcl`` with its defaults is a demo that finishes in minutes on 2 CPU cores: its
work, counted in steps and XLA's FLOPs, stays within a budget; the paper's scale is its config's."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.config import load_config
from fedjax_rcl.data.sources import spec_only
from fedjax_rcl.experiment import make_partition
from fedjax_rcl.mfcl.run import MFCL_DEFAULTS, mfcl_dataset
from fedjax_rcl.models.mfcl import Autoencoder, ServerModel
from fedjax_rcl.nn import conv

# 3 minutes on 2 cores: the measurement of the old demo (a phase-1 round of 40 padded
# steps of 92 GFLOP in 47 s on a 2-core AVX2 EPYC) is ~78 GFLOP/s; 180 s at that rate, less
# about 40 s of compiling, is ~11 TFLOP. The budget leaves room for the probe and evaluations.
BUDGET_FLOP = 10e12


def _train_step_flops(model, x) -> float:
    """XLA's FLOP count of one forward and backward pass of ``model`` on ``x``, with the
    patch convolutions (XLA's matrix products, which its cost analysis counts)."""
    variables = model.init(jax.random.PRNGKey(0), x, train=True)

    def loss(params, x):
        with conv.implementation("patches"):
            out, _ = model.apply({**variables, "params": params}, x, train=True, mutable=True)
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(out))

    cost = jax.jit(jax.grad(loss)).lower(variables["params"], x).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.slow  # compiles the demo's two models at full size (CI's second step)
def test_the_default_mfcl_run_is_a_demo_within_the_budget():
    cfg = load_config(None, [], defaults=MFCL_DEFAULTS)
    ds = mfcl_dataset(cfg)
    sizes = np.array([len(p) for p in make_partition(cfg, ds.train_labels)])
    # Phase 1: every client runs the largest client's step count (padded steps are computed).
    steps1 = int(np.ceil(sizes.max() / cfg.batch_size)) * cfg.local_epochs * len(sizes)
    hw = ds.train_images.shape[1:3]
    ae = Autoencoder(norm=cfg.norm, group_size=cfg.mfcl.group_size)
    f1 = _train_step_flops(ae, jnp.zeros((2 * cfg.batch_size, *hw, 3)))
    # Phase 2: the server's epochs over one view pair per sample (rho = 1, no dropout).
    m = cfg.mfcl
    pairs = len(ds.train_labels) * m.rho
    batch = min(m.server_batch_size, pairs)
    server = ServerModel(width=m.server_width, projection_dim=m.projection_dim)
    f2 = _train_step_flops(server, jnp.zeros((2 * batch, hw[0] // 2, hw[1] // 2, 64)))
    total = cfg.rounds * steps1 * f1 + m.server_epochs * (pairs // batch) * f2
    assert total <= BUDGET_FLOP, (cfg.rounds, steps1, f1, m.server_epochs, pairs // batch, f2)
    # Still MFCL: the paper's client module on the digits at 32x32, every client every round.
    assert hw == (32, 32) and cfg.participation == 1.0 and cfg.norm == "twin"


def test_the_paper_config_keeps_the_papers_scale():
    paper = Path(__file__).resolve().parents[1] / "experiments" / "mfcl" / "paper_cifar10.yaml"
    with spec_only():  # CIFAR-10 need not be here
        cfg = load_config(str(paper), [], defaults=MFCL_DEFAULTS)
    m = cfg.mfcl
    assert (cfg.rounds, m.train_samples, m.server_width, m.server_epochs,
            m.server_batch_size) == (15, 0, 64, 150, 512)
