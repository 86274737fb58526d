"""Whether Twin Normalization's two forms explain TN's phase 2 in a finished MFCL run (issue 30).

In phase 2 a TN client module normalises each augmented view together with its twin (the
other view of the same image, MFCL's Eq. 2), and the server is trained on those
representations. The linear probe -- like any image of no client, the test set -- takes each
image alone (per-image statistics, TN's evaluation form). A server trained on one form and
probed on the other may lose to a random server for that reason alone. This tool probes a
finished run's trained server, and the run's randomly initialised control server, with the
same converged L-BFGS probe (the run's grid and hold-out) on three forms of the client
module's output for the probe's training and test images:

- ``single``: each image alone (what the run's probe read);
- ``paired``: each image normalised together with one augmented view of itself as its twin
  (the image's own representation kept);
- ``views``: two augmented views normalised together as in phase 2, the first view's
  representation kept (phase 2's representations, one draw).

``single`` against ``paired`` isolates the twin normalisation (the same clean image, alone
or with a twin); ``paired`` against ``views`` the augmentation of the probed image. Views are
drawn from the run's seed, the same for both servers.

Usage (from the repository root; prints a table)::

    python experiments/mfcl_xi/mfcl_tn_pairing.py RUN_DIR [--out FILE.json]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

FORMS = ("single", "paired", "views")
# Streams of the run's root key, as ``fedjax-rcl mfcl`` draws them: the probe's held-out split
# and the random server network of the control probe (15, 16); the views drawn here take the
# next one (the run's own use 11-16). The check that these match the run: ``trained/single``
# and ``random/single`` reproduce the run's own ``linear_probe_accuracy`` and
# ``control_random_server_accuracy`` (its metrics.jsonl) up to XLA's fusion.
_PROBE_STREAM, _CONTROL_STREAM, _FORM_STREAM = 15, 16, 17


def _padded(rows, chunk: int):
    """``rows`` (at most ``chunk``) padded to ``chunk`` by repeating the last: one compiled
    shape for every block."""
    import numpy as np

    return np.concatenate([rows, np.repeat(rows[-1:], chunk - len(rows), 0)])


def _pairing(run_dir: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedjax_rcl.checkpoint import Checkpointer
    from fedjax_rcl.data.contrastive_augment import simclr_view
    from fedjax_rcl.experiment import build
    from fedjax_rcl.loop import resume_config
    from fedjax_rcl.mfcl import phase2
    from fedjax_rcl.mfcl.encoder import ClientEncoder
    from fedjax_rcl.mfcl.probe import lbfgs_probe
    from fedjax_rcl.mfcl.run import mfcl_dataset
    from fedjax_rcl.models.mfcl import ServerModel
    from fedjax_rcl.nn import conv

    cfg = resume_config(run_dir, force=True)
    if cfg.norm != "twin":
        raise SystemExit(f"{run_dir}: norm={cfg.norm!r}; this tool reads a TN run (norm=twin)")
    m, exp = cfg.mfcl, build(cfg, mfcl_dataset(cfg))

    def restore(phase, state, want):
        ckpt = Checkpointer(run_dir / "checkpoints" / phase, keep=cfg.keep_checkpoints)
        try:
            got = ckpt.restore_latest(state)
        finally:
            ckpt.close()
        if got is None or got.step < want:
            raise SystemExit(f"{run_dir}: {phase} is not finished (no step-{want} checkpoint)")
        return got.state

    p1 = restore("phase1", exp.state, cfg.rounds)
    encode = ClientEncoder(exp, p1.params, p1.model_state)
    ds, root = exp.dataset, jax.random.PRNGKey(cfg.seed)
    rep_shape = jax.eval_shape(lambda x: encode(x, False),
                               jax.ShapeDtypeStruct((1, *ds.image_shape), jnp.float32)).shape
    model = ServerModel(width=m.server_width, projection_dim=m.projection_dim)
    tx = phase2.server_optimizer(m.server_lr, m.server_weight_decay, 1)  # state shape only
    with conv.implementation(cfg.conv_impl):  # the run's convolutions, as mfcl.run traces
        trained = restore("phase2", phase2.init_server_training(model, root, rep_shape[1:],
                                                                tx), m.server_epochs)
        random = phase2.init_server_training(model, jax.random.fold_in(root, _CONTROL_STREAM),
                                             rep_shape[1:], tx)
    servers = {"trained": {"params": trained.params, "batch_stats": trained.batch_stats},
               "random": {"params": random.params, "batch_stats": random.batch_stats}}
    form_key = jax.random.fold_in(root, _FORM_STREAM)

    def represent(form, images, index):
        x = images.astype(jnp.float32) / 255.0
        if form == "single":
            return encode(x, False)

        def views(v):  # view v of each image, keyed by (image index, v)
            return jax.vmap(lambda i, img: simclr_view(
                jax.random.fold_in(jax.random.fold_in(form_key, i), v), img, blur=m.blur))(
                    index, x)

        first = x if form == "paired" else views(0)
        return encode(jnp.concatenate([first, views(1)]), True)[:len(x)]

    @functools.partial(jax.jit, static_argnums=3)
    def embed(variables, images, index, form):
        with conv.implementation(cfg.conv_impl):
            embedding, _ = model.apply(variables, represent(form, images, index), train=False)
        return embedding

    def features(variables, images, offset, form, chunk=500):
        out = []
        for s in range(0, len(images), chunk):
            n = min(chunk, len(images) - s)
            block = _padded(images[s:s + chunk], chunk)  # the padding is dropped below
            index = np.arange(offset + s, offset + s + chunk, dtype=np.int32)
            out.append(np.asarray(embed(variables, jnp.asarray(block), jnp.asarray(index),
                                        form))[:n])
        return np.concatenate(out)

    key = jax.random.fold_in(root, _PROBE_STREAM)
    results = {"run_dir": str(run_dir), "seed": cfg.seed, "alpha": cfg.alpha,
               "tn_variance": m.tn_variance, "probes": {}}
    for name, variables in servers.items():
        for form in FORMS:
            train_x = features(variables, ds.train_images, 0, form)
            test_x = features(variables, ds.test_images, len(ds.train_images), form)
            p = lbfgs_probe(train_x, ds.train_labels, test_x, ds.test_labels,
                            num_classes=ds.num_classes, l2_grid=m.probe_l2_grid,
                            holdout=m.probe_holdout, max_iter=m.probe_max_iter, tol=m.probe_tol,
                            key=key, prefix="")
            results["probes"][f"{name}/{form}"] = {
                k: p[k] for k in ("accuracy", "train_accuracy", "l2", "iterations", "converged")}
            print(f"{run_dir.name} {name:7s} {form:6s} test {p['accuracy']:.4f} "
                  f"train {p['train_accuracy']:.4f}", flush=True)
    return results


def _table(results: list[dict]) -> str:
    lines = ["| run | form | trained server test (train) | random server test (train) "
             "| trained - random |", "|---|---|---|---|---|"]
    for r in results:
        for form in FORMS:
            t, z = r["probes"][f"trained/{form}"], r["probes"][f"random/{form}"]
            lines.append(f"| {Path(r['run_dir']).name} | {form} | {t['accuracy']:.4f} "
                         f"({t['train_accuracy']:.4f}) | {z['accuracy']:.4f} "
                         f"({z['train_accuracy']:.4f}) | {t['accuracy'] - z['accuracy']:+.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from run_dirs_cli import main_over_run_dirs  # a sibling: the script's directory

    return main_over_run_dirs("mfcl_tn_pairing", __doc__.splitlines()[0], _pairing, _table, argv)


if __name__ == "__main__":
    sys.exit(main())
