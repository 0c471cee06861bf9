"""CLI processes forked from the fork server behave as fresh `p2pfusion` processes: their own
arguments, working directory, output, exit code and signals; a peer of a quantized format imports
its library itself (the server hides them all from transformers)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.test_cli_errors import DEAD_PEER


def _run(forks, argv, tmp_path, cwd=None, timeout=60):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = forks.popen(argv, stdout=stdout, stderr=stderr, cwd=cwd)
    code = proc.wait(timeout)
    return code, out.read_text(), err.read_text()


def test_output_exit_codes_and_working_directory(forks, tmp_path):
    from p2pfusion import __version__

    assert _run(forks, ["--version"], tmp_path) == (0, f"p2pfusion {__version__}\n", "")
    code, out, err = _run(forks, ["swarm-secret", "s.key"], tmp_path, cwd=tmp_path)
    assert code == 0 and (tmp_path / "s.key").stat().st_mode & 0o777 == 0o600, err
    assert out.startswith("wrote a new swarm secret to s.key")
    code, out, err = _run(forks, ["swarm-secret", "s.key"], tmp_path, cwd=tmp_path)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "already exists" in err, err
    code, _, err = _run(forks, ["infer", "--temperature", "-1", "--initial-peers", DEAD_PEER, "hi"], tmp_path)
    assert code == 2 and err.startswith("p2pfusion: error: argument --temperature"), err


def test_an_int8_peer_forked_from_the_server_serves_until_it_is_stopped(forks, tiny_models, tmp_path):
    address = tmp_path / "peer.addr"
    argv = ["run-peer", "--new-swarm", "--model", str(tiny_models["llama"].folder), "--layers", "0:2",
            "--quant", "int8", "--throughput", "100", "--address-file", str(address)]
    with open(tmp_path / "peer.log", "w") as log:
        proc = forks.popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while not address.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    log = (tmp_path / "peer.log").read_text()
    assert address.exists(), log
    assert "int8" in log and "Traceback" not in log, log
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.terminate()
    assert proc.wait(30) == 0 and proc.poll() == 0, (tmp_path / "peer.log").read_text()
    proc.kill()  # an exited child is not signalled again: its pid may be another process's
