"""What verification catches, how fast, and what it costs.

1. Detection: peers of the default model on 127.0.0.1, in this process: 0:15, and 15:30 twice; one
   of the 15:30 peers lies (its stage's forward patched, as a modified `run-peer` would be) and
   claims to be faster, so routes go through it. For each corruption and verification rate, fresh
   clients generate greedily (compression none: the tight tolerance). Per run: whether the liar
   corrupted anything, whether the client caught it (a rewind) and named it, whether the tokens
   are the honest swarm's, and the time to detection, in positions and seconds, from the liar's
   first corrupted output to the client's noticing it.
2. Cost: real peer processes, 0:15 and 15:30 twice each (every layer checkable), honest; tokens/s of
   a whole generation (prefill and the final check included) with verification 0, the default rate
   and 1.0, as ratios to verification 0.

Usage: python scripts/bench_verify.py [--runs 3] [--tokens 32] [--rates 0.02,0.1,1.0] [--cost-runs 3]
       [--corruptions "zeros,noise 1%,..."] [--skip-cost]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import torch
import uvloop
from tqdm import tqdm

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.checks import verifier as verifier_module
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.checks.policy import DEFAULT_RATE
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.models.source import resolve_model
from p2pfusion.peer.runtime import Peer, PeerOptions
from bench_machine import machine_header

PROMPT = "Write a short story about a robot who learns to paint."
FLIPPED = 20  # the position whose output the "flip" liar negates


def noise(scale: float):
    return lambda out, offset: out + scale * out.norm(dim=-1, keepdim=True) / out.shape[-1] ** 0.5 * torch.randn_like(out)


def flip(out: torch.Tensor, offset: int) -> torch.Tensor:
    if offset <= FLIPPED < offset + out.shape[1]:
        out = out.clone()
        out[:, FLIPPED - offset] = -out[:, FLIPPED - offset]
    return out


def one_in_100(out: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.zeros_like(out) if random.random() < 0.01 else out


CORRUPTIONS = {
    "zeros": lambda out, offset: torch.zeros_like(out),
    "noise 1%": noise(1e-2),
    "noise 0.1%": noise(1e-3),
    "noise 0.01%": noise(1e-4),
    "one position flipped": flip,
    "1 step in 100 zeroed": one_in_100,
}


class Liar:
    """Patches a peer's stage; notes its first corruption (time and position)."""

    def __init__(self, peer: Peer):
        self.stage = peer.server.stage
        self.honest = self.stage.forward
        self.corrupt = None
        self.first: tuple[float, int] | None = None
        self.stage.forward = self._forward

    def _forward(self, hidden, offset, *args, **kwargs):
        out = self.honest(hidden, offset, *args, **kwargs)
        if self.corrupt is None:
            return out
        lied = self.corrupt(out, offset)
        if self.first is None and not torch.equal(lied, out):
            self.first = (time.perf_counter(), offset)
        return lied


async def keep_announcing(peer: Peer) -> None:
    """What `run-peer`'s upkeep does for a record, and no more (no moves): refresh it before it expires."""
    while True:
        await asyncio.sleep(peer.options.refresh_period)
        await peer.announce()


async def start_peers(source, ranges, liar_range):
    peers, initial = [], []
    for layers in [*ranges, liar_range]:
        fast = layers is liar_range
        swarm = await join_swarm(initial)
        options = PeerOptions(source=source, initial_peers=initial, layers=layers, throughput="1000" if fast else "100")
        peer = Peer(options, swarm)
        await peer.start()
        peer.refresher = asyncio.create_task(keep_announcing(peer))
        peers.append(peer)
        initial = initial or await swarm.maddrs()
    return peers, initial


async def stop_peers(peers) -> None:
    for peer in peers:
        peer.refresher.cancel()
        await peer.leave()
        await peer.swarm.shutdown()


