"""``fedjax-rcl mfcl``: MFCL end to end — phase 1 (federated reconstruction), phase 2 (the
server's contrastive training on the clients' representations), the linear probe, and the
resource figures — in one run directory that resumes in either phase.

A program over the shared run loop (``fedjax_rcl.loop``), as ``training`` is: phase 1 is a stage
of the engine's compiled rounds (``experiment.build`` with ``algorithm=mfcl``,
``model=mfcl_autoencoder``: clients side by side, local steps scanned); phase 2 a stage of
server epochs, one compiled program each (``mfcl.phase2``); then the probe (``mfcl.probe``).
The run directory holds ``config.yaml``, ``metrics.jsonl`` (a line per phase-1 evaluation
``{"phase": 1, "round", ...}``, per server epoch ``{"phase": 2, "epoch", ...}`` and the
probe's, with its controls, ``{"phase": "probe", "linear_probe_accuracy", ...,
"control_random_server_accuracy", ..., "control_pixels_accuracy", ...}``),
``checkpoints/phase1`` and ``checkpoints/phase2`` (Orbax) and ``resources.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_rcl import interrupts, provenance
from fedjax_rcl.algorithms.mfcl import reconstruction_bce
from fedjax_rcl.checkpoint import Checkpointer
from fedjax_rcl.config import CoreConfig, config_digest, to_yaml
from fedjax_rcl.data import ImageDataset, load_dataset
from fedjax_rcl.data.augment import normalize
from fedjax_rcl.engine.sharding import to_host
from fedjax_rcl.experiment import Experiment, build
from fedjax_rcl.loop import (
    Sink,
    Stage,
    TrainingError,
    locked_run,
    new_run,
    resume_config,
    run_stage,
    save_checkpoint,
)
from fedjax_rcl.metrics.resources import format_resources, mfcl_resources
from fedjax_rcl.mfcl import phase2
from fedjax_rcl.mfcl.probe import adam_probe, lbfgs_probe
from fedjax_rcl.models.mfcl import ClientModule, ServerModel
from fedjax_rcl.rundir import atomic_write_text
from fedjax_rcl.validation import ConfigError

# What ``fedjax-rcl mfcl`` starts from before the YAML file and the overrides: MFCL's phase-1
# setting (Adam 1e-3, batches of 64 view pairs, 10 clients all taking part, Dirichlet split
# of MOON's kind; Twin Normalization, the paper's 64-channel client module) at a demo's size
# that finishes in minutes on 2 CPU cores. A phase-1 step of that client module on 64 pairs of
# 32x32 images costs 92 GFLOP (forward and backward; XLA's count), so the paper's 15 rounds
# over all 1,438 digits (40 padded client steps a round) were 55 TFLOP and its full-width
# server's 20 epochs 43 TFLOP more (about 15 minutes on a 2-core AVX2 EPYC). The demo keeps the
# method and makes the run smaller: 600 training images, 3 rounds (20 padded steps each:
# 5.5 TFLOP), a server of width 16 for 10 epochs of 3 steps (0.8 TFLOP). The paper's scale is
# experiments/mfcl/paper_cifar10.yaml, which sets each of these keys itself.
MFCL_DEFAULTS = {
    "algorithm": "mfcl", "model": "mfcl_autoencoder", "norm": "twin", "num_clients": 10,
    "participation": 1.0, "partition": "dirichlet", "alpha": 0.01, "balanced": False,
    "rounds": 3, "local_epochs": 1, "batch_size": 64, "lr": 1e-3, "lr_decay": 1.0,
    "momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.0, "aggregation": "size",
    "checkpoint_every": 5,
    "mfcl": {"train_samples": 600, "server_width": 16, "server_epochs": 10,
             "server_batch_size": 200},
}
# Streams of the run's root key besides phase 2's (``mfcl.phase2``): the probe's held-out split
# (and the Adam probe's batch order), and the random server network of the control probe.
_PROBE_STREAM, _CONTROL_STREAM = 15, 16


def mfcl_dataset(cfg: CoreConfig, dataset: ImageDataset | None = None) -> ImageDataset:
    """The data MFCL trains on: pixels in [0, 1] (phase 1 reconstructs them; the
    normalisation is the client module's), three channels (the colour augmentations of phase
    2 need them; grey images are replicated), and a random subset of ``mfcl.train_samples``
    training samples when set."""
    ds = dataset or load_dataset(cfg.dataset, data_dir=cfg.data_dir)
    train_x, train_y, test_x = ds.train_images, ds.train_labels, ds.test_images
    n = cfg.mfcl.train_samples
    if n and n < len(train_y):
        keep = np.sort(np.random.default_rng(cfg.seed).permutation(len(train_y))[:n])
        train_x, train_y = train_x[keep], train_y[keep]
    if train_x.shape[-1] == 1:
        train_x, test_x = (np.repeat(x, 3, axis=-1) for x in (train_x, test_x))
    c = train_x.shape[-1]
    return dataclasses.replace(ds, train_images=train_x, train_labels=train_y,
                               test_images=test_x, mean=(0.0,) * c, std=(1.0,) * c)


def _reconstruction_eval(exp: Experiment):
    """``(params, model_state, test) -> {"loss"}``: mean BCE of the test reconstructions."""

    def evaluate(params, model_state, test):
        def one(batch):
            images, _, mask = batch
            x = normalize(images, exp.dataset.mean, exp.dataset.std)
            out, _ = exp.model.apply(params, model_state, x, train=False)
            per = jax.vmap(reconstruction_bce)(out.logits, x)
            return jnp.sum(jnp.where(mask, per, 0.0))

        total = jax.lax.map(one, (test.images, test.labels, test.mask))
        return {"loss": jnp.sum(total) / jnp.sum(test.mask)}

    return jax.jit(evaluate)


def _batch_dependent(cfg: CoreConfig) -> bool:
    """Whether the client module's phase-2 output depends on its batch (BatchNorm computing
    with batch statistics, ``mfcl.bn_statistics=batch``)."""
    return cfg.norm == "batch" and cfg.mfcl.bn_statistics == "batch"


def _client_statistics_mode(cfg: CoreConfig) -> bool:
    """Whether each client normalises its phase-2 representations with its own BatchNorm
    statistics (``mfcl.bn_statistics=client``)."""
    return cfg.norm == "batch" and cfg.mfcl.bn_statistics == "client"


class ClientEncoder:
    """The frozen client module of a phase-1 model: ``encode(x, paired, batch_stats=None)``.

    ``paired`` (a client computing its view pairs) makes Twin Normalization take rows i and
    i + K together and, with ``mfcl.bn_statistics=batch``, BatchNorm use the statistics of the
    batch ``x``. ``batch_stats`` (``mfcl.bn_statistics=client``) replaces the model's running
    statistics with a client's own (``client_statistics``); BatchNorm then computes in its
    evaluation form with those.

    Which statistics MFCL's BatchNorm client module uses for the representations is not
    stated in the paper: it writes them ``z = f_theta_T(x)``, a function of the final
    federated parameters alone, which is the evaluation form with the averaged running
    statistics (``running``, the default) when those statistics count among the parameters,
    as they do for a Keras model averaged by FedAvg (MFCL's implementation is TensorFlow).
    ``batch`` and ``client`` are the two other readings (``MfclConfig.bn_statistics``).

    Attributes:
      module: the ``ClientModule``.
      variables: its variables (``params`` and, for BatchNorm, ``batch_stats``).
      norm: the client module's normalisation.
      bn_layers: the names of its normalisation layers, in order, each after the convolution
        ``conv{i}`` of the same index.
    """

    bn_layers = ("norm1", "norm2")

    def __init__(self, exp: Experiment, params, model_state):
        ae = exp.model.module
        self.module = ClientModule(ae.norm, ae.group_size, ae.conv_impl,
                                   tn_variance=ae.tn_variance)
        self.norm = exp.cfg.norm
        self._batch_stats = _batch_dependent(exp.cfg)
        self._compiled: dict = {}
        # The autoencoder's "client" submodule's variables, every collection.
        self.variables = {"params": params["client"],
                          **{k: v["client"] for k, v in model_state.items()}}

    def __call__(self, x: jax.Array, paired: bool, batch_stats=None) -> jax.Array:
        if batch_stats is not None:  # a client's own statistics, BatchNorm's evaluation form
            return self.module.apply({**self.variables, "batch_stats": batch_stats}, x,
                                     train=False)
        # Twin Normalization: the client computes each pair's representations together;
        # GroupNorm, and BatchNorm by default, use their evaluation form (running
        # statistics), which depends on no other sample.
        if paired and self._batch_stats:  # training form; the running statistics stay frozen
            return self.module.apply(self.variables, x, train=True,
                                     mutable=["batch_stats"])[0]
        return self.module.apply(self.variables, x, train=paired and self.norm == "twin")

    def norm_input_moments(self, x: jax.Array, mask: jax.Array, batch_stats, layer: int
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(count, mean [C], M2 [C])`` of the input of BatchNorm layer ``layer`` (1-based:
        the output of ``conv{layer}``) over the rows of ``x [2N, H, W, 3]`` whose pair is
        marked in ``mask [N]`` (rows i and i + N), the earlier layers normalised with
        ``batch_stats``; ``M2`` is the sum of squared deviations from ``mean``."""
        name = f"conv{layer}"
        _, state = self.module.apply(
            {**self.variables, "batch_stats": batch_stats}, x, train=False,
            capture_intermediates=lambda mdl, method: mdl.name == name,
            mutable=["intermediates"])
        y = state["intermediates"][name]["__call__"][0]
        m = jnp.concatenate([mask, mask]).astype(y.dtype)[:, None, None, None]
        count = jnp.sum(m) * y.shape[1] * y.shape[2]
        mean = jnp.sum(y * m, axis=(0, 1, 2)) / count
        return count, mean, jnp.sum(jnp.square(y - mean) * m, axis=(0, 1, 2))

    def compiled(self, what: str, arg=None):
        """This encoder's functions for ``mfcl.bn_statistics=client``, each compiled once:
        ``("views", blur)``: ``(key, images, pool) -> views [2N, H, W, 3]`` (the augmented
        view pairs, ``phase2.make_representations`` with no encoder); ``("moments",
        layer)``: ``(views, mask, batch_stats) -> norm_input_moments``; ``("encode",)``:
        ``(views, batch_stats) -> representations``. The augmentations compile once, not
        once per function."""
        if (what, arg) not in self._compiled:
            if what == "views":
                fn = phase2.make_representations(lambda x, paired: x, paired=True, blur=arg)
            elif what == "moments":
                def fn(x, mask, batch_stats):
                    return self.norm_input_moments(x, mask, batch_stats, arg)
            else:
                def fn(x, batch_stats):
                    return self(x, True, batch_stats)
            self._compiled[what, arg] = jax.jit(fn)
        return self._compiled[what, arg]


def client_encoder(exp: Experiment):
    """``(params, model_state) -> ClientEncoder``: the frozen client module of a phase-1
    model (``ClientEncoder``)."""

    def make(params, model_state):
        return ClientEncoder(exp, params, model_state)

    return make


def _padded(rows: np.ndarray, chunk: int) -> tuple[np.ndarray, jax.Array]:
    """``rows`` (at most ``chunk``) padded to ``chunk`` by repeating the last, and the mask
    of the real ones."""
    m = len(rows)
    return (np.concatenate([rows, np.repeat(rows[-1:], chunk - m, 0)]),
            jnp.asarray(np.arange(chunk) < m))


def client_statistics(exp: Experiment, encode: ClientEncoder, rows: np.ndarray,
                      chunk: int = 250, images: jax.Array | None = None) -> dict:
    """A client's own BatchNorm statistics (``mfcl.bn_statistics=client``): for each BatchNorm
    layer of the client module in turn, the mean and (biased) variance of its input over all
    the views of the client's pool ``rows [n, 2]`` (both views of each, as it sends them),
    the earlier layers normalised with the statistics already computed -- the population
    statistics BatchNorm's running averages estimate, of this client's data alone, with the
    final phase-1 weights. Chunks of ``chunk`` pairs, combined exactly (Chan et al.'s
    pairwise update of the mean and the sum of squared deviations, in float64).

    ``images``: the training images already on the device (default: put there now).

    Returns the client module's ``batch_stats`` collection with those statistics."""
    key = jax.random.PRNGKey(exp.cfg.seed)
    images = jnp.asarray(exp.dataset.train_images) if images is None else images
    views = encode.compiled("views", exp.cfg.mfcl.blur)
    stats = jax.tree.map(jnp.asarray, encode.variables["batch_stats"])
    for i, name in enumerate(encode.bn_layers, 1):
        moments = encode.compiled("moments", i)
        n, mean, m2 = 0.0, 0.0, 0.0
        for s in range(0, len(rows), chunk):
            block, mask = _padded(rows[s:s + chunk], chunk)
            x = views(key, images[block[:, 0]], jnp.asarray(block))
            nb, mb, m2b = (np.asarray(v, np.float64) for v in moments(x, mask, stats))
            total = n + nb
            delta = mb - mean
            mean, m2 = mean + delta * (nb / total), m2 + m2b + delta ** 2 * (n * nb / total)
            n = total
        stats = {**stats, name: {"bn": {"mean": jnp.asarray(mean, jnp.float32),
                                        "var": jnp.asarray(m2 / n, jnp.float32)}}}
    return stats


def _phase1(exp: Experiment, run_dir: Path, state, done: int, sink: Sink, log,
            callbacks=()) -> tuple[object, bool]:
    """Phase 1: the engine's federated rounds of the reconstruction objective, through the
    run loop, evaluated by the test images' reconstruction BCE."""
    cfg = exp.cfg
    ckpt = Checkpointer(run_dir / "checkpoints" / "phase1", keep=cfg.keep_checkpoints)

    def meta(done: int) -> dict:
        return {"round": done, "config_digest": config_digest(cfg)}

    try:
        if done == 0 and not ckpt.steps():
            save_checkpoint(ckpt, run_dir, 0, state, meta(0), "phase 1 round 0")
        if done >= cfg.rounds:
            return state, False
        log("phase 1: compiling the round (clients x local steps, one program)...")
        t0 = time.perf_counter()
        advance_rounds = exp.compile_rounds()
        evaluate = _reconstruction_eval(exp)
        log(f"compiled in {time.perf_counter() - t0:.1f} s")

        def advance(state, done, n):
            state, metrics = advance_rounds(state, n)
            return state, (metrics, to_host(evaluate(state.params, state.model_state,
                                                     exp.test)))

        def record(state, out, done, n, block_s, elapsed_s):
            metrics, ev = out
            train = float(np.mean(metrics["loss"]))
            if not np.isfinite(train):
                raise TrainingError(f"phase 1: non-finite reconstruction loss at round {done}")
            return {"phase": 1, "round": done, "train_bce": train,
                    "test_bce": float(ev["loss"]), "round_s": round(block_s / n, 3)}

        stage = Stage(label="phase 1 round", unit="rounds", total=cfg.rounds,
                      every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                      advance=advance, record=record,
                      checkpoint=lambda state, done, line: (state, meta(done)),
                      checkpointer=ckpt,
                      describe=lambda r: (f"train BCE {r['train_bce']:.4f}  test BCE "
                                          f"{r['test_bce']:.4f}"))
        state, _, stopped = run_stage(stage, state, done, run_dir=run_dir, sink=sink, log=log,
                                      callbacks=callbacks)
        return state, stopped
    finally:
        ckpt.close()


def _represent_with_own_statistics(exp: Experiment, encode: ClientEncoder, pool: np.ndarray,
                                   bounds: list, owners: list, chunk: int) -> jax.Array:
    """``represent_all`` with ``mfcl.bn_statistics=client``: each client's statistics over
    all of its runs (``bounds`` of the pool, ``owners`` the client of each), then its runs
    normalised with them in padded chunks of ``chunk`` pairs."""
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(exp.cfg.seed)
    views, apply = encode.compiled("views", exp.cfg.mfcl.blur), encode.compiled("encode")
    firsts, seconds, stats = [], [], {}
    for (start, end), c in zip(bounds, owners, strict=True):
        if c not in stats and end > start:
            rows = [pool[s:e] for (s, e), o in zip(bounds, owners, strict=True) if o == c]
            stats[c] = client_statistics(exp, encode, np.concatenate(rows), chunk, images)
        for s in range(start, end, chunk):
            m = min(chunk, end - s)
            rows, _ = _padded(pool[s:s + m], chunk)
            r = apply(views(key, images[rows[:, 0]], jnp.asarray(rows)), stats[c])
            firsts.append(r[:m])
            seconds.append(r[chunk:chunk + m])
    return jnp.concatenate(firsts + seconds)


def represent_all(exp: Experiment, encode, pool: np.ndarray, segments: list[int],
                   chunk: int = 250, owners: Sequence[int] | None = None) -> jax.Array:
    """The representation pairs the kept clients send: ``[2P, h, w, c]``, first views then
    second views (row i and row i + P a pair).

    ``segments`` are the lengths of the pool's per-client runs (in pool order), ``owners``
    the client of each (None: each its own; a client with several draws, ``rho > 1``, owns
    several). A client module whose output depends on the batch (``mfcl.bn_statistics=
    batch``) is run on each client's own batches of ``batch_size`` pairs, as the client
    would; with ``mfcl.bn_statistics=client`` each client's runs are normalised with its own
    statistics (``client_statistics`` over all of its runs), in padded chunks of ``chunk``
    pairs of one client; any other in padded chunks of ``chunk`` pairs across clients (one
    compiled shape; the same result)."""
    cfg = exp.cfg.mfcl
    starts = np.cumsum([0, *segments])
    bounds = list(zip(starts[:-1], starts[1:], strict=True))
    if _client_statistics_mode(exp.cfg):
        owners = list(range(len(segments))) if owners is None else list(owners)
        return _represent_with_own_statistics(exp, encode, pool, bounds, owners, chunk)
    represent = jax.jit(phase2.make_representations(encode, paired=True, blur=cfg.blur))
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(exp.cfg.seed)
    if _batch_dependent(exp.cfg):
        batches = [(s, min(s + exp.cfg.batch_size, end)) for start, end in bounds
                   for s in range(start, end, exp.cfg.batch_size)]
        pad = False  # a client's last batch is smaller (its own compiled shape)
    else:
        batches = [(s, min(s + chunk, len(pool))) for s in range(0, len(pool), chunk)]
        pad = True
    firsts, seconds = [], []
    for s, e in batches:
        rows, m = pool[s:e], e - s
        if pad and m < chunk:  # pad the last chunk, drop the padding
            rows = np.concatenate([rows, np.repeat(rows[-1:], chunk - m, 0)])
        r = represent(key, images[rows[:, 0]], jnp.asarray(rows))
        firsts.append(r[:m])
        seconds.append(r[len(rows):len(rows) + m])
    return jnp.concatenate(firsts + seconds)


def _phase2(exp: Experiment, run_dir: Path, encode, resuming: bool, sink: Sink, log,
            callbacks=()):
    """Phase 2: the server's NT-Xent training on the clients' representations, one compiled
    program per epoch, through the run loop."""
    cfg, m = exp.cfg, exp.cfg.mfcl
    key = jax.random.PRNGKey(cfg.seed)
    kept = phase2.kept_clients(key, cfg.num_clients, m.delta)
    pool = phase2.sample_pool(exp.parts, kept, m.rho)
    log(f"phase 2: {len(kept)} of {cfg.num_clients} clients send {m.rho} view pair(s) per "
        f"sample: {len(pool)} representation pairs")
    t0 = time.perf_counter()
    reps = represent_all(exp, encode, pool, [len(exp.parts[k]) for k in kept] * m.rho,
                         owners=list(range(len(kept))) * m.rho)
    log(f"representations {tuple(reps.shape)} in {time.perf_counter() - t0:.1f} s")
    batch = min(m.server_batch_size, len(pool))
    steps = len(pool) // batch
    model = ServerModel(width=m.server_width, projection_dim=m.projection_dim,
                        conv_impl=cfg.conv_impl)
    tx = phase2.server_optimizer(m.server_lr, m.server_weight_decay, steps * m.server_epochs)
    state = phase2.init_server_training(model, key, reps.shape[1:], tx)
    ckpt = Checkpointer(run_dir / "checkpoints" / "phase2", keep=cfg.keep_checkpoints)

    def meta(done: int) -> dict:
        return {"epoch": done, "config_digest": config_digest(cfg)}

    try:
        if resuming:
            got = ckpt.restore_latest(state)
            if got is not None:
                state = got.state
        done = int(state.epoch)
        if done == 0 and not ckpt.steps():
            save_checkpoint(ckpt, run_dir, 0, state, meta(0), "phase 2 epoch 0")
        if done < m.server_epochs:
            epoch = jax.jit(phase2.make_server_epoch(model, tx, batch_size=batch,
                                                     temperature=m.temperature),
                            donate_argnums=0)
            log(f"phase 2: compiling the server epoch ({steps} steps of {batch} pairs)...")
            t = time.perf_counter()
            epoch = epoch.lower(state, reps, key).compile()
            log(f"compiled in {time.perf_counter() - t:.1f} s")

            def advance(state, done, n):
                state, loss = epoch(state, reps, key)
                return state, float(to_host(loss))

            def record(state, loss, done, n, block_s, elapsed_s):
                if not np.isfinite(loss):
                    raise TrainingError(f"phase 2: non-finite NT-Xent loss at epoch {done}")
                return {"phase": 2, "epoch": done, "server_loss": loss,
                        "epoch_s": round(block_s, 3)}

            stage = Stage(label="phase 2 epoch", unit="epochs", total=m.server_epochs,
                          every=1, checkpoint_every=cfg.checkpoint_every, advance=advance,
                          record=record,
                          checkpoint=lambda state, done, line: (state, meta(done)),
                          checkpointer=ckpt,
                          describe=lambda r: f"NT-Xent {r['server_loss']:.4f}")
            state, _, stopped = run_stage(stage, state, done, run_dir=run_dir, sink=sink,
                                          log=log, callbacks=callbacks)
            if stopped:
                return model, None
        return model, state
    finally:
        ckpt.close()


def _features(features, variables: dict, images: np.ndarray, chunk: int) -> np.ndarray:
    """``float32 [N, 8w]``: ``features(variables, images)`` in padded chunks of ``chunk``
    images (one compiled shape)."""
    parts = []
    for s in range(0, len(images), chunk):
        block, _ = _padded(images[s:s + chunk], chunk)
        parts.append(np.asarray(features(variables, jnp.asarray(block)))[:len(images) - s])
    return np.concatenate(parts)


def _probe(exp: Experiment, encode, model, state, chunk: int = 500) -> dict:
    """The linear probe (``mfcl.probe``) on the frozen features: client module, then the
    trained server network. With ``mfcl.probe_controls`` the same probe, on the same
    held-out split, also on two controls, what the trained server's features have to beat
    for phase 2 to have learnt anything: the features of a randomly initialised server
    network of the same architecture on the same client-module outputs (keys
    ``control_random_server_*``), and the raw pixels in [0, 1] (``control_pixels_*``).

    The features are the server network's embeddings (the projection head dropped, as SimCLR
    evaluates) of the client module's outputs in its evaluation form: a BatchNorm client
    module uses its running statistics whatever ``mfcl.bn_statistics``, since the images
    classified belong to no client (the test set)."""
    cfg, m, ds = exp.cfg, exp.cfg.mfcl, exp.dataset
    root = jax.random.PRNGKey(cfg.seed)
    key = jax.random.fold_in(root, _PROBE_STREAM)

    @jax.jit
    def features(variables, images):
        x = images.astype(jnp.float32) / 255.0
        embedding, _ = model.apply(variables, encode(x, False), train=False)
        return embedding

    def probe(train_x, test_x, prefix, scale=1.0):
        common = dict(num_classes=ds.num_classes, key=key, scale=scale, prefix=prefix)
        if m.probe == "adam":
            return adam_probe(train_x, ds.train_labels, test_x, ds.test_labels,
                              epochs=m.probe_epochs, lr=m.probe_lr,
                              batch_size=m.probe_batch_size, **common)
        return lbfgs_probe(train_x, ds.train_labels, test_x, ds.test_labels,
                           l2_grid=m.probe_l2_grid, holdout=m.probe_holdout,
                           max_iter=m.probe_max_iter, tol=m.probe_tol, **common)

    def server_probe(variables, prefix):
        return probe(_features(features, variables, ds.train_images, chunk),
                     _features(features, variables, ds.test_images, chunk), prefix)

    out = server_probe({"params": state.params, "batch_stats": state.batch_stats},
                       "linear_probe_")
    if m.probe_controls:
        rep_shape = jax.eval_shape(lambda x: encode(x, False),
                                   jax.ShapeDtypeStruct((1, *ds.image_shape), jnp.float32))
        random = phase2.init_server_training(model, jax.random.fold_in(root, _CONTROL_STREAM),
                                             rep_shape.shape[1:], optax.identity())
        out.update(server_probe({"params": random.params, "batch_stats": random.batch_stats},
                                "control_random_server_"))
        n, nt = len(ds.train_images), len(ds.test_images)
        out.update(probe(ds.train_images.reshape(n, -1), ds.test_images.reshape(nt, -1),
                         "control_pixels_", scale=1 / 255))
    return out


def _describe_probe(probe: dict) -> str:
    """The log line of the probe and its controls."""
    def one(prefix):
        line = (f"{probe[f'{prefix}accuracy']:.4f} (train "
                f"{probe[f'{prefix}train_accuracy']:.4f}")
        if f"{prefix}l2" in probe:
            line += (f"; lambda {probe[f'{prefix}l2']:g}, {probe[f'{prefix}iterations']} "
                     f"iterations, max|grad| {probe[f'{prefix}grad_max_abs']:.1e}"
                     + ("" if probe[f"{prefix}converged"] else ", NOT CONVERGED"))
        return line + ")"

    line = f"linear probe accuracy {one('linear_probe_')}"
    if "control_pixels_accuracy" in probe:
        line += (f"; controls: random server network {one('control_random_server_')}, raw "
                 f"pixels {one('control_pixels_')}")
    return line


def _resources(exp: Experiment) -> dict:
    cfg = exp.cfg
    h, w = exp.dataset.image_shape[:2]
    return mfcl_resources(num_samples_per_client=[len(p) for p in exp.parts], image_hw=(h, w),
                          phase1_rounds=cfg.rounds, local_epochs=cfg.local_epochs,
                          rho=cfg.mfcl.rho, delta=cfg.mfcl.delta, batch_size=cfg.batch_size,
                          norm=cfg.norm)


def _describe(exp: Experiment, run_dir: Path) -> str:
    cfg = exp.cfg
    return (f"run_dir: {run_dir}  |  {cfg.dataset}: {len(exp.dataset.train_labels)} train / "
            f"{len(exp.dataset.test_labels)} test  |  MFCL, client module norm={cfg.norm}, "
            f"{cfg.num_clients} clients (alpha {cfg.alpha})  |  backend {jax.default_backend()}")


def _loop(exp: Experiment, run_dir: Path, state, done1: int, phase2_started: bool, log,
          callbacks=()) -> dict:
    sink = Sink(run_dir)
    try:
        state, stopped = _phase1(exp, run_dir, state, done1, sink, log, callbacks)
        if stopped:
            return {"run_dir": str(run_dir), "stopped_early": True}
        encode = client_encoder(exp)(state.params, state.model_state)
        model, server = _phase2(exp, run_dir, encode, phase2_started, sink, log, callbacks)
        if server is None:
            return {"run_dir": str(run_dir), "stopped_early": True}
        log("linear probe on the frozen features"
            + (" and the controls..." if exp.cfg.mfcl.probe_controls else "..."))
        probe = _probe(exp, encode, model, server)
        resources = _resources(exp)
        with interrupts.critical():
            atomic_write_text(run_dir / "resources.json", json.dumps(resources, indent=1) + "\n")
        record = {"phase": "probe", **probe}
        sink.write(record)
    finally:
        sink.close()
    log(_describe_probe(probe))
    log(format_resources(resources))
    return {**record, "run_dir": str(run_dir)}


def run_mfcl(cfg: CoreConfig, *, dataset: ImageDataset | None = None,
             log: Callable[[str], None] = print, command: str | None = None,
             progress: bool = True, callbacks=()) -> dict:
    """Runs MFCL from scratch (``cfg.algorithm == "mfcl"``); returns the probe's record."""
    if cfg.algorithm != "mfcl":
        raise ConfigError([f"algorithm={cfg.algorithm!r}: the mfcl command runs algorithm=mfcl"])
    if cfg.seeds:
        raise ConfigError([f"seeds={list(cfg.seeds)}: mfcl runs one seed per command (use "
                           "seed=)"])

    def prepare() -> Experiment:
        log(f"loading data: {cfg.dataset} ...")
        return build(cfg, mfcl_dataset(cfg, dataset))

    del progress  # MFCL prints a line per evaluation
    with new_run(cfg, prepare, command=command) as (run_dir, exp):
        log(_describe(exp, run_dir))
        return _loop(exp, run_dir, exp.state, 0, False, log, callbacks)


def _trim_metrics(path: Path, done1: int, done2: int) -> None:
    """Keeps the lines up to the checkpoints being resumed from (phase-1 round ``done1``,
    phase-2 epoch ``done2``); the probe's line goes (it is recomputed)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed process
        if (r.get("phase") == 1 and r["round"] <= done1) or (
                r.get("phase") == 2 and r["epoch"] <= done2):
            keep.append(line)
    atomic_write_text(path, "".join(f"{x}\n" for x in keep))


def resume_mfcl(run_dir: Path, cfg: CoreConfig, *, force: bool = False,
                dataset: ImageDataset | None = None, progress: bool = True,
                log: Callable[[str], None] = print, command: str | None = None,
                callbacks=()) -> dict:
    """Continues an MFCL run in whichever phase it stopped; identical to an uninterrupted
    run. ``cfg`` is the run's config as ``loop.resume_config`` checked it."""
    del progress  # MFCL prints a line per evaluation
    run_dir = Path(run_dir)
    with locked_run(run_dir):
        with interrupts.critical():
            atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))
        log(f"loading data: {cfg.dataset} ...")
        exp = build(cfg, mfcl_dataset(cfg, dataset))
        ckpt = Checkpointer(run_dir / "checkpoints" / "phase1", keep=cfg.keep_checkpoints)
        try:
            restored = ckpt.restore_latest(exp.state)
        finally:
            ckpt.close()
        state, done1 = (exp.state, 0) if restored is None else (restored.state, restored.step)
        if (restored is not None and restored.meta.get("config_digest") != config_digest(cfg)
                and not force):
            raise ConfigError([f"resume: the checkpoint in {run_dir} was written with a "
                               "different config than config.yaml now holds"])
        p2 = Checkpointer(run_dir / "checkpoints" / "phase2", keep=cfg.keep_checkpoints)
        try:
            steps2 = p2.steps()
        finally:
            p2.close()
        started2 = done1 >= cfg.rounds and bool(steps2)
        done2 = steps2[-1] if started2 else 0
        with interrupts.critical():
            _trim_metrics(run_dir / "metrics.jsonl", done1, done2)
            (run_dir / "resources.json").unlink(missing_ok=True)
        provenance.record(run_dir, command, done1, cfg.plugins)
        where = f"phase 2 epoch {done2}" if started2 else f"phase 1 round {done1}"
        interrupts.resume_status(run_dir, where)
        log(_describe(exp, run_dir))
        log(f"resuming from the checkpoint of {where}")
        return _loop(exp, run_dir, state, done1, started2, log, callbacks)


def resume(run_dir: str | Path, overrides=(), *, force: bool = False, **kwargs) -> dict:
    """``resume_mfcl`` with the run's config read and checked (``loop.resume_config``)."""
    run_dir = Path(run_dir)
    return resume_mfcl(run_dir, resume_config(run_dir, overrides, force=force), force=force,
                       **kwargs)
