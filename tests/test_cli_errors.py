"""Bad input on the command line ends with one clear error line and a non-zero exit, no traceback."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import uvloop

from p2pfusion import __version__
from p2pfusion.cli.main import build_parser
from p2pfusion.client.tune.adapter import Adapter, TuningConfig
from p2pfusion.dht.swarm import join_swarm
from tests.conftest import reference_model
from tests.forked_cli import forked
from tests.swarm import peers_in_background
from tests.tiny_chat import with_chat_tokenizer

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




def cases(tiny: dict, tmp: Path, taken_port: int, live: str, empty: str) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """Each bad command line the CLI must end with one error line: its arguments, and what the line
    says. `live`: a peer that answers, for mistakes found once the swarm is joined (a client joins
    while its model loads, so an unreachable swarm is said first); `empty`: a swarm's node where no
    peer serves (an empty model list proves nothing early, as a read that timed out gives one too:
    the reads of the model's records say it)."""
    llama = str(tiny["llama"].folder)
    (tmp / "broken.gguf").write_bytes(b"not a gguf file at all")
    (tmp / "gpt2").mkdir()
    (tmp / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    config = reference_model(tiny["gemma"]).config
    config.num_hidden_layers = 6  # made for a deeper model
    Adapter(config, TuningConfig("lora", rank=2)).save(tmp / "deeper", tiny["gemma"])
    infer = ["infer", "--initial-peers", DEAD_PEER]
    return {
        "missing model path": (["run-peer", "--model", "/no/such/model", "--new-swarm"], ("model not found",)),
        "unreadable gguf": (["run-peer", "--model", str(tmp / "broken.gguf"), "--new-swarm"], ("cannot read GGUF",)),
        "unsupported architecture": (["run-peer", "--model", str(tmp / "gpt2"), "--new-swarm"], ("unsupported architecture",)),
        "layers out of bounds": (["run-peer", "--model", llama, "--new-swarm", "--layers", "2:9"], ("out of bounds",)),
        "empty layer range": (["run-peer", "--model", llama, "--new-swarm", "--layers", "3:1"], ("empty",)),
        "bad initial peer": (["infer", "--initial-peers", "nonsense", "hi"], ("not a peer multiaddr",)),
        "data port in use": (
            ["run-peer", "--model", llama, "--new-swarm", "--layers", "0:2", "--data-port", str(taken_port)],
            ("cannot listen for direct connections", "address already in use"),
        ),
        "client compression": ([*infer, "--compression", "zstd", "hi"], ("choose from auto",)),
        "peer compression": (["run-peer", "--new-swarm", "--compression", "gzip"], ("unknown compression 'gzip'",)),
        "training a quantized peer": (
            ["run-peer", "--model", llama, "--new-swarm", "--train", "r", "--quant", "int8"], ("--train trains float32 weights",),
        ),
        "unreachable initial peer": ([*infer, "hi"], ("no initial peer is reachable",)),
        "a swarm that serves nothing": (
            ["infer", "--model", llama, "--initial-peers", empty, "hi"], ("no model with the weights of", "no model at all"),
        ),
        "empty prompt": ([*infer, "   "], ("prompt is empty",)),
        "unavailable gpu": (["run-peer", "--model", llama, "--new-swarm", "--gpu", "0"], ("not available",)),
        "missing adapter": (
            ["infer", "--model", llama, "--initial-peers", live, "--adapter", str(tmp / "none"), "hi"],
            ("cannot read the adapter",),
        ),
        "adapter of another model": (
            ["infer", "--model", llama, "--initial-peers", live, "--adapter", str(tmp / "deeper"), "hi"],
            ("does not fit this model",),
        ),
        "layers with two models": (
            ["run-peer", "--model", llama, "--model", llama, "--new-swarm", "--layers", "0:2"], ("give one --model",),
        ),
        "too little memory": (
            ["run-peer", "--model", llama, "--new-swarm", "--max-memory", "0.01"], ("cannot hold one layer",),
        ),
    }


@pytest.fixture(scope="module")
def outcomes(tiny_models, tmp_path_factory, forks) -> dict[str, tuple[tuple[int, str], tuple[str, ...]]]:
    """Every case's CLI process, forked from the tests' fork server (tests/forked_cli.py)."""
    import socket

    with socket.socket() as taken, peers_in_background(tiny_models["llama"], [(0, 4)]) as (_, maddrs, loop):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lone = loop.run(join_swarm([]))
        try:
            table = cases(tiny_models, tmp_path_factory.mktemp("cli-errors"), taken.getsockname()[1], maddrs[0],
                          loop.run(lone.maddrs())[0])
            assert list(table) == CASE_NAMES  # every case is a test of its own
            results = forked(forks, [args for args, _ in table.values()])
        finally:
            loop.run(lone.shutdown())
    return {name: ((r.returncode, r.stderr), needles) for (name, (_, needles)), r in zip(table.items(), results)}


CASE_NAMES = [
    "missing model path", "unreadable gguf", "unsupported architecture", "layers out of bounds", "empty layer range",
    "bad initial peer", "data port in use", "client compression", "peer compression", "training a quantized peer",
    "unreachable initial peer", "a swarm that serves nothing",
    "empty prompt", "unavailable gpu", "missing adapter", "adapter of another model",
    "layers with two models", "too little memory",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_command_lines_end_with_one_error_line(outcomes, name):
    import torch

    if name == "unavailable gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result, needles = outcomes[name]
    assert_one_line_error(result, *needles)


@pytest.mark.slow
def test_swarm_missing_layers_are_named(default_model, forks):
    with peers_in_background(default_model, [(0, 10)]) as (_, maddrs, _loop):
        [result] = forked(forks, [["infer", "--initial-peers", maddrs[0], "hello"]])
    assert_one_line_error((result.returncode, result.stderr), "no peer serves layers 10:30")


@pytest.mark.parametrize("args, needle", [
    (["infer", "--temperature", "-1"], "argument --temperature: expected a finite number >= 0, got '-1'"),
    (["infer", "--temperature", "nan"], "argument --temperature: expected a finite number >= 0"),
    (["infer", "--temperature", "inf"], "argument --temperature: expected a finite number >= 0"),
    (["infer", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a whole number >= 1, got '0'"),
    (["chat", "--max-new-tokens", "-5"], "argument --max-new-tokens: expected a whole number >= 1"),
    (["infer", "--seed", "-1"], "argument --seed: expected a whole number >= 0"),
    (["chat", "--seed", "x"], "argument --seed: expected a whole number >= 0, got 'x'"),
    (["run-peer", "--session-limit", "0"], "argument --session-limit: expected a whole number >= 1"),
    (["run-peer", "--port", "65536"], "argument --port: expected a whole number in 0..65535"),
    (["run-peer", "--data-port", "-1"], "argument --data-port: expected a whole number in 0..65535"),
    (["run-peer", "--max-layers", "0"], "argument --max-layers: expected a whole number >= 1"),
    (["demo", "--peers", "0"], "argument --peers: expected a whole number >= 1"),
    (["run-peer", "--max-memory", "0"], "argument --max-memory: expected a positive number of GiB, got '0'"),
    (["run-peer", "--max-memory", "lots"], "argument --max-memory: expected GiB as a number, e.g. 1.5; got 'lots'"),
    (["run-peer", "--quant", "int2"], "argument --quant: invalid choice: 'int2'"),
    (["run-peer", "--decode-threads", "1:warm"], "argument --decode-threads: expected auto, N (at least 1) or N:warm"),
    (["run-peer", "--decode-threads", "0"], "argument --decode-threads: expected auto, N (at least 1) or N:warm"),
    (["run-peer", "--train", "my run"], "argument --train: a run name is 1 to 64 letters"),
    (["infer", "--min-precision", "fp8"], "argument --min-precision: invalid choice: 'fp8'"),
    (["chat", "--exact", "--min-precision", "int8"], "argument --min-precision: not allowed with argument --exact"),
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


def test_the_hosts_script_names_the_interpreter_to_use_when_sudo_drops_the_virtualenv():
    """`sudo python scripts/hosts_swarm.py` runs a python without the virtualenv's packages: one line
    naming the command that works (the README's), no traceback; with the virtualenv's it starts."""
    script = Path(__file__).parents[1] / "scripts" / "hosts_swarm.py"
    bare = subprocess.run([sys.executable, "-I", "-S", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "Traceback" not in bare.stderr
    assert "sudo .venv/bin/python scripts/hosts_swarm.py" in bare.stderr.strip().splitlines()[-1]
    ours = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and "--max-new-tokens" in ours.stdout
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "sudo .venv/bin/python scripts/hosts_swarm.py" in readme and "sudo python scripts" not in readme


_EVERY_HELP = """
import contextlib, io, runpy, sys
sys.path.insert(0, "scripts")
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None) or "usage:" not in out.getvalue():
            print(path, "exited", done.code)
    except Exception as exc:
        print(path, repr(exc))
    else:
        print(path, "did not stop at --help")
"""


def test_every_script_prints_its_help():
    """`--help` of every bench and tool script prints its usage (a help text is a %-format: a bare
    percent sign in one broke two of them); one process imports their libraries once."""
    root = Path(__file__).parents[1]
    scripts = sorted(str(p.relative_to(root)) for p in (root / "scripts").glob("*.py")
                     if '__name__ == "__main__"' in p.read_text())
    assert len(scripts) > 20
    proc = subprocess.run([sys.executable, "-c", _EVERY_HELP, *scripts], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr[-2000:]


def test_an_unreachable_swarm_is_said_before_the_model_has_loaded(forks):
    """`infer` joins the swarm while its model loads: a dead peer is the error, and no line about the
    loaded model comes first."""
    [result] = forked(forks, [["infer", "--initial-peers", DEAD_PEER, "hi"]])
    code, stderr = result.returncode, result.stderr
    assert code != 0 and "no initial peer is reachable" in stderr.strip().splitlines()[-1]
    assert "loaded SmolLM2" not in stderr, stderr


def test_every_length_message_names_the_limit_that_holds(tiny_models, tmp_path, forks):
    """Peers that accept 64 tokens of a model with 128 positions: a prompt over either limit, and
    one too long to tokenize at all, are each refused at the swarm's 64."""
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path / "chat")

    with peers_in_background(source, [(0, 4)], session_limit=64) as (_, maddrs, _loop):
        prompts = ("a" * 100, "a" * 300, "a" * 5000)
        results = [(r.returncode, r.stderr) for r in forked(
            forks, [["infer", "--model", str(source.folder), "--initial-peers", maddrs[0], p] for p in prompts]
        )]
    for result, needle in zip(results, ("10", "30", "5000 characters cannot fit in the 64 tokens")):
        assert_one_line_error(result, f"prompt too long: {needle}", "the swarm accepts")
        assert "64" in result[1].splitlines()[-1] and "128" not in result[1].splitlines()[-1]


def test_a_model_the_swarm_does_not_serve_is_said_before_a_first_run_has_converted_it(tiny_models, tmp_path, forks):
    """With an empty cache, the default model takes tens of seconds to convert and hash; a swarm
    that serves another model is said from the model's shape (its GGUF header) before that ends."""
    env = dict(os.environ, P2PFUSION_CACHE=str(tmp_path / "cache"))
    with peers_in_background(tiny_models["llama"], [(0, 4)]) as (_, maddrs, _loop):
        [result] = forked(forks, [["infer", "--initial-peers", maddrs[0], "hi"]], env=env)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "the swarm serves no model like SmolLM2-135M-Instruct (30 layers" in last, result.stderr
    assert "(key llama-4x64-" in last  # and names what it does serve
    assert not list((tmp_path / "cache").glob("converted/*/complete")), "it waited for the conversion"


def test_a_stopped_peer_removes_its_address_file_and_a_stale_address_is_named_so(tiny_models, tmp_path, forks):
    """The README's snippet reads `peer1.addr`: once its peer stops the file is gone, and an address
    kept from it elsewhere fails with one short traceback that says what is wrong."""
    address_file = tmp_path / "peer1.addr"
    with open(tmp_path / "peer.log", "w") as log:
        peer = forks.popen(
            ["run-peer", "--model", str(tiny_models["llama"].folder), "--new-swarm", "--layers", "0:4",
             "--throughput", "100", "--address-file", str(address_file)], stderr=log,
        )
    deadline = time.monotonic() + 120
    while not address_file.exists():
        assert peer.poll() is None and time.monotonic() < deadline, "the peer never wrote its address file"
        time.sleep(0.2)
    stale = address_file.read_text().split()[0]
    peer.send_signal(signal.SIGINT)
    assert peer.wait(60) == 0, (tmp_path / "peer.log").read_text()
    assert not address_file.exists()
    api = subprocess.run([sys.executable, "-c", PYTHON_API, stale, str(tiny_models["llama"].folder)],
                         capture_output=True, text=True, timeout=180)
    assert api.returncode != 0 and api.stderr.count("Traceback") == 1, api.stderr
    assert "no initial peer is reachable" in api.stderr and "stale once its peer stopped" in api.stderr.splitlines()[-1]


OUR_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARN|WARNING|ERROR) [\w.]+: ")
PYTHON_API = """
import sys
from p2pfusion import SwarmLMSync
lm = SwarmLMSync([sys.argv[1]], sys.argv[2], verify=0.0)
print(lm.generate([3, 17, 42], 3, stop_at_eos=False).token_ids)
lm.close()
"""


def test_one_log_format_and_no_library_noise(tiny_models, tmp_path):
    """At default verbosity a user's terminal gets our lines only, in one format (hivemind's
    included), and the Python API prints nothing of torchao's or torch's."""
    source = with_chat_tokenizer(tiny_models["llama"], tmp_path / "chat")
    with peers_in_background(source, [(0, 4)]) as (_, maddrs, _loop):
        code, stderr = run("infer", "--model", str(source.folder), "--initial-peers", maddrs[0], "--max-new-tokens", "3", "hi")
        api = subprocess.run([sys.executable, "-c", PYTHON_API, maddrs[0], str(source.folder)],
                             capture_output=True, text=True, timeout=180)
    assert code == 0, stderr
    strays = [line for line in stderr.splitlines() if line.strip() and not OUR_LINE.match(line)]
    assert not strays, strays
    assert api.returncode == 0 and api.stdout.strip().startswith("["), api.stderr
    assert not [line for line in api.stderr.splitlines() if "Failed to load" in line or "_pytree" in line], api.stderr
