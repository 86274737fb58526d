"""The config digest that checkpoints carry: it covers exactly the result-deciding settings, and a
setting added later (declared ``digest_neutral`` with its field) leaves the digest of every run
checkpointed before it unchanged at its default: without that, every checkpoint written so far
would be refused on resume."""

import dataclasses

import pytest

from fedjax_rcl import registry
from fedjax_rcl.config import (
    changed_keys,
    config_digest,
    flat_keys,
    keys_declared,
    load_config,
    to_dict,
    with_setting,
)
from fedjax_rcl.fields import Treatment, declared, setting


def test_digest_covers_the_sections_in_use_only():
    base = load_config(None, ["algorithm=fedrcl"])
    # Another algorithm's section, set by a file (a run's config.yaml records every section; on
    # the command line it is refused, as the algorithm does not read it).
    other_section = load_config(None, ["algorithm=fedrcl"], defaults={"moon": {"mu": 5.0}})
    assert other_section.moon.mu == 5.0
    assert config_digest(other_section) == config_digest(base)
    assert config_digest(load_config(None, ["algorithm=fedrcl"],
                                     defaults={"server": {"fedadam": {"tau": 0.1}}})) == \
        config_digest(base)
    assert config_digest(load_config(None, ["algorithm=fedrcl", "fedrcl.beta=2"])) != \
        config_digest(base)
    adam = load_config(None, ["server.optimizer=fedadam"])
    assert config_digest(load_config(None, ["server.optimizer=fedadam",
                                            "server.fedadam.tau=0.1"])) != config_digest(adam)
    assert config_digest(load_config(None, ["rounds=7"])) == config_digest(base)  # resume-safe
    assert changed_keys(base, other_section) == []


@pytest.mark.parametrize("overrides,digest", [
    # Computed by the code of commit a22deca, before mfcl.bn_statistics existed.
    ([], "312c4ff782b9954d"),
    (["norm=batch", "mfcl.rho=2"], "db0f75bb7c96e658"),
])
def test_a_setting_added_later_keeps_older_runs_digest_at_its_default(overrides, digest):
    # fedjax-rcl mfcl's defaults as they were then (before the digits demo was made smaller).
    MFCL_DEFAULTS = {  # noqa: N806
        "algorithm": "mfcl", "model": "mfcl_autoencoder", "norm": "twin", "num_clients": 10,
        "participation": 1.0, "partition": "dirichlet", "alpha": 0.01, "balanced": False,
        "rounds": 15, "local_epochs": 1, "batch_size": 64, "lr": 1e-3, "lr_decay": 1.0,
        "momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.0, "aggregation": "size",
        "checkpoint_every": 5,
    }
    cfg = load_config(None, overrides, defaults=MFCL_DEFAULTS)
    assert config_digest(cfg) == digest
    if "norm=batch" in overrides:
        other = load_config(None, [*overrides, "mfcl.bn_statistics=batch"],
                            defaults=MFCL_DEFAULTS)
        assert config_digest(other) != digest
    else:  # mfcl.tn_variance came later still: its default keeps the digest, "views" not
        other = load_config(None, [*overrides, "mfcl.tn_variance=views"],
                            defaults=MFCL_DEFAULTS)
        assert config_digest(other) != digest


@pytest.mark.parametrize("overrides,digest", [
    # Computed by the code of commit d2eef41, before init_threefry_partitionable existed.
    ([], "a0b993d66bfb8b49"),
    (["model=resnet10", "width=16", "algorithm=fedavg", "alpha=0.1"], "dc4229e6293cbf75"),
])
def test_init_layout_setting_keeps_older_runs_digest_at_its_default(overrides, digest):
    assert config_digest(load_config(None, overrides)) == digest
    other = load_config(None, [*overrides, "init_threefry_partitionable=true"])
    assert config_digest(other) != digest


# The settings added after checkpoints existed, with the defaults those checkpoints' configs
# mean: each must stay declared digest-neutral at this default, or their digests change (a
# setting added later joins by its declaration alone).
PROTECTED_DEFAULTS = {"mfcl.bn_statistics": "running", "init_threefry_partitionable": False,
                      "client_eval": False, "precision": "fp32", "seeds": [],
                      "runs_in_parallel": 1, "sweep.key": None, "sweep.values": [],
                      "mfcl.probe": "lbfgs",
                      "mfcl.probe_l2_grid": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0],
                      "mfcl.probe_holdout": 0.1, "mfcl.probe_max_iter": 1000,
                      "mfcl.probe_tol": 1e-5, "mfcl.probe_controls": True,
                      "mfcl.tn_variance": "pooled", "mfcl.probe_projection": False,
                      "split_file": None, "transforms": "fedrcl", "partition_version": 1,
                      "drop_last": False, "sampling_version": 1}


