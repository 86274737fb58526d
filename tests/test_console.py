"""A command whose standard output or error loses its reader (``fedjax-rcl train | head``)
goes on without it: no traceback, the run finishes, one line on the other stream says so."""

import io
import json
import os
import subprocess
import sys

import pytest

from fedjax_rcl import console


def test_a_closed_pipe_is_discarded_and_the_other_stream_told():
    read, write = os.pipe()
    os.close(read)  # the reader has gone: every write to the pipe fails with EPIPE
    out = io.TextIOWrapper(io.FileIO(write, "w"), write_through=True)
    err = io.StringIO()
    err.fileno = lambda: -1  # a stream without a file descriptor: dup2 is skipped
    t_out, t_err = console.tolerant(out, err)
    assert t_out.write("round 1\n") == len("round 1\n")  # no BrokenPipeError
    assert t_out.gone and not t_err.gone
    t_out.write("round 2\n")
    t_out.flush()
    assert err.getvalue() == ("fedjax-rcl: standard output closed by its reader; the command "
                              "goes on without it (its results are in its files)\n")
    os.write(write, b"later lines go to /dev/null\n")  # the descriptor now points there
    out.close()


def test_a_stream_that_works_is_passed_through():
    out, err = io.StringIO(), io.StringIO()
    t_out, t_err = console.tolerant(out, err)
    print("a line", file=t_out)
    print("a warning", file=t_err)
    t_out.flush()
    assert (out.getvalue(), err.getvalue()) == ("a line\n", "a warning\n")
    assert not t_out.gone and not t_out.isatty()  # the stream's own methods


def _closed_pipe() -> int:
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.slow
@pytest.mark.parametrize("closed", ["stdout", "stdout and stderr"])
def test_a_run_whose_output_reader_has_gone_finishes(tmp_path, closed):
    """Before: the first line printed raised BrokenPipeError, a traceback and exit 1, and
    nothing was trained."""
    run = tmp_path / "run"
    write = _closed_pipe()
    err_to = write if closed == "stdout and stderr" else subprocess.PIPE
    proc = subprocess.run(
        [sys.executable, "-m", "fedjax_rcl", "train", "dataset=digits", "num_clients=4",
         "participation=0.5", "local_epochs=1", "rounds=3", f"run_dir={run}"],
        stdout=write, stderr=err_to, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=600)
    os.close(write)
    assert proc.returncode == 0
    rounds = [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    if closed == "stdout":
        err = proc.stderr.decode()
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert err.count("fedjax-rcl: standard output closed by its reader; the command goes "
                         "on without it") == 1, err
