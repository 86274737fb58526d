"""The config digest that checkpoints carry: it covers exactly the result-deciding settings, and a
setting added later leaves the digest of every run checkpointed before it unchanged at its default
(``DIGEST_NEUTRAL_DEFAULTS``): without that, every checkpoint written so far would be refused on
resume."""

import pytest

from fedjax_rcl.config import DIGEST_NEUTRAL_DEFAULTS, changed_keys, config_digest, load_config


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


def test_every_setting_left_out_of_the_digest_at_its_default_is_a_config_key_at_that_default():
    """``DIGEST_NEUTRAL_DEFAULTS`` names real keys with their real defaults (a renamed key or a
    changed default would silently change the digest of the runs it protects)."""
    from fedjax_rcl.config import flat_keys, to_dict
    from fedjax_rcl.mfcl.run import MFCL_DEFAULTS

    flat = flat_keys(to_dict(load_config(None, [], defaults=MFCL_DEFAULTS)))
    assert {k: flat[k] for k in DIGEST_NEUTRAL_DEFAULTS} == DIGEST_NEUTRAL_DEFAULTS


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
