"""MFCL end to end: phase 1 through the engine, phase 2 on the clients' representations, the
linear probe, the command line, and resume in either phase to an identical result."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_rcl.algorithms.mfcl import reconstruction_bce
from fedjax_rcl.cli import main
from fedjax_rcl.config import load_config
from fedjax_rcl.experiment import build
from fedjax_rcl.mfcl import phase2
from fedjax_rcl.mfcl.encoder import client_encoder, client_statistics, represent_all
from fedjax_rcl.mfcl.probe import lbfgs_probe
from fedjax_rcl.mfcl.run import (
    MFCL_DEFAULTS,
    _probe,
    mfcl_dataset,
    resume_mfcl,
    run_mfcl,
)
from fedjax_rcl.models.mfcl import ServerModel

# A small run: 96 digits, 3 clients, 2 rounds of phase 1, 3 server epochs, a probe penalty
# chosen from 2 values (the default grid's 8 fits per probe took half of each run's time).
TINY = ["dataset=digits", "mfcl.train_samples=96", "num_clients=3", "alpha=0.5", "rounds=2",
        "batch_size=8", "checkpoint_every=1", "mfcl.server_epochs=3", "mfcl.server_width=4",
        "mfcl.server_batch_size=32", "mfcl.projection_dim=16", "mfcl.probe_epochs=3",
        "mfcl.probe_l2_grid=[0.01,1.0]"]


def test_reconstruction_bce_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 5, 5, 3)) * 3
    x = rng.uniform(size=(4, 5, 5, 3))
    p = 1 / (1 + np.exp(-logits))
    want = np.mean(-(x * np.log(p) + (1 - x) * np.log(1 - p)))
    got = reconstruction_bce(jnp.asarray(logits, jnp.float32), jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_sample_pool_and_dropout():
    parts = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    pool = phase2.sample_pool(parts, np.array([0, 2]), rho=2)
    assert pool.tolist() == [[0, 0], [1, 0], [2, 0], [4, 0], [5, 0],
                             [0, 1], [1, 1], [2, 1], [4, 1], [5, 1]]
    key = jax.random.PRNGKey(0)
    assert phase2.kept_clients(key, 50, 0.0).tolist() == list(range(50))
    kept = phase2.kept_clients(key, 2000, 0.3)
    assert 0.65 < len(kept) / 2000 < 0.75  # each client drops out with probability delta
    assert len(phase2.kept_clients(key, 3, 0.999999)) == 1  # never nobody


def _rows(run):
    """metrics.jsonl without its wall times."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted tiny run (twin normalization)."""
    run = tmp_path_factory.mktemp("mfcl") / "run"
    cfg = load_config(None, [*TINY, f"run_dir={run}"], defaults=MFCL_DEFAULTS)
    lines = []
    result = run_mfcl(cfg, log=lines.append)
    return run, result, lines


def test_the_default_probe_grid_is_eight_penalties_from_1e6_to_10():
    cfg = load_config(None, [], defaults=MFCL_DEFAULTS)
    assert cfg.mfcl.probe_l2_grid == [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]


@pytest.mark.slow
def test_run_writes_both_phases_probe_and_resources(finished):
    run, result, lines = finished
    rows = _rows(run)
    assert [(r["phase"], r.get("round", r.get("epoch"))) for r in rows[:-1]] == [
        (1, 1), (1, 2), (2, 1), (2, 2), (2, 3)]
    assert rows[-1]["phase"] == "probe"
    probe = rows[-1]
    for prefix in ("linear_probe_", "control_random_server_", "control_pixels_"):
        assert 0.0 <= probe[f"{prefix}accuracy"] <= 1.0
        assert 0.0 <= probe[f"{prefix}train_accuracy"] <= 1.0
        assert probe[f"{prefix}converged"] and probe[f"{prefix}grad_max_abs"] < 1e-5
        assert probe[f"{prefix}l2"] in probe[f"{prefix}l2_grid"]
        assert probe[f"{prefix}l2_grid"] == [0.01, 1.0]  # the configured grid
        assert len(probe[f"{prefix}heldout_accuracy"]) == 2  # one hold-out fit per penalty
    assert any(line.startswith("linear probe accuracy") and "controls: random server network"
               in line and "raw pixels" in line for line in lines)
    assert rows[-1] == {k: v for k, v in result.items() if k != "run_dir"}
    assert rows[1]["train_bce"] < rows[0]["train_bce"] or rows[1]["test_bce"] < rows[0]["test_bce"]
    resources = json.loads((run / "resources.json").read_text())
    assert resources  # the figures of MFCL's Eqs. 4-6
    assert "norm: twin" in (run / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["phase2", "phase1"])
