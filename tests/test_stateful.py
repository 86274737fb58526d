"""Stateful algorithms (SCAFFOLD, FedDyn): the compiled rounds against a float64 NumPy round
on random inputs, side by side and one after another, full and partial participation; their
server and client state checkpointed and resumed exactly; a run written before the algorithm
server state existed still resumes."""

import tarfile
from pathlib import Path

import chex
import flax.linen as nn
import jax
import numpy as np
import pytest

from fedjax_rcl.config import Config, load_config
from fedjax_rcl.engine.client import epoch_permutations
from fedjax_rcl.engine.round import client_keys, clients_per_round, sample_clients
from fedjax_rcl.experiment import build
from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.training import restore_run, resume_single, train

CLASSES = 4


class Linear(nn.Module):
    """Softmax regression on the flattened image: a model whose gradient NumPy writes down."""

    @nn.compact
    def __call__(self, x, *, train=True, start=0):
        del train, start
        x = x.reshape(x.shape[0], -1)
        logits = nn.Dense(CLASSES, kernel_init=nn.initializers.normal(0.05),
                          bias_init=nn.initializers.normal(0.05))(x)
        return ModelOutput(logits, (), x, None, ())


def _cfg(algorithm, **kw):
    base = dict(dataset="toy", model="cnn", algorithm=algorithm, num_clients=6,
                participation=0.5, partition="dirichlet", alpha=0.5, balanced=False,
                local_epochs=2, batch_size=16, lr=0.05, lr_decay=0.9, momentum=0.9,
                weight_decay=1e-3, clip_norm=0.0, augment=False, rounds=2)
    base.update(kw)
    return Config(**base)


def _softmax_grad(w, b, x, y):
    """Mean cross-entropy's gradient of softmax regression, float64."""
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = (p - np.eye(CLASSES)[y]) / len(y)
    return x.T @ d, d.sum(0)


def _reference_rounds(exp, rounds, algorithm, alpha):
    """``rounds`` rounds of ``algorithm`` client by client in float64 NumPy: the same clients,
    batches and learning rates as the engine draws (sampling and shuffles are not under test),
    every update written out from the papers' equations."""
    cfg, st = exp.cfg, exp.state
    n = cfg.num_clients
    leaf = lambda tree: {k: np.asarray(v, np.float64) for k, v in tree["Dense_0"].items()}
    params = leaf(st.params)
    server = leaf(st.algorithm_state)
    table = {k: np.asarray(v, np.float64) for k, v in st.client_states["Dense_0"].items()}
    images = np.asarray(exp.data.images, np.float64) / 255.0
    mean, std = np.asarray(exp.dataset.mean), np.asarray(exp.dataset.std)
    x_all = ((images - mean) / std).reshape(len(images), -1)
    labels = np.asarray(exp.data.labels)
    m = clients_per_round(n, cfg.participation)
    for r in range(rounds):
        clients = np.asarray(sample_clients(st.key, np.int32(r), n, m))
        keys = client_keys(st.key, np.int32(r), clients)
        sizes = np.asarray(exp.data.client_sizes)[clients].astype(np.float64)
        trained, results = [], []
        for j, c in enumerate(clients):
            size = int(exp.data.client_sizes[c])
            indices = np.asarray(exp.data.client_indices[c])
            perm_key, _ = jax.random.split(keys[j])
            perms = np.asarray(epoch_permutations(perm_key, size, len(indices),
                                                  cfg.local_epochs))
            steps = size // cfg.batch_size if cfg.drop_last else -(-size // cfg.batch_size)
            w, b = params["kernel"].copy(), params["bias"].copy()
            mw, mb = np.zeros_like(w), np.zeros_like(b)
            row = {k: v[c] for k, v in table.items()}
            lr_sum = 0.0
            for t in range(cfg.local_epochs * steps):
                epoch, bi = divmod(t, steps)
                pos = (bi * cfg.batch_size + np.arange(cfg.batch_size)) % size
                idx = indices[perms[epoch, pos]]
                gw, gb = _softmax_grad(w, b, x_all[idx], labels[idx])
                if algorithm == "feddyn":  # - <g_k, theta> + alpha/2 ||theta - theta_g||^2
                    gw = gw - row["kernel"] + alpha * (w - params["kernel"])
                    gb = gb - row["bias"] + alpha * (b - params["bias"])
                lr = cfg.lr * cfg.lr_decay ** (r + epoch)
                lr_sum += lr
                gw, gb = gw + cfg.weight_decay * w, gb + cfg.weight_decay * b
                mw, mb = gw + cfg.momentum * mw, gb + cfg.momentum * mb
                uw, ub = -lr * mw, -lr * mb
                if algorithm == "scaffold":  # y <- y - lr (c - c_i), after the optimizer
                    uw = uw - lr * (server["kernel"] - row["kernel"])
                    ub = ub - lr * (server["bias"] - row["bias"])
                w, b = w + uw, b + ub
            y = {"kernel": w, "bias": b}
            if algorithm == "scaffold":  # option II
                new = {k: row[k] - server[k] + (params[k] - y[k]) / lr_sum for k in y}
                results.append({k: new[k] - row[k] for k in y})
            else:
                new = {k: row[k] - alpha * (y[k] - params[k]) for k in y}
                results.append({k: y[k] - params[k] for k in y})
            for k in y:
                table[k][c] = new[k]
            trained.append(y)
        weights = sizes / sizes.sum()
        mean_model = {k: sum(wj * t[k] for wj, t in zip(weights, trained, strict=True))
                      for k in params}
        summed = {k: sum(res[k] for res in results) for k in params}
        if algorithm == "scaffold":
            server = {k: server[k] + summed[k] / n for k in params}
            params = mean_model
        else:
            server = {k: server[k] - alpha * summed[k] / n for k in params}
            params = {k: mean_model[k] - server[k] / alpha for k in params}
    return params, server, table


