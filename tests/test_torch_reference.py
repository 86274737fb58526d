"""The benchmark's PyTorch reference (``fedjax_rcl.bench.torch_reference``) does our work exactly.

A speed comparison is only fair if both sides compute the same thing. On the same weights (our
Flax params copied into the torch models) and the same inputs, these tests check that the torch
models' logits and every feature level match ours, that the FedRCL and MOON objectives match,
that one full local step (clip, weight decay, SGD) lands on the same parameters, and that the
torch augmentation, given the parameters our augmentation drew, produces the same pixels.

PyTorch is installed only for the benchmark; without it this module is skipped.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is a benchmark-only dependency (pip install -e '.[bench]')"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fedjax_rcl.algorithms import Batch, LocalContext  # noqa: E402
from fedjax_rcl.algorithms.fedavg import cross_entropy  # noqa: E402
from fedjax_rcl.algorithms.fedrcl import fedrcl  # noqa: E402
from fedjax_rcl.algorithms.moon import moon  # noqa: E402
from fedjax_rcl.bench import flops  # noqa: E402
from fedjax_rcl.bench import torch_reference as tr  # noqa: E402
from fedjax_rcl.data.augment import augment_image, augment_params, normalize  # noqa: E402
from fedjax_rcl.data.device import ClientData  # noqa: E402
from fedjax_rcl.engine.client import (  # noqa: E402
    LocalTraining,
    client_optimizer,
    make_local_update,
)
from fedjax_rcl.losses import moon_loss, rcl_loss_terms  # noqa: E402
from fedjax_rcl.models import get_model, model_fns  # noqa: E402

MEAN, STD = tr.CIFAR10_MEAN, tr.CIFAR10_STD


@pytest.fixture(autouse=True, scope="module")
def _threads():
    # One thread: pytest runs with -n 2 workers, and a second PyTorch thread per worker would
    # oversubscribe the cores (OpenMP barriers then wait for descheduled threads).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _t(x):
    return torch.from_numpy(np.array(x))


def _nchw(images):
    return _t(images).permute(0, 3, 1, 2)  # NCHW in channels_last memory, as the models run


@functools.cache
def _pair(model_name, *, projection_dim=None, seeds=(0,), batch=8):
    """Our model and params (one set per seed) plus a random batch of normalized images; cached,
    as compiling the initialiser is most of a test's time."""
    fns = model_fns(get_model(model_name, num_classes=10, projection_dim=projection_dim))
    x = np.random.default_rng(0).normal(size=(batch, 32, 32, 3)).astype(np.float32)
    params = [fns.init(jax.random.key(s), x[:1])[0] for s in seeds]
    return fns, params, x


def _torch_model(model_name, params, projection_dim=None):
    model = tr.build_model(model_name, num_classes=10, projection_dim=projection_dim)
    return tr.load_flax_params(model, params)


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - b.detach().numpy())))


def _labels(batch, seed=0):
    # Few classes so anchors have classmates, plus one singleton class.
    labels = np.random.default_rng(seed).integers(0, 3, batch).astype(np.int32)
    labels[0] = 9
    return labels


@pytest.fixture(scope="module", params=["cnn", "resnet18"])
def case(request):
    """One model (with MOON's head) in both frameworks on the same weights: three param sets
    (local, global, previous) through one compiled apply (ResNet-18 compiles in seconds)."""
    name = request.param
    fns, params, x = _pair(name, projection_dim=256, seeds=(0, 1, 2),
                           batch=16 if name == "cnn" else 8)
    apply = jax.jit(lambda p, x: fns.apply(p, {}, x, train=True)[0])
    outs = [apply(p, jnp.asarray(x)) for p in params]
    models = [_torch_model(name, p, 256) for p in params]
    return {"name": name, "fns": fns, "params": params, "x": x, "outs": outs,
            "models": models, "xt": _nchw(x), "labels": _labels(x.shape[0])}