def test_resume_in_either_phase_is_identical(finished, tmp_path, cut):
    """A copy of the finished run cut back to phase 2 epoch 1 (or phase 1 round 1), as an
    interrupt would leave it, resumes to exactly the same metrics and probe."""
    run, _, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ck = copy / "checkpoints"
    if cut == "phase2":
        for step in ("2", "3"):
            shutil.rmtree(ck / "phase2" / step)
    else:
        shutil.rmtree(ck / "phase2")
        shutil.rmtree(ck / "phase1" / "2")
    cfg = load_config(str(copy / "config.yaml"), [f"run_dir={copy}"])
    resume_mfcl(copy, cfg, log=lambda s: None)
    assert _rows(copy) == _rows(run)


@pytest.mark.slow
def test_command_line_runs_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["mfcl", *TINY, "mfcl.server_epochs=1", "norm=group", "mfcl.probe=adam",
            "mfcl.probe_epochs=1", "mfcl.probe_controls=false", f"run_dir={run}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "linear probe accuracy" in out and "phase 2 epoch 1/1" in out
    assert "controls" not in out
    probe = _rows(run)[-1]
    assert sorted(probe) == ["linear_probe_accuracy", "linear_probe_loss",  # Adam's
                             "linear_probe_train_accuracy", "phase"]
    # resume of a finished MFCL run dispatches to MFCL and recomputes the same probe.
    before = _rows(run)
    assert main(["resume", str(run), "--no-progress"]) == 0
    assert _rows(run) == before


def test_bad_input_and_train_refuses_mfcl(tmp_path, capsys):
    assert main(["mfcl", "mfcl.rho=0", "mfcl.delta=1.5", "norm=layer",
                 "mfcl.bn_statistics=mean", "mfcl.probe=sgd", "mfcl.probe_l2_grid=[]",
                 "mfcl.probe_holdout=1.0", "mfcl.probe_tol=0", f"run_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "mfcl.rho=0" in err and "mfcl.delta=1.5" in err and "norm" in err
    lines = err.splitlines()
    # One line each, naming the field, the value and what is allowed.
    for want in ("mfcl.bn_statistics='mean': allowed: running, batch, client",
                 "mfcl.probe='sgd': allowed: lbfgs, adam",
                 "mfcl.probe_l2_grid=[]: must be a non-empty list of finite numbers > 0",
                 "mfcl.probe_holdout=1.0: must be in [0, 1)",
                 "mfcl.probe_tol=0"):
        assert sum(want in line for line in lines) == 1, (want, err)
    assert main(["mfcl", "mfcl.tn_variance=joint", f"run_dir={tmp_path / 'x'}"]) == 2
    assert "mfcl.tn_variance='joint': allowed: pooled, views" in capsys.readouterr().err
    assert main(["mfcl", "norm=group", "mfcl.tn_variance=views",
                 f"run_dir={tmp_path / 'x'}"]) == 2
    assert "tn_variance='views' applies to a Twin Normalization client module" in \
        capsys.readouterr().err
    for mode in ("batch", "client"):
        assert main(["mfcl", "norm=twin", f"mfcl.bn_statistics={mode}",
                     f"run_dir={tmp_path / 'x'}"]) == 2
        assert f"bn_statistics='{mode}' applies to a BatchNorm client module" in \
            capsys.readouterr().err
    assert main(["train", "algorithm=mfcl", "model=mfcl_autoencoder", "norm=twin",
                 f"run_dir={tmp_path / 'y'}"]) == 2
    assert "fedjax-rcl mfcl" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_batch_statistics_representations_are_each_clients_own_batches():
    """mfcl.bn_statistics=batch: a BatchNorm client module normalises each client's batches
    of batch_size pairs by their own statistics, never mixing clients; the default (running
    statistics) gives each sample's representation on its own."""
    cfg = load_config(None, [*TINY, "norm=batch", "mfcl.bn_statistics=batch"],
                      defaults=MFCL_DEFAULTS)
    exp = build(cfg, mfcl_dataset(cfg))
    encode = client_encoder(exp)(exp.state.params, exp.state.model_state)
    kept = np.arange(cfg.num_clients)
    pool = phase2.sample_pool(exp.parts, kept, rho=2)
    sizes = [len(exp.parts[k]) for k in kept]
    assert min(sizes) > 0 and max(sizes) > cfg.batch_size  # several batches per client
    reps = np.asarray(represent_all(exp, encode, pool, sizes * 2))
    p = len(pool)
    assert reps.shape[0] == 2 * p
    # The expected batches, from the clients' parts: each client's draws, batch_size at a time.
    represent = jax.jit(phase2.make_representations(encode, paired=True, blur=False))
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(cfg.seed)
    start = 0
    for size in sizes * 2:
        for s in range(start, start + size, cfg.batch_size):
            e = min(s + cfg.batch_size, start + size)
            rows = pool[s:e]
            want = np.asarray(represent(key, images[rows[:, 0]], jnp.asarray(rows)))
            np.testing.assert_allclose(reps[s:e], want[:e - s], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(reps[p + s:p + e], want[e - s:], rtol=1e-4, atol=1e-4)
        start += size
    # Running statistics: another result, in which a sample does not depend on its batch.
    cfg_running = load_config(None, [*TINY, "norm=batch"], defaults=MFCL_DEFAULTS)
    exp.cfg = cfg_running
    running = client_encoder(exp)(exp.state.params, exp.state.model_state)
    alone = np.asarray(represent_all(exp, running, pool, sizes * 2))
    assert np.abs(alone - reps).max() > 1e-2
    one = np.asarray(jax.jit(phase2.make_representations(running, paired=True, blur=False))(
        key, images[pool[:1, 0]], jnp.asarray(pool[:1])))
    np.testing.assert_allclose(alone[[0, p]], one, rtol=1e-4, atol=1e-4)


def _client_module_reference(params, x, stats=None):
    """MFCL's BatchNorm client module in float64 NumPy: (3x3 convolution, padding 1 -> BN ->
    ReLU) x 2, 2x2 max-pool. Each BN normalises with ``stats[i] = (mean, var)``, or (None)
    with the mean and biased variance of its input over all of ``x``. Returns the output and
    the statistics used."""
    x = np.asarray(x, np.float64)
    used = []
    for i in (1, 2):
        k = np.asarray(params[f"conv{i}"]["kernel"], np.float64)
        xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        h, w = x.shape[1:3]
        y = sum(np.tensordot(xp[:, a:a + h, b:b + w], k[a, b], axes=1)
                for a in range(3) for b in range(3))
        mean, var = (y.mean((0, 1, 2)), y.var((0, 1, 2))) if stats is None else stats[i - 1]
        bn = jax.tree.map(np.asarray, params[f"norm{i}"]["bn"])
        x = np.maximum((y - mean) / np.sqrt(var + 1e-5) * bn["scale"] + bn["bias"], 0.0)
        used.append((mean, var))
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max((2, 4)), used


@pytest.mark.slow
def test_client_statistics_normalise_each_clients_representations_with_its_own():
    """mfcl.bn_statistics=client: a client's representations are BatchNorm's evaluation form
    with the statistics of all the views it sends (both draws of rho=2, across chunks), layer
    by layer -- a NumPy client module normalising with its own data's statistics; the same
    image gets another representation from another client."""
    cfg = load_config(None, [*TINY, "norm=batch", "mfcl.bn_statistics=client", "num_clients=2",
                             "mfcl.train_samples=32"], defaults=MFCL_DEFAULTS)
    exp = build(cfg, mfcl_dataset(cfg))
    encode = client_encoder(exp)(exp.state.params, exp.state.model_state)
    params = exp.state.params["client"]
    kept = np.arange(cfg.num_clients)
    pool = phase2.sample_pool(exp.parts, kept, rho=2)
    sizes = [len(exp.parts[k]) for k in kept]
    assert min(sizes) > 8  # several chunks of 8 pairs per client and draw
    reps = np.asarray(represent_all(exp, encode, pool, sizes * 2, chunk=8, owners=[0, 1] * 2))
    p = len(pool)
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(cfg.seed)

    def views(rows):  # the augmented view pairs (no encoder), in padded chunks of 8 pairs
        firsts, seconds = [], []
        for s in range(0, len(rows), 8):
            b = rows[s:s + 8]
            r = np.concatenate([b, np.repeat(b[-1:], 8 - len(b), 0)])
            v = np.asarray(encode.compiled("views", False)(key, images[r[:, 0]],
                                                           jnp.asarray(r)))
            firsts.append(v[:len(b)])
            seconds.append(v[8:8 + len(b)])
        return np.concatenate(firsts + seconds)

    starts = np.cumsum([0, *sizes * 2])
    own = []
    for c in kept:
        at = np.concatenate([np.arange(starts[c], starts[c + 1]),
                             np.arange(starts[c + 2], starts[c + 3])])  # both draws
        rows = pool[at]
        x = views(rows)
        want, stats = _client_module_reference(params, x)
        np.testing.assert_allclose(reps[at], want[:len(at)], rtol=1e-4, atol=2e-4)
        np.testing.assert_allclose(reps[p + at], want[len(at):], rtol=1e-4, atol=2e-4)
        got = client_statistics(exp, encode, rows, chunk=8)
        for (mean, var), name in zip(stats, ("norm1", "norm2"), strict=True):
            np.testing.assert_allclose(got[name]["bn"]["mean"], mean, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got[name]["bn"]["var"], var, rtol=1e-4, atol=1e-5)
        own.append((got, stats))
    # The same images (client 0's first 8 view pairs) with the statistics of client 0 and of
    # client 1: two representations, each the NumPy one.
    x = views(pool[:8])
    out = [np.asarray(encode.compiled("encode")(jnp.asarray(x), own[c][0])) for c in (0, 1)]
    for c in (0, 1):
        want, _ = _client_module_reference(params, x, own[c][1])
        np.testing.assert_allclose(out[c], want, rtol=1e-4, atol=2e-4)
    assert np.abs(out[0] - out[1]).max() > 1e-2
    # The running statistics (the default) give yet another representation.
    assert np.abs(np.asarray(encode(jnp.asarray(x), True)) - out[0]).max() > 1e-2


@pytest.mark.slow  # L-BFGS probes fitted twice (CI's second step)
def test_probe_controls_are_the_same_probe_on_a_random_server_and_on_pixels():
    """The probe record holds the probe of the server's features and, with the same probe
    and held-out split, the controls: a server network initialised from the control's key
    (here the probed server is that same network, so both probes agree) and the raw pixels."""
    cfg = load_config(None, TINY, defaults=MFCL_DEFAULTS)
    exp = build(cfg, mfcl_dataset(cfg))
    encode = client_encoder(exp)(exp.state.params, exp.state.model_state)
    model = ServerModel(width=4, projection_dim=16)
    root = jax.random.PRNGKey(cfg.seed)
    state = phase2.init_server_training(model, jax.random.fold_in(root, 16), (16, 16, 64),
                                        optax.identity())
    out = _probe(exp, encode, model, state, chunk=128)
    trained = {k[len("linear_probe_"):]: v for k, v in out.items()
               if k.startswith("linear_probe_")}
    assert trained["l2_grid"] == [0.01, 1.0] and trained["converged"]
    assert trained == {k[len("control_random_server_"):]: v for k, v in out.items()
                       if k.startswith("control_random_server_")}
    ds = exp.dataset
    n, nt = len(ds.train_images), len(ds.test_images)
    pixels = lbfgs_probe(ds.train_images.reshape(n, -1), ds.train_labels,
                         ds.test_images.reshape(nt, -1), ds.test_labels,
                         num_classes=ds.num_classes, l2_grid=[0.01, 1.0], holdout=0.1,
                         max_iter=1000, tol=1e-5, key=jax.random.fold_in(root, 15),
                         scale=1 / 255, prefix="control_pixels_")
    assert {k: out[k] for k in pixels} == pixels
    assert set(out) == set(pixels) | {f"linear_probe_{k}" for k in trained} | {
        f"control_random_server_{k}" for k in trained}


@pytest.mark.slow  # L-BFGS probes fitted twice (CI's second step)
def test_probe_projection_reads_the_projection_heads_output():
    """With mfcl.probe_projection the record also holds the same probe on the projection
    head's output (MFCL's linear evaluation reads it), computed here directly from the server
    model in its evaluation form on every image at once, for the trained server and the
    random control; the embedding's probe is the one the option leaves out."""
    overrides = [*TINY, "mfcl.probe_l2_grid=[0.01]"]
    cfg = load_config(None, [*overrides, "mfcl.probe_projection=true"],
                      defaults=MFCL_DEFAULTS)
    exp = build(cfg, mfcl_dataset(cfg))
    encode = client_encoder(exp)(exp.state.params, exp.state.model_state)
    model = ServerModel(width=4, projection_dim=16)
    root = jax.random.PRNGKey(cfg.seed)
    state = phase2.init_server_training(model, jax.random.fold_in(root, 3), (16, 16, 64),
                                        optax.identity())
    out = _probe(exp, encode, model, state, chunk=128)
    ds = exp.dataset
    variables = {"params": state.params, "batch_stats": state.batch_stats}

    def projection(images):
        x = jnp.asarray(images, jnp.float32) / 255.0
        return np.asarray(model.apply(variables, encode(x, False), train=False)[1])

    z_train, z_test = projection(ds.train_images), projection(ds.test_images)
    assert z_train.shape == (len(ds.train_images), 16)
    want = lbfgs_probe(z_train, ds.train_labels, z_test, ds.test_labels,
                       num_classes=ds.num_classes, l2_grid=[0.01], holdout=0.1,
                       max_iter=1000, tol=1e-5, key=jax.random.fold_in(root, 15),
                       prefix="projection_probe_")
    # The run's features come in padded chunks of 128 (another batch shape): equal up to
    # float reassociation, so the probe agrees to within one test image.
    assert out["projection_probe_converged"]
    assert out["projection_probe_accuracy"] == pytest.approx(
        want["projection_probe_accuracy"], abs=1.5 / len(ds.test_images))
    assert out["projection_probe_loss"] == pytest.approx(want["projection_probe_loss"],
                                                         rel=1e-3)
    # The random control's projection is another network's: another probe.
    assert {k[len("control_random_server_projection_"):] for k in out
            if k.startswith("control_random_server_projection_")} == {
        k[len("projection_probe_"):] for k in want}
    assert (out["control_random_server_projection_loss"]
            != pytest.approx(out["projection_probe_loss"], rel=1e-3))
    # Without the option: the same embedding probe and no projection keys.
    plain = load_config(None, overrides, defaults=MFCL_DEFAULTS)
    base = _probe(build(plain, mfcl_dataset(plain)), encode, model, state, chunk=128)
    assert set(out) - set(base) == {k for k in out if "projection_" in k}
    assert base["linear_probe_loss"] == pytest.approx(out["linear_probe_loss"], rel=1e-6)

def test_tn_variance_reaches_the_client_module():
    """mfcl.tn_variance=views builds a Twin Normalization client module with the paper's
    listing's variance: the same parameters give other representations of view pairs whose
    views differ, and the same for single images (where both variances are the one view's)."""
    exps = {v: build(c := load_config(None, [*TINY, "norm=twin", f"mfcl.tn_variance={v}"],
                                      defaults=MFCL_DEFAULTS), mfcl_dataset(c))
            for v in ("pooled", "views")}
    assert exps["views"].model.module.tn_variance == "views"
    params, state = exps["pooled"].state.params, exps["pooled"].state.model_state
    rng = np.random.default_rng(0)
    a = rng.uniform(size=(4, 8, 8, 3)).astype(np.float32)
    # Second views shifted far in brightness: their first-layer group means move off the
    # first views' (by the shift times the kernels' sums), which only the pooled variance sees.
    pairs = jnp.asarray(np.concatenate([a, a + 5.0]))
    out = {v: np.asarray(client_encoder(e)(params, state)(pairs, True)) for v, e in exps.items()}
    assert np.max(np.abs(out["views"] - out["pooled"])) > 1e-3  # 0.014 here; rounding ~1e-6
    single = {v: np.asarray(client_encoder(e)(params, state)(pairs, False))
              for v, e in exps.items()}
    np.testing.assert_allclose(single["views"], single["pooled"], rtol=1e-6, atol=1e-6)
