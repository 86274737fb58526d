"""Clients sharded over devices and processes give the single-device result."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).parent / "sharding_worker.py"


def _env(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(args, devices=4, timeout=600):
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=_env(devices),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def _assert_close(a, b):
    for key in ("loss", "client_loss", "param_sums", "table_sums"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert a["clients"] == b["clients"]
    assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6)
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,participation,chunk,devices,model", [
    ("fedrcl", 0.5, 0, [1, 2, 4], None),  # 4 clients over 1, 2, 4 devices
    # 5 clients, 2 at a time (lax.map over groups of a vmap), padded to 6 and sharded over 2
    # devices; MOON's per-client state table sharded by client.
    ("moon", 0.625, 2, [1, 2], None),
    # A GroupNorm ResNet: on a CPU its norms are FFI kernels inside the sharded program. One
    # round: the device count reorders the clients' mean (1e-7), and a second round of a ResNet
    # amplifies that past the tolerance (1e-5..4e-4, with XLA's norms as with the kernels).
    ("fedrcl", 0.5, 0, [1, 2], "resnet10"),
])
def test_one_two_four_devices_agree(algorithm, participation, chunk, devices, model):
    rows = _run(["--devices", *map(str, devices), "--algorithm", algorithm,
                 "--participation", str(participation), "--clients-in-parallel", str(chunk),
                 *(["--model", model, "--width", "4", "--rounds", "1"] if model else [])])
    assert [r["devices"] for r in rows] == devices
    assert all(r["global_devices"] == 4 for r in rows)
    for r in rows[1:]:
        _assert_close(r, rows[0])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one():
    """Two processes on localhost, one CPU device each, form one 2-device cluster."""
    single = _run(["--devices", "1", "--algorithm", "moon", "--participation", "0.5"],
                  devices=1)[0]
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), "--devices", "2", "--algorithm", "moon",
         "--participation", "0.5", "--process-id", str(i), "--num-processes", "2",
         "--coordinator", f"127.0.0.1:{port}"],
        env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    rows = [json.loads(next(x for x in out.splitlines() if x.startswith("{")))
            for out, _ in outs]
    assert sorted(r["process"] for r in rows) == [0, 1]
    for r in rows:
        assert r["global_devices"] == 2
        _assert_close(r, single)
