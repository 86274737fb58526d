"""Why does a collapsed model keep a high effective rank? Collapse metrics per run and per
feature variant.

The representation analysis (``fedjax_rcl.engine.analysis``) takes the effective rank of the
*centred* covariance of the global model's embedding (``ModelOutput.embedding``: the last
stage's output after its ReLU, spatially mean-pooled; not L2-normalised). Centring removes the
mean feature and the effective rank ignores the spread's size, so features that collapse to one
point plus a small residual spread keep whatever effective rank that residual has: a collapse
to a point plus tiny isotropic noise has a *high* effective rank. This script measures, on a
class-balanced subset of the test set (``fedjax_rcl.engine.analysis.analysis_subset``), for
each run (its newest checkpoint, or ``RUN_DIR@ROUND`` for the newest at or before a round):

* per model: the accuracy on the subset and the fraction of predictions in the most predicted
  class (``top_class``);
* per feature variant -- ``emb`` (the analysis' features), ``emb/l2`` (each row L2-normalised),
  ``L0``..``L4`` (FedRCL's levels: stem and stage outputs, pre-ReLU, mean-pooled) and
  ``L0/l2``..``L4/l2`` (normalised, which is what the contrastive loss compares):

  - ``erank``: the project's effective rank (centred covariance; scale-invariant);
  - ``erank_unc``: effective rank of the uncentred second moment ``X^T X / N`` (keeps the
    mean: ~1 when every row points one way);
  - ``cos``: mean pairwise cosine similarity of the uncentred rows (1 = one direction);
  - ``spread``: total variance over squared mean norm, ``tr(Cov) / |mu|^2`` (0 = one point);
  - ``pc1``: the largest covariance eigenvalue's share of the total variance, and ``pc90``:
    how many eigenvalues hold 90 % of it (the shape of the residual spread);
  - ``live``: dimensions whose variance exceeds 1e-6 of the largest dimension's variance;
  - ``vci``, ``between``: the variability collapse index and the between-class share of the
    total variance ``tr(S_B) / (tr(S_W) + tr(S_B))`` (both scale-invariant);
  - ``probe``: linear separability -- a logistic regression on standardised features, fitted
    on a stratified half of the subset and scored on the other half (chance 0.1 here).

``--synthetic`` adds control rows: one point plus isotropic Gaussian noise (``iso``), and one
point plus noise in a few directions (``aniso``), both at a tiny spread, to show what each
metric does under an exact "point plus noise" collapse.

    python experiments/rank_under_collapse/rank_under_collapse.py RUN_DIR[@ROUND] [...] \\
        [--images 2000] [--cache DIR] [--json FILE] [--markdown FILE] [--synthetic]

Prints one JSON object per run and the Markdown tables. Run from the repository root (the run
configs' dataset paths are relative to it). Features are cached in ``--cache`` as ``.npz``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

LEVEL_METRICS = ("erank", "erank_unc", "cos", "spread", "pc1", "live", "vci", "probe")
EMB_METRICS = ("erank", "erank_unc", "cos", "spread", "pc1", "pc90", "live", "vci", "between",
               "probe")


def l2_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def entropy_rank(eigenvalues: np.ndarray) -> float:
    s = np.abs(eigenvalues)
    if s.sum() == 0:
        return 0.0
    p = s[s > 0] / s.sum()
    return float(np.exp(-np.sum(p * np.log(p))))


def linear_probe(x: np.ndarray, y: np.ndarray) -> float:
    """Held-out accuracy of a logistic regression on standardised features: fitted on a
    stratified random half of the rows, scored on the other half. Standardising makes it
    blind to the features' scale, as the rank is."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    train, test = train_test_split(np.arange(len(y)), test_size=0.5, stratify=y,
                                   random_state=0)
    sc = StandardScaler().fit(x[train])
    clf = LogisticRegression(max_iter=3000, C=1.0).fit(sc.transform(x[train]), y[train])
    return float(clf.score(sc.transform(x[test]), y[test]))


