"""``fedjax-rcl mfcl``: MFCL end to end — phase 1 (federated reconstruction), phase 2 (the
server's contrastive training on the clients' representations), the linear probe, and the
resource figures — in one run directory that resumes in either phase.

A program over the shared run loop (``fedjax_rcl.loop``), as ``training`` is: phase 1 is a stage
of the engine's compiled rounds (``experiment.build`` with ``algorithm=mfcl``,
``model=mfcl_autoencoder``: clients side by side, local steps scanned); phase 2 a stage of
server epochs, one compiled program each (``mfcl.phase2``) on the representations the clients'
frozen encoders send (``mfcl.encoder``); then the probe (``mfcl.probe``) and the resource
counts (``mfcl.resources``).
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
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_rcl import interrupts
from fedjax_rcl.algorithms.mfcl import reconstruction_bce
from fedjax_rcl.checkpoint import Checkpointer
from fedjax_rcl.config import CoreConfig, config_digest
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
    require_command,
    restore_checked,
    resumed_records,
    run_stage,
    save_checkpoint,
)
from fedjax_rcl.mfcl import phase2
from fedjax_rcl.mfcl.encoder import _padded, client_encoder, represent_all
from fedjax_rcl.mfcl.probe import adam_probe, lbfgs_probe
from fedjax_rcl.mfcl.resources import format_resources, mfcl_resources
from fedjax_rcl.models.mfcl import ServerModel
from fedjax_rcl.nn import conv
from fedjax_rcl.rundir import RunDir, atomic_write_text
from fedjax_rcl.validation import ConfigError

# What ``fedjax-rcl mfcl`` starts from before the YAML file and the overrides: MFCL's phase-1
# setting (Adam 1e-3, batches of 64 view pairs, 10 clients all taking part, Dirichlet split
# of MOON's kind; Twin Normalization, the paper's 64-channel client module) at a demo's size.
# A phase-1 step of that client module on 64 pairs of 32x32 images costs 92 GFLOP (forward and
# backward; XLA's count), so the paper's 15 rounds over all 1,438 digits (40 padded client
# steps a round) would be 55 TFLOP and its full-width server's 20 epochs 43 TFLOP more
# (BENCHMARKS.md times them). The demo keeps the method and makes the run about 15 times
# smaller: 600 training images, 3 rounds (20 padded steps each: 5.5 TFLOP), a server of width
# 16 for 10 epochs of 3 steps (0.8 TFLOP). The paper's scale is
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


def _phase1(exp: Experiment, run_dir: Path, state, done: int, sink: Sink, log,
            callbacks=()) -> tuple[object, bool]:
    """Phase 1: the engine's federated rounds of the reconstruction objective, through the
    run loop, evaluated by the test images' reconstruction BCE."""
    cfg = exp.cfg
    ckpt = Checkpointer(RunDir(run_dir).checkpoint_dir("phase1"), keep=cfg.keep_checkpoints)

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
        # Compiled now, not at the first evaluation (later calls find it in JAX's cache).
        evaluate.lower(state.params, state.model_state, exp.test).compile()
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
    # The server network's programs trace with the run's convolutions (conv_impl).
    model = ServerModel(width=m.server_width, projection_dim=m.projection_dim)
    tx = phase2.server_optimizer(m.server_lr, m.server_weight_decay, steps * m.server_epochs)
    with conv.implementation(cfg.conv_impl):
        state = phase2.init_server_training(model, key, reps.shape[1:], tx)
    ckpt = Checkpointer(RunDir(run_dir).checkpoint_dir("phase2"), keep=cfg.keep_checkpoints)

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
            epoch = jax.jit(conv.under(cfg.conv_impl, phase2.make_server_epoch(
                model, tx, batch_size=batch, temperature=m.temperature)), donate_argnums=0)
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


