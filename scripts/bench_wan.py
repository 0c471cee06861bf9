#!/usr/bin/env python
"""The swarm over emulated wide-area links: per-token time against the round-trip bound, time to
first token, a batch forward, DHT lookups and joins, many users at once, and speculative
decoding, at several round trips, in one run.

Three peers of the default model, each on a host of its own behind a delaying relay (scripts/wan.py,
p2pfusion/cli/wan.py), the client on this machine's own namespace; every pair of hosts is the same
round trip R apart, set live for each R (the swarm stays up). A token's trip goes client -> stage 1
-> stage 2 -> stage 3 -> client: four one-way delays, 2R. The bound at R is the per-token time at
R = 0 (each hop's compute, the links' own cost and the client's head, measured in this run) plus
2R; the ratio is the measured time over it (target <= 1.15). Decode is greedy, one token per step
(`speculate="off"`), (tokens - 1) / decode time. At --spec-rtt, speculative decoding against plain
on a prompt whose answer repeats its context and on free chat (targets 1.8x and 0.95x at 50 ms).
Needs root. Usage: sudo .venv/bin/python scripts/bench_wan.py [--rtts 0,20,50,100] [--tokens 32] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch
import uvloop

from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
from p2pfusion.cli.local_swarm import even_ranges
from p2pfusion.cli.wan import RELOAD_EVERY, WanSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Conversation
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config
from bench_machine import machine_header
from bench_speculative import FREE, REPEATING

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def decode(model: RemoteCausalLM, ids: list[int], tokens: int):
    conversation = Conversation(model, keep=False)
    try:
        return await conversation.generate(ids, tokens, stop_at_eos=False)
    finally:
        await conversation.close()


async def many_users(model: RemoteCausalLM, ids: list[int], users: int, tokens: int) -> float:
    """Tokens/s of `users` greedy generations at once, first token to last."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(decode(model, ids, tokens) for _ in range(users)))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)


async def dht_times(client, maddrs: list[str], key: str, lookups: int) -> tuple[tuple[float, float], float]:
    """(p50, p99) of a lookup of the model's records, and the median time for a new client to join."""
    seconds = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        await client.lookup(key)
        seconds.append(time.perf_counter() - t0)
    seconds.sort()
    joins = []
    for _ in range(3):
        t0 = time.perf_counter()
        node = await join_swarm(maddrs, client_mode=True)
        joins.append(time.perf_counter() - t0)
        await node.shutdown()
    return (statistics.median(seconds), seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]), statistics.median(joins)


