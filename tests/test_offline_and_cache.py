"""``--print-config`` reads no data (it prints offline, for data this machine does not have);
the cache root follows ``$FEDJAX_RCL_CACHE``, else ``$XDG_CACHE_HOME``, else ``~/.cache``."""

import socket
from pathlib import Path

import pytest
import yaml

from fedjax_rcl.cli import main
from fedjax_rcl.data.cache import default_cache_dir
from fedjax_rcl.nn import onednn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def offline(monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable (test)")

    monkeypatch.setattr(socket, "create_connection", unreachable)


@pytest.mark.parametrize("command, config", [
    ("mfcl", "experiments/mfcl/paper_cifar10.yaml"),
    ("train", "experiments/paper/cifar10_resnet18.yaml"),
])
def test_print_config_of_a_paper_config_needs_no_data(offline, tmp_path, capsys, command,
                                                      config):
    empty = tmp_path / "no-data-here"
    empty.mkdir()
    args = [command, str(ROOT / config), f"data_dir={empty}", "--print-config"]
    assert main(args) == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["dataset"] == "cifar10" and printed["data_dir"] == str(empty)
    assert list(empty.iterdir()) == []  # nothing was downloaded or prepared
    # Training it is refused as before, in one line, since the data is not there.
    assert main([command, str(ROOT / config), f"data_dir={empty}", "rounds=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cifar10 is not prepared" in err[0]


def test_print_config_still_checks_the_dataset_spec(capsys):
    assert main(["train", "dataset=imagefolder:/nowhere/data.zip", "--print-config"]) == 0
    assert "dataset: imagefolder:/nowhere/data.zip" in capsys.readouterr().out
    assert main(["train", "dataset=cifar1", "--print-config"]) == 2
    assert "did you mean 'cifar10'?" in capsys.readouterr().err


def test_the_cache_root_follows_fedjax_rcl_cache_then_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("FEDJAX_RCL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fedjax_rcl"
    assert onednn.cache_dir() == tmp_path / "xdg" / "fedjax_rcl" / "ext"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "fedjax_rcl"
    assert onednn.cache_dir() == Path.home() / ".cache" / "fedjax_rcl" / "ext"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert onednn.cache_dir() == tmp_path / "mine" / "ext"


def test_the_compile_cache_lives_under_the_cache_root(monkeypatch, tmp_path):
    import jax

    from fedjax_rcl.cli import _enable_compilation_cache

    monkeypatch.delenv("FEDJAX_RCL_CACHE", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("FEDJAX_RCL_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    before = jax.config.jax_compilation_cache_dir
    try:
        _enable_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "fedjax_rcl" / "jax")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