def test_forward_matches_ours(case):
    out, model = case["outs"][0], case["models"][0]
    with torch.no_grad():
        got = model(case["xt"])
    assert len(got.features) == len(out.features) == (4 if case["name"] == "cnn" else 5)
    diffs = {"logits": _max_diff(out.logits, got.logits),
             "embedding": _max_diff(out.embedding, got.embedding),
             "projection": _max_diff(out.projection, got.projection)}
    diffs.update({f"level{i}": _max_diff(a, b)
                  for i, (a, b) in enumerate(zip(out.features, got.features, strict=True))})
    print(case["name"], "max |torch - ours|:", diffs)
    assert max(diffs.values()) < 1e-4, diffs


def test_parameter_count_matches_ours(case):
    ours = sum(np.size(p) for p in jax.tree.leaves(case["params"][0]))
    theirs = sum(p.numel() for p in case["models"][0].parameters())
    assert ours == theirs
    if case["name"] == "resnet18":  # the reference's count, plus MOON's 512-512-256 head
        assert ours == 11_173_962 + (512 * 512 + 512) + (512 * 256 + 256)


def test_fedrcl_objective_matches_ours(case):
    out, labels, x = case["outs"][0], case["labels"], case["x"]
    ours, ours_terms = fedrcl().objective(out, case["params"][0], Batch(jnp.asarray(x), labels),
                                          None)
    with torch.no_grad():
        got, got_terms = tr.Objective("fedrcl")(case["models"][0](case["xt"]),
                                                _t(labels).long())
    rel = {k: abs(float(got_terms[k]) / float(ours_terms[k]) - 1) for k in ours_terms}
    rel["total"] = abs(float(got) / float(ours) - 1)
    print(case["name"], "fedrcl relative differences:", rel)
    assert max(rel.values()) < 1e-5, rel


def test_moon_objective_matches_ours(case):
    (out, _, _), labels, x = case["outs"], case["labels"], case["x"]
    local, glob, prev = case["params"]
    if case["name"] == "cnn":  # our MOON objective as the engine calls it
        objective = jax.jit(lambda out, local, glob, prev, x, y: moon(case["fns"]).objective(
            out, local, Batch(x, y), LocalContext(glob, {}, (prev, {}), jax.random.key(0))))
        ours, ours_terms = objective(out, local, glob, prev, jnp.asarray(x), jnp.asarray(labels))
    else:  # the same formula on the fixture's projections (spares a ResNet-18 compile)
        ce = cross_entropy(out.logits, labels)
        con = moon_loss(out.projection, case["outs"][1].projection, case["outs"][2].projection)
        ours, ours_terms = ce + con, {"ce": ce, "moon": con}
    with torch.no_grad():
        z_global, z_prev = (m(case["xt"], features=False).projection
                            for m in case["models"][1:])
        got, got_terms = tr.Objective("moon")(case["models"][0](case["xt"], features=False),
                                              _t(labels).long(), z_global=z_global, z_prev=z_prev)
    rel = {k: abs(float(got_terms[k]) / float(ours_terms[k]) - 1) for k in ours_terms}
    rel["total"] = abs(float(got) / float(ours) - 1)
    print(case["name"], "moon relative differences:", rel)
    assert max(rel.values()) < 1e-5, rel


