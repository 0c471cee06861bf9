"""Canaries and receipts: what they convict, with what evidence, at what cost.

1. Conviction: peers of the default model on 127.0.0.1, in this process: 0:15, and 15:30 twice; one
   of the 15:30 peers lies (its stage's forward patched, as a modified `run-peer` would be). A
   client with no checks of its own (verify 0) sends canaries through it (as a client does through
   a peer it suspects); per corruption: the share of canaries that convict the liar, the share whose
   report a second, fresh client judges to hold (it recomputes the evidence itself), any honest
   peer convicted, and a canary's wall time. "in 1 session of 4" lies only in sessions it draws at
   random: the column "canaries to catch" is the median number of canaries sent until one
   convicted it. "drafts only" lies only on steps of a token and its drafts (speculative decoding,
   which canaries do as users do).
2. False convictions: honest peers of four formats (float32, int8, bfloat16, int4) on both stages,
   clients of every codec in turn; N canaries: peers convicted, and peers avoided for receipts
   that do not hold.
3. Receipts: what signing one costs a peer per step, beside the step's compute through 15 layers,
   and the bytes it adds to a step's header.

Usage: python scripts/bench_canaries.py [--canaries 20] [--honest 200] [--corruptions "zeros,..."]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import random
import statistics
import sys
import time

import msgpack
import torch
import uvloop
from tqdm import tqdm

from p2pfusion.client.checks.evidence import judge_report
from p2pfusion.client.generate.canary import Canaries
from p2pfusion.client.generate.draft import MAX_DRAFTS
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_stage
from p2pfusion.net.compression import Codec
from p2pfusion.net.identity import Identity
from p2pfusion.net.receipts import ReceiptChain, ReceiptKey
from p2pfusion.net.wire import encode
from bench_verify import CODECS, FORMAT_NAMES, MIXED, Int4Compute, Liar, Nudge, noise, start_mixed, start_peers, stop_peers

SOMETIMES = 4  # "in 1 session of 4": the liar lies in a session with this chance in 1


class Sometimes:
    """Corrupts whole sessions, drawn at random when a session's first step (offset 0) comes."""

    def __init__(self, corrupt):
        self.corrupt = corrupt
        self.lying = False

    def __call__(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        if offset == 0:
            self.lying = random.random() < 1 / SOMETIMES
        return self.corrupt(out, offset) if self.lying else out


CORRUPTIONS = {
    "zeros": lambda out, offset: torch.zeros_like(out),
    "noise 1%": noise(1e-2),
    "noise 0.1%": noise(1e-3),
    "noise 0.01%": noise(1e-4),
    "decode steps only": lambda out, offset: torch.zeros_like(out) if out.shape[1] == 1 else out,
    "drafts only": lambda out, offset: torch.zeros_like(out) if 2 <= out.shape[1] <= MAX_DRAFTS + 1 else out,
    "noise 1% in 1 session of 4": "sometimes",
    "token nudge": "nudge",
    "int4 as float32": "int4",
}


def made(name: str, source):
    corrupt = CORRUPTIONS[name]
    if corrupt == "nudge":
        nudge = Nudge(source)
        return lambda out, offset: nudge(out, max(offset, 60))  # any decode step of a canary
    if corrupt == "int4":
        return Int4Compute(source, 15, 30)
    if corrupt == "sometimes":
        return Sometimes(noise(1e-2))
    return corrupt


def convictions(source, args) -> None:
    peers_loop = BackgroundLoop("bench-peers")
    peers, maddrs = peers_loop.run(start_peers(source, [(0, 15), (15, 30)], (15, 30)))
    liar = Liar(peers[-1])
    liar_id = peers[-1].swarm.peer_id
    honest = {p.swarm.peer_id for p in peers[:-1]}

    async def matrix() -> None:
        client = await join_swarm(maddrs, client_mode=True)
        judge_model = RemoteCausalLM.build(source, client, verify=0.0)  # a second client, judging reports
        try:
            print(f"conviction: liar on 15:30 of {source.name}, {args.canaries} canaries per corruption, compression none")
            print(f"{'corruption':28} {'convicted':>9} {'held for another':>16} {'honest convicted':>16} "
                  f"{'canaries to catch':>17} {'seconds':>7}")
            for name in tqdm(args.corruptions, desc="conviction", file=sys.stderr, disable=not sys.stderr.isatty()):
                liar.corrupt = made(name, source)
                convicted = held = framed = 0
                seconds, until = [], []
                sent = 0
                for _ in range(args.canaries):
                    model = RemoteCausalLM.build(source, client, compression="none", verify=0.0)
                    t0 = time.perf_counter()
                    # through the liar, which clients that read the reports so far would avoid
                    result = await Canaries(model.core, model.speculates).run(through=liar_id)
                    seconds.append(time.perf_counter() - t0)
                    sent += 1
                    framed += bool(set(result.convicted) & honest)
                    if liar_id in result.convicted:
                        convicted += 1
                        until.append(sent)
                        sent = 0
                        report = await fresh_report(model, result, liar_id)
                        judgement = await asyncio.to_thread(judge_report, report, judge_model.core.recomputer)
                        held += judgement is not None and judgement.guilty
                liar.corrupt = None
                n = args.canaries
                span = statistics.median(until) if until else "-"
                print(f"{name:28} {convicted:>6}/{n} {held:>13}/{n} {framed:>13}/{n} {span:>17} "
                      f"{statistics.median(seconds):7.2f}", flush=True)
        finally:
            await client.shutdown()

    try:
        uvloop.run(matrix())
    finally:
        peers_loop.run(stop_peers(peers))
        peers_loop.close()


async def fresh_report(model, result, liar_id):
    """The report the canary's client published against the liar, as another client reads it."""
    reports = await model.core.swarm.fault_reports(model.core.access().model, [liar_id])
    mine = [r for writer, r in reports if writer == model.core.swarm.writer_id and r.peer_id == liar_id]
    return max(mine, key=lambda r: r.time)


def honest_canaries(source, args) -> None:
    peers_loop = BackgroundLoop("bench-peers")
    peers, maddrs = peers_loop.run(start_mixed(source))
    convicted = avoided = drafted = fell = 0
    routes: dict[str, int] = {}

    async def run() -> None:
        nonlocal convicted, avoided, drafted, fell
        client = await join_swarm(maddrs, client_mode=True)
        try:
            for i in tqdm(range(args.honest), desc="honest canaries", file=sys.stderr, disable=not sys.stderr.isatty()):
                model = RemoteCausalLM.build(source, client, compression=CODECS[i % len(CODECS)], verify=0.0)
                result = await Canaries(model.core, model.speculates, seed=i).run()
                convicted += bool(result.convicted)
                avoided += bool(result.avoided)
                steps = sorted((r.step, r.offset, r.tokens) for r in result.receipts if r.peer_id == result.route[0])
                drafted += any(tokens > 1 for _, _, tokens in steps[1:])
                fell += any(offset < before + size for (_, before, size), (_, offset, _) in zip(steps, steps[1:]))
                for peer in result.route:
                    routes[peer] = routes.get(peer, 0) + 1
        finally:
            await client.shutdown()

    try:
        uvloop.run(run())
    finally:
        peers_loop.run(stop_peers(peers))
        peers_loop.close()
    layout = ", ".join(f"{a}:{b} {FORMAT_NAMES[i]}" for i, ((a, b), _) in enumerate(MIXED))
    names = {p.swarm.peer_id: FORMAT_NAMES[i] for i, p in enumerate(peers)}
    through = ", ".join(f"{names.get(p, p[:8])} {n}" for p, n in sorted(routes.items(), key=lambda kv: names.get(kv[0], "")))
    print(f"honest: {args.honest} canaries, codecs {', '.join(CODECS)} in turn; peers {layout}; hops through {through}")
    print(f"  a peer convicted in {convicted}, a peer avoided for its receipts in {avoided}; {drafted} canaries sent "
          f"drafts, in {fell} some fell and left the caches")


def receipt_cost(source) -> None:
    stage = load_stage(source, 0, 15)
    key = ReceiptKey(Identity.create())
    print("receipts: one peer's cost per step (median of 50), beside the step's compute through 15 layers")
    for tokens in (1, 16, 256):
        chain = ReceiptChain(key, "s" * 32, 0, 15, "float32")
        hidden = torch.randn(1, tokens, stage.hidden_size)
        cache = stage.new_cache()
        compute, sign = [], []
        with torch.inference_mode():
            for i in range(50):
                t0 = time.perf_counter()
                out = stage.forward(hidden, 0, None)
                t1 = time.perf_counter()
                receipt = chain.receipt(i, 0, hidden, out, Codec.NONE)
                sign.append(time.perf_counter() - t1)
                compute.append(t1 - t0)
        del cache
        size = len(msgpack.packb(encode(receipt), use_bin_type=True))
        c, s = statistics.median(compute), statistics.median(sign)
        print(f"  {tokens:>4} positions: signing {s * 1e6:7.0f} us, compute {c * 1e3:7.2f} ms ({s / c:.1%}); "
              f"{size} bytes a hop, beside {tokens * stage.hidden_size * 4} bytes of float32 states")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--canaries", type=int, default=20)
    parser.add_argument("--honest", type=int, default=0, metavar="N")
    parser.add_argument("--corruptions", type=lambda t: t.split(","), default=list(CORRUPTIONS),
                        help="comma-separated, of: " + ", ".join(CORRUPTIONS).replace("%", "%%"))
    parser.add_argument("--skip-conviction", action="store_true")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    unknown = set(args.corruptions) - set(CORRUPTIONS)
    if unknown:
        parser.error(f"unknown corruptions: {sorted(unknown)}")
    source = resolve_model(args.model)
    receipt_cost(source)
    if not args.skip_conviction:
        convictions(source, args)
    if args.honest:
        honest_canaries(source, args)


if __name__ == "__main__":
    main()
