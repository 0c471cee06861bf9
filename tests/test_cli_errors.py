"""Bad input on the command line ends with one clear error line and a non-zero exit, no traceback."""

import asyncio
import json
import subprocess
import sys

import pytest
import uvloop

from p2pfusion import __version__
from p2pfusion.cli.main import build_parser
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
    assert_one_line_error(
        run("infer", "--initial-peers", DEAD_PEER, long_prompt), "prompt too long: ", "the model accepts 8192"
    )


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
    Adapter(config, TuningConfig("lora", rank=2)).save(tmp_path / "deeper", tiny_models["gemma"])
    assert_one_line_error(
        run("infer", "--model", folder, "--initial-peers", peer, "--adapter", str(tmp_path / "deeper"), "hi"),
        "does not fit this model",
    )



@pytest.mark.parametrize("args, needle", [
    (["infer", "--temperature", "-1"], "argument --temperature: expected a finite number >= 0, got '-1'"),
    (["infer", "--temperature", "nan"], "argument --temperature: expected a finite number >= 0"),
    (["infer", "--temperature", "inf"], "argument --temperature: expected a finite number >= 0"),
    (["infer", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a whole number >= 1, got '0'"),
    (["chat", "--max-new-tokens", "-5"], "argument --max-new-tokens: expected a whole number >= 1"),
    (["infer", "--seed", "-1"], "argument --seed: expected a whole number >= 0"),
    (["chat", "--seed", "x"], "argument --seed: expected a whole number >= 0, got 'x'"),
    (["run-peer", "--max-length", "0"], "argument --max-length: expected a whole number >= 1"),
    (["run-peer", "--port", "65536"], "argument --port: expected a whole number in 0..65535"),
    (["run-peer", "--data-port", "-1"], "argument --data-port: expected a whole number in 0..65535"),
    (["run-peer", "--max-layers", "0"], "argument --max-layers: expected a whole number >= 1"),
    (["demo", "--peers", "0"], "argument --peers: expected a whole number >= 1"),
])
def test_bad_numbers_are_one_line_errors(args, needle):
    command, *options = args
    joining = {"run-peer": ["--new-swarm"], "demo": []}.get(command, ["--initial-peers", DEAD_PEER])
    code, stderr = run(command, *joining, *options, *(["hi"] if command == "infer" else []))
    assert code == 2
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"p2pfusion: error: {needle}") and f"(see p2pfusion {command} --help)" in stderr, stderr


def test_version():
    code, out = uvloop.run(_stdout("--version"))
    assert (code, out) == (0, f"p2pfusion {__version__}\n")


async def _stdout(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*CLI, *args, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode()


def test_every_option_has_help_and_shows_its_default():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    infer_help = " ".join(commands["infer"].format_help().split())
    for shown in ("prompt the text to continue", "most tokens to generate (default: 64)", "0 is greedy (default: 0.0)"):
        assert shown in infer_help, infer_help


def test_verbose_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["infer", "-v", "--initial-peers", DEAD_PEER, "hi"]).verbose
    assert parser.parse_args(["-v", "chat", "--initial-peers", DEAD_PEER]).verbose
    assert not parser.parse_args(["swarm", "--initial-peers", DEAD_PEER]).verbose


# The CLI with a spy on its first log line: was torch imported by then?
FIRST_LINE = """
import logging, sys
from p2pfusion.cli.main import main

class Spy(logging.Handler):
    def emit(self, record):
        if not hasattr(self, "seen"):
            self.seen = True
            print("torch imported:", "torch" in sys.modules, record.getMessage(), file=sys.stderr)

logging.getLogger("p2pfusion").addHandler(Spy())
sys.exit(main(sys.argv[1:]))
"""


def test_infer_says_it_is_connecting_before_importing_torch(tiny_models):
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_LINE, "infer", "--model", str(tiny_models["llama"].folder),
         "--initial-peers", DEAD_PEER, "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.stderr.startswith(f"torch imported: False connecting to the swarm via {DEAD_PEER}"), proc.stderr