def detections(source, args, ids) -> None:
    noticed: dict[str, float] = {}
    original = verifier_module.Verifier._mismatch

    async def mismatch(self, position, end, error):  # when the client noticed, for the time to detection
        noticed.setdefault("time", time.perf_counter())
        noticed.setdefault("position", self.session.position)
        return await original(self, position, end, error)

    verifier_module.Verifier._mismatch = mismatch
    peers_loop = BackgroundLoop("bench-peers")
    peers, maddrs = peers_loop.run(start_peers(source, [(0, 15), (15, 30)], (15, 30)))
    liar = Liar(peers[-1])
    liar_id = peers[-1].swarm.peer_id

    honest_id = peers[1].swarm.peer_id

    async def run(client, verify: float):
        for attempt in range(3):  # a lookup on this busy 2-core machine may miss a record
            model = RemoteCausalLM.build(source, client, compression="none", verify=verify)
            model.core.health.observed = {liar_id: 1e6, honest_id: 1.0}  # routes go through the liar
            try:
                result = await model.generate(ids, args.tokens, stop_at_eos=False, decode=False)
                return result, liar_id in model.core.access().distrusted
            except RouteError:
                if attempt == 2:
                    raise

    async def matrix() -> None:
        client = await join_swarm(maddrs, client_mode=True)
        try:
            expected = (await run(client, 0.0))[0].token_ids
            print(f"detection: liar on 15:30 of {source.name}, {args.runs} runs x {args.tokens} tokens, compression none")
            print(f"{'corruption':22} {'rate':>5} {'corrupted':>9} {'caught':>6} {'named':>5} {'tokens ok':>9} "
                  f"{'positions':>9} {'seconds':>7}")
            cases = [(name, rate) for name in args.corruptions for rate in args.rates]
            for name, rate in tqdm(cases, desc="detection", file=sys.stderr, disable=not sys.stderr.isatty()):
                corrupted = caught = named = correct = 0
                positions, seconds = [], []
                for _ in range(args.runs):
                    liar.corrupt, liar.first = CORRUPTIONS[name], None
                    noticed.clear()
                    result, distrusted = await run(client, rate)
                    liar.corrupt = None
                    corrupted += liar.first is not None
                    caught += result.rewinds > 0
                    named += distrusted
                    correct += result.token_ids == expected
                    if liar.first is not None and noticed:
                        positions.append(noticed["position"] - liar.first[1])
                        seconds.append(noticed["time"] - liar.first[0])
                span = lambda xs, fmt: format(statistics.median(xs), fmt) if xs else "-"  # noqa: E731
                print(f"{name:22} {rate:5.2f} {corrupted:>6}/{args.runs} {caught:>4}/{args.runs} {named:>3}/{args.runs} "
                      f"{correct:>7}/{args.runs} {span(positions, '9.0f')} {span(seconds, '7.2f')}", flush=True)
        finally:
            await client.shutdown()

    try:
        uvloop.run(matrix())
    finally:
        peers_loop.run(stop_peers(peers))
        peers_loop.close()
        verifier_module.Verifier._mismatch = original


def cost(source, args, ids) -> None:
    with LocalSwarm(str(source.folder)) as swarm:
        swarm.start([(0, 15), (15, 30), (0, 15), (15, 30)])

        async def run(verify: float) -> float:
            client = await join_swarm(swarm.maddrs, client_mode=True)
            try:
                model = RemoteCausalLM.build(source, client, verify=verify)
                result = await model.generate(ids, args.tokens, stop_at_eos=False, decode=False)
                return len(result.token_ids) / (result.prefill_seconds + result.decode_seconds)
            finally:
                await client.shutdown()

        rates = {0.0: [], DEFAULT_RATE: [], 1.0: []}
        uvloop.run(run(0.0))  # warm-up: links measured, caches filled
        for _ in tqdm(range(args.cost_runs), desc="cost", file=sys.stderr, disable=not sys.stderr.isatty()):
            for verify in rates:
                rates[verify].append(uvloop.run(run(verify)))
    base = statistics.median(rates[0.0])
    print(f"cost: honest swarm of 4 peer processes (0:15, 15:30 twice), {args.tokens} tokens, {args.cost_runs} runs")
    for verify, speeds in rates.items():
        speed = statistics.median(speeds)
        print(f"verify {verify:4.2f}: {speed:6.1f} tokens/s, {speed / base:.2f}x of verify 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[0.02, 0.1, 1.0])
    parser.add_argument("--corruptions", type=lambda t: t.split(","), default=list(CORRUPTIONS),
                        help=f"comma-separated, of: {', '.join(CORRUPTIONS)}")
    parser.add_argument("--cost-runs", type=int, default=3)
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    unknown = set(args.corruptions) - set(CORRUPTIONS)
    if unknown:
        parser.error(f"unknown corruptions: {sorted(unknown)}")
    source = resolve_model(args.model)
    model = RemoteCausalLM.build(source)
    ids = model.encode(PROMPT, chat=True)
    detections(source, args, ids)
    if not args.skip_cost:
        cost(source, args, ids)


if __name__ == "__main__":
    main()
