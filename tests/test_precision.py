"""Mixed precision: bf16 and fp16 rounds against fp32, the fp16 loss scaler against PyTorch's
GradScaler rule (NumPy), skipped steps, and exact resume in each precision."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.algorithms import ClientAlgorithm, cross_entropy
from fedjax_rcl.cli import main
from fedjax_rcl.config import Config
from fedjax_rcl.engine.client import GradScaler, client_optimizer, make_local_update
from fedjax_rcl.experiment import build
from fedjax_rcl.models.base import with_precision


def _cfg(**kw):
    base = dict(dataset="toy", model="cnn", num_clients=6, participation=0.5, partition="iid",
                local_epochs=1, batch_size=16, algorithm="fedrcl", conv_impl="patches")
    return Config(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("precision,rtol", [("bf16", 0.25), ("fp16", 0.1)])
def test_a_round_in_low_precision_is_close_to_fp32(toy, precision, rtol):
    """One round's update of the global model (3 clients, 3 local steps each, FedAvg) in bf16
    / fp16 against fp32, relative to the update's size: bf16 keeps 8 bits of mantissa and
    fp16 11, so the update moves by a few percent (about 8 % and 3 % here; the tolerances
    leave room for other CPUs' rounding); a zero difference would mean the casts did nothing."""
    ref = build(_cfg(algorithm="fedavg"), toy)
    low = build(_cfg(algorithm="fedavg", precision=precision), toy)
    start = jax.tree.leaves(ref.state.params)
    after32 = jax.tree.leaves(jax.jit(ref.run_round)(ref.state, ref.data)[0].params)
    after, metrics = jax.jit(low.run_round)(low.state, low.data)
    low_leaves = jax.tree.leaves(after.params)
    assert all(b.dtype == jnp.float32 for b in low_leaves)  # master weights stay float32
    d32 = np.concatenate([np.ravel(np.asarray(a - s, np.float64))
                          for s, a in zip(start, after32, strict=True)])
    dlow = np.concatenate([np.ravel(np.asarray(b - s, np.float64))
                           for s, b in zip(start, low_leaves, strict=True)])
    error = np.linalg.norm(dlow - d32) / np.linalg.norm(d32)
    assert 1e-4 < error < rtol, error  # computed in the low precision, and close
    if precision == "fp16":
        assert float(metrics["amp_skipped"]) == 0.0  # a small loss: no step overflowed


def _torch_grad_scaler(finite_flags):
    """PyTorch's GradScaler.update() rule, written out: the scale before each step."""
    scale, tracker, scales = 2.0 ** 16, 0, []
    for finite in finite_flags:
        scales.append(scale)
        if not finite:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 2000:
                scale, tracker = scale * 2.0, 0
    return scales


def test_grad_scaler_follows_pytorchs_rule_with_planted_overflows():
    rng = np.random.default_rng(0)
    flags = np.ones(4500, bool)
    flags[[0, 1, 7, 2100, 4300]] = False  # overflows: at the start, alone, after a growth
    flags[3000:3003] = rng.random(3) < 2  # three more in a row
    flags[3000:3003] = False

    def run(flags):
        def step(scaler, finite):
            return scaler.update(finite), scaler.scale

        return jax.lax.scan(step, GradScaler.fresh(), jnp.asarray(flags))[1]

    got = np.asarray(jax.jit(run)(flags))
    want = np.asarray(_torch_grad_scaler(flags), np.float32)
    np.testing.assert_array_equal(got, want)
    assert want.max() > 2.0 ** 14  # it grew back after the backoffs


def _local_update(exp, factor):
    """A float16 local update of an objective ``factor * cross-entropy``."""

    def objective(out, params, batch, ctx):
        ce = cross_entropy(out.logits, batch.labels)
        return factor * ce, {"ce": ce}

    settings = dataclasses.replace(exp.settings, precision="fp16")
    opt = client_optimizer(0.1, clip_norm=10.0, weight_decay=0.0, momentum=0.0)
    return jax.jit(make_local_update(with_precision(exp.model, "fp16"),
                                     ClientAlgorithm(objective), opt, settings))


@pytest.mark.parametrize("factor", [pytest.param(1e30, marks=pytest.mark.slow), 100.0],
                         ids=["every-step-overflows", "some-overflow"])
def test_overflowing_fp16_steps_are_skipped(toy, factor):
    exp = build(_cfg(algorithm="fedavg", local_epochs=4), toy)
    s = exp.state
    update = _local_update(exp, factor)
    params, _, _, metrics = update(s.params, s.model_state, (), jax.random.PRNGKey(1),
                                   exp.data.client_indices[0], exp.data.client_sizes[0],
                                   s.round, exp.data)
    skipped = float(metrics["amp_skipped"])
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(s.params), strict=True)]
    if factor == 1e30:  # the scale can never shrink enough: every step skipped, nothing moved
        assert skipped == 1.0 and max(moved) == 0.0
    else:  # the scale halves until the gradients fit float16, then training goes on
        assert 0.0 < skipped < 1.0 and max(moved) > 0.0
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_is_exact_in_low_precision(tmp_path, precision, capsys):
    args = ["algorithm=fedrcl", "num_clients=6", "participation=0.5", "local_epochs=1",
            "partition=iid", f"precision={precision}", "checkpoint_every=1", "--no-progress"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    # Two rounds, the second one resumed: the fewest that show an exact resume.
    assert main(["train", *args, "rounds=2", f"run_dir={whole}"]) == 0
    assert main(["train", *args, "rounds=1", f"run_dir={part}"]) == 0
    assert main(["resume", str(part), "rounds=2", "--no-progress"]) == 0
    rows = [[{k: v for k, v in json.loads(x).items() if not k.endswith("_s")}
             for x in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (whole, part)]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    assert f"precision: {precision}" in (whole / "config.yaml").read_text()