def feature_metrics(x: np.ndarray, y: np.ndarray, *, probe: bool = True) -> dict:
    from fedjax_rcl.metrics import (
        class_covariance_traces,
        effective_rank,
        mean_pairwise_cosine,
        variability_collapse_index,
    )

    x = np.asarray(x, np.float64)
    n = len(x)
    mu = x.mean(axis=0)
    c = x - mu
    cov_eig = np.sort(np.clip(np.linalg.eigvalsh(c.T @ c / n), 0, None))[::-1]
    total = float(cov_eig.sum())
    second_eig = np.linalg.eigvalsh(x.T @ x / n)
    var = (c * c).mean(axis=0)
    within, between = class_covariance_traces(x, y)
    out = {
        "dim": int(x.shape[1]),
        "mean_norm": float(np.linalg.norm(mu)),
        "total_var": total,
        "erank": effective_rank(x),
        "erank_unc": entropy_rank(second_eig),
        "cos": mean_pairwise_cosine(x),
        "spread": total / max(float(mu @ mu), 1e-300),
        "pc1": float(cov_eig[0] / total) if total > 0 else float("nan"),
        "pc90": int(np.searchsorted(np.cumsum(cov_eig) / total, 0.9) + 1) if total > 0 else 0,
        "eig_top5": [float(v / total) for v in cov_eig[:5]] if total > 0 else [],
        "mean_dir_var": float(((c @ (mu / np.linalg.norm(mu))) ** 2).mean() / total)
        if total > 0 and mu @ mu > 0 else float("nan"),
        "live": int((var > 1e-6 * var.max()).sum()) if var.max() > 0 else 0,
        "vci": variability_collapse_index(x, y),
        "trace_within": within,
        "trace_between": between,
        "between": between / (within + between) if within + between > 0 else float("nan"),
    }
    if probe:
        out["probe"] = linear_probe(x, y)
    return out


def parse_run(spec: str) -> tuple[str, int | None]:
    if "@" in spec:
        run_dir, rnd = spec.rsplit("@", 1)
        return run_dir, int(rnd)
    return spec, None


def load_state(run_dir: str, at_most: int | None, dataset=None):
    """The experiment and server state of the newest checkpoint (at or before ``at_most``),
    as ``fedjax_rcl.training.restore_run`` reads them."""
    from fedjax_rcl.checkpoint import Checkpointer
    from fedjax_rcl.experiment import build
    from fedjax_rcl.loop import load_run_config

    _, cfg = load_run_config(Path(run_dir))
    exp = build(cfg, dataset)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=max(cfg.keep_checkpoints, 1000))
    try:
        restored = ckpt.restore_latest(exp.table.checkpoint(exp.state), at_most=at_most)
    finally:
        ckpt.close()
    if restored is None:
        raise SystemExit(f"{run_dir}: no complete checkpoint at or before round {at_most}")
    return exp, exp.table.restore(restored.state), int(restored.step), cfg


def extract(run_dir: str, at_most: int | None, images: int, cache: Path | None, datasets: dict):
    """Levels, embedding, logits and labels of the subset, from the cache when present."""
    key = None
    if cache is not None:
        ckpts = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())
        key = hashlib.sha1(f"{Path(run_dir).resolve()}|{at_most}|{images}|{ckpts}".encode()
                           ).hexdigest()[:16]
        path = cache / f"{Path(run_dir).name}-{key}.npz"
        if path.exists():
            z = np.load(path, allow_pickle=False)
            levels = [z[f"level{k}"] for k in range(int(z["num_levels"]))]
            return (levels, z["emb"], z["logits"], z["labels"], int(z["round"]),
                    str(z["algorithm"]))
    import jax

    from fedjax_rcl.data.augment import normalize
    from fedjax_rcl.engine.analysis import analysis_subset
    from fedjax_rcl.loop import load_run_config

    _, cfg0 = load_run_config(Path(run_dir))
    exp, state, rnd, cfg = load_state(run_dir, at_most, datasets.get(cfg0.dataset))
    datasets[cfg.dataset] = exp.dataset
    ds = exp.dataset
    pick = analysis_subset(ds.test_labels, images)
    x = normalize(np.asarray(ds.test_images)[pick], ds.mean, ds.std)
    y = np.asarray(ds.test_labels)[pick]
    apply = jax.jit(lambda p, s, x: exp.model.apply(p, s, x, train=False)[0]._replace(blocks=()))
    outs = [apply(state.params, state.model_state, x[i:i + 250]) for i in range(0, len(x), 250)]
    levels = [np.concatenate([np.asarray(o.features[k]) for o in outs])
              for k in range(len(outs[0].features))]
    emb = np.concatenate([np.asarray(o.embedding) for o in outs])
    logits = np.concatenate([np.asarray(o.logits) for o in outs])
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(path, emb=emb, logits=logits, labels=y, round=rnd, algorithm=cfg.algorithm,
                 num_levels=len(levels), **{f"level{k}": f for k, f in enumerate(levels)})
    return levels, emb, logits, y, rnd, cfg.algorithm


