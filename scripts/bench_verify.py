"""What verification catches, how fast, and what it costs.

1. Detection: peers of the default model on 127.0.0.1, in this process: 0:15, and 15:30 twice; one
   of the 15:30 peers lies (its stage's forward patched, as a modified `run-peer` would be) and
   claims to be faster, so routes go through it. For each corruption and verification rate, fresh
   clients generate greedily (compression none: the tight tolerance). Per run: whether the liar
   corrupted anything, whether the client caught it (a rewind) and named it (by the end of the
   canaries it sent through the peers it suspected after the generation), whether it named an
   honest peer ("wrongly named": blame gone wrong), whether the tokens
   are the honest swarm's, and the time to detection, in positions and seconds, from the liar's
   first corrupted output to the client's noticing it.
2. Cost: real peer processes, 0:15 and 15:30 twice each (every layer checkable), honest; tokens/s of
   a whole generation (prefill and the final check included) with verification 0, the default rate
   and 1.0, as ratios to verification 0, and the longest gap between two tokens as the user sees
   them (checks run beside the generation; "held" shows only checked tokens).

Usage: python scripts/bench_verify.py [--runs 3] [--tokens 32] [--rates 0.02,0.1,1.0] [--cost-runs 3]
       [--corruptions "zeros,noise 1%,..."] [--skip-cost]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

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
from p2pfusion.client.checks.distrust import Distrust
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.loop import BackgroundLoop
from p2pfusion.client.checks.policy import DEFAULT_RATE
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.models.formats import WeightFormat
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_head, load_stage
from p2pfusion.peer.runtime import Peer, PeerOptions

PROMPT = "Write a short story about a robot who learns to paint."
FLIPPED = 20  # the position whose output the "flip" liar negates
NUDGED = 50  # the nudge liar changes the first decode step after this position (past the prompt)
ELSEWHERE = (20, 30)  # an honest int4 peer's layers, which no route takes (nobody serves 15:20 alone)


def noise(scale: float):
    return lambda out, offset: out + scale * out.norm(dim=-1, keepdim=True) / out.shape[-1] ** 0.5 * torch.randn_like(out)


def flip(out: torch.Tensor, offset: int) -> torch.Tensor:
    if offset <= FLIPPED < offset + out.shape[1]:
        out = out.clone()
        out[:, FLIPPED - offset] = -out[:, FLIPPED - offset]
    return out


def one_in_100(out: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.zeros_like(out) if random.random() < 0.01 else out


class Nudge:
    """The smallest change to the last stage's output that makes the client's head choose another
    greedy token, at one decode step (the first after position NUDGED): the worst case for a bar
    on the norm. Notes the nudge's size relative to the output."""

    def __init__(self, source):
        self.head = load_head(source)
        self.sizes: list[float] = []

    def _token(self, h: torch.Tensor) -> int:
        with torch.no_grad():
            return int(self.head(inputs_embeds=h[None, None]).logits[0, -1].argmax())

    def __call__(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        if out.shape[1] != 1 or offset < NUDGED or getattr(self, "done", None) == id(out):
            return out
        h = out[0, -1].detach().clone().requires_grad_(True)
        logits = self.head(inputs_embeds=h[None, None]).logits[0, -1]
        first, second = logits.topk(2).indices
        (logits[second] - logits[first]).backward()
        direction = h.grad / h.grad.norm()
        low, high = 0.0, float(h.norm())
        chosen = int(first)
        for _ in range(30):  # the least step along the direction that flips the token
            middle = (low + high) / 2
            low, high = (low, middle) if self._token(h.detach() + middle * direction) != chosen else (middle, high)
        nudged = out.clone()
        nudged[0, -1] = h.detach() + high * direction
        self.sizes.append(high / float(h.norm()))
        self.done = id(nudged)
        return nudged


class Int4Compute:
    """The liar's layers computed from int4 weights while its record says float32."""

    def __init__(self, source, start: int, end: int):
        self.stage = load_stage(source, start, end, quant=WeightFormat.INT4)

    def __call__(self, hidden, offset, *args, **kwargs):
        return self.stage.forward(hidden, offset, *args, **kwargs)


CORRUPTIONS = {
    "zeros": lambda out, offset: torch.zeros_like(out),
    "noise 1%": noise(1e-2),
    "noise 0.1%": noise(1e-3),
    "noise 0.01%": noise(1e-4),
    "one position flipped": flip,
    "1 step in 100 zeroed": one_in_100,
    "decode steps only (honest on replays)": lambda out, offset: torch.zeros_like(out) if out.shape[1] == 1 else out,
    "token nudge": "nudge",  # built once the model is known: Nudge
    "int4 as float32": "int4",  # Int4Compute, on the liar's layers
    "int4 as float32, an int4 record elsewhere": "int4",  # and an honest int4 peer on layers 20:30
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
        if isinstance(self.corrupt, Int4Compute):
            lied = self.corrupt(hidden, offset, *args, **kwargs)
            if self.first is None:
                self.first = (time.perf_counter(), offset)
            return lied
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


def made(name: str, source):
    corrupt = CORRUPTIONS[name]
    if corrupt == "nudge":
        return Nudge(source)
    if corrupt == "int4":
        return Int4Compute(source, 15, 30)
    return corrupt


async def start_extra(source, maddrs) -> Peer:
    """An honest int4 peer on ELSEWHERE: a record of the least precise format in the swarm."""
    swarm = await join_swarm(maddrs)
    options = PeerOptions(source=source, initial_peers=maddrs, layers=ELSEWHERE, throughput="100", quant=WeightFormat.INT4)
    peer = Peer(options, swarm)
    await peer.start()
    peer.refresher = asyncio.create_task(keep_announcing(peer))
    return peer


async def stop_peers(peers) -> None:
    for peer in peers:
        peer.refresher.cancel()
        await peer.leave()
        await peer.swarm.shutdown()


async def skip_reports(self) -> None:
    """Reads no fault reports."""


def detections(source, args, ids) -> None:
    noticed: dict[str, float] = {}
    original = verifier_module.Verifier._mismatch

    async def mismatch(self, position, end, error, *args):  # when the client noticed, for the time to detection
        noticed.setdefault("time", time.perf_counter())
        noticed.setdefault("position", self.session.position)
        return await original(self, position, end, error, *args)

    verifier_module.Verifier._mismatch = mismatch
    refresh = Distrust.refresh
    Distrust.refresh = skip_reports  # each run a client of its own, which earlier runs' reports do not warn
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
                await model.canaries.wait()  # a canary owed to a suspect names a liar that replays hid
                return result, set(model.core.access().distrusted)
            except RouteError:
                if attempt == 2:
                    raise

    async def matrix() -> None:
        client = await join_swarm(maddrs, client_mode=True)
        try:
            expected = (await run(client, 0.0))[0].token_ids
            print(f"detection: liar on 15:30 of {source.name}, {args.runs} runs x {args.tokens} tokens, compression none")
            print(f"{'corruption':22} {'rate':>5} {'corrupted':>9} {'caught':>6} {'named':>5} {'wrongly named':>13} {'tokens ok':>9} "
                  f"{'positions':>9} {'seconds':>7}")
            cases = [(name, rate) for name in args.corruptions for rate in args.rates]
            for name, rate in tqdm(cases, desc="detection", file=sys.stderr, disable=not sys.stderr.isatty()):
                corrupted = caught = named = wrongly = correct = 0
                positions, seconds = [], []
                corrupt = made(name, source)
                extra = peers_loop.run(start_extra(source, maddrs)) if name.endswith("elsewhere") else None
                for _ in range(args.runs):
                    liar.corrupt, liar.first = corrupt, None
                    noticed.clear()
                    result, distrusted = await run(client, rate)
                    liar.corrupt = None
                    corrupted += liar.first is not None
                    caught += result.rewinds > 0
                    named += liar_id in distrusted
                    wrongly += bool(distrusted - {liar_id})
                    correct += result.token_ids == expected
                    if liar.first is not None and noticed:
                        positions.append(noticed["position"] - liar.first[1])
                        seconds.append(noticed["time"] - liar.first[0])
                if extra is not None:
                    peers_loop.run(stop_peers([extra]))
                span = lambda xs, fmt: format(statistics.median(xs), fmt) if xs else "-"  # noqa: E731
                nudged = isinstance(corrupt, Nudge) and corrupt.sizes
                size = f" (nudges {statistics.median(corrupt.sizes):.1e} of the norm)" if nudged else ""
                print(f"{name:22} {rate:5.2f} {corrupted:>6}/{args.runs} {caught:>4}/{args.runs} {named:>3}/{args.runs} {wrongly:>11}/{args.runs} "
                      f"{correct:>7}/{args.runs} {span(positions, '9.0f')} {span(seconds, '7.2f')}{size}", flush=True)
        finally:
            await client.shutdown()

    try:
        uvloop.run(matrix())
    finally:
        peers_loop.run(stop_peers(peers))
        peers_loop.close()
        verifier_module.Verifier._mismatch = original
        Distrust.refresh = refresh


MIXED = [((0, 15), {}), ((0, 15), {"quant": WeightFormat.INT8}), ((15, 30), {"dtype": torch.bfloat16}),
         ((15, 30), {"quant": WeightFormat.INT4})]
FORMAT_NAMES = ["float32", "int8", "bfloat16", "int4"]
CODECS = ["none", "float16", "bfloat16", "int8", "auto"]


async def start_mixed(source) -> tuple[list[Peer], list[str]]:
    """Honest peers of the MIXED formats, in this process."""
    peers, initial = [], []
    for layers, options in MIXED:
        swarm = await join_swarm(initial)
        peer = Peer(PeerOptions(source=source, initial_peers=initial, layers=layers, throughput="100", **options), swarm)
        await peer.start()
        peer.refresher = asyncio.create_task(keep_announcing(peer))
        peers.append(peer)
        initial = initial or await swarm.maddrs()
    return peers, initial


def honest_sessions(source, args, ids) -> None:
    """False alarms: honest peers of four formats, clients of every codec, every step checked."""
    peers_loop = BackgroundLoop("bench-peers")
    peers, maddrs = peers_loop.run(start_mixed(source))
    alarms = accused = banned = 0

    async def run(sessions: int) -> None:
        nonlocal alarms, accused, banned
        client = await join_swarm(maddrs, client_mode=True)
        try:
            for i in tqdm(range(sessions), desc="honest sessions", file=sys.stderr, disable=not sys.stderr.isatty()):
                model = RemoteCausalLM.build(source, client, compression=CODECS[i % len(CODECS)], verify=1.0)
                result = await model.generate(ids, args.tokens, stop_at_eos=False, decode=False)
                alarms += result.rewinds > 0
                accused += bool(model.core.access().distrusted)
                banned += bool(model.core.health.banned(await model.core.access().records(0)))
        finally:
            await client.shutdown()

    try:
        uvloop.run(run(args.honest))
    finally:
        peers_loop.run(stop_peers(peers))
        peers_loop.close()
    layout = ", ".join(f"{a}:{b} {FORMAT_NAMES[i]}" for i, ((a, b), _) in enumerate(MIXED))
    print(f"honest: {args.honest} sessions of {args.tokens} tokens, every step checked, codecs {', '.join(CODECS)} "
          f"in turn; peers {layout}")
    print(f"  rewinds in {alarms} sessions, a peer accused in {accused}, a peer banned in {banned}")


def cost(source, args, ids) -> None:
    with LocalSwarm(str(source.folder)) as swarm:
        swarm.start([(0, 15), (15, 30), (0, 15), (15, 30)])

        async def run(verify: float, hold: bool) -> tuple[float, float]:
            """tokens/s of the whole generation, and the longest gap between tokens as a user sees them."""
            client = await join_swarm(swarm.maddrs, client_mode=True)
            shown: list[float] = []
            try:
                model = RemoteCausalLM.build(source, client, verify=verify)
                result = await model.generate(
                    ids, args.tokens, stop_at_eos=False, decode=False, hold=hold,
                    on_token=lambda _: shown.append(time.perf_counter()),
                    on_rewind=lambda kept: shown.__delitem__(slice(kept, None)),
                )
                gap = max((b - a for a, b in zip(shown, shown[1:])), default=0.0)
                return len(result.token_ids) / (result.prefill_seconds + result.decode_seconds), gap
            finally:
                await client.shutdown()

        cases = {"verify 0": (0.0, False), f"verify {DEFAULT_RATE:g}": (DEFAULT_RATE, False),
                 "verify 1": (1.0, False), f"verify {DEFAULT_RATE:g}, held": (DEFAULT_RATE, True)}
        figures = {name: [] for name in cases}
        uvloop.run(run(0.0, False))  # warm-up: links measured, caches filled
        for _ in tqdm(range(args.cost_runs), desc="cost", file=sys.stderr, disable=not sys.stderr.isatty()):
            for name, (verify, hold) in cases.items():
                figures[name].append(uvloop.run(run(verify, hold)))
    base = statistics.median(speed for speed, _ in figures["verify 0"])
    print(f"cost: honest swarm of 4 peer processes (0:15 and 15:30, each twice), {args.tokens} tokens, {args.cost_runs} runs; "
          "gap: the longest wait between two tokens shown (median of runs; max)")
    for name, runs in figures.items():
        speed = statistics.median(speed for speed, _ in runs)
        gaps = [gap for _, gap in runs]
        print(f"{name:18}: {speed:6.1f} tokens/s, {speed / base:.2f}x of verify 0; "
              f"gap {statistics.median(gaps):.2f} s (max {max(gaps):.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[0.02, 0.1, 1.0])
    parser.add_argument("--corruptions", type=lambda t: t.split(","), default=list(CORRUPTIONS),
                        help="comma-separated, of: " + ", ".join(CORRUPTIONS).replace("%", "%%"))
    parser.add_argument("--cost-runs", type=int, default=3)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-detection", action="store_true")
    parser.add_argument("--honest", type=int, default=0, metavar="N",
                        help="also N honest sessions on a swarm of float32, int8, bfloat16 and int4 peers, codecs in turn")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    unknown = set(args.corruptions) - set(CORRUPTIONS)
    if unknown:
        parser.error(f"unknown corruptions: {sorted(unknown)}")
    source = resolve_model(args.model)
    model = RemoteCausalLM.build(source)
    ids = model.encode(PROMPT, chat=True)
    if not args.skip_detection:
        detections(source, args, ids)
    if args.honest:
        honest_sessions(source, args, ids)
    if not args.skip_cost:
        cost(source, args, ids)


if __name__ == "__main__":
    main()
