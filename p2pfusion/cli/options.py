"""The command line's argument types (each a one-line error on bad input) and the options several
commands share. Only the standard library is imported: parsing must not wait for torch."""

from __future__ import annotations

import argparse
import ipaddress
import math
from pathlib import Path


def whole_number(minimum: int, maximum: int | None = None):
    """An argument type: a whole number in [minimum, maximum]."""
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected a whole number {bounds}, got {text!r}")
        return value

    return parse


PORT = whole_number(0, 65535)


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def layer_range(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"layer range {text} is empty or negative")
    return start, end


def peer_id(text: str) -> str:
    if not 0 < len(text) <= 128 or not text.isascii() or not text.isalnum():
        raise argparse.ArgumentTypeError(f"expected a peer id (letters and digits, as Qm... or 12D3KooW...), got {text!r}")
    return text


def run_name(text: str) -> str:
    if not 0 < len(text) <= 64 or not all(c.isalnum() or c in "-_." for c in text):
        raise argparse.ArgumentTypeError(f"a run name is 1 to 64 letters, digits, '-', '_' or '.', got {text[:80]!r}")
    return text


def ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


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


def decode_threads(text: str) -> str:
    """auto, N (threads for one-token steps) or N:warm (and spinning between a session's steps:
    only a second thread has anything to keep awake)."""
    count, _, warm = text.partition(":")
    if text == "auto" or (count.isdigit() and int(count) >= (2 if warm else 1) and warm in ("", "warm")):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, N (at least 1) or N:warm (at least 2), got {text!r}")


def positive_bytes(unit: str, shift: int):
    """An argument type: a positive amount of `unit` (2**shift bytes; fractions allowed), as bytes."""

    def parse(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit} as a number, e.g. 1.5; got {text!r}") from None
        if not math.isfinite(value) or value <= 0 or int(value * (1 << shift)) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, got {text!r}")
        return int(value * (1 << shift))

    return parse


gibibytes = positive_bytes("GiB", 30)


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


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability from 0 to 1, got {text!r}")
    return value


def compression(text: str) -> str:
    if text == "auto":  # the default, parsed on every run: checking it must not import torch (the codecs do)
        return text
    from p2pfusion.net.compression import parse_compression

    try:
        return parse_compression(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


COMPRESSION = dict(
    type=compression, default="auto", metavar="auto|none|float16|bfloat16|int8|topk",
    help="codec of hidden states on the wire; auto picks per link from its measured speed",
)


VERIFY = dict(
    type=probability, default=0.05, metavar="RATE",
    help="chance that a step's results are checked against other peers, beside the generation (0: never); "
    "a generation's end always is",
)
CANARIES = dict(
    type=probability, default=0.0, metavar="RATE",
    help="chance that a generation is followed by a canary: a synthetic chat whose every hop this client "
    "recomputes, reporting a peer that signed a wrong result (canaries go through suspected peers anyway)",
)


SWARM_SECRET = dict(type=Path, metavar="FILE", help="a private swarm's secret file (from p2pfusion swarm-secret)")
TRUSTED_PEERS = dict(
    type=Path, metavar="FILE",
    help="route only through the peers this file lists (a peer id or a multiaddr ending in /p2p/ID per line; "
    "# comments): routes, failovers and verification never leave the list, and layers it does not cover are an error",
)
LOCAL_LAYERS = dict(
    type=whole_number(0), default=0, metavar="K",
    help="run at least the first K layers on this machine (up to the next stage boundary), so no peer sees the "
    "token embeddings; costs client compute and memory",
)

SPECULATE = dict(
    choices=("auto", "off"), default="auto",
    help="send drafted tokens (looked up in the text so far) for the swarm to check in one step, when the "
    "model's layers allow it and drafting pays: the same text, in fewer trips around the route",
)
DRAFT_MODEL = dict(
    metavar="PATH",
    help="a small model with the model's tokenizer (folder, .gguf file or Hub id) that drafts the tokens for "
    "--speculate, instead of looking them up in the text: drafts for any text, at its cost on this machine",
)

# models/formats.py's WeightFormat, from most to least precise, the two half-precision formats ranking
# equal (named here: importing it would import torch)
FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
DTYPES = FORMATS[:3]
QUANTS = FORMATS[3:]
QUANTIZERS = {"int8": "torchao", "int4": "bitsandbytes"}  # the library each quantized format needs


def unused_quantizers(command: str, quant: str | None) -> list[str]:
    """The quantization libraries a command's process never uses: all but a run-peer's own format's.
    transformers imports torchao whenever it is installed (some 80 MiB, and warnings about GPU
    kernels this machine lacks), so the CLI hides these from the process before anything imports them."""
    needed = QUANTIZERS.get(quant) if command == "run-peer" else None
    return [library for library in QUANTIZERS.values() if library != needed]


def precision_options(command: argparse.ArgumentParser) -> None:
    """Which peers' weight formats a client routes through (peers announce theirs)."""
    group = command.add_mutually_exclusive_group()
    group.add_argument(
        "--exact", dest="min_precision", action="store_const", const="float32", default="int4",
        help="route only through float32 peers: the tokens transformers would give",
    )
    group.add_argument(
        "--min-precision", choices=FORMATS, default="int4", metavar="FORMAT",
        help="the least precise weight format a route may use: float32, then bfloat16 and float16 (equal), then "
        "int8, then int4 (default: int4, any peer)",
    )


def api_key(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("an API key is a non-empty word without spaces")
    return text


# what a user reads in `infer --help` (and chat's, api's) before trusting the swarm with a prompt
PRIVACY = (
    "Privacy: the tokenizer, embeddings and LM head stay on this machine, but the peers of a route see "
    "the hidden states of every token, and those give the prompt away. Measured on the default model "
    "(docs/privacy.md): the peer serving layer 0 recovered 100% of the prompt's tokens by a "
    "nearest-neighbour lookup; a peer with the model's weights (every peer of an open model has them) "
    "recovered 100% of them by trying candidate tokens, at every split depth measured (1 to 29); "
    "a probe trained on other text, 98% at depth 1 and 40% at 29. "
    "float16 and int8 codecs do not change that; noise strong enough to hinder it changes the answers. "
    "What protects a prompt: --trusted-peers FILE (only the machines you list see the states) and "
    "--swarm-secret FILE (a private swarm only its members can join). --local-layers K stops the "
    "nearest-neighbour lookup only."
)