def analyse(spec: str, images: int, cache: Path | None, datasets: dict) -> dict:
    run_dir, at_most = parse_run(spec)
    levels, emb, logits, y, rnd, algorithm = extract(run_dir, at_most, images, cache, datasets)
    pred = logits.argmax(-1)
    variants = {"emb": emb, "emb/l2": l2_rows(emb)}
    for k, f in enumerate(levels):
        variants[f"L{k}"] = f
        variants[f"L{k}/l2"] = l2_rows(f)
    return {
        "run": Path(run_dir).name, "run_dir": run_dir, "algorithm": algorithm, "round": rnd,
        "images": int(len(y)), "accuracy": float((pred == y).mean()),
        "top_class": float(np.bincount(pred).max() / len(pred)),
        "variants": {name: feature_metrics(f, y) for name, f in variants.items()},
    }


def synthetic(images: int, dim: int = 128, seed: int = 0) -> list[dict]:
    """A point plus tiny noise: isotropic, and in 5 directions of decaying size."""
    rng = np.random.default_rng(seed)
    y = np.arange(images) % 10
    mu = np.abs(rng.normal(size=dim))
    iso = mu + 1e-2 * rng.normal(size=(images, dim))
    basis = np.linalg.qr(rng.normal(size=(dim, 5)))[0]
    aniso = (mu + (rng.normal(size=(images, 5)) * np.array([1, .6, .4, .3, .2]) * 3e-2)
             @ basis.T)
    rows = []
    for name, x in (("synthetic: point + isotropic noise", iso),
                    ("synthetic: point + noise in 5 directions", aniso)):
        rows.append({"run": name, "algorithm": "-", "round": None, "images": images,
                     "accuracy": None, "top_class": None,
                     "variants": {"emb": feature_metrics(x, y)}})
    return rows


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4):
            return f"{v:.2e}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def _embeddings(results: list[dict]):
    """``(run result, variant name, metrics)`` of each run's embedding variants."""
    for r in results:
        for name in ("emb", "emb/l2"):
            if name in r["variants"]:
                yield r, name, r["variants"][name]


def markdown(results: list[dict]) -> str:
    lines = ["### Embedding (what the analysis sees) and its L2-normalised rows", "",
             "| run | round | acc | top_class | features | " + " | ".join(EMB_METRICS) + " |",
             "|---" * (5 + len(EMB_METRICS)) + "|"]
    for r, name, m in _embeddings(results):
        lines.append(f"| {r['run']} | {fmt(r['round'])} | {fmt(r['accuracy'])} | "
                     f"{fmt(r['top_class'])} | {name} | "
                     + " | ".join(fmt(m.get(k)) for k in EMB_METRICS) + " |")
    lines += ["", "### FedRCL's levels (pre-ReLU, mean-pooled; /l2: rows normalised)", "",
              "| run | round | level | " + " | ".join(LEVEL_METRICS) + " |",
              "|---" * (3 + len(LEVEL_METRICS)) + "|"]
    for r in results:
        for name, m in r["variants"].items():
            if name.startswith("emb"):
                continue
            lines.append(f"| {r['run']} | {fmt(r['round'])} | {name} | "
                         + " | ".join(fmt(m.get(k)) for k in LEVEL_METRICS) + " |")
    lines += ["", "### Covariance spectrum of the embedding (top five eigenvalue shares, "
              "variance along the mean direction)", "",
              "| run | round | features | mean norm | total var | top-5 eigenvalue shares | "
              "mean-direction share |", "|---" * 7 + "|"]
    for r, name, m in _embeddings(results):
        lines.append(f"| {r['run']} | {fmt(r['round'])} | {name} | {fmt(m['mean_norm'])} | "
                     f"{fmt(m['total_var'])} | "
                     + ", ".join(f"{v:.3f}" for v in m["eig_top5"])
                     + f" | {fmt(m['mean_dir_var'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR@ROUND")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--cache", type=Path, help="a folder for the extracted features (.npz)")
    ap.add_argument("--synthetic", action="store_true", help="add the synthetic control rows")
    ap.add_argument("--json", type=Path, help="write the results as a JSON list")
    ap.add_argument("--markdown", type=Path, help="write the Markdown tables")
    args = ap.parse_args()
    results, datasets = [], {}
    for spec in args.runs:
        results.append(analyse(spec, args.images, args.cache, datasets))
        print(json.dumps(results[-1]), flush=True)
    if args.synthetic:
        results += synthetic(args.images)
    table = markdown(results)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
