"""``partition=file``: a run trains on exactly the clients of a split file (the FedRCL
reference's format), whatever its seed; bad settings are refused before anything is built,
naming the field; and the config digest follows the file's contents, so a run resumed with the
same path but another split is refused."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from fedjax_rcl.cli import main
from fedjax_rcl.config import changed_keys, config_digest, load_config
from fedjax_rcl.config.checks import validate
from fedjax_rcl.data import class_counts, heterogeneity_summary, load_dataset
from fedjax_rcl.experiment import make_partition
from fedjax_rcl.validation import ConfigError


def _write(path, parts):
    path.write_text(str({k: [int(i) for i in p] for k, p in enumerate(parts)}))
    return path


def _random_parts(n, num_clients, size, seed):
    order = np.random.default_rng(seed).permutation(n)
    return [order[k * size:(k + 1) * size] for k in range(num_clients)]


def test_a_split_file_gives_exactly_its_clients_whatever_the_seed(tmp_path):
    labels = np.arange(60) % 5
    parts = _random_parts(60, 4, 12, seed=3)  # 12 samples left to no client
    path = _write(tmp_path / "split.txt", parts)
    for seed in (0, 7):
        cfg = load_config(None, ["partition=file", f"split_file={path}", "num_clients=4",
                                 f"seed={seed}"])
        got = make_partition(cfg, labels)
        assert [g.tolist() for g in got] == [sorted(p.tolist()) for p in parts]


def test_a_split_file_must_match_the_clients_and_the_training_set(tmp_path):
    labels = np.arange(60) % 5
    path = _write(tmp_path / "split.txt", _random_parts(60, 4, 12, seed=0))
    cfg = load_config(None, ["partition=file", f"split_file={path}", "num_clients=5"])
    with pytest.raises(ConfigError, match=r"holds 4 clients, but num_clients=5: set "
                                          r"num_clients=4"):
        make_partition(cfg, labels)
    cfg = load_config(None, ["partition=file", f"split_file={path}", "num_clients=4"])
    with pytest.raises(ConfigError, match=r"split_file=.*indices must be < num_samples=40"):
        make_partition(cfg, labels[:40])


@pytest.mark.parametrize("args,message", [
    (["partition=file"], "split_file=None: partition=file needs the path of a client split file"),
    (["partition=file", "split_file=/nonexistent/split.txt"],
     "split_file='/nonexistent/split.txt': no such file"),
    (["split_file=/nonexistent/split.txt"],
     "split_file='/nonexistent/split.txt': applies only to partition=file (partition="
     "'dirichlet' draws its split from the seed); leave it null"),
])
def test_bad_split_settings_are_refused_before_anything_runs(args, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *args, f"run_dir={run_dir}", "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_the_digest_follows_the_split_files_contents(tmp_path):
    path = _write(tmp_path / "split.txt", _random_parts(60, 4, 12, seed=0))
    args = ["partition=file", f"split_file={path}", "num_clients=4"]
    before = load_config(None, args)
    digest = config_digest(before)
    assert config_digest(load_config(None, args)) == digest
    _write(path, _random_parts(60, 4, 12, seed=1))  # same path, another split
    after = load_config(None, args)
    assert config_digest(after) != digest
    assert changed_keys(before, after) == []  # the configs are equal; only the file changed
    other = _write(tmp_path / "other.txt", _random_parts(60, 4, 12, seed=1))
    assert "split_file" in changed_keys(after, load_config(None, [*args[:1],
                                                                  f"split_file={other}",
                                                                  *args[2:]]))


@pytest.mark.slow
def test_a_run_trains_on_the_files_clients(tmp_path, capsys):
    """The digits job on a split of 6 clients of 100 samples: ``partition`` reports the file's
    class counts, and a round trains on it."""
    labels = load_dataset("digits").train_labels
    parts = _random_parts(len(labels), 6, 100, seed=5)
    path = _write(tmp_path / "split.txt", parts)
    args = ["partition=file", f"split_file={path}", "num_clients=6", "participation=0.5"]
    assert main(["partition", *args, "--plot", str(tmp_path / "split.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    expected = heterogeneity_summary(class_counts(labels, parts, int(labels.max()) + 1))
    assert {k: summary[k] for k in expected} == pytest.approx(expected)
    run_dir = tmp_path / "run"
    assert main(["train", *args, "rounds=1", "local_epochs=1", f"run_dir={run_dir}",
                 "--no-progress"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 1
    # The run's records say which file it trained on, not only its path.
    env = json.loads((run_dir / "environment.jsonl").read_text().splitlines()[0])
    assert env["input_sha256"] == {str(path): hashlib.sha256(path.read_bytes()).hexdigest()}


def test_the_split_files_existence_is_checked_with_the_data():
    """Like the dataset, the file is looked for only when the data is (a run, not tabulating a
    committed run's config on a machine without its files)."""
    cfg = dataclasses.replace(load_config(None, []), partition="file",
                              split_file="/nonexistent/split.txt")
    validate(cfg, check_data=False)
    with pytest.raises(ConfigError, match="no such file"):
        validate(cfg)
