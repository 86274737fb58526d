"""Every experiment config and every run of every suite under experiments/ is a valid config
(its dataset may be absent here, so the dataset is checked for its form only)."""

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from fedjax_rcl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
FILES = sorted(p for p in EXPERIMENTS.rglob("*.yaml")
               if not {"runs", "results"} & set(p.relative_to(EXPERIMENTS).parts))


def _cases():
    for path in FILES:
        doc = yaml.safe_load(path.read_text())
        if "runs" in doc:  # a suite: base config + each run's overrides
            for name, overrides in doc["runs"].items():
                yield pytest.param(ROOT / doc["base"], overrides,
                                   id=f"{path.relative_to(EXPERIMENTS)}:{name}")
        else:
            yield pytest.param(path, [], id=str(path.relative_to(EXPERIMENTS)))


def test_there_are_paper_and_cpu_tables():
    names = {p.relative_to(EXPERIMENTS).as_posix() for p in FILES}
    assert {"paper/table1_cifar10.yaml", "paper/table1_cifar100.yaml",
            "paper/table5_cifar10.yaml", "paper/tableB_cifar100.yaml",
            "cpu/table1_cifar10_resnet10w16.yaml"} <= names


@pytest.mark.parametrize("base,overrides", list(_cases()))
def test_config_is_valid(base, overrides, tmp_path):
    raw = yaml.safe_load(Path(base).read_text())
    dataset = raw.get("dataset", "digits")
    assert dataset in ("digits", "cifar10", "cifar100") or dataset.startswith("imagefolder:")
    # A split file, like the dataset, lives outside the repository (made where the run is,
    # docs/reproducing.md): a stand-in that exists lets the rest be checked.
    stand_in = []
    if any(o.startswith("split_file=") for o in overrides):
        (tmp_path / "split.txt").write_text("{0: [0]}")
        stand_in = [f"split_file={tmp_path / 'split.txt'}"]
    cfg = load_config(str(base), [*overrides, "dataset=digits", "data_dir=null", *stand_in])
    # Every setting the file and the run's overrides write is what the run gets (none
    # dropped, renamed or defaulted on the way), parsed as the config parses values.
    written = OmegaConf.merge(OmegaConf.load(base), OmegaConf.from_dotlist(list(overrides)))
    got = OmegaConf.structured(cfg)
    for key, value in _leaves(OmegaConf.to_container(written)):
        if key not in ("dataset", "data_dir", "plugins", "split_file"):
            assert OmegaConf.select(got, key) == value, key


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
