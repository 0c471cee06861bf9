"""Churn for scripts/bench_scale.py: every minute a random share of the nodes is killed and started
again, while users generate without pause and a sampler reads the swarm's coverage. With
--freeze-share, that share of each minute's victims is frozen instead (SIGSTOP to the node and its
daemon, as a host suspended or gone without a reset) for FROZEN_SECONDS, then killed and started
again: the volunteer's host never came back, and a new start takes its place."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.coverage import layer_throughputs
from p2pfusion.dht.records import PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError

ROUND_SECONDS = 60.0
SAMPLE_EVERY = 5.0
FROZEN_SECONDS = 45.0  # longer than a record lives (30 s): only clients' reports tell of a frozen peer sooner


@dataclass
class Outcomes:
    identical: int = 0
    differ: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)  # longest gap between tokens less the median one
    covered: list[tuple[float, bool]] = field(default_factory=list)  # (when, every layer served online)


async def user(index: int, fleet, source, expected: dict, stop: asyncio.Event, out: Outcomes) -> None:
    node = await join_swarm(fleet.entry_points(), client_mode=True)
    model = RemoteCausalLM.build(source, node)
    try:
        for turn in itertools.count(index):
            if stop.is_set():
                return
            ids, tokens = list(expected.values())[turn % len(expected)]
            stamps = [time.perf_counter()]
            try:
                result = await model.generate(ids, len(tokens), stop_at_eos=False,
                                              on_token=lambda _t: stamps.append(time.perf_counter()))
            except P2PFusionError as exc:
                out.failed.append(str(exc))
                print(f"  user {index}: generation failed: {exc}", file=sys.stderr)
                continue
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            out.seconds.append(stamps[-1] - stamps[0])
            out.stalls.append(max(gaps) - statistics.median(gaps))
            if result.token_ids == tokens:
                out.identical += 1
            else:
                out.differ += 1
    finally:
        await node.shutdown()


async def sampler(client, source, num_layers: int, stop: asyncio.Event, out: Outcomes) -> None:
    while not stop.is_set():
        records = await client.lookup(source.key)
        online = [r for r in records if r.state == PeerState.ONLINE]
        out.covered.append((time.monotonic(), min(layer_throughputs(online, num_layers)) > 0))
        await asyncio.sleep(SAMPLE_EVERY)


def longest_gap(samples: list[tuple[float, bool]]) -> float:
    """The longest stretch of time the samples saw a layer without an online peer."""
    longest, began = 0.0, None
    for when, covered in samples:
        if not covered and began is None:
            began = when
        elif covered and began is not None:
            longest, began = max(longest, when - began), None
    return max(longest, samples[-1][0] - began) if began is not None else longest


async def churn(fleet, source, client, expected: dict, args) -> None:
    stop, out = asyncio.Event(), Outcomes()
    users = [asyncio.create_task(user(i, fleet, source, expected, stop, out)) for i in range(args.users)]
    sampling = asyncio.create_task(sampler(client, source, args.layers, stop, out))
    restarts, killed, frozen = [], {"peer": 0, "dht": 0}, 0
    rounds = max(1, round(args.churn_minutes * 60 / ROUND_SECONDS))
    for minute in range(rounds):
        victims = fleet.rng.sample(fleet.live(), min(len(fleet.live()), round(args.churn_share * len(fleet.nodes))))
        freezing = round(args.freeze_share * len(victims))
        for i, node in enumerate(victims):
            if i < freezing:
                fleet.freeze(node)
                asyncio.get_running_loop().call_later(FROZEN_SECONDS, fleet.kill, node)
            else:
                fleet.kill(node)
            killed[node.kind] += 1
        frozen += freezing
        restarts += [asyncio.create_task(fleet.restart(node)) for node in victims]
        print(f"  minute {minute}: stopped {len(victims)} nodes ({freezing} frozen); {out.identical} generations "
              f"done so far, {len(out.failed)} failed", file=sys.stderr)
        await asyncio.sleep(ROUND_SECONDS)
    stop.set()
    await asyncio.gather(*users)
    await sampling
    back = await asyncio.gather(*restarts)
    came_back = [s for s in back if s is not None]
    done = out.identical + out.differ
    print(f"churn: {rounds} minutes, {len(back)} kills ({killed['peer']} peers, {killed['dht']} DHT nodes; {frozen} "
          f"frozen {FROZEN_SECONDS:.0f} s first), {len(came_back)} back, in {statistics.median(came_back):.0f} s median "
          f"({max(came_back):.0f} s max)")
    print(f"churn, {args.users} users: {done} generations completed ({out.identical} token-identical, "
          f"{out.differ} differ), {len(out.failed)} failed; per generation {statistics.median(out.seconds):.1f} s "
          f"median; stall median {statistics.median(out.stalls):.2f} s, max {max(out.stalls):.2f} s")
    for reason in dict.fromkeys(out.failed):
        print(f"  failed: {reason}")
    fully = sum(c for _, c in out.covered)
    print(f"churn, coverage: every layer served by an online peer in {fully} of {len(out.covered)} samples "
          f"(every {SAMPLE_EVERY:.0f} s); longest stretch with a gap {longest_gap(out.covered):.0f} s")