@pytest.mark.parametrize("algorithm,alpha", [("scaffold", None), ("feddyn", 0.1)])
@pytest.mark.parametrize("participation,in_parallel,drop_last", [
    # Side by side with every client, and one by one with some: the default step; the
    # other two layouts in the slow step.
    pytest.param(0.5, 0, False, id="partial-side-by-side", marks=pytest.mark.slow),
    pytest.param(0.5, 1, False, id="partial-one-by-one"),
    pytest.param(1.0, 0, False, id="full-side-by-side"),
    pytest.param(1.0, 2, True, id="full-groups-of-2-drop-last", marks=pytest.mark.slow)])
def test_rounds_equal_a_float64_numpy_reference(toy, algorithm, alpha, participation,
                                                in_parallel, drop_last):
    cfg = _cfg(algorithm, participation=participation, clients_in_parallel=in_parallel,
               drop_last=drop_last)
    if alpha is not None:
        cfg.feddyn.alpha = alpha
    exp = build(cfg, toy, module=Linear())
    sizes = np.asarray(exp.data.client_sizes)
    assert sizes.min() != sizes.max()  # uneven clients: different step counts K
    params, server, table = _reference_rounds(exp, 2, algorithm, alpha)
    step = jax.jit(exp.run_round)
    state = exp.state
    for _ in range(2):
        state, _ = step(state, exp.data)
    got = lambda tree: jax.tree.map(np.asarray, tree["Dense_0"])
    chex.assert_trees_all_close(got(state.params), params, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(got(state.algorithm_state), server, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(got(state.client_states), table, rtol=2e-4, atol=2e-5)
    # The state really moved: every client that trained has a nonzero row.
    assert np.abs(server["kernel"]).max() > 1e-4
    trained = np.abs(table["kernel"]).reshape(cfg.num_clients, -1).max(1) > 0
    assert trained.sum() >= clients_per_round(cfg.num_clients, participation)


TINY = ["dataset=digits", "num_clients=10", "participation=0.3", "local_epochs=1",
        "batch_size=32", "momentum=0.5"]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_stop_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, algorithm):
    quiet = dict(progress=False, log=lambda s: None)
    base = [*TINY, f"algorithm={algorithm}", "checkpoint_every=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(load_config(None, [*base, "rounds=4", f"run_dir={whole}"]), **quiet)
    train(load_config(None, [*base, "rounds=2", f"run_dir={cut}"]), **quiet)
    resume_single(cut, ["rounds=4"], **quiet)
    a, b = restore_run(whole)[1], restore_run(cut)[1]
    assert a.step == b.step == 4
    chex.assert_trees_all_equal(a.state, b.state)
    assert np.abs(jax.tree.leaves(a.state.algorithm_state)[0]).max() > 0


@pytest.mark.slow
def test_a_run_written_before_algorithm_state_existed_resumes(tmp_path):
    """tests/data/run_5c33619.tar.gz: a tiny FedAvg run (2 rounds) written by commit 5c33619,
    before ``ServerState.algorithm_state``; it resumes, and its third round equals a fresh
    run's (within float reassociation: the two were compiled apart)."""
    with tarfile.open(Path(__file__).parent / "data" / "run_5c33619.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    old, fresh = tmp_path / "run", tmp_path / "fresh"
    quiet = dict(progress=False, log=lambda s: None)
    resume_single(old, ["rounds=3"], **quiet)
    cfg = restore_run(old)[0].cfg
    train(load_config(None, ["algorithm=fedavg", "num_clients=4", "participation=0.5",
                             "local_epochs=1", "rounds=3", f"run_dir={fresh}"]), **quiet)
    a, b = restore_run(old)[1], restore_run(fresh)[1]
    assert a.step == b.step == 3 and cfg.algorithm == "fedavg"
    # Rounds 1-2 of the archived run were computed on another machine with other XLA flags.
    chex.assert_trees_all_close(a.state.params, b.state.params, rtol=1e-3, atol=1e-4)


def test_table_memory_is_estimated_before_anything_is_built():
    from fedjax_rcl.engine.tables import describe_table, table_memory_problem

    row = {"w": jax.ShapeDtypeStruct((1000, 250), np.float32)}  # 1 MB a client
    assert table_memory_problem("device", "moon", row, 1000, host_free=10**10) is None
    assert table_memory_problem("device", "moon", (), 10**9, host_free=1) is None  # no state
    line = table_memory_problem("device", "moon", row, 6000, host_free=10**10)
    # On a CPU the device table is held twice while placed: 12 GB; the host table once fits.
    assert line == ("client_states=device: moon's per-client state needs 12.00 GB (6,000 "
                    "clients x 1.00 MB) and host memory (a CPU device's) has 10.00 GB "
                    "available; use fewer clients or a smaller model, or client_states=host "
                    "(it holds the table once, in host memory), or client_states=sparse (rows "
                    "only for the clients who train), or client_states=disk (those rows in "
                    "files)")
    assert table_memory_problem("host", "moon", row, 6000, host_free=10**10) is None
    gpu = table_memory_problem("device", "moon", row, 6000, host_free=10**9, device_free=10**9)
    assert "device memory has 1.00 GB" in gpu and "client_states=host" not in gpu
    assert describe_table("host", row, 2000) == ", client states 2.00 GB on the host"


def test_a_table_that_cannot_fit_stops_before_compiling_with_one_line(tmp_path, capsys,
                                                                      monkeypatch):
    from fedjax_rcl.cli import main
    from fedjax_rcl.engine import tables

    monkeypatch.setattr(tables, "available_memory", lambda: 10**6)  # 1 MB left
    run = tmp_path / "run"
    assert main(["train", "algorithm=moon", "rounds=1", f"run_dir={run}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "client_states=device: moon's per-client state needs" in err[0]
    assert not run.exists()


def _run_metrics(run_dir):
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for timing in ("elapsed_s", "round_s", "total_s"):
            r.pop(timing)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["moon", "scaffold"])
def test_sparse_table_matches_the_dense_one_holds_only_trained_rows_and_resumes(tmp_path,
                                                                               algorithm):
    """``client_states=sparse``: the same results as the host table (bitwise: the same rows
    reach the same compiled round), rows only for the clients sampled so far (a client never
    sampled reads the initial state), and a stop and resume with more rows in the later
    checkpoint is exact: the sparse run stops at round 2 (fewer rows saved) and resumes to 4,
    and equals the host table's uninterrupted run."""
    quiet = dict(progress=False, log=lambda s: None)
    base = [*TINY, f"algorithm={algorithm}", "num_clients=40", "participation=0.05",
            "checkpoint_every=2"]
    host, sparse = tmp_path / "host", tmp_path / "sparse"
    train(load_config(None, [*base, "rounds=4", "client_states=host", f"run_dir={host}"]),
          **quiet)
    train(load_config(None, [*base, "rounds=2", "client_states=sparse", f"run_dir={sparse}"]),
          **quiet)
    resume_single(sparse, ["rounds=4"], **quiet)
    assert _run_metrics(host) == _run_metrics(sparse)
    exp, restored = restore_run(sparse)
    exp_host, restored_host = restore_run(host)
    table = exp.table
    sampled = {c for r in _run_metrics(sparse) for c in r.get("clients", [])} or None
    trained = set(table.trained().tolist())
    assert table.count == len(trained) <= 4 * 2  # 2 clients a round, 4 rounds
    if sampled is not None:
        assert trained == sampled
    for c in range(40):  # every row equals the dense table's, trained or not
        chex.assert_trees_all_equal(
            jax.tree.map(np.asarray, table.row(None, c)),
            jax.tree.map(lambda t, c=c: np.asarray(t[c]), exp_host.table.rows))
    chex.assert_trees_all_equal(restored.state["server"], restored_host.state["server"])


@pytest.mark.slow
def test_disk_table_equals_the_sparse_one_and_resumes_from_its_snapshots(tmp_path):
    """``client_states=disk``: the rows in files under the run directory give the sparse
    table's run bitwise (the same rows reach the same compiled round); a stop at round 2 and a
    resume to 4 read the round-2 snapshot back; only the newest snapshots are kept; and a
    snapshot that does not match its checkpoint, or is missing, stops the restore."""
    import shutil

    quiet = dict(progress=False, log=lambda s: None)
    base = [*TINY, "algorithm=moon", "num_clients=40", "participation=0.05",
            "checkpoint_every=1", "keep_checkpoints=2"]
    sparse, disk = tmp_path / "sparse", tmp_path / "disk"
    train(load_config(None, [*base, "rounds=4", "client_states=sparse",
                             f"run_dir={sparse}"]), **quiet)
    train(load_config(None, [*base, "rounds=2", "client_states=disk", f"run_dir={disk}"]),
          **quiet)
    resume_single(disk, ["rounds=4"], **quiet)
    assert _run_metrics(sparse) == _run_metrics(disk)
    exp, restored = restore_run(disk)
    exp_sparse, restored_sparse = restore_run(sparse)
    exp.table.restore(restored.state)
    exp_sparse.table.restore(restored_sparse.state)
    assert exp.table.name == "disk" and exp.table.count == exp_sparse.table.count > 0
    np.testing.assert_array_equal(exp.table.trained(), exp_sparse.table.trained())
    for c in range(40):
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, exp.table.row(None, c)),
                                    jax.tree.map(np.asarray, exp_sparse.table.row(None, c)))
    chex.assert_trees_all_equal(restored.state["server"], restored_sparse.state["server"])
    snapshots = disk / "client_table" / "snapshots"
    assert sorted(int(p.name) for p in snapshots.iterdir()) == [2, 3, 4]  # keep 2, and 1
    assert isinstance(jax.tree.leaves(exp.table.store)[0], np.memmap)
    # A snapshot that does not match its checkpoint, then one missing, is refused.
    leaf = snapshots / "4" / "0.npy"
    rows = np.load(leaf)
    rows[0] += 1
    np.save(leaf, rows)
    with pytest.raises(ValueError, match="snapshot of round 4 does not match its checkpoint"):
        exp.table.restore(restored.state)
    shutil.rmtree(snapshots / "4")
    with pytest.raises(FileNotFoundError, match="snapshot of round 4 is missing"):
        exp.table.restore(restored.state)


def test_disk_table_is_chosen_when_host_memory_cannot_hold_the_rows():
    from fedjax_rcl.engine.tables import choose_table, describe_table, table_memory_problem

    row = {"w": jax.ShapeDtypeStruct((1000, 250), np.float32)}  # 1 MB a client
    # 1,000 clients can train: 1 GB, more than the host's 0.5 GB, less than the disk's 10 GB.
    assert choose_table(row, 10**6, 10, 100, host_free=5 * 10**8, device_free=10**8,
                        disk=10**10) == "disk"
    assert choose_table(row, 10**6, 10, 100, host_free=10**10, device_free=10**8,
                        disk=10**10) == "sparse"
    assert choose_table(row, 10**6, 10, 100, host_free=5 * 10**8, device_free=10**8) == (
        "sparse")  # no run directory: no disk table
    assert table_memory_problem("disk", "moon", row, 1000, disk=10**10) is None
    assert table_memory_problem("disk", "moon", row, 1000, disk=10**9) == (
        "client_states=disk: moon's per-client state needs 2.00 GB on disk (1,000 clients "
        "who can have trained x 1.00 MB, in the table and a checkpoint's snapshot) and the run "
        "directory's file system has 1.00 GB free; use fewer clients, fewer rounds or a "
        "smaller model")
    assert describe_table("disk", row, 1000) == (
        ", client states at most 1.00 GB on disk (rows for the 1,000 clients who can have "
        "trained)")


def test_sparse_table_is_estimated_by_the_clients_who_can_train():
    from fedjax_rcl.engine.tables import describe_table, table_memory_problem, table_rows

    row = {"w": jax.ShapeDtypeStruct((1000, 250), np.float32)}  # 1 MB a client
    assert table_rows("sparse", 10**6, 10, 100) == 1000
    assert table_rows("host", 10**6, 10, 100) == 10**6
    assert table_memory_problem("sparse", "moon", row, 1000, host_free=10**10) is None
    line = table_memory_problem("host", "moon", row, 10**6, host_free=10**10)
    assert "or client_states=sparse (rows only for the clients who train)" in line
    assert describe_table("sparse", row, 1000) == (
        ", client states at most 1.00 GB in host memory (rows for the 1,000 clients who can "
        "have trained)")


@pytest.mark.slow  # three runs end to end; the estimate it follows is tested by default
def test_auto_places_the_table_by_its_estimate_and_the_run_records_the_choice(tmp_path,
                                                                             monkeypatch):
    """``client_states=auto``: the whole table on the device where it fits, else sparse; the
    start-up line says which, config.yaml records it, and a resume keeps it."""
    from fedjax_rcl.engine import tables

    quiet = dict(progress=False)
    base = [*TINY, "algorithm=moon", "num_clients=40", "participation=0.05", "rounds=2",
            "client_states=auto"]
    lines: list[str] = []
    roomy = tmp_path / "roomy"
    train(load_config(None, [*base, f"run_dir={roomy}"]), log=lines.append, **quiet)
    assert "client_states: device" in (roomy / "config.yaml").read_text()
    assert any("client states" in x and "on the device" in x for x in lines)
    # 40 MOON rows do not fit twice in the memory left, the 4 that can train do.
    row_bytes = tables.table_bytes(restore_run(roomy)[0].table.row(restore_run(roomy)[1].state, 0),
                                   1)[0]
    monkeypatch.setattr(tables, "available_memory", lambda: int(12 * row_bytes))
    lines.clear()
    tight = tmp_path / "tight"
    train(load_config(None, [*base, f"run_dir={tight}"]), log=lines.append, **quiet)
    assert "client_states: sparse" in (tight / "config.yaml").read_text()
    assert any("client states at most" in x for x in lines)
    resume_single(tight, ["rounds=3"], progress=False, log=lambda s: None)
    assert restore_run(tight)[0].table.name == "sparse"
