"""Where MFCL's BatchNorm failure would come from, measured on a finished run (issue 30).

MFCL (its Table 2) finds a BatchNorm client module collapsing at Dirichlet xi = 0.01
(linear evaluation 15.3 % against TN's 84.1 % on CIFAR-10) and blames batch statistics of
class-imbalanced client batches. This tool takes a run of ``fedjax-rcl mfcl`` (its final
phase-1 client module) and measures, on the run's own training subset and split:

1. **Class imbalance per client and per batch**: each client's size, the classes it holds
   (more than 1 % of its samples) and the share of its largest class -- the share a batch of
   its own data has in expectation.
2. **Per-client feature statistics**: for each BatchNorm layer, how far each client's own
   statistics of the layer's input (mean and variance over its data, the earlier layers
   normalised with its own) are from the federated running ones the model carries: the mean
   over channels of ``|mu_client - mu_running| / sd_running`` and of
   ``|log(var_client / var_running)|``.
3. **What the server sees**: the client module's output for each training image with the
   statistics of each reading of MFCL's BatchNorm (``running``: the federated running
   statistics; ``client``: each client's own, over the augmented views it sends, as the run's
   ``mfcl.bn_statistics=client`` computes them; ``batch``: the statistics of each batch of
   ``batch_size`` images of one client), summarised per channel by its spatial mean and
   standard deviation, and (a) how much class information survives -- the converged L-BFGS
   probe's top-1 for the class on those summaries (train on 80 % of the images, test on the
   other 20 %, each normalised as its client sends it), (b) the share of the summaries'
   variance that lies between clients (``sum_c n_c |m_c - m|^2 / sum_i |x_i - m|^2``).
   A client module without BatchNorm has one reading (its own output). Read (a) with care
   under ``client`` and ``batch``: the summaries then also carry each client's own
   normalisation, and where a client holds one class (xi = 0.01) that identifies the class
   too, so (a) is what the server could read off the representations it is sent, not what a
   probe on images of no client (the test set) can use.

Usage (from the repository root; prints a table)::

    python experiments/mfcl_xi/mfcl_bn_evidence.py RUN_DIR... [--out FILE.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def class_composition(labels: np.ndarray, parts, num_classes: int) -> list[dict]:
    """Per client: ``n``, ``classes`` (holding more than 1 % of its samples) and
    ``majority_share`` (the fraction of its largest class)."""
    out = []
    for idx in parts:
        counts = np.bincount(labels[np.asarray(idx)], minlength=num_classes)
        n = int(counts.sum())
        out.append({"n": n, "classes": int((counts > 0.01 * n).sum()),
                    "majority_share": float(counts.max() / n) if n else 0.0})
    return out


def statistics_distance(mean_c, var_c, mean_r, var_r) -> tuple[float, float]:
    """``(mean_ch |mu_c - mu_r| / sd_r, mean_ch |log(var_c / var_r)|)``."""
    mean_c, var_c, mean_r, var_r = (np.asarray(v, np.float64)
                                    for v in (mean_c, var_c, mean_r, var_r))
    return (float(np.mean(np.abs(mean_c - mean_r) / np.sqrt(var_r))),
            float(np.mean(np.abs(np.log(var_c / var_r)))))


def between_share(x: np.ndarray, groups: np.ndarray) -> float:
    """The share of the total sum of squares of the rows of ``x`` [n, d] that lies between
    the groups: ``sum_g n_g |m_g - m|^2 / sum_i |x_i - m|^2``, the between-class trace's share
    of the total with the groups as classes."""
    from fedjax_rcl.metrics import class_covariance_traces

    within, between = class_covariance_traces(x, groups)
    return between / (within + between)


def summarise(z: np.ndarray) -> np.ndarray:
    """``[n, h, w, c] -> [n, 2c]``: each channel's spatial mean and standard deviation."""
    z = np.asarray(z, np.float64)
    return np.concatenate([z.mean((1, 2)), z.std((1, 2))], axis=1)


