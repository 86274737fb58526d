"""Several runs in one compiled program (``seeds=[...]``): each member equals its seed's run
alone, bitwise; an interrupted grid resumes to the uninterrupted result; members are ordinary
runs; bad grids are refused before anything is built."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import fedjax_rcl
from fedjax_rcl.cli import main
from fedjax_rcl.training import restore_run

# Uneven Dirichlet clients (different sizes per seed, so members are padded to one shape).
GRID = ["algorithm=fedavg", "num_clients=5", "participation=0.6", "local_epochs=1",
        "partition=dirichlet", "alpha=0.5", "balanced=false", "batch_size=32", "eval_every=1"]


def _rows(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def _params(run_dir):
    exp, restored = restore_run(run_dir)
    return restored.step, jax.tree.leaves(exp.table.restore(restored.state).params)


def _sizes(run_dir):
    exp, _ = restore_run(run_dir)
    return sorted(len(p) for p in exp.parts)


@pytest.fixture(scope="module")
def grid01(tmp_path_factory):
    """Seeds 0 and 1 to round 3 in one program, a checkpoint every round: read by three tests
    (each pytest-xdist worker that runs one of them trains it once)."""
    return fedjax_rcl.train(None, *GRID, "rounds=3", "seeds=[0,1]", "checkpoint_every=1",
                            f"run_dir={tmp_path_factory.mktemp('grid01') / 'grid'}")


@pytest.mark.slow
def test_each_member_equals_its_seed_run_alone_bitwise(grid01, tmp_path):
    grid = grid01
    assert [m.run_dir.name for m in grid.members] == ["seed-0", "seed-1"]
    # Largest clients 353 and 333 samples: 12 and 11 steps of 32, so seed 1 is padded.
    assert len({max(_sizes(m.run_dir)) for m in grid.members}) > 1, "members must be padded"
    for member, seed in zip(grid.members, (0, 1), strict=True):
        assert member.config.seed == seed and member.config.seeds == []
        alone = fedjax_rcl.train(None, *GRID, "rounds=3", f"seed={seed}",
                                 f"run_dir={tmp_path / f'alone-{seed}'}")
        assert _rows(member.run_dir) == _rows(alone.run_dir)
        (step_g, grid_params), (step_a, alone_params) = (_params(member.run_dir),
                                                         _params(alone.run_dir))
        assert step_g == step_a == 3
        for g, a in zip(grid_params, alone_params, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(a))
    # The seeds really differ.
    assert _rows(grid.members[0].run_dir) != _rows(grid.members[1].run_dir)


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_an_interrupted_grid_resumes_to_the_uninterrupted_result(grid01, tmp_path):
    whole = grid01
    seen = []

    def stop_at_2(record):
        seen.append((record["round"], len(record["runs"])))
        return record["round"] == 2

    part = fedjax_rcl.train(None, *GRID, "rounds=3", "seeds=[0,1]",
                            f"run_dir={tmp_path / 'part'}", callbacks=[stop_at_2])
    assert part.stopped_early and seen == [(1, 2), (2, 2)]
    assert [r["round"] for r in part.members[1].metrics] == [1, 2]
    again = fedjax_rcl.resume(part.run_dir)
    for a, w in zip(again.members, whole.members, strict=True):
        assert [r["round"] for r in a.metrics] == [1, 2, 3]
        assert _rows(a.run_dir) == _rows(w.run_dir)
        for x, y in zip(_params(a.run_dir)[1], _params(w.run_dir)[1], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ev = fedjax_rcl.evaluate(again.run_dir)
    assert [r["round"] for r in ev["runs"]] == [3, 3]
    assert ev["test_accuracy"] == pytest.approx(np.mean([r["test_accuracy"] for r in ev["runs"]]))
    # A member is an ordinary run: it continues alone.
    one = fedjax_rcl.resume(again.members[0].run_dir, "rounds=4")
    assert [r["round"] for r in one.metrics] == [1, 2, 3, 4]


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_a_resumed_grid_keeps_the_layouts_it_began_with(tmp_path, monkeypatch):
    """The layout cost model refitted between two processes of a grid (its CPU threshold
    moved so that the runs and their clients, side by side when it began, would now go one
    at a time): the grid and its members keep the layouts their first process recorded, and
    end as the grid that went through."""
    from fedjax_rcl.engine import layout

    def layouts(run, key):
        return [r["layout"][key] for r in map(
            json.loads, (Path(run) / "environment.jsonl").read_text().splitlines())]

    auto = [*GRID, "seeds=[0,1]", "runs_in_parallel=0"]  # runs: the cost model's choice
    monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, "cpu", float("inf"))
    part = fedjax_rcl.train(None, *auto, "rounds=2", f"run_dir={tmp_path / 'g'}")
    monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, "cpu", 0.0)  # the refit
    lines = []
    again = fedjax_rcl.resume(part.run_dir, "rounds=3", log=lines.append)
    assert layouts(again.run_dir, "runs_in_parallel") == [2, 2]
    assert any("2 runs, side by side" in x for x in lines), lines
    whole = fedjax_rcl.train(None, *GRID, "seeds=[0,1]", "runs_in_parallel=2",
                             "clients_in_parallel=3", "rounds=3", f"run_dir={tmp_path / 'w'}")
    for a, w in zip(again.members, whole.members, strict=True):
        assert layouts(a.run_dir, "clients_in_parallel") == [0, 0]
        assert _rows(a.run_dir) == _rows(w.run_dir)


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_a_grid_resumes_from_the_newest_round_every_member_has(grid01, tmp_path):
    part = fedjax_rcl.train(None, *GRID, "rounds=2", "seeds=[0,1]", "checkpoint_every=1",
                            f"run_dir={tmp_path / 'g'}")
    # Member seed-1 lost its round-2 checkpoint (a crash between the members' saves).
    lost = part.members[1].run_dir / "checkpoints" / "2"
    assert lost.is_dir()
    import shutil

    shutil.rmtree(lost)
    again = fedjax_rcl.resume(part.run_dir, "rounds=3")
    for m in again.members:
        assert [r["round"] for r in m.metrics] == [1, 2, 3]
    for a, w in zip(again.members, grid01.members, strict=True):
        assert _rows(a.run_dir) == _rows(w.run_dir)


@pytest.mark.slow  # the CLI over a grid, end to end; the API's grids run by default
def test_the_command_line_trains_a_grid_and_prints_mean_and_sd(tmp_path, capsys):
    run_dir = tmp_path / "cli"
    assert main(["train", "--no-progress", *GRID, "seeds=[0,1,2]", "rounds=2",
                 f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "± " in out and "over 3 seeds" in out
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == [
        "seed-0", "seed-1", "seed-2"]
    assert "seeds:\n- 0\n- 1\n- 2" in (run_dir / "config.yaml").read_text()
    assert "seed: 1\n" in (run_dir / "seed-1" / "config.yaml").read_text()
    assert main(["eval", str(run_dir)]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert len(ev["runs"]) == 3 and ev["test_accuracy_sd"] >= 0


@pytest.mark.parametrize("bad, message", [
    (["seeds=[1,1]"], "seeds=[1, 1]: must not repeat a seed"),
    (["seeds=[0,1]", "client_states=host"], "client_states='host': must be 'device' with seeds"),
    (["seeds=[-1]"], "seeds=[-1]: must be a list of integers >= 0"),
])
def test_bad_grids_are_refused_with_the_field_and_what_is_allowed(tmp_path, capsys, bad,
                                                                  message):
    run_dir = tmp_path / "bad"
    assert main(["train", "--no-progress", *GRID, "rounds=1", *bad,
                 f"run_dir={run_dir}"]) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.slow  # three grids end to end; members equal to runs alone run by default
def test_runs_side_by_side_agree_with_runs_one_after_another(tmp_path):
    """``runs_in_parallel=2`` vmaps the two runs: the same results up to float reassociation
    (at a small learning rate: at lr=0.1 this CNN amplifies last-bit differences to 1e-3
    within a round, as it does between two convolution implementations)."""
    slow = [*GRID, "lr=0.005"]
    mapped = fedjax_rcl.train(None, *slow, "rounds=2", "seeds=[0,1]",
                              f"run_dir={tmp_path / 'mapped'}")
    side = fedjax_rcl.train(None, *slow, "rounds=2", "seeds=[0,1]", "runs_in_parallel=2",
                            f"run_dir={tmp_path / 'side'}")
    for a, b in zip(mapped.members, side.members, strict=True):
        ra, rb = _rows(a.run_dir), _rows(b.run_dir)
        assert [r["round"] for r in ra] == [r["round"] for r in rb] == [1, 2]
        for x, y in zip(ra, rb, strict=True):
            for k in ("train_loss", "test_loss", "test_accuracy"):
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-4), k
        for x, y in zip(_params(a.run_dir)[1], _params(b.run_dir)[1], strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_runs_in_parallel_0_follows_the_layout_cost_model(monkeypatch):
    """``runs_in_parallel=0`` puts all runs side by side iff their step work together (runs x
    clients a run trains side by side x one client's training-step GFLOP) is below the
    platform's threshold, else one after another; the threshold is moved around this grid's
    work (no timing). A configured count is kept, at most the number of runs."""
    from dataclasses import replace

    from fedjax_rcl import grid
    from fedjax_rcl.config import load_config
    from fedjax_rcl.engine import layout
    from fedjax_rcl.experiment import training_step_gflop

    cfg = load_config(None, [*GRID, "seeds=[0,1,2]", "runs_in_parallel=0"])
    exps = grid.build_members(grid.member_configs(cfg, None))
    e = exps[0]
    step = training_step_gflop(e.model, e.state.params, e.state.model_state,
                               e.dataset.image_shape, 32)
    assert step > 0
    work = 3 * 3 * step  # 3 runs x 3 clients a round (5 x 0.6), side by side, x one step
    for platform in ("cpu", "gpu"):
        for threshold, expected in [(work * 1.01, 3), (work, 1), (work * 0.99, 1),
                                    (work / 3 * 1.01, 1), (step * 0.5, 1)]:
            monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, platform, threshold)
            assert grid.runs_in_parallel(exps, platform) == expected, (platform, threshold)
    # Clients one after another within a run put one client's step per run on the device.
    apart = [replace(e, cfg=replace(e.cfg, clients_in_parallel=1))]
    monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, "gpu", 3 * step * 1.01)
    assert grid.runs_in_parallel(apart * 3, "gpu") == 3
    assert grid.runs_in_parallel(exps, "gpu") == 1  # 3 clients side by side each: 9 steps
    for k, expected in [(1, 1), (2, 2), (5, 3)]:
        configured = [replace(e, cfg=replace(e.cfg, runs_in_parallel=k))]
        assert grid.runs_in_parallel(configured * 3, "gpu") == expected


def test_a_grid_that_cannot_fit_is_refused_before_compiling(tmp_path, monkeypatch, capsys):
    from fedjax_rcl import grid

    monkeypatch.setattr(grid, "device_memory", lambda: 4_000_000)  # 4 MB "device"
    run_dir = tmp_path / "big"
    assert main(["train", "--no-progress", *GRID, "rounds=1", "seeds=[0,1,2,3,4,5,6,7]",
                 f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "seeds=[0, 1, 2, 3, 4, 5, 6, 7]: 8 runs need about" in err
    assert "use fewer seeds" in err and "Traceback" not in err
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_sweep_of_alpha_gives_each_member_its_own_split_and_its_run_alone(tmp_path):
    """``alpha`` changes only the split (each member's data), so a member is its run alone,
    bitwise."""
    grid = fedjax_rcl.train(None, *GRID, "rounds=2", "alpha=[0.2,5]",
                            f"run_dir={tmp_path / 'grid'}")
    assert [m.run_dir.name for m in grid.members] == ["alpha-0.2", "alpha-5"]
    assert [m.config.alpha for m in grid.members] == [0.2, 5.0]
    assert _sizes(grid.members[0].run_dir) != _sizes(grid.members[1].run_dir)
    # The second member alone (the first member's split differs, so a member given the
    # other's data would differ from it).
    assert all(m.config.sweep.key is None and m.config.sweep.values == [] for m in grid.members)
    for member in grid.members[1:]:
        alone = fedjax_rcl.train(None, *GRID, "rounds=2", f"alpha={member.config.alpha}",
                                 f"run_dir={tmp_path / ('alone-' + member.run_dir.name)}")
        assert _rows(member.run_dir) == _rows(alone.run_dir)
        for g, a in zip(_params(member.run_dir)[1], _params(alone.run_dir)[1], strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(a))


def _within_fedrcl_noise(run_a, run_b) -> bool:
    """Whether two FedRCL runs' metrics and parameters agree within the sweep test's
    tolerances (its docstring says why these)."""
    for x, y in zip(_rows(run_a), _rows(run_b), strict=True):
        assert x.keys() == y.keys()
        for k in ("train_loss", "penalty", "test_loss"):
            if x[k] != pytest.approx(y[k], rel=2e-3):
                return False
        if abs(x["test_accuracy"] - y["test_accuracy"]) > 2.5 / 359:  # two test images
            return False
    return all(np.allclose(np.asarray(g), np.asarray(a), rtol=2e-3, atol=3e-3)
               for g, a in zip(_params(run_a)[1], _params(run_b)[1], strict=True))


@pytest.mark.slow  # a 4-member sweep and its resume; the alpha sweep runs by default
def test_a_sweep_of_an_algorithm_setting_with_seeds_equals_each_run_alone(tmp_path):
    """FedRCL's beta enters the one program as a traced value per run; each member agrees with
    its run alone (where beta is a constant) within what float reassociation can make of two
    rounds of FedRCL, and the values and seeds really differ.

    FedRCL amplifies a rounding-level difference: its penalty gates each classmate pair on
    ``similarity > threshold`` and its hard mining takes a min and a top-k, so a pair on the
    edge switches a term on or off. Moving the run alone's lr by 2^-22 relative (one place,
    one program) moves its penalty by about 2e-4 relative and a weight by 2e-4 to 4e-4, where
    FedAvg's moves by 1e-7; a member and its run alone differ by as much or less, and the
    member with the other beta by 0.2 in loss, 1.2 in penalty and 3e-2 in a weight
    (experiments/small_model_speed/grid_drift.json). The tolerances sit between the two."""
    fedrcl = [*GRID, "algorithm=fedrcl", "lr=0.01"]
    grid = fedjax_rcl.train(None, *fedrcl, "rounds=2", "fedrcl.beta=[0.5,3]", "seeds=[0,1]",
                            f"run_dir={tmp_path / 'grid'}")
    assert [m.run_dir.name for m in grid.members] == [
        "fedrcl.beta-0.5-seed-0", "fedrcl.beta-0.5-seed-1", "fedrcl.beta-3-seed-0",
        "fedrcl.beta-3-seed-1"]
    # The last member (beta 3, seed 1) alone agrees with it within the tolerances and with
    # none of the other three (another beta or another seed).
    member = grid.members[3]
    c = member.config
    alone = fedjax_rcl.train(None, *fedrcl, "rounds=2", f"fedrcl.beta={c.fedrcl.beta}",
                             f"seed={c.seed}", f"run_dir={tmp_path / member.run_dir.name}")
    assert [_within_fedrcl_noise(m.run_dir, alone.run_dir) for m in grid.members] == [
        False, False, False, True]
    # An interrupted sweep resumes whole, as a grid of seeds does.
    again = fedjax_rcl.resume(grid.run_dir, "rounds=3")
    assert [[r["round"] for r in m.metrics] for m in again.members] == [[1, 2, 3]] * 4


@pytest.mark.parametrize("bad, message", [
    (["local_epochs=[1,2]"], "local_epochs=[1,2]: a list of values is a sweep, of one float "
                             "setting"),
    (["lr=[0.1,0.2]", "alpha=[1,2]"], "lr, alpha: lists for 2 settings"),
    (["participation=[0.2,0.4]"], "sweep.key='participation': participation sets how many "
                                  "clients a round trains"),
    (["lr=[0.1,-1]"], "lr=-1: lr=-1.0: must be a finite number > 0"),
    (["lr=[0.1,0.1]"], "sweep.values=[0.1, 0.1]: must not repeat a value"),
    (["sweep.key=rounds", "sweep.values=[1,2]"], "sweep.key='rounds': must name a float "
                                                  "setting, such as fedrcl.beta, alpha or lr "
                                                  "(rounds is int)"),
    (["clip_norm=[0,10]"], "sweep.key='clip_norm': the training program decides by the value "
                           "of clip_norm in Python"),
])
def test_bad_sweeps_are_refused_before_the_run_starts(tmp_path, capsys, bad, message):
    run_dir = tmp_path / "bad"
    assert main(["train", "--no-progress", *GRID, "rounds=1", *bad,
                 f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not run_dir.exists()