def _features(features, variables: dict, images: np.ndarray, chunk: int
              ) -> tuple[np.ndarray, ...]:
    """Each output of ``features(variables, images)`` (a tuple of ``float32 [N, D]``), in
    padded chunks of ``chunk`` images (one compiled shape)."""
    parts = []
    for s in range(0, len(images), chunk):
        block, _ = _padded(images[s:s + chunk], chunk)
        parts.append([np.asarray(f)[:len(images) - s]
                      for f in features(variables, jnp.asarray(block))])
    return tuple(np.concatenate(p) for p in zip(*parts, strict=True))


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
    classified belong to no client (the test set). With ``mfcl.probe_projection`` the same
    probe also reads the projection head's output (evaluation form), where MFCL puts its
    linear layer (keys ``projection_probe_*``; for the random server
    ``control_random_server_projection_*``)."""
    cfg, m, ds = exp.cfg, exp.cfg.mfcl, exp.dataset
    root = jax.random.PRNGKey(cfg.seed)
    key = jax.random.fold_in(root, _PROBE_STREAM)

    @jax.jit
    def features(variables, images):
        x = images.astype(jnp.float32) / 255.0
        with conv.implementation(cfg.conv_impl):
            embedding, projection = model.apply(variables, encode(x, False), train=False)
        return (embedding, projection) if m.probe_projection else (embedding,)

    def probe(train_x, test_x, prefix, scale=1.0):
        common = dict(num_classes=ds.num_classes, key=key, scale=scale, prefix=prefix)
        if m.probe == "adam":
            return adam_probe(train_x, ds.train_labels, test_x, ds.test_labels,
                              epochs=m.probe_epochs, lr=m.probe_lr,
                              batch_size=m.probe_batch_size, **common)
        return lbfgs_probe(train_x, ds.train_labels, test_x, ds.test_labels,
                           l2_grid=m.probe_l2_grid, holdout=m.probe_holdout,
                           max_iter=m.probe_max_iter, tol=m.probe_tol, **common)

    def server_probe(variables, prefixes):
        train = _features(features, variables, ds.train_images, chunk)
        test = _features(features, variables, ds.test_images, chunk)
        out = {}
        # The projection's prefix goes unused when only the embedding was computed.
        for prefix, tr, te in zip(prefixes, train, test, strict=False):
            out.update(probe(tr, te, prefix))
        return out

    out = server_probe({"params": state.params, "batch_stats": state.batch_stats},
                       ("linear_probe_", "projection_probe_"))
    if m.probe_controls:
        rep_shape = jax.eval_shape(lambda x: encode(x, False),
                                   jax.ShapeDtypeStruct((1, *ds.image_shape), jnp.float32))
        with conv.implementation(cfg.conv_impl):
            random = phase2.init_server_training(
                model, jax.random.fold_in(root, _CONTROL_STREAM), rep_shape.shape[1:],
                optax.identity())
        out.update(server_probe({"params": random.params, "batch_stats": random.batch_stats},
                                ("control_random_server_",
                                 "control_random_server_projection_")))
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
    if "projection_probe_accuracy" in probe:
        line += f"; on the projection head's output {one('projection_probe_')}"
    if "control_pixels_accuracy" in probe:
        line += f"; controls: random server network {one('control_random_server_')}"
        if "control_random_server_projection_accuracy" in probe:
            line += f" (its projection {one('control_random_server_projection_')})"
        line += f", raw pixels {one('control_pixels_')}"
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
            atomic_write_text(RunDir(run_dir).resources,
                              json.dumps(resources, indent=1) + "\n")
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
    require_command(cfg, "mfcl", lambda runs_with: (
        f"algorithm={cfg.algorithm!r}: the mfcl command runs algorithm=mfcl"))
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


def _kept_lines(run: RunDir, done1: int, done2: int) -> list[str]:
    """The metrics lines up to the checkpoints being resumed from (phase-1 round ``done1``,
    phase-2 epoch ``done2``); the probe's line goes (it is recomputed)."""
    def kept(r: dict) -> bool:
        return ((r.get("phase") == 1 and r["round"] <= done1)
                or (r.get("phase") == 2 and r["epoch"] <= done2))

    return [x for x in run.metric_lines() if kept(json.loads(x))]


def resume_mfcl(run_dir: Path, cfg: CoreConfig, *, force: bool = False,
                dataset: ImageDataset | None = None, progress: bool = True,
                log: Callable[[str], None] = print, command: str | None = None,
                callbacks=()) -> dict:
    """Continues an MFCL run in whichever phase it stopped; identical to an uninterrupted
    run. ``cfg`` is the run's config as ``loop.resume_config`` checked it."""
    del progress  # MFCL prints a line per evaluation
    run_dir = Path(run_dir)
    run = RunDir(run_dir)
    with locked_run(run_dir):
        log(f"loading data: {cfg.dataset} ...")
        exp = build(cfg, mfcl_dataset(cfg, dataset))
        ckpt = Checkpointer(run.checkpoint_dir("phase1"), keep=cfg.keep_checkpoints)
        try:
            restored = restore_checked(ckpt, exp.state, cfg, run_dir, force=force)
        finally:
            ckpt.close()
        state, done1 = (exp.state, 0) if restored is None else (restored.state, restored.step)
        p2 = Checkpointer(run.checkpoint_dir("phase2"), keep=cfg.keep_checkpoints)
        try:
            steps2 = p2.steps()
        finally:
            p2.close()
        started2 = done1 >= cfg.rounds and bool(steps2)
        done2 = steps2[-1] if started2 else 0
        with interrupts.critical():
            run.resources.unlink(missing_ok=True)
        resumed_records(run_dir, cfg, _kept_lines(run, done1, done2), command=command,
                        first=done1)
        where = f"phase 2 epoch {done2}" if started2 else f"phase 1 round {done1}"
        interrupts.resume_status(run_dir, where)
        log(_describe(exp, run_dir))
        log(f"resuming from the checkpoint of {where}")
        return _loop(exp, run_dir, state, done1, started2, log, callbacks)

