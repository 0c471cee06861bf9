"""Bad input on the command line ends with one clear error line and a non-zero exit, no traceback."""

import asyncio
import json
import sys

import pytest
import uvloop

from p2pfusion.client.adapters import Adapter, TuningConfig
from tests.conftest import reference_model
from tests.swarm import running_peers

CLI = [sys.executable, "-m", "p2pfusion.cli.main"]
DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWJNSFBr4gPnCYC2XSNsR4vbs2ugsCsTHmE2CeghrcATvX"


async def _run(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, err.decode()


def assert_one_line_error(result: tuple[int, str], *needles: str) -> None:
    code, stderr = result
    assert code != 0
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "error:" in last, stderr
    for needle in needles:
        assert needle in last, last


def run(*args: str) -> tuple[int, str]:
    return uvloop.run(_run(*args))


def test_missing_model_path():
    assert_one_line_error(run("run-peer", "--model", "/no/such/model", "--new-swarm"), "model not found")


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert_one_line_error(run("run-peer", "--model", str(bad), "--new-swarm"), "cannot read GGUF")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_line_error(run("run-peer", "--model", str(tmp_path), "--new-swarm"), "unsupported architecture")


def test_layer_range_out_of_bounds(tiny_models):
    folder = str(tiny_models["llama"].folder)
    assert_one_line_error(run("run-peer", "--model", folder, "--new-swarm", "--layers", "2:9"), "out of bounds")
    assert_one_line_error(run("run-peer", "--model", folder, "--new-swarm", "--layers", "3:1"), "empty")


def test_bad_initial_peer_address():
    assert_one_line_error(run("infer", "--initial-peers", "nonsense", "hi"), "not a peer multiaddr")


def test_data_port_in_use(tiny_models):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        folder = str(tiny_models["llama"].folder)
        result = run("run-peer", "--model", folder, "--new-swarm", "--layers", "0:2", "--data-port", port)
    assert_one_line_error(result, "cannot listen for direct connections", "address already in use")


def test_unknown_compression():
    assert_one_line_error(run("infer", "--initial-peers", DEAD_PEER, "--compression", "zstd", "hi"), "choose from auto")
    assert_one_line_error(run("run-peer", "--new-swarm", "--compression", "gzip"), "unknown compression 'gzip'")


@pytest.mark.slow
def test_unreachable_initial_peer():
    assert_one_line_error(run("infer", "--initial-peers", DEAD_PEER, "hi"), "no initial peer is reachable")


@pytest.mark.slow
def test_empty_and_too_long_prompts():
    assert_one_line_error(run("infer", "--initial-peers", DEAD_PEER, "   "), "prompt is empty")
    long_prompt = "word " * 9000
    assert_one_line_error(run("infer", "--initial-peers", DEAD_PEER, long_prompt), "longer than the maximum length")


async def _infer_with_gap(source):
    async with running_peers(source, [(0, 10)]) as (_, maddrs):
        return await _run("infer", "--initial-peers", maddrs[0], "hello")


@pytest.mark.slow
def test_swarm_missing_layers_are_named(default_model):
    assert_one_line_error(uvloop.run(_infer_with_gap(default_model)), "no peer serves layers 10:30")


def test_unavailable_gpu(tiny_models):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    folder = str(tiny_models["llama"].folder)
    assert_one_line_error(run("run-peer", "--model", folder, "--new-swarm", "--gpu", "0"), "not available")


def test_adapter_that_does_not_fit(tiny_models, tmp_path):
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    folder = str(tiny_models["llama"].folder)
    assert_one_line_error(
        run("infer", "--model", folder, "--initial-peers", peer, "--adapter", str(tmp_path / "none"), "hi"),
        "cannot read the adapter",
    )
    config = reference_model(tiny_models["gemma"]).config
    config.num_hidden_layers = 6  # made for a deeper model
    Adapter(config, TuningConfig("lora", rank=2)).save(tmp_path / "deeper", "deeper")
    assert_one_line_error(
        run("infer", "--model", folder, "--initial-peers", peer, "--adapter", str(tmp_path / "deeper"), "hi"),
        "does not fit this model",
    )