async def sweep(wan: WanSwarm, maddrs: list[str], source, args) -> dict:
    client = await join_swarm(maddrs, client_mode=True)
    found: dict = {"per_token": {}, "ttft": {}, "forward": {}, "spec": {}, "lookup": {}, "join": {}, "users": {}}
    try:
        plain = RemoteCausalLM.build(source, client, speculate="off", verify=0.0)
        drafting = RemoteCausalLM.build(source, client, speculate="auto", verify=0.0)
        chat = plain.encode(CHAT, chat=True)
        batch = torch.randint(0, plain.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
        await decode(plain, chat, 4)  # connections, links, caches
        for rtt in args.rtts:
            wan.delays(lambda a, b: rtt / 2000)
            await asyncio.sleep(2 * RELOAD_EVERY)
            per_token, ttft, forward = [], [], []
            for _ in range(args.runs):
                result = await decode(plain, chat, args.tokens)
                ttft.append(result.token_times[0])
                per_token.append(result.decode_seconds / (len(result.token_ids) - 1))
                t0 = time.perf_counter()
                await plain.forward_logits(batch)
                forward.append(time.perf_counter() - t0)
            found["per_token"][rtt], found["ttft"][rtt] = statistics.median(per_token), statistics.median(ttft)
            found["forward"][rtt] = statistics.median(forward)
            found["lookup"][rtt], found["join"][rtt] = await dht_times(client, maddrs, plain.source.key, args.lookups)
            if rtt in (0.0, args.spec_rtt):
                found["users"][rtt] = await many_users(plain, chat, args.users, args.tokens)
                print(f"RTT {rtt} ms: {args.users} users together, {found['users'][rtt]:.1f} tokens/s", file=sys.stderr)
            print(f"RTT {rtt} ms: {1000 * found['per_token'][rtt]:.1f} ms per token, first token "
                  f"{1000 * found['ttft'][rtt]:.0f} ms, 4x128 forward {found['forward'][rtt]:.2f} s", file=sys.stderr)
        wan.delays(lambda a, b: args.spec_rtt / 2000)
        await asyncio.sleep(2 * RELOAD_EVERY)
        for group, prompts in (("repeating", REPEATING), ("free-form", FREE)):
            ratios = []
            for name, text in prompts.items():
                ids = plain.encode(text, chat=True)
                fast = await decode(drafting, ids, args.spec_tokens)
                slow = await decode(plain, ids, args.spec_tokens)
                if fast.token_ids != slow.token_ids:
                    raise SystemExit(f"{name}: speculative decoding changed the text")
                ratio = slow.decode_seconds / fast.decode_seconds
                ratios.append(ratio)
                print(f"RTT {args.spec_rtt} ms, {group} {name}: drafts {fast.decode_seconds:.2f} s, plain "
                      f"{slow.decode_seconds:.2f} s, ratio {ratio:.2f}, {len(fast.token_ids) / fast.steps:.2f} "
                      f"tokens per step", file=sys.stderr)
            found["spec"][group] = ratios
        return found
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", default="0,20,50,100", help="round trips to sweep, ms")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--spec-rtt", type=float, default=50.0)
    parser.add_argument("--spec-tokens", type=int, default=64)
    parser.add_argument("--mbit", type=int, default=1000, help="each host's link rate")
    parser.add_argument("--lookups", type=int, default=30, help="DHT lookups timed at each round trip")
    parser.add_argument("--users", type=int, default=8, help="generations at once, at 0 ms and at --spec-rtt")
    args = parser.parse_args()
    args.rtts = [float(x) for x in args.rtts.split(",")]
    if 0.0 not in args.rtts:
        args.rtts.insert(0, 0.0)  # the bound's own base
    reason = namespaces_unavailable()
    if reason is not None:
        sys.exit(f"bench_wan.py: error: {reason}")
    print(machine_header(), flush=True)
    source = resolve_model(None)
    layers = load_config(source).num_hidden_layers
    with HostNetwork(3, prefix="p2pfbw", subnet="10.81.0", mbit=args.mbit) as net, WanSwarm(net, [0, 1, 2]) as wan:
        wan.delays(lambda a, b: 0.0)
        maddrs = wan.start(even_ranges(layers, 3))
        r = uvloop.run(sweep(wan, maddrs, source, args))
    base = r["per_token"][0.0]
    print(f"model {source.name}, 3 peers on 3 emulated hosts, {args.mbit} Mbit/s links, {args.tokens} greedy tokens, "
          f"{args.runs} runs (medians)")
    print(f"{'RTT ms':>7} {'ms/token':>9} {'bound ms':>9} {'ratio':>6} {'first token ms':>15} {'4x128 forward s':>16} "
          f"{'lookup p50/p99 ms':>18} {'join ms':>8}")
    for rtt in args.rtts:
        bound = base + 2 * rtt / 1000
        p50, p99 = r["lookup"][rtt]
        print(f"{rtt:>7.0f} {1000 * r['per_token'][rtt]:>9.1f} {1000 * bound:>9.1f} {r['per_token'][rtt] / bound:>6.2f} "
              f"{1000 * r['ttft'][rtt]:>15.0f} {r['forward'][rtt]:>16.2f} {f'{1000 * p50:.0f}/{1000 * p99:.0f}':>18} "
              f"{1000 * r['join'][rtt]:>8.0f}")
    if r["users"]:
        zero, far = r["users"].get(0.0), r["users"].get(args.spec_rtt)
        print(f"{args.users} users at once: {zero:.1f} tokens/s at 0 ms (the peers' compute limit here), {far:.1f} at "
              f"{args.spec_rtt:.0f} ms, ratio {far / zero:.2f}")
    for group, ratios in r["spec"].items():
        print(f"speculative vs plain at RTT {args.spec_rtt:.0f} ms, {group}: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