def _evidence(run_dir: Path) -> dict:
    import jax
    import jax.numpy as jnp

    from fedjax_rcl.checkpoint import Checkpointer
    from fedjax_rcl.experiment import build
    from fedjax_rcl.loop import resume_config
    from fedjax_rcl.mfcl.encoder import ClientEncoder, client_statistics
    from fedjax_rcl.mfcl.probe import lbfgs_probe
    from fedjax_rcl.mfcl.run import mfcl_dataset

    cfg = resume_config(run_dir, force=True)
    exp = build(cfg, mfcl_dataset(cfg))
    ckpt = Checkpointer(run_dir / "checkpoints" / "phase1", keep=cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(exp.state)
    finally:
        ckpt.close()
    if restored is None or restored.step < cfg.rounds:
        raise SystemExit(f"{run_dir}: phase 1 is not finished (no round-{cfg.rounds} "
                         "checkpoint)")
    state = restored.state
    enc = ClientEncoder(exp, state.params, state.model_state)
    ds = exp.dataset
    labels = np.asarray(ds.train_labels)
    parts = [np.asarray(p) for p in exp.parts]
    owner = np.empty(len(labels), np.int64)
    for c, idx in enumerate(parts):
        owner[idx] = c
    out = {"run_dir": str(run_dir), "norm": cfg.norm, "alpha": cfg.alpha, "seed": cfg.seed,
           "clients": class_composition(labels, parts, ds.num_classes)}
    images = jnp.asarray(ds.train_images)
    x_all = images.astype(jnp.float32) / 255.0
    readings = {}
    eval_apply = jax.jit(lambda x: enc(x, False))
    chunk = 250

    def run_rows(fn, rows):
        return np.concatenate([np.asarray(fn(x_all[rows[s:s + chunk]]))
                               for s in range(0, len(rows), chunk)])

    every = np.arange(len(labels))
    readings["running" if cfg.norm == "batch" else "own"] = summarise(run_rows(eval_apply,
                                                                                every))
    if cfg.norm == "batch":
        running = enc.variables["batch_stats"]
        own = np.zeros_like(readings["running"])
        dist = []
        batch_apply = jax.jit(lambda x: enc.module.apply(enc.variables, x, train=True,
                                                         mutable=["batch_stats"])[0])
        by_batch = np.zeros_like(own)
        for idx in parts:
            # The statistics the run's mfcl.bn_statistics=client computes: over the views the
            # client sends (draw 0 of each sample).
            rows = np.stack([idx, np.zeros_like(idx)], axis=1)
            stats = client_statistics(exp, enc, rows, chunk, images)
            apply_c = jax.jit(lambda x, s=stats: enc(x, False, batch_stats=s))
            z = run_rows(apply_c, idx)
            own[idx] = summarise(z)
            dist.append({name: statistics_distance(
                stats[name]["bn"]["mean"], stats[name]["bn"]["var"],
                running[name]["bn"]["mean"], running[name]["bn"]["var"])
                for name in enc.bn_layers})
            for s in range(0, len(idx), cfg.batch_size):
                b = idx[s:s + cfg.batch_size]
                by_batch[b] = summarise(np.asarray(batch_apply(x_all[b])))
        readings["client"], readings["batch"] = own, by_batch
        out["statistics_distance"] = [
            {name: {"mean_shift_sd": d[name][0], "abs_log_var_ratio": d[name][1]}
             for name in enc.bn_layers} for d in dist]
    split = np.random.default_rng(cfg.seed).permutation(len(labels))
    test, train = split[: len(labels) // 5], split[len(labels) // 5:]
    out["readings"] = {}
    for name, feats in readings.items():
        p = lbfgs_probe(feats[train], labels[train], feats[test], labels[test],
                        num_classes=ds.num_classes, l2_grid=cfg.mfcl.probe_l2_grid,
                        holdout=cfg.mfcl.probe_holdout, max_iter=cfg.mfcl.probe_max_iter,
                        tol=cfg.mfcl.probe_tol, key=jax.random.PRNGKey(cfg.seed), prefix="")
        out["readings"][name] = {"class_probe_accuracy": float(p["accuracy"]),
                                 "class_probe_train_accuracy": float(p["train_accuracy"]),
                                 "between_client_share": between_share(feats, owner)}
    return out


def _table(results: list[dict]) -> str:
    lines = ["| run | norm | xi | reading | class probe test (train) | between-client share |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for name, v in r["readings"].items():
            lines.append(f"| {Path(r['run_dir']).name} | {r['norm']} | {r['alpha']:g} | {name} "
                         f"| {v['class_probe_accuracy']:.4f} "
                         f"({v['class_probe_train_accuracy']:.4f}) "
                         f"| {v['between_client_share']:.3f} |")
    lines += ["", "| run | client | n | classes | majority share | BN layer distances "
              "(mean shift / sd, abs log var ratio) |", "|---|---|---|---|---|---|"]
    for r in results:
        for c, info in enumerate(r["clients"]):
            d = r.get("statistics_distance")
            ds = "; ".join(f"{k} {v['mean_shift_sd']:.2f} / {v['abs_log_var_ratio']:.2f}"
                           for k, v in d[c].items()) if d else "—"
            lines.append(f"| {Path(r['run_dir']).name} | {c} | {info['n']} | {info['classes']} "
                         f"| {info['majority_share']:.2f} | {ds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from run_dirs_cli import main_over_run_dirs  # a sibling: the script's directory

    return main_over_run_dirs("mfcl_bn_evidence", __doc__.splitlines()[0], _evidence, _table, argv)


if __name__ == "__main__":
    sys.exit(main())