def test_rcl_terms_match_ours_on_clustered_features():
    # Tight clusters put classmates above the 0.7 threshold (penalty gate open) next to spread-out
    # classes (gate shut), a singleton class (no classmate) and a one-class batch (no negative).
    rng = np.random.default_rng(1)
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4], np.int32)
    centres = rng.normal(size=(5, 32))
    spread = np.array([0.05, 3.0, 0.2, 1.0, 0.5])[labels][:, None]
    levels = [(centres[labels] + spread * rng.normal(size=(12, 32))).astype(np.float32),
              rng.normal(size=(12, 7, 7, 16)).astype(np.float32)]
    for feats, labs in ((levels, labels), ([levels[0]], np.zeros(12, np.int32))):
        ours = [rcl_loss_terms(f, labs) for f in feats]
        pooled = [_t(f).mean(dim=(1, 2)) if f.ndim == 4 else _t(f) for f in feats]
        scl, pen = tr.rcl_terms(pooled, _t(labs).long())
        assert float(scl) == pytest.approx(float(np.mean([o[0] for o in ours])), rel=1e-5)
        assert float(pen) == pytest.approx(float(np.mean([o[1] for o in ours])), rel=1e-5)
    sim = levels[0] / np.linalg.norm(levels[0], axis=1, keepdims=True)
    assert (sim[:3] @ sim[:3].T).min() > 0.7  # the gate really opens for class 0


@pytest.mark.parametrize("algorithm", ["fedrcl", "moon"])
def test_one_local_step_matches_ours(algorithm):
    """One step of our compiled client update (no augmentation, one batch = the whole client, so
    our shuffle only reorders the batch, which no loss term depends on) and one torch step from
    the same weights land on the same parameters: same gradient, clipping, decay and lr."""
    # The model of the ``case`` fixture (cached); FedRCL leaves the MOON head to weight decay.
    fns, (params, _, prev), _ = _pair("cnn", projection_dim=256, seeds=(0, 1, 2), batch=16)
    rng = np.random.default_rng(0)
    batch = 16
    images = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    labels = _labels(40)
    indices = np.arange(3, 3 + batch, dtype=np.int32)
    settings = LocalTraining(batch_size=batch, local_epochs=1, steps_per_epoch=1,
                             uniform_sizes=True, lr_fn=lambda r, e: 0.1 * 0.998 ** (r + e),
                             mean=MEAN, std=STD, augment=False)
    # A large lr and a small clip norm make clipping, decay and lr all visible in the result.
    settings = LocalTraining(**{**settings.__dict__,
                                "lr_fn": lambda r, e: 0.5 * 0.998 ** (r + e)})
    opt = client_optimizer(0.5, clip_norm=1.0, weight_decay=1e-3, momentum=0.0)
    alg = moon(fns) if algorithm == "moon" else fedrcl()
    update = jax.jit(make_local_update(fns, alg, opt, settings))
    data = ClientData(images=jnp.asarray(images), labels=jnp.asarray(labels),
                      client_indices=jnp.asarray(indices[None]), client_sizes=jnp.asarray([batch]))
    state = (prev, {}) if algorithm == "moon" else ()
    ours, *_ = update(params, {}, state, jax.random.key(0), data.client_indices[0],
                      jnp.int32(batch), jnp.int32(3), data)

    fed = tr.TorchFederation("cnn", algorithm, images=images, labels=labels,
                             client_indices=[indices], num_classes=10, batch=batch, epochs=1,
                             lr=0.5, clip_norm=1.0, augment=False,
                             flax_params={k: v for k, v in params.items()
                                          if algorithm == "moon" or k != "projection"})
    if algorithm == "moon":
        fed.prev_state[0] = list(_torch_model("cnn", prev, 256).parameters())
    fed.local_update(0, 3)
    expected = tr.flax_to_torch_state(fed.local_model, ours)
    moved = tr.flax_to_torch_state(fed.local_model, params)
    worst = 0.0
    for name, value in fed.local_model.state_dict().items():
        step = float((expected[name] - moved[name]).abs().max())
        assert step > 0, name  # every tensor moved
        worst = max(worst, float((value - expected[name]).abs().max()) / step)
    print(algorithm, "max |torch - ours| / max |step| over tensors:", worst)
    assert worst < 1e-4
    # Clipping was active, and lr and decay are as stated: our step is -lr (clip(g) + wd w) with
    # ||clip(g)|| = 1 exactly when the raw gradient norm exceeds the clip norm.
    lr = 0.5 * 0.998**3
    clipped = [(-(expected[k] - moved[k]) / lr - 1e-3 * moved[k]) for k in expected]
    assert float(torch.sqrt(sum((c**2).sum() for c in clipped))) == pytest.approx(1.0, rel=1e-3)


