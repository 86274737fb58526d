"""``fedjax-rcl report``: the paper-layout table from run directories (methods as rows,
settings as columns, the EMA values of metrics.jsonl), the figures, the beta sweep, errors."""

import json

import pytest

from fedjax_rcl.cli import main

ARGS = ["dataset=digits", "num_clients=10", "participation=0.5", "local_epochs=1",
        "partition=iid", "rounds=2", "--no-progress"]

# FedRCL's label: the report names its loss (the released, hard-mined one by default).
RCL = "fedrcl (released hard-mined loss)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for name, extra in {"avg": ["algorithm=fedavg", "analysis_every=1", "analysis_images=100"],
                        "rcl": ["algorithm=fedrcl", "fedrcl.beta=1.0"],
                        "rcl-b05": ["algorithm=fedrcl", "fedrcl.beta=0.5"]}.items():
        assert main(["train", *ARGS, *extra, f"run_dir={root / name}"]) == 0
        made[name] = root / name
    return made


def _ema(run, r):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(x["test_accuracy_ema"] for x in rows if x["round"] == r)


@pytest.mark.slow
def test_two_runs_table_and_figures_and_the_beta_sweep(runs, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", str(runs["avg"]), str(runs["rcl"]), "--out", str(out),
                 "--at", "1", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.md")
    text = (out / "report.md").read_text()
    assert "EMA test accuracy at round 1" in text and "EMA test accuracy at round 2" in text
    # Methods as rows; the two runs differ only in the algorithm: one setting column.
    assert "| method | IID, 10 clients, seed 0 |" in text  # what they share, not "all runs"
    assert f"| fedavg | {_ema(runs['avg'], 2):.4f} (" in text
    assert f"| fedrcl (released hard-mined loss) | {_ema(runs['rcl'], 2):.4f} (" in text
    for png in ("convergence.png", "collapse.png"):  # the fedavg run was analysed
        assert (out / png).stat().st_size > 10_000
    # ... and its analysis at the reported rounds is a table: global (local) for each measure.
    rows = [json.loads(x) for x in (runs["avg"] / "metrics.jsonl").read_text().splitlines()]
    for r in (1, 2):
        x = next(y for y in rows if y["round"] == r)
        cells = [f"{x[f'global_{k}']:.4f} ({x[f'local_{k}']:.4f})"
                 for k in ("effective_rank", "vci", "effective_rank_uncentred", "mean_cosine",
                           "spread_share")]
        assert f"| fedavg | {r} | " + " | ".join(cells) + " |" in text
    assert f"| {RCL} |" not in text.split("Representation analysis")[1]  # not analysed
    assert not (out / "beta_sweep.png").exists()
    # Runs that differ only in beta: the beta sweep. (One test with the above, so that the
    # three runs are trained once: pytest-xdist would build the fixture on each worker.)
    out = tmp_path / "rep-beta"
    assert main(["report", str(runs["rcl"]), str(runs["rcl-b05"]), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert f"| {RCL} beta=1.0 |" in text and f"| {RCL} beta=0.5 |" in text
    assert (out / "beta_sweep.png").stat().st_size > 10_000
    assert not (out / "collapse.png").exists()


def test_not_a_run_directory_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory (needs config.yaml and metrics.jsonl)" in err
    assert "Traceback" not in err


def test_best_in_brackets_counts_only_the_rounds_up_to_the_reported_one(tmp_path):
    """A run that went further than the reported round: its later, better rounds do not
    enter the bracket of an earlier round."""
    from fedjax_rcl.report import read_run, table

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algorithm: fedavg\nseed: 0\n")
    acc = [0.2, 0.5, 0.3, 0.9]  # the best through round 3 is 0.5; round 4's 0.9 comes later
    ema, lines = None, []
    for r, a in enumerate(acc, start=1):
        ema = a if ema is None else 0.9 * ema + 0.1 * a
        lines.append(json.dumps({"round": r, "test_accuracy": a, "test_accuracy_ema": ema}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = table([read_run(run)], [3, 4])
    at3, at4 = text.split("EMA test accuracy at round 4")
    assert "(0.5000)" in at3 and "0.9000" not in at3
    assert "(0.9000)" in at4


def _fake_run(path, config: str, accs):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    ema, lines = None, []
    for r, a in enumerate(accs, start=1):
        ema = a if ema is None else 0.9 * ema + 0.1 * a
        lines.append(json.dumps({"round": r, "test_accuracy": a, "test_accuracy_ema": ema}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return ema


def test_seeds_share_a_cell_with_mean_sd_and_paired_differences(tmp_path, capsys):
    """Three fedavg runs (separate directories, one with another init bit layout) and a
    three-seed fedrcl grid: one row each,
    mean ± sd over the seeds, and the paired per-seed difference from fedavg (NumPy
    reference); the curves get bands."""
    import numpy as np

    rng = np.random.default_rng(0)
    avg, rcl = {}, {}
    for s in (0, 1, 2):
        # The init's bit layout is part of the random draw: seed 0 has another, same cell.
        layout = "init_threefry_partitionable: true\n" if s == 0 else ""
        avg[s] = _fake_run(tmp_path / f"avg-{s}", f"algorithm: fedavg\nseed: {s}\n{layout}",
                           rng.uniform(0.1, 0.5, 4))
    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "config.yaml").write_text("algorithm: fedrcl\nseed: 0\nseeds: [0, 1, 2]\n")
    for s in (0, 1, 2):
        rcl[s] = _fake_run(grid / f"seed-{s}", f"algorithm: fedrcl\nseed: {s}\nseeds: []\n",
                           rng.uniform(0.2, 0.6, 4))
    out = tmp_path / "rep"
    dirs = [str(tmp_path / f"avg-{s}") for s in (0, 1, 2)] + [str(grid)]
    assert main(["report", *dirs, "--out", str(out), "--baseline", "fedavg"]) == 0
    text = (out / "report.md").read_text()
    a, r = np.array([avg[s] for s in (0, 1, 2)]), np.array([rcl[s] for s in (0, 1, 2)])
    assert "| method | seeds 0, 1, 2 |" in text  # seeds are not settings
    assert f"| fedavg | {a.mean():.4f} ± {a.std(ddof=1):.4f} (" in text
    assert f"| {RCL} | {r.mean():.4f} ± {r.std(ddof=1):.4f} (" in text and "n=3)" in text
    d = r - a
    assert f"| {RCL} | {d.mean():+.4f} ± {d.std(ddof=1):.4f} (n=3) |" in text
    assert "Paired difference from fedavg at round 4" in text
    assert (out / "convergence.png").stat().st_size > 10_000
    capsys.readouterr()
    assert main(["report", *dirs, "--out", str(out), "--baseline", "fedprox"]) == 2
    assert f"--baseline 'fedprox': not a method of these runs; methods: fedavg, {RCL}" in (
        capsys.readouterr().err)


def test_one_archive_by_two_paths_is_one_dataset(tmp_path):
    """Seeds whose image-folder archive was named by two paths (another working directory, a
    link) share a cell; archives of different names stay different settings."""
    import numpy as np

    rng = np.random.default_rng(2)
    ema = {}
    for s, path in enumerate(["../other/data/c10.zip", "data/c10.zip", "/abs/data/c10.zip"]):
        ema[s] = _fake_run(tmp_path / f"avg-{s}",
                           f"algorithm: fedavg\nseed: {s}\ndataset: imagefolder:{path}\n",
                           rng.uniform(0.1, 0.5, 3))
    _fake_run(tmp_path / "other", "algorithm: fedavg\nseed: 0\ndataset: imagefolder:c100.zip\n",
              rng.uniform(0.1, 0.5, 3))
    out = tmp_path / "rep"
    assert main(["report", *(str(tmp_path / f"avg-{s}") for s in range(3)), "--out",
                 str(out)]) == 0
    text = (out / "report.md").read_text()
    e = np.array(list(ema.values()))
    assert "| method | seeds 0, 1, 2 |" in text
    assert f"| fedavg | {e.mean():.4f} ± {e.std(ddof=1):.4f} (" in text and "n=3)" in text
    assert main(["report", str(tmp_path / "avg-1"), str(tmp_path / "other"), "--out",
                 str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "dataset=imagefolder:data/c10.zip" in text
    assert "dataset=imagefolder:c100.zip" in text


def test_within_run_counts_rounds_above_the_baseline_over_the_window(tmp_path, capsys):
    """The within-run statistic: per seed, the rounds of the window in which the method's raw
    accuracy is above the baseline's, and the mean raw difference, mean ± sd over the seeds
    (NumPy reference); a round only one run evaluated is not compared; bad windows refused."""
    import numpy as np

    rng = np.random.default_rng(1)
    acc = {(m, s): rng.uniform(0.1, 0.6, 6) for m in ("fedavg", "fedrcl") for s in (0, 1, 2)}
    acc["fedrcl", 2][1] = acc["fedavg", 2][1] + 0.25  # outside the window: must not count
    dirs = []
    for (m, s), a in acc.items():
        _fake_run(tmp_path / f"{m}-{s}", f"algorithm: {m}\nseed: {s}\n", a)
        dirs.append(str(tmp_path / f"{m}-{s}"))
    moon = rng.uniform(0.1, 0.6, 6)  # one seed only: no sd to show
    moon_ema = _fake_run(tmp_path / "moon-0", "algorithm: moon\nseed: 0\n", moon)
    dirs.append(str(tmp_path / "moon-0"))
    # Seed 1's baseline skipped the evaluation of round 5: four rounds compared, not five.
    base = tmp_path / "fedavg-1" / "metrics.jsonl"
    base.write_text("".join(x + "\n" for x in base.read_text().splitlines()
                            if json.loads(x)["round"] != 5))
    out = tmp_path / "rep"
    assert main(["report", *dirs, "--out", str(out), "--baseline", "fedavg", "--at", "6",
                 "--window", "5"]) == 0
    text = (out / "report.md").read_text()
    cells, means = [], []
    for s in (0, 1, 2):
        rounds = [r for r in range(2, 7) if not (s == 1 and r == 5)]
        d = np.array([acc["fedrcl", s][r - 1] - acc["fedavg", s][r - 1] for r in rounds])
        cells.append(f"s{s}: {int((d > 0).sum())}/{len(rounds)}")
        means.append(d.mean())
    m = np.array(means)
    assert "Within the runs, rounds 2-6" in text
    assert f"| {RCL} | {', '.join(cells)}; {m.mean():+.4f} ± {m.std(ddof=1):.4f} |" in text
    d0 = moon[1:] - acc["fedavg", 0][1:]
    assert f"| moon | s0: {int((d0 > 0).sum())}/5; {d0.mean():+.4f} |" in text
    base0 = [json.loads(x) for x in (tmp_path / "fedavg-0" / "metrics.jsonl").read_text()
             .splitlines()][-1]["test_accuracy_ema"]
    assert f"| moon | {moon_ema - base0:+.4f} (n=1) |" in text
    assert f"| moon | {moon_ema:.4f} ({moon.max():.4f}) |" in text
    capsys.readouterr()
    assert main(["report", *dirs, "--out", str(out), "--baseline", "fedavg",
                 "--window", "0"]) == 2
    assert "--window 0: must be a number of rounds >= 1" in capsys.readouterr().err
    assert main(["report", *dirs, "--out", str(out), "--at", "5", "0"]) == 2
    assert "--at 5 0: rounds are numbered from 1" in capsys.readouterr().err


def test_a_cell_one_seed_reached_shows_no_sd(tmp_path):
    """Three seeds of which one reached the round: the value alone, n=1, no '± 0.0000'."""
    from fedjax_rcl.report import read_run, table

    runs = [read_run(_fake_run_dir(tmp_path / f"s{s}", s, [0.3] * (6 if s == 0 else 3)))
            for s in (0, 1, 2)]
    text = table(runs, [6])
    assert "| fedavg | 0.3000 (0.3000; n=1) |" in text


def _fake_run_dir(path, seed, accs):
    _fake_run(path, f"algorithm: fedavg\nseed: {seed}\n", accs)
    return path


def test_an_iid_run_is_not_labelled_with_the_alpha_it_does_not_read(tmp_path):
    """alpha is a setting of Dirichlet splits only: an IID run's column carries no alpha (its
    config's default is no part of the run), and Dirichlet runs keep theirs."""
    import numpy as np

    rng = np.random.default_rng(3)
    for name, cfg in {"a005": "partition: dirichlet\nalpha: 0.05\n",
                      "a03": "partition: dirichlet\nalpha: 0.3\n",
                      "iid": "partition: iid\nalpha: 0.3\n"}.items():
        _fake_run(tmp_path / name, f"algorithm: fedavg\nseed: 0\n{cfg}",
                  rng.uniform(0.1, 0.5, 3))
    out = tmp_path / "rep"
    assert main(["report", *(str(tmp_path / n) for n in ("a005", "a03", "iid")), "--out",
                 str(out)]) == 0
    text = (out / "report.md").read_text()
    assert ("| method | alpha=0.05 partition=dirichlet | alpha=0.3 partition=dirichlet "
            "| partition=iid |") in text
    # Dirichlet runs of one alpha and an IID run: alpha does not differ among the runs that
    # read it, so only the split names the columns.
    assert main(["report", str(tmp_path / "a03"), str(tmp_path / "iid"), "--out",
                 str(out)]) == 0
    assert "| method | partition=dirichlet | partition=iid |" in (out / "report.md").read_text()


def test_a_run_not_yet_at_the_reported_round_has_an_empty_cell(tmp_path):
    """A run that stopped before a reported round shows "—" there, not a best accuracy "through"
    a round it never reached; at a round it reached it shows both."""
    import numpy as np

    rng = np.random.default_rng(4)
    _fake_run(tmp_path / "long", "algorithm: fedavg\nseed: 0\n", rng.uniform(0.1, 0.5, 4))
    _fake_run(tmp_path / "short", "algorithm: fedprox\nseed: 0\n", rng.uniform(0.1, 0.5, 2))
    out = tmp_path / "rep"
    assert main(["report", str(tmp_path / "long"), str(tmp_path / "short"), "--out", str(out),
                 "--at", "2", "4"]) == 0
    text = (out / "report.md").read_text()
    at2, at4 = text.split("EMA test accuracy at round 4")
    assert "| fedprox | — |" in at4.split("Runs:")[0]
    assert "| fedprox | 0." in at2 and "| fedprox | — |" not in at2.split("Wall-clock")[0]


def _cadence_run(path, config: str, accs, every: int, per_round_decay: bool):
    """A run evaluated every ``every`` rounds: its EMA as written before the decay was per
    round (0.9 per evaluation) or after (0.9**every, with ``ema_rounds``)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    ema, lines = None, []
    for i, a in enumerate(accs, start=1):
        d = 0.9 ** every if per_round_decay else 0.9
        ema = a if ema is None else d * ema + (1 - d) * a
        row = {"round": i * every, "test_accuracy": a, "test_accuracy_ema": ema}
        lines.append(json.dumps(row | ({"ema_rounds": every} if per_round_decay else {})))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return ema


def test_an_ema_at_another_cadence_is_marked_and_the_raw_means_stand_beside_it(tmp_path):
    """A run evaluated every round: its EMA unmarked. Runs evaluated every 10th round (old
    records: 0.9 per evaluation; new: 0.9**10): marked † with a footnote naming them, their
    cadence and what their EMA is. Beside the EMA, each run's mean raw accuracy of the last 10
    and 50 rounds (NumPy reference), labelled."""
    import numpy as np

    from fedjax_rcl.report import read_run, table

    rng = np.random.default_rng(5)
    every = rng.uniform(0.2, 0.8, 60)
    e1 = _cadence_run(tmp_path / "avg", "algorithm: fedavg\nseed: 0\n", every, 1, True)
    sparse = rng.uniform(0.2, 0.8, 6)
    e10 = _cadence_run(tmp_path / "rcl", "algorithm: fedrcl\nseed: 0\n", sparse, 10, False)
    e10n = _cadence_run(tmp_path / "moon", "algorithm: moon\nseed: 0\n", sparse, 10, True)
    text = table([read_run(tmp_path / n) for n in ("avg", "rcl", "moon")], [60])
    ema_table, raw_table = text.split("Raw test accuracy at round 60")
    assert f"| fedavg | {e1:.4f} (" in ema_table  # every round: the paper's EMA, no mark
    assert f"| {RCL} | {e10:.4f}† (" in ema_table and f"| moon | {e10n:.4f}† (" in ema_table
    note = ema_table.split("† Not evaluated every round")[1]
    assert f"`{tmp_path / 'rcl'}`: evaluated every 10 rounds" in note
    assert "applies 0.9 once per evaluation: a time constant of about 100 rounds" in note
    assert f"`{tmp_path / 'moon'}`: evaluated every 10 rounds; its EMA applies 0.9**k" in note
    assert f"`{tmp_path / 'avg'}`" not in note
    assert "rounds 51-60 (in brackets: rounds 11-60)" in raw_table
    assert f"| fedavg | {every[-10:].mean():.4f} ({every[-50:].mean():.4f}) |" in raw_table
    # Every 10th round: the last 10 rounds hold one evaluation, the last 50 five.
    assert f"| {RCL} | {sparse[-1]:.4f} ({sparse[-5:].mean():.4f}) |" in raw_table


def test_a_report_of_runs_all_evaluated_every_round_has_no_mark(tmp_path):
    from fedjax_rcl.report import read_run, table

    _fake_run(tmp_path / "a", "algorithm: fedavg\nseed: 0\n", [0.1, 0.2, 0.3])
    text = table([read_run(tmp_path / "a")], [3])
    assert "†" not in text and "Not evaluated every round" not in text


def _keep_figures(monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def test_titles_name_the_split_clients_and_seeds_and_the_band_is_explained(tmp_path,
                                                                            monkeypatch):
    """Panels are titled by what their runs share (split, clients, seeds), never "all runs";
    the curves show the raw accuracy beside the EMA; report.md's caption explains the band."""
    import numpy as np

    rng = np.random.default_rng(6)
    dirs = []
    for s in (0, 1):
        for m in ("fedavg", "fedrcl"):
            _fake_run(tmp_path / f"{m}-{s}", f"algorithm: {m}\nseed: {s}\npartition: dirichlet\n"
                      "alpha: 0.3\nnum_clients: 100\n", rng.uniform(0.1, 0.5, 4))
            dirs.append(str(tmp_path / f"{m}-{s}"))
    figures = _keep_figures(monkeypatch)
    out = tmp_path / "rep"
    assert main(["report", *dirs, "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "all runs" not in text
    assert "| method | Dirichlet alpha 0.3, 100 clients, seeds 0, 1 |" in text
    assert "shaded band is the EMA's mean ± one standard deviation over the seeds" in text
    ax = figures[0].axes[0]
    assert ax.get_title() == "Dirichlet alpha 0.3, 100 clients, seeds 0, 1"
    assert "band" in figures[0]._suptitle.get_text()
    assert len(ax.lines) == 4  # per method: the raw mean (thin) and the EMA mean (thick)
    assert sorted(line.get_linewidth() for line in ax.lines) == [0.7, 0.7, 2, 2]


def test_a_beta_sweep_is_summarised_per_value_beside_another_method(tmp_path, monkeypatch):
    """FedRCL at two betas, two seeds each, and a FedAvg baseline in the same report: the sweep
    plot is drawn, one point per beta (the mean over its seeds, bars of ± one sd), not one per
    run; its title names the split, clients and seeds."""
    import numpy as np

    from fedjax_rcl.report import _beta_sweep, read_run

    rng = np.random.default_rng(7)
    dirs, final = [], {}
    for beta in (0.5, 2.0):
        for s in (0, 1):
            name = f"rcl-{beta}-{s}"
            final[beta, s] = _fake_run(tmp_path / name, f"algorithm: fedrcl\nseed: {s}\n"
                                       f"fedrcl:\n  beta: {beta}\npartition: iid\n",
                                       rng.uniform(0.1, 0.5, 12))
            dirs.append(str(tmp_path / name))
    _fake_run(tmp_path / "avg", "algorithm: fedavg\nseed: 0\npartition: iid\n",
              rng.uniform(0.1, 0.5, 12))
    dirs.append(str(tmp_path / "avg"))
    sweep = _beta_sweep([read_run(d) for d in dirs])
    (points,) = sweep.values()
    assert sorted(points) == [0.5, 2.0]
    assert [e for e, _ in points[0.5]] == [final[0.5, 0], final[0.5, 1]]
    figures = _keep_figures(monkeypatch)
    out = tmp_path / "rep"
    assert main(["report", *dirs, "--out", str(out)]) == 0
    assert (out / "beta_sweep.png").stat().st_size > 10_000
    ax = figures[-1].axes[0]
    assert ax.get_title().endswith("IID, seeds 0, 1")
    ema_line = ax.lines[0]
    assert list(ema_line.get_xdata()) == [0.5, 2.0]
    want = [np.mean([final[b, 0], final[b, 1]]) for b in (0.5, 2.0)]
    np.testing.assert_allclose(np.asarray(ema_line.get_ydata(), np.float64), want, rtol=1e-12)


def test_tables_as_csv_and_json_with_wall_time_variant_labels_and_a_few_seeds_note(tmp_path):
    """report.csv/report.json hold the tables' figures (NumPy over the seeds), each method's
    wall-clock time to the round; FedRCL's two losses are named; fewer than three seeds are
    flagged, three are not."""
    import csv

    import numpy as np

    def run(path, config, accs, secs):
        _fake_run(path, config, accs)
        rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        for r, t in zip(rows, secs, strict=True):
            r["total_s"] = t
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    rng = np.random.default_rng(1)
    accs = {s: rng.uniform(0.2, 0.6, 3) for s in (0, 1)}
    for s in (0, 1):
        run(tmp_path / f"hard-{s}", f"algorithm: fedrcl\nseed: {s}\nfedrcl:\n  mining: hard\n",
            accs[s], [10.0, 20.0, 30.0 + s])
    run(tmp_path / "paper", "algorithm: fedrcl\nseed: 0\nfedrcl:\n  mining: none\n",
        [0.3, 0.4, 0.5], [5.0, 9.0, 4000.0])
    out = tmp_path / "rep"
    assert main(["report", *(str(tmp_path / d) for d in ("hard-0", "hard-1", "paper")),
                 "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| fedrcl (released hard-mined loss) |" in text
    assert "| fedrcl (paper's equations) |" in text
    assert "| fedrcl (released hard-mined loss) | 0.5 min |" in text  # 30 and 31 s: 30.5
    assert "| fedrcl (paper's equations) | 66.7 min |" in text
    assert "**Note: some cells rest on 1 seed**" in text
    data = json.loads((out / "report.json").read_text())
    hard = next(r for r in data if r["method"] == "fedrcl (released hard-mined loss)")
    emas = [_ema(tmp_path / f"hard-{s}", 3) for s in (0, 1)]
    assert hard["round"] == 3 and hard["ema_n"] == 2
    assert hard["ema_mean"] == pytest.approx(np.mean(emas))
    assert hard["ema_sd"] == pytest.approx(np.std(emas, ddof=1))
    assert hard["wall_s_mean"] == pytest.approx(30.5)
    with open(out / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 and float(table[0]["ema_mean"]) == pytest.approx(data[0]["ema_mean"])
    # Three seeds: no note.
    for s in (2,):
        run(tmp_path / f"hard-{s}", f"algorithm: fedrcl\nseed: {s}\n", accs[0], [1.0, 2, 3])
    assert main(["report", *(str(tmp_path / f"hard-{s}") for s in (0, 1, 2)),
                 "--out", str(out)]) == 0
    assert "Note: some cells" not in (out / "report.md").read_text()
