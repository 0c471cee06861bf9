"""The `p2pfusion` command: run-peer, infer, swarm, demo. Logs go to stderr; results go to stdout."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from p2pfusion.errors import P2PFusionError


def layer_range(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"layer range {text} is empty or negative")
    return start, end


def maddr_list(text: str) -> list[str]:
    maddrs = [m.strip() for m in text.split(",") if m.strip()]
    for maddr in maddrs:
        if not maddr.startswith("/") or "/p2p/" not in maddr:
            raise argparse.ArgumentTypeError(f"not a peer multiaddr (/ip4/HOST/tcp/PORT/p2p/PEER_ID): {maddr!r}")
    return maddrs


def throughput(text: str) -> str:
    if text in ("auto", "eval"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected auto, eval or a positive number, got {text!r}")
    return text


def mebibytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB >= 0, got {text!r}")
    return value << 20


# One address per flag (repeatable, or comma-separated), so a trailing prompt is never taken for one.
INITIAL_PEERS = dict(
    type=maddr_list, action="extend", metavar="MADDR", help="multiaddr of a swarm peer (repeat for more)"
)


def compression(text: str) -> str:
    from p2pfusion.net.compression import parse_compression

    try:
        return parse_compression(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


COMPRESSION = dict(
    type=compression, default="auto", metavar="auto|none|float16|bfloat16|int8|topk",
    help="codec of hidden states on the wire; auto picks per link from its measured speed",
)


def _device(args) -> str:
    if args.gpu is not None:
        return f"cuda:{args.gpu}"
    return args.device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pfusion", description="Serve and use LLMs over a peer-to-peer swarm.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    peer = sub.add_parser("run-peer", help="serve a range of a model's layers")
    peer.add_argument("--model", help="local HF folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct)")
    joining = peer.add_mutually_exclusive_group(required=True)
    joining.add_argument("--new-swarm", action="store_true", help="start a new swarm with this peer")
    joining.add_argument("--initial-peers", **INITIAL_PEERS)
    peer.add_argument("--layers", type=layer_range, metavar="START:END", help="layers to serve")
    peer.add_argument("--max-layers", type=int, help="serve at most this many layers when --layers is not given")
    peer.add_argument("--backup", action="store_true", help="keep a stage warm and take over when its peer leaves")
    peer.add_argument(
        "--throughput", type=throughput, default="auto", metavar="auto|eval|N",
        help="auto: reuse the cached benchmark; eval: measure again; N: one-token steps/s through one layer",
    )
    where = peer.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=int, metavar="N", help="serve on CUDA device N")
    where.add_argument("--device", choices=["cpu", "cuda", "mps"], default="cpu")
    peer.add_argument("--host", default="127.0.0.1", help="IP address to listen on")
    peer.add_argument("--port", type=int, default=0, help="libp2p TCP port (0 picks a free one)")
    peer.add_argument(
        "--data-port", type=int, default=0, help="TCP port of direct TLS connections for hidden states (0 picks one)"
    )
    peer.add_argument("--identity", help="file holding this peer's key (created if missing)")
    peer.add_argument("--address-file", type=Path, help="write this peer's multiaddrs here once serving")
    peer.add_argument("--max-length", type=int, default=2048, help="longest session accepted, in tokens")
    peer.add_argument("--compression", **COMPRESSION)
    peer.add_argument(
        "--training-memory", type=mebibytes, default=1 << 30, metavar="MIB",
        help="activations kept between training clients' forward and backward passes (default 1024); "
        "beyond it, backward passes recompute their forward",
    )

    infer = sub.add_parser("infer", help="private inference through the swarm")
    infer.add_argument("prompt")
    infer.add_argument("--model")
    infer.add_argument("--initial-peers", required=True, **INITIAL_PEERS)
    infer.add_argument("--max-new-tokens", type=int, default=64)
    infer.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    infer.add_argument("--seed", type=int)
    infer.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    infer.add_argument("--compression", **COMPRESSION)
    infer.add_argument("--adapter", type=Path, metavar="PATH", help="a trained adapter (PEFT format) to generate with")

    view = sub.add_parser("swarm", help="show a swarm's stages, peers and bottleneck")
    view.add_argument("--initial-peers", required=True, **INITIAL_PEERS)
    view.add_argument("--model", help="show only this model (default: every model served)")
    view.add_argument("--json", action="store_true", help="print JSON for scripts")
    view.add_argument("--no-probe", dest="probe", action="store_false", help="do not time each peer from here")

    demo = sub.add_parser("demo", help="a local 3-peer swarm of the default model and one private inference")
    demo.add_argument("--prompt", default="What is the capital of France?")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--peers", type=int, default=3)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _run(coro) -> None:
    import uvloop

    uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run-peer":
        # A stage idles while other stages compute, often on the same cores, so its OpenMP
        # threads must not spin for long (libgomp's default is about 3 ms) after a step; never
        # spinning (OMP_WAIT_POLICY=PASSIVE) made batch steps 18% slower. About 0.1 ms keeps
        # threads warm between one step's ops. Set before torch starts its thread pool.
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    _configure_logging(args.verbose)
    try:
        if args.command == "run-peer":
            from p2pfusion.cli.commands import run_peer

            _run(run_peer(args, _device(args)))
        elif args.command == "infer":
            from p2pfusion.cli.commands import infer

            _run(infer(args))
        elif args.command == "swarm":
            from p2pfusion.cli.swarm_view import show_swarm

            _run(show_swarm(args))
        else:
            from p2pfusion.cli.demo import demo

            demo(args)
    except P2PFusionError as exc:
        print(f"p2pfusion: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