def test_the_settings_older_checkpoints_lack_stay_digest_neutral_at_their_defaults():
    """A renamed key, a lost declaration or a changed default would silently change the digest
    of the runs it protects; the declared default is also the config's."""
    from fedjax_rcl.mfcl.run import MFCL_DEFAULTS

    cfg = load_config(None, [], defaults=MFCL_DEFAULTS)
    settings, flat = declared(cfg), flat_keys(to_dict(cfg))
    neutral = {k: d.default for k, d in settings.items() if d.treatment.digest_neutral}
    assert {k: neutral.get(k) for k in PROTECTED_DEFAULTS} == PROTECTED_DEFAULTS
    assert {k: flat[k] for k in neutral} == neutral


def _another(value):
    """A value other than ``value``, of its kind."""
    if isinstance(value, bool):
        return not value
    if value is None or isinstance(value, str):
        return f"{value}-other"
    return [*value, 0.5] if isinstance(value, list) else value + 1


@pytest.mark.parametrize("key", keys_declared(digest_neutral=True))
def test_a_digest_neutral_setting_counts_only_off_its_default(key):
    base = load_config(None, [])
    section = key.partition(".")[0]
    users = [e.name for e in registry.ALGORITHMS.values() if e.section == section]
    if users:  # an algorithm's section is in the digest while that algorithm runs
        base = with_setting(base, "algorithm", users[0])
    default = declared(base)[key].default
    assert config_digest(with_setting(base, key, default)) == config_digest(base)
    assert config_digest(with_setting(base, key, _another(default))) != config_digest(base)


def test_resume_safe_settings_are_outside_the_digest_and_reports_skip_what_says_nothing():
    base = load_config(None, [])
    safe = keys_declared(resume_safe=True)
    assert {"rounds", "checkpoint_every", "run_dir", "plugins", "distributed.process_id",
            "tracking.wandb"} <= set(safe)
    assert "seed" not in safe and "distributed.num_processes" not in safe
    for key in ("rounds", "eval_batch_size", "analysis_every", "client_metrics"):
        value = getattr(base, key)
        assert config_digest(with_setting(base, key, not value if isinstance(value, bool)
                                          else value + 1)) == config_digest(base), key
    assert set(keys_declared(replicate=True)) == {"seed", "seeds", "init_threefry_partitionable"}
    assert {"conv_impl", "devices", "distributed.num_processes", "data_dir"} <= set(
        keys_declared(report=False))


def test_a_section_declares_a_treatment_for_all_its_settings():
    @dataclasses.dataclass
    class Inner:
        a: int = 1
        b: int = setting(2, report=False)

    @dataclasses.dataclass
    class Outer:
        inner: Inner = setting(default_factory=Inner, resume_safe=True)
        c: list = setting(default_factory=list, digest_neutral=True, replicate=True)
        d: int = 0

    got = declared(Outer)
    assert got["inner.a"].treatment == Treatment(resume_safe=True)
    assert got["inner.b"].treatment == Treatment(resume_safe=True, report=False)
    assert got["c"] == (Treatment(digest_neutral=True, replicate=True), [])
    assert got["d"] == (Treatment(), 0)
    assert declared(Outer(c=[1])) == got  # an instance reads the defaults its class declares


def test_switching_algorithms_names_only_the_keys_the_user_changed(tmp_path):
    """``resume RUN algorithm=fedavg`` of a FedRCL run named every fedrcl.* key as changed;
    only ``algorithm`` (and what the user set anew) changed."""
    from fedjax_rcl.config import ConfigError, to_yaml
    from fedjax_rcl.loop import resume_config

    fedrcl = load_config(None, ["algorithm=fedrcl"])
    assert changed_keys(fedrcl, load_config(None, ["algorithm=fedavg"])) == ["algorithm"]
    assert changed_keys(fedrcl, load_config(None, ["algorithm=moon", "moon.mu=3"])) == [
        "algorithm", "moon.mu"]
    assert changed_keys(fedrcl, load_config(None, ["algorithm=fedrcl", "fedrcl.beta=3"])) == [
        "fedrcl.beta"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None, ["algorithm=fedrcl",
                                                                f"run_dir={run}"])))
    with pytest.raises(ConfigError) as err:
        resume_config(run, ["algorithm=fedavg"])
    assert str(err.value).startswith("resume: algorithm would change the run's results"), err
