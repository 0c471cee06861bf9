"""The `p2pfusion` command: run-peer, infer, chat, api, swarm, swarm-secret, demo. Logs to stderr, results to stdout.

Only the standard library is imported up front: torch and transformers take seconds to import, so
a command says what it is doing before it imports them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from p2pfusion import __version__
from p2pfusion.cli.options import (
    run_name,
    COMPRESSION,
    DTYPES,
    INITIAL_PEERS,
    LOCAL_LAYERS,
    SPECULATE,
    DRAFT_MODEL,
    PORT,
    PRIVACY,
    QUANTS,
    SWARM_SECRET,
    TRUSTED_PEERS,
    VERIFY,
    CANARIES,
    api_key,
    gibibytes,
    ip_address,
    layer_range,
    mebibytes,
    peer_id,
    positive_bytes,
    precision_options,
    temperature,
    throughput,
    decode_threads,
    unused_quantizers,
    whole_number,
)
from p2pfusion.dht.records import DEFAULT_SESSION_LIMIT  # no torch: parsing must not wait for it
from p2pfusion.errors import P2PFusionError

log = logging.getLogger("p2pfusion")


class _Parser(argparse.ArgumentParser):
    """Bad arguments end with one line, as every other error of the CLI does."""

    def error(self, message: str):
        self.exit(2, f"p2pfusion: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it has none to show (None, or a flag's) or its help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0 or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _device(args) -> str:
    if args.gpu is not None:
        return f"cuda:{args.gpu}"
    return args.device


def _command(sub, name: str, summary: str, epilog: str | None = None) -> argparse.ArgumentParser:
    command = sub.add_parser(name, help=summary, description=summary, epilog=epilog, formatter_class=_HelpFormatter)
    # also after the command's name; SUPPRESS keeps a -v given before it
    command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logs on stderr")
    return command


def _generation_options(command: argparse.ArgumentParser, max_new_tokens: int, what: str) -> None:
    """The options infer and chat share."""
    command.add_argument("--model", help="local HF folder, .gguf file, Hub id, or gemma-3-270m (default: SmolLM2-135M-Instruct)")
    command.add_argument("--initial-peers", required=True, **INITIAL_PEERS)
    command.add_argument(
        "--max-new-tokens", type=whole_number(1), default=max_new_tokens, metavar="N", help=f"most tokens {what}"
    )
    command.add_argument(
        "--temperature", type=temperature, default=0.0, metavar="T", help="sampling temperature; 0 is greedy"
    )
    command.add_argument("--seed", type=whole_number(0), metavar="N", help="seed of the sampler (with --temperature)")
    command.add_argument("--compression", **COMPRESSION)
    command.add_argument("--verify", **VERIFY)
    command.add_argument("--canaries", **CANARIES)
    command.add_argument(
        "--hold-until-checked", action="store_true",
        help="print only text whose results verification checked (the default when stdout is not a terminal); "
        "otherwise text prints at once, and a failed check prints a notice and the corrected text",
    )
    command.add_argument("--adapter", type=Path, metavar="PATH", help="a trained adapter (PEFT format) to generate with")
    command.add_argument("--swarm-secret", **SWARM_SECRET)
    command.add_argument("--trusted-peers", **TRUSTED_PEERS)
    command.add_argument("--local-layers", **LOCAL_LAYERS)
    command.add_argument("--speculate", **SPECULATE)
    command.add_argument("--draft-model", **DRAFT_MODEL)
    precision_options(command)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="p2pfusion", description="Serve and use LLMs over a peer-to-peer swarm.", formatter_class=_HelpFormatter,
        epilog="Files: P2PFUSION_CACHE (default ~/.cache/p2pfusion) holds converted models, each peer's benchmark, "
        "the speeds clients observed and training drivers' keys; delete it to start afresh.",
    )
    parser.add_argument("--version", action="version", version=f"p2pfusion {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    peer = _command(sub, "run-peer", "serve a range of a model's layers")
    peer.add_argument(
        "--model", action="append",
        help="local HF folder, .gguf file, Hub id, or gemma-3-270m (default: SmolLM2-135M-Instruct); given more than once, the "
        "peer serves the one the swarm needs most",
    )
    joining = peer.add_mutually_exclusive_group(required=True)
    joining.add_argument("--new-swarm", action="store_true", help="start a new swarm with this peer")
    joining.add_argument("--initial-peers", **INITIAL_PEERS)
    peer.add_argument(
        "--layers", type=layer_range, metavar="START:END",
        help="layers to serve (default: those that help the swarm most, or a warm backup's once every layer is served)",
    )
    peer.add_argument(
        "--max-layers", type=whole_number(1), metavar="N",
        help="serve at most this many layers when --layers is not given (default: as many as fit in memory)",
    )
    peer.add_argument("--backup", action="store_true", help="keep a stage warm and take over when its peer leaves")
    peer.add_argument(
        "--train", type=run_name, metavar="RUN",
        help="be a replica of training run RUN: train this stage's weights (float32, AdamW) on the run's "
        "micro-batches and average them with the stage's other replicas; serves no inference (docs/training.md)",
    )
    peer.add_argument(
        "--run-driver", type=peer_id, metavar="PEER_ID",
        help="with --train: obey only this driver (the peer id SwarmTrainer logs); default: the run's first driver",
    )
    peer.add_argument(
        "--throughput", type=throughput, default="auto", metavar="auto|eval|N",
        help="auto: reuse the cached benchmark; eval: measure again; N: one-token steps/s through one layer",
    )
    peer.add_argument(
        "--decode-threads", type=decode_threads, default="auto", metavar="auto|N|N:warm",
        help="CPU threads for one-token steps, and whether they spin between a session's steps; "
        "auto: what the compute benchmark found fastest after idle gaps like a pipeline's",
    )
    where = peer.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=whole_number(0), metavar="N", help="serve on CUDA device N")
    where.add_argument("--device", choices=["cpu", "cuda", "mps"], default="cpu", help="where the layers run")
    peer.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="what the layers compute in (and hold, without --quant): float32 gives transformers' tokens; "
        "bfloat16 and float16 halve the memory",
    )
    peer.add_argument(
        "--quant", choices=QUANTS,
        help="hold the layers' weights quantized: int8 (torchao) takes a quarter of float32's memory, int4 "
        "(bitsandbytes NF4) an eighth; clients choose which formats they accept",
    )
    peer.add_argument(
        "--max-memory", type=gibibytes, metavar="GIB",
        help="memory this peer may use in all (its weights, KV caches and, on CPU, the process itself): it "
        "claims as many layers as fit (default: 80%% of the device's free memory)",
    )
    peer.add_argument(
        "--host", default="127.0.0.1",
        help="IP address to listen on: 127.0.0.1 serves this machine only, 0.0.0.0 every interface",
    )
    peer.add_argument(
        "--announce-host", metavar="IP", type=ip_address,
        help="the address other hosts reach this peer at (a public or forwarded IP), announced instead of "
        "the listening addresses",
    )
    peer.add_argument("--port", type=PORT, default=0, metavar="N", help="libp2p TCP port; 0 picks a free one")
    peer.add_argument(
        "--data-port", type=PORT, default=0, metavar="N",
        help="TCP port of direct TLS connections for hidden states; 0 picks a free one",
    )
    peer.add_argument(
        "--identity", metavar="PATH",
        help="file holding this peer's key, created if missing (mode 0600; its TLS certificate goes in PATH.tls): "
        "the peer keeps its id, address and layers across restarts (default: a new key each run)",
    )
    peer.add_argument(
        "--address-file", type=Path, metavar="PATH", help="write this peer's multiaddrs here once serving; removed when it stops"
    )
    peer.add_argument(
        "--session-limit", type=whole_number(1), default=DEFAULT_SESSION_LIMIT, metavar="N",
        help="longest session accepted, in tokens (clients learn it from the DHT)",
    )
    peer.add_argument("--compression", **COMPRESSION)
    peer.add_argument(
        "--training-memory", type=mebibytes, default="1024", metavar="MIB",
        help="activations kept between training clients' forward and backward passes; "
        "beyond it, backward passes recompute their forward",
    )
    peer.add_argument(
        "--cache-mib", type=mebibytes, metavar="N",
        help="MiB of KV cache all sessions may reserve together (each reserves its whole max length when it "
        "opens; one client gets at most half); default: half of what the device has free once this peer's layers "
        "are loaded (its free memory before loading them, less their weights; CPU: available RAM, CUDA: the "
        "GPU's free memory)",
    )
    peer.add_argument(
        "--max-sessions", type=whole_number(1), default=256, metavar="N",
        help="sessions open here at once, all clients together; past it, new ones are told to retry",
    )
    peer.add_argument(
        "--sessions-per-client", type=whole_number(1), default=64, metavar="N",
        help="sessions one client address may hold open here (relayed ones count against their client)",
    )
    peer.add_argument(
        "--idle-timeout", type=whole_number(1), default=120, metavar="SECONDS",
        help="a session without a step for this long is closed and its memory freed (its client reopens it)",
    )
    peer.add_argument(
        "--metrics-port", type=PORT, metavar="N",
        help="serve Prometheus metrics over HTTP at /metrics on this port (0 picks a free one; default: not served)",
    )
    peer.add_argument(
        "--metrics-host", type=ip_address, default="127.0.0.1", metavar="IP",
        help="IP address the metrics listen on: 127.0.0.1 serves this machine only",
    )
    peer.add_argument("--swarm-secret", **SWARM_SECRET)

    infer = _command(sub, "infer", "inference through the swarm; the text stays here, hidden states go to peers", PRIVACY)
    infer.add_argument("prompt", help="the text to continue (with --chat, the user's message)")
    _generation_options(infer, 64, "to generate")
    infer.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    chat = _command(sub, "chat", "chat in the terminal with the model, through the swarm", PRIVACY)
    _generation_options(chat, 256, "per reply")
    chat.add_argument("--system", metavar="PROMPT", help="a system message to start the conversation with")

    api = _command(
        sub, "api", "serve an OpenAI-compatible HTTP API (and a web chat) for a model, through the swarm", PRIVACY
    )
    api.add_argument("--initial-peers", required=True, **INITIAL_PEERS)
    api.add_argument("--model", help="local HF folder, .gguf file, Hub id, or gemma-3-270m (default: SmolLM2-135M-Instruct)")
    api.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on: 127.0.0.1 serves this machine only, 0.0.0.0 every interface",
    )
    api.add_argument("--port", type=PORT, default=8000, metavar="N", help="HTTP port; 0 picks a free one")
    api.add_argument(
        "--api-key", type=api_key, action="append", metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 requests; give it once per user to share "
        "--requests-per-user by key rather than by address",
    )
    api.add_argument(
        "--requests-per-user", type=whole_number(1), default=4, metavar="N",
        help="generations one user (API key, or address) runs at once; more wait 2 s for a slot, then get 429 "
        "(default: 4)",
    )
    api.add_argument(
        "--max-body", type=positive_bytes("MiB", 20), default=4 << 20, metavar="MIB",
        help="largest request body, in MiB; larger ones get 413 before they are read (default: 4)",
    )
    api.add_argument(
        "--allowed-hosts", nargs="+", metavar="NAME",
        help="host names this API answers without --api-key, besides IP addresses and localhost "
        "(a defence against DNS rebinding); '*' for any",
    )
    api.add_argument("--compression", **COMPRESSION)
    api.add_argument("--verify", **VERIFY)
    api.add_argument("--canaries", **CANARIES)
    api.add_argument("--swarm-secret", **SWARM_SECRET)
    api.add_argument("--trusted-peers", **TRUSTED_PEERS)
    api.add_argument("--local-layers", **LOCAL_LAYERS)
    api.add_argument("--speculate", **SPECULATE)
    api.add_argument("--draft-model", **DRAFT_MODEL)
    precision_options(api)

    view = _command(sub, "swarm", "show a swarm's stages, peers and bottleneck")
    view.add_argument("--initial-peers", required=True, **INITIAL_PEERS)
    view.add_argument(
        "--model", metavar="KEY|NAME|PATH",
        help="show only this model: its swarm key, its name, or a local model (matched by its weights); "
        "default: every model the swarm serves",
    )
    view.add_argument("--json", action="store_true", help="print JSON for scripts")
    view.add_argument("--no-probe", dest="probe", action="store_false", help="do not time each peer from here")
    view.add_argument("--swarm-secret", **SWARM_SECRET)

    secret = _command(sub, "swarm-secret", "write a new secret for a private swarm (mode 0600; never overwrites)")
    secret.add_argument("file", type=Path, metavar="FILE", help="where to write it; must not exist")

    demo = _command(sub, "demo", "a local swarm of the default model: one inference, or (--api) the HTTP API")
    demo.add_argument("--prompt", default="What is the capital of France?", help="the user's message")
    demo.add_argument("--max-new-tokens", type=whole_number(1), default=48, metavar="N", help="most tokens to generate")
    demo.add_argument(
        "--peers", type=whole_number(1), default=3, metavar="N", help="peers to start, each serving a share of the layers"
    )
    demo.add_argument(
        "--api", action="store_true",
        help="serve the OpenAI-compatible API (and the web chat) on 127.0.0.1 until Ctrl-C, instead of one inference",
    )
    demo.add_argument("--port", type=PORT, default=8000, metavar="N", help="the API's HTTP port, with --api")
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "transformers", "httpx", "huggingface_hub", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    # importing torchao (transformers does when it is installed) warns of kernels for GPUs this machine
    # lacks and of torch.compile internals: nothing a user can act on
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR if not verbose else logging.INFO)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not sys.stderr.isatty():
        # a progress bar redrawn into a file or pipe leaves fragments on every line: no bars from
        # transformers and huggingface_hub, nor from tqdm itself (transformers' GGUF conversion).
        # Set before they are imported, which read them then.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


def _run(coro) -> None:
    import uvloop

    uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    for library in unused_quantizers(args.command, getattr(args, "quant", None)):
        # a name mapped to None fails to import, and transformers then sees the library as absent
        sys.modules.setdefault(library, None)
    _configure_logging(args.verbose)
    try:
        if args.command == "run-peer":
            from p2pfusion.cli.commands import run_peer

            _run(run_peer(args, _device(args)))
        elif args.command == "infer":
            log.info("connecting to the swarm via %s while the model loads ...", args.initial_peers[0])
            from p2pfusion.cli.commands import infer

            _run(infer(args, started))
        elif args.command == "chat":
            log.info("connecting to the swarm via %s while the model loads ...", args.initial_peers[0])
            from p2pfusion.cli.chat import chat

            chat(args, started)
        elif args.command == "api":
            log.info("connecting to the swarm via %s while the model loads ...", args.initial_peers[0])
            from p2pfusion.cli.commands import api

            _run(api(args))
        elif args.command == "swarm":
            from p2pfusion.cli.swarm_view import show_swarm

            _run(show_swarm(args))
        elif args.command == "swarm-secret":
            from p2pfusion.net.secret import create_secret_file

            path = create_secret_file(args.file)
            print(f"wrote a new swarm secret to {path}: give each peer and client of the swarm --swarm-secret {path}")
        else:
            from p2pfusion.cli.demo import demo

            demo(args)
    except P2PFusionError as exc:
        print(f"p2pfusion: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a network or file error the code below did not turn into one of ours
        print(f"p2pfusion: error: {type(exc).__name__}: {exc or 'no detail'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