def test_augmentation_is_ours_exactly():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (300, 32, 32, 3), dtype=np.uint8)
    idx = rng.integers(0, 300, 256)
    keys = jax.random.split(jax.random.key(7), idx.size)
    draw = jax.vmap(lambda k: augment_params(k, max_degrees=10.0, crop_padding=4, hflip=True))
    p = draw(keys)
    ours = jax.vmap(augment_image)(keys, jnp.asarray(train[idx]))  # draws the same p inside
    params = tr.AugmentParams(_t(p["angle"]), _t(p["oy"]).long(), _t(p["ox"]).long(),
                              _t(p["flip"]))
    got = tr.gather_augmented(_t(train), _t(idx).long(), params)
    np.testing.assert_array_equal(got.numpy(), np.asarray(ours))
    assert 0.2 < float(p["flip"].mean()) < 0.8 and float(jnp.abs(p["angle"]).max()) > 0.1
    assert (got.numpy() == 0).mean() > (train == 0).mean()  # zero fill happened
    # Normalization is the same formula, (x/255 - mean)/std in float32, but XLA:CPU's float32
    # division is not correctly rounded (eager and jitted JAX even differ from each other), so
    # the floats agree to a few ulp, not bit for bit; PyTorch's is IEEE division.
    mean, std = torch.tensor(MEAN), torch.tensor(STD)
    ours_normalized = np.asarray(jax.jit(lambda a: normalize(a, MEAN, STD))(ours))
    np.testing.assert_allclose(tr.normalize(got, mean, std).permute(0, 2, 3, 1).numpy(),
                               ours_normalized, rtol=1e-6, atol=1e-6)


def test_flop_counts_of_the_torch_models_are_the_benchmarks():
    """``fedjax_rcl.bench.flops`` counts our models' traced programs; the PyTorch models, counted
    layer by layer, have the same FLOPs (the GFLOP/s of both sides use that one count)."""
    for name, shape in (("cnn", {}), ("resnet18", {}), ("resnet10", {"width": 16})):
        model = tr.build_model("resnet18" if name == "resnet10" else name, projection_dim=256,
                               **shape, **({"stage_sizes": (1, 1, 1, 1)}
                                           if name == "resnet10" else {}))
        total = []

        def hook(mod, inp, out, total=total):
            fan_in = mod.weight[0].numel()  # in/groups * kh * kw, or in_features
            total.append(2 * out.numel() * fan_in)

        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d | torch.nn.Linear):
                m.register_forward_hook(hook)
        with torch.no_grad():
            model(torch.zeros(1, 3, 32, 32))
        assert sum(total) == flops.forward_flops(name, projection_dim=256, **shape)


def test_round_and_eval_timers_run():
    data = tr._random_cifar(400, 120)
    r = tr.round_seconds("cnn", "moon", clients=2, steps=2, batch=20, epochs=2, data=data,
                         repeats=2, warmup_steps=1, threads=1)
    assert r["round_s"] > 0 and r["client_step_ms"] > 0 and len(r["losses"]) == 2
    assert len(r["minor_faults_all"]) == 2 and all(f >= 0 for f in r["minor_faults_all"])
    assert all(np.isfinite(r["losses"]))
    e = tr.eval_seconds("cnn", data=data, batch=50, repeats=1, threads=1)
    assert e["images"] == 120 and 0 <= e["accuracy"] <= 1 and np.isfinite(e["loss"])
    with pytest.raises(ValueError, match="multiple of epochs"):
        tr.round_seconds("cnn", "fedavg", steps=3, epochs=2, data=data)
