"""The command line explains itself: the config reference, the version, suggestions for
misspellings, where a YAML file is broken, plugins given loosely or run from elsewhere, and
warnings for settings that probably do not do what was meant."""

import json
import sys

import pytest

from fedjax_rcl import registry
from fedjax_rcl.cli import main

TINY = ["num_clients=4", "participation=0.5", "local_epochs=1", "partition=iid",
        "--no-progress"]

MISSPELT = [
    (["algorithm=fedrc"], "algorithm='fedrc': allowed:", "(did you mean 'fedrcl'?)"),
    (["model=resnt18"], "model='resnt18': allowed:", "(did you mean 'resnet18'?)"),
    (["fedrcl.bta=2"], "fedrcl.bta: unknown config key", "(did you mean 'fedrcl.beta'?)"),
    (["server.optimizer=fedadm"], "server.optimizer='fedadm'", "(did you mean 'fedadam'?)"),
    (["roundz=3"], "roundz: unknown config key", "(did you mean 'rounds'?)"),
    (["dataset=cifar1O"], "unknown dataset 'cifar1O'", "(did you mean 'cifar10'?)"),
    (["norm=grup"], "norm='grup': allowed: group, batch, twin", "(did you mean 'group'?)"),
]


@pytest.mark.parametrize("args,what,suggestion", MISSPELT, ids=[m[0][0] for m in MISSPELT])
def test_misspellings_get_a_suggestion(args, what, suggestion, capsys, tmp_path):
    assert main(["train", *args, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0] and suggestion in err[0], err


def test_a_name_far_from_every_allowed_one_gets_no_suggestion(capsys):
    assert main(["train", "algorithm=zzzzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_config_lists_keys_with_type_default_allowed_values_and_meaning(capsys):
    assert main(["config", "fedrcl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fedrcl.temperature: float = 0.05\n")
    assert "fedrcl.beta: float = 1.0\n    the weight of the relaxation penalty" in out
    assert "fedrcl.mining: str = 'hard'" in out and "seed" not in out
    assert main(["config", "server.optimizer"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "server.optimizer: str = 'fedavg'"
    assert "Allowed: fedavg, fedavgm, fedadam, fedacg." in out.replace("\n    ", " ")
    assert main(["config"]) == 0
    every = capsys.readouterr().out
    assert every.count("\n    ") >= 80 and "mfcl.bn_statistics: str = 'running'" in every
    assert main(["config", "fedrcll"]) == 2
    err = capsys.readouterr().err
    assert "config 'fedrcll': no such key or section (did you mean 'fedrcl'?)" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == "fedjax-rcl 0.1.0"


def test_yaml_errors_say_where(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("rounds: 3\nalgorithm: fedavg\nlr: [0.1\n")
    assert main(["train", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"config file '{broken}': not valid YAML at line " in err
    assert ", column " in err


def test_a_single_plugin_may_be_named_without_brackets(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_plugin.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    for args in (["plugins=my_plugin"], [str(tmp_path / "c.yaml")]):
        (tmp_path / "c.yaml").write_text("plugins: my_plugin\nrounds: 2\n")
        assert main(["train", *args, "--print-config"]) == 0, capsys.readouterr().err
        assert "plugins:\n- my_plugin\n" in capsys.readouterr().out


def test_a_missing_plugin_names_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "plugins=[no_such_plugin]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "cannot import 'no_such_plugin' (ModuleNotFoundError" in err[0]
    assert f"looked in {tmp_path}" in err[0] and "PYTHONPATH" in err[0]


@pytest.mark.slow
def test_a_runs_plugins_are_found_from_another_directory(tmp_path, monkeypatch, capsys,
                                                         fresh_registry):
    """resume and eval from elsewhere (each as a fresh process: the plugin unknown, its
    directory not on sys.path) find the plugins where the run found them."""
    home = tmp_path / "project"
    home.mkdir()
    (home / "my_algo.py").write_text(
        "from fedjax_rcl import registry\n"
        "from fedjax_rcl.algorithms import ClientAlgorithm, cross_entropy\n\n"
        "def build(settings, model):\n"
        "    def objective(out, params, batch, ctx):\n"
        "        ce = cross_entropy(out.logits, batch.labels)\n"
        "        return ce, {'ce': ce}\n"
        "    return ClientAlgorithm(objective)\n\n"
        "registry.register_algorithm('my_ce', build)\n")
    run = tmp_path / "run"
    monkeypatch.chdir(home)
    monkeypatch.syspath_prepend(str(home))
    assert main(["train", "plugins=my_algo", "algorithm=my_ce", "rounds=1",
                 f"run_dir={run}", *TINY]) == 0, capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for cmd in (["resume", str(run), "rounds=2", "--no-progress"], ["eval", str(run)]):
        fresh_registry()
        assert str(home) not in sys.path and "my_algo" not in sys.modules
        assert "my_ce" not in registry.ALGORITHMS
        assert main(cmd) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round"] == 2


@pytest.mark.slow
def test_degenerate_settings_are_warned_about_at_the_start(tmp_path, capsys):
    assert main(["train", "algorithm=fedavg", "num_clients=3", "participation=0.1",
                 "eval_every=1000", "rounds=2", "local_epochs=1", "partition=iid",
                 f"run_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("fedjax-rcl: warning: participation=0.1 x num_clients=3 = 0.3 clients: each round "
            "samples 1 client (the minimum)") in err
    assert ("fedjax-rcl: warning: eval_every=1000 > rounds=2: the run is evaluated only at "
            "its end (round 2)") in err
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [2]


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_switching_the_analysis_off_on_resume_plots_fine(tmp_path, capsys):
    """The README lets analysis be switched on or off on resume: the plot at the end reads
    the loss terms from every line (it crashed reading them from the first)."""
    run = tmp_path / "run"
    assert main(["train", "algorithm=fedavg", "analysis_every=1", "analysis_images=50",
                 "rounds=1", f"run_dir={run}", *TINY]) == 0
    assert main(["resume", str(run), "rounds=2", "analysis_every=0", "--no-progress"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert "global_effective_rank" in rows[0] and "global_effective_rank" not in rows[1]
    assert (run / "accuracy.png").stat().st_size > 0


def test_a_setting_or_sweep_the_algorithm_does_not_read_is_refused(capsys, tmp_path):
    """``algorithm=fedavg 'fedrcl.beta=[0.5,2]'`` trained two identical runs; a setting of
    another algorithm's section on the command line, or a sweep of one, is now refused with
    a line naming the algorithm and what it reads. A YAML file may still set several
    algorithms' sections (a run's config.yaml records them all)."""
    from fedjax_rcl.config import load_config

    reader = "fedrcl.* is read by algorithm=fedrcl, algorithm=fedscl"
    assert main(["train", "algorithm=fedavg", "fedrcl.beta=[0.5,2]",
                 f"run_dir={tmp_path / 'a'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fedjax-rcl: error: fedrcl.beta: algorithm fedavg does not read it (it reads no "
        f"section of its own, only the shared settings; {reader})"]
    assert main(["train", "algorithm=moon", "fedrcl.beta=2", f"run_dir={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedjax-rcl: error: fedrcl.beta: algorithm moon does not read it (it reads: "
                   f"moon.mu, moon.temperature, moon.projection_dim; {reader})"], err
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("algorithm: fedavg\nsweep:\n  key: fedrcl.beta\n  values: [0.5, 2]\n")
    assert main(["train", str(sweep), f"run_dir={tmp_path / 'c'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweep.key='fedrcl.beta': a sweep of a setting the run " \
        "does not read trains identical runs; fedrcl.beta: algorithm fedavg does not" in err[0]
    both = tmp_path / "both.yaml"
    both.write_text("algorithm: fedavg\nfedrcl:\n  beta: 2.0\nmoon:\n  mu: 3.0\n")
    cfg = load_config(str(both), ["rounds=3"])
    assert (cfg.algorithm, cfg.fedrcl.beta, cfg.moon.mu) == ("fedavg", 2.0, 3.0)
    assert load_config(None, ["algorithm=moon", "moon.mu=2"]).moon.mu == 2.0


@pytest.mark.parametrize("given", [["seeds=3"], ["seeds=0,1,2"], "seeds: 3\n"])
def test_a_list_setting_given_one_value_says_how_to_write_a_list(given, capsys, tmp_path):
    """``seeds=3``, ``seeds=0,1,2`` and YAML ``seeds: 3`` said "AnyNode is not a ListConfig"."""
    if isinstance(given, str):
        (tmp_path / "c.yaml").write_text(given)
        given = [str(tmp_path / "c.yaml")]
    assert main(["train", *given, f"run_dir={tmp_path / 'run'}"]) == 2
    value = "0,1,2" if given == ["seeds=0,1,2"] else "3"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"fedjax-rcl: error: seeds: {value}: must be a list such as seeds=[0,1,2]"]


def test_a_setting_written_as_an_option_gets_a_hint(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--rounds=10", "lr=0.1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("fedjax-rcl: error: unrecognized arguments: --rounds=10 (write settings "
                       "as key=value: rounds=10)")


def test_every_unknown_key_of_a_yaml_file_is_named_with_its_line_and_column(capsys, tmp_path):
    """A file with two unknown keys reported only the first, and not where it was."""
    path = tmp_path / "two.yaml"
    path.write_text("rounds: 3\nroundz: 3\nfedrcl:\n  beta: 1.0\n  bta: 2\n")
    assert main(["train", str(path), f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"fedjax-rcl: error: roundz: unknown config key (did you mean "
                             f"'rounds'?) (config file '{path}', line 2, column 1); allowed "
                             "keys here: seed, seeds,")
    assert err[1].startswith(f"fedjax-rcl: error: fedrcl.bta: unknown config key (did you mean "
                             f"'fedrcl.beta'?) (config file '{path}', line 5, column 3); "
                             "allowed keys here: temperature,")
