#!/usr/bin/env python
"""The swarm over emulated wide-area links: per-token time against the round-trip bound, time to
first token, a batch forward, DHT lookups and joins, many users at once, speculative decoding,
rough links and failover, at several round trips, in one run.

Three peers of the default model, each on a host of its own behind a delaying relay (scripts/wan.py,
p2pfusion/cli/wan.py), the client on this machine's own namespace; every pair of hosts is the same
round trip R apart, set live for each R (the swarm stays up). A token's trip goes client -> stage 1
-> stage 2 -> stage 3 -> client: four one-way delays, 2R. The bound at R is the per-token time at
R = 0 (each hop's compute, the links' own cost and the client's head, measured in this run) plus
2R; the ratio is the measured time over it (target <= 1.15). Decode is greedy, one token per step
(`speculate="off"`), (tokens - 1) / decode time. Parts (--parts):
- sweep: the above at each of --rtts, and --users generations at once at 0 ms and at --spec-rtt,
  against the lesser of the peers' compute limit (the users at 0 ms) and --users times a lone
  user's rate at that round trip (one token a step: a user's tokens come one a route's trip); then at --spec-rtt with --jitter-ms of jitter and --loss of the chunks retransmitted.
- spec: at --spec-rtt, speculative decoding against plain on prompts whose answer repeats its
  context and on free chat (targets 1.8x and 0.95x at 50 ms): drafts looked up in the text, and,
  with --draft-layers N, drafts from a draft model made of the default model's first N layers and
  its head (N = all its layers: a drafter that always agrees, the upper bound). Generations stop at
  the answer's end (EOS), as users' do, or after --spec-tokens.
- failover: at --spec-rtt, fresh swarms whose stage peer is killed (SIGKILL; with --freeze, SIGSTOP
  to it and its libp2p daemon: a host suspended, its connections open) after 12 tokens, with a
  warm `--backup` and without one (the peer that alone serves its layers dies, and a peer must move); the stall is the longest gap between tokens
  less the median, each run's tokens compared with transformers' greedy tokens.
Needs root. Usage: sudo .venv/bin/python scripts/bench_wan.py [--parts sweep,spec,failover]
[--rtts 0,20,50,100] [--tokens 32] [--runs 2] [--draft-layers 30]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import itertools
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import uvloop

from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
from p2pfusion.cli.local_swarm import even_ranges
from p2pfusion.cli.wan import RELOAD_EVERY, WanSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.client.generate.conversation import Conversation
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config
from bench_churn import KILL_AT, PROMPT, family, reference_tokens, send_signal
from bench_poisoned_run import small_model
from bench_speculative import FREE, REPEATING, lookup_bound

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def decode(model: RemoteCausalLM, ids: list[int], tokens: int, stop_at_eos: bool = False):
    conversation = Conversation(model, keep=False)
    try:
        return await conversation.generate(ids, tokens, stop_at_eos=stop_at_eos)
    finally:
        await conversation.close()


def cpu_jiffies() -> tuple[int, int]:
    """The machine's (busy, all) CPU time so far, from /proc/stat (every namespace shares it)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


async def many_users(model: RemoteCausalLM, ids: list[int], users: int, tokens: int) -> tuple[float, float]:
    """Tokens/s of `users` greedy generations at once, first token to last, and the share of the
    machine's CPU time busy meanwhile."""
    t0, (busy0, all0) = time.perf_counter(), cpu_jiffies()
    results = await asyncio.gather(*(decode(model, ids, tokens) for _ in range(users)))
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)
    busy1, all1 = cpu_jiffies()
    return rate, (busy1 - busy0) / max(all1 - all0, 1)


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


async def sweep(wan: WanSwarm, client, plain: RemoteCausalLM, args, found: dict) -> None:
    chat = plain.encode(CHAT, chat=True)
    batch = torch.randint(0, plain.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    rows = [(rtt, 0.0, 0.0) for rtt in args.rtts] + [(args.spec_rtt, args.jitter_ms, args.loss)]
    for rtt, jitter, loss in rows:
        wan.delays(lambda a, b: rtt / 2000, jitter=jitter / 1000, loss=loss)
        await asyncio.sleep(2 * RELOAD_EVERY)
        row = (rtt, jitter, loss)
        per_token, ttft, forward, alone = [], [], [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            result = await decode(plain, chat, args.tokens)
            alone.append(len(result.token_ids) / (time.perf_counter() - t0))
            ttft.append(result.token_times[0])
            per_token.append(result.decode_seconds / (len(result.token_ids) - 1))
            t0 = time.perf_counter()
            await plain.forward_logits(batch)
            forward.append(time.perf_counter() - t0)
        found["per_token"][row], found["ttft"][row] = statistics.median(per_token), statistics.median(ttft)
        found["forward"][row], found["alone"][row] = statistics.median(forward), statistics.median(alone)
        found["lookup"][row], found["join"][row] = await dht_times(client, wan.swarm.maddrs, plain.source.key, args.lookups)
        if not jitter and not loss and rtt in (0.0, args.spec_rtt):
            found["users"][rtt], found["busy"][rtt] = await many_users(plain, chat, args.users, args.tokens)
            print(f"RTT {rtt} ms: {args.users} users together, {found['users'][rtt]:.1f} tokens/s, CPU "
                  f"{100 * found['busy'][rtt]:.0f} % busy", file=sys.stderr)
        print(f"RTT {rtt} ms (jitter {jitter} ms, loss {loss}): {1000 * found['per_token'][row]:.1f} ms per token, "
              f"first token {1000 * found['ttft'][row]:.0f} ms, 4x128 forward {found['forward'][row]:.2f} s", file=sys.stderr)


async def speculation(wan: WanSwarm, plain: RemoteCausalLM, drafters: dict[str, RemoteCausalLM], args, found: dict) -> None:
    wan.delays(lambda a, b: args.spec_rtt / 2000)
    await asyncio.sleep(2 * RELOAD_EVERY)
    for group, prompts in (("repeating", REPEATING), ("free-form", FREE)):
        for name, text in prompts.items():
            ids = plain.encode(text, chat=True)
            slow = await decode(plain, ids, args.spec_tokens, stop_at_eos=True)  # the answer, as a user gets it
            for drafter, model in drafters.items():
                fast = await decode(model, ids, args.spec_tokens, stop_at_eos=True)
                if fast.token_ids != slow.token_ids:
                    raise SystemExit(f"{name}: speculative decoding ({drafter}) changed the text")
                ratio = slow.decode_seconds / fast.decode_seconds
                found["spec"].setdefault((drafter, group), []).append(ratio)
                bound = lookup_bound(ids, fast.token_ids)
                print(f"RTT {args.spec_rtt} ms, {group} {name}, {drafter}: drafts {fast.decode_seconds:.2f} s, plain "
                      f"{slow.decode_seconds:.2f} s, ratio {ratio:.2f}, {len(fast.token_ids) / fast.steps:.2f} "
                      f"tokens per step (prompt lookup's bound {bound:.2f})", file=sys.stderr)


async def measured(wan: WanSwarm, source, draft: Path | None, args) -> dict:
    client = await join_swarm(wan.swarm.maddrs, client_mode=True)
    found: dict = {"per_token": {}, "ttft": {}, "forward": {}, "spec": {}, "lookup": {}, "join": {}, "users": {}, "alone": {}, "busy": {}}
    try:
        plain = RemoteCausalLM.build(source, client, speculate="off", verify=0.0)
        await decode(plain, plain.encode(CHAT, chat=True), 4)  # connections, links, caches
        if "sweep" in args.parts:
            await sweep(wan, client, plain, args, found)
        if "spec" in args.parts:
            drafters = {"lookup": RemoteCausalLM.build(source, client, verify=0.0)}
            if draft is not None:
                drafters[f"draft model ({args.draft_layers} layers)"] = RemoteCausalLM.build(
                    source, client, verify=0.0, draft_model=str(draft)
                )
            await speculation(wan, plain, drafters, args, found)
        return found
    finally:
        await client.shutdown()


async def _stalled(source, maddrs: list[str], tokens: int, victim: list[int], freeze: bool) -> tuple[list[float], list[int], int]:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client, verify=0.0, speculate="off")
        stamps: list[float] = []

        def on_token(_token: int) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) == KILL_AT:
                send_signal(victim, signal.SIGSTOP if freeze else signal.SIGKILL)

        result = await model.generate(model.encode(PROMPT, chat=True), tokens, on_token=on_token)
        return stamps, result.token_ids, result.recoveries
    finally:
        await client.shutdown()


async def _records(maddrs: list[str], model: str) -> dict:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        return {r.peer_id: r for r in await client.lookup(model)}
    finally:
        await client.shutdown()


def lone_server(source, wan: WanSwarm, maddrs: list[str]):
    """The peer process whose layers no other peer serves: every route goes through it."""
    records = uvloop.run(_records(maddrs, source.key))
    for proc in wan.swarm.processes:
        me = records.get(proc.address_file.read_text().split()[0].rsplit("/p2p/", 1)[1])
        if me is not None and not any(r is not me and r.start < me.end and me.start < r.end for r in records.values()):
            return proc
    return None


def failover(source, layers: int, setup: str, expected: list[int], args) -> float | None:
    """One run's stall at --spec-rtt: None when the generation failed or its tokens differ."""
    third = layers // 3
    if setup == "backup":  # hosts 0-2 hold the stages, host 3 a warm backup of the middle one
        ranges, each, victim, hosts = [(0, third), (third, 2 * third), (2 * third, layers), (third, 2 * third)], \
            [[], [], [], ["--backup"]], 1, 4
    else:  # each peer chooses, with room for two thirds (0:20, 20:30, 0:20): the lone server of its layers dies
        ranges, each, victim, hosts = [None, None, None], [["--max-layers", str(2 * third)]] * 3, None, 3
    with HostNetwork(hosts, prefix="p2pfbf", subnet="10.82.0", mbit=args.mbit) as net, \
            WanSwarm(net, list(range(hosts))) as wan:
        wan.delays(lambda a, b: args.spec_rtt / 2000)
        maddrs = wan.start(ranges, each=each, one_by_one=setup != "backup")
        doomed = wan.swarm.processes[victim] if victim is not None else lone_server(source, wan, maddrs)
        if doomed is None:
            print(f"  {setup}: every peer's layers are served twice; no run", file=sys.stderr)
            return None
        victim = family(doomed)
        try:
            stamps, tokens, recoveries = uvloop.run(_stalled(source, maddrs, args.tokens, victim, args.freeze))
        except P2PFusionError as exc:
            print(f"  {setup}: FAILED: {exc}", file=sys.stderr)
            return None
        finally:
            send_signal(victim, signal.SIGKILL)  # a stopped process takes no SIGTERM
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    stall = max(gaps) - statistics.median(gaps)
    same = tokens == expected
    print(f"  {setup} at {args.spec_rtt:.0f} ms: stall {stall:.2f} s (median step {1000 * statistics.median(gaps):.0f} "
          f"ms, recoveries {recoveries}, tokens {'identical' if same else 'DIFFER'})", file=sys.stderr)
    return stall if same else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="sweep,spec,failover", help="what to measure, comma-separated")
    parser.add_argument("--rtts", default="0,20,50,100", help="round trips to sweep, ms")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--spec-rtt", type=float, default=50.0)
    parser.add_argument("--spec-tokens", type=int, default=64)
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="jitter of the rough-links row, at --spec-rtt")
    parser.add_argument("--loss", type=float, default=0.01, help="share of chunks lost in the rough-links row")
    parser.add_argument("--draft-layers", type=int, help="also draft with the default model's first N layers")
    parser.add_argument("--stall-runs", type=int, default=2, help="failover runs per setup")
    parser.add_argument("--freeze", action="store_true", help="failover: SIGSTOP the peer and its daemon instead of SIGKILL")
    parser.add_argument("--mbit", type=int, default=1000, help="each host's link rate")
    parser.add_argument("--lookups", type=int, default=30, help="DHT lookups timed at each round trip")
    parser.add_argument("--users", type=int, default=8, help="generations at once, at 0 ms and at --spec-rtt")
    args = parser.parse_args()
    args.parts = set(args.parts.split(","))
    args.rtts = [float(x) for x in args.rtts.split(",")]
    if 0.0 not in args.rtts:
        args.rtts.insert(0, 0.0)  # the bound's own base
    reason = namespaces_unavailable()
    if reason is not None:
        sys.exit(f"bench_wan.py: error: {reason}")
    print(machine_header(), flush=True)
    source = resolve_model(None)
    layers = load_config(source).num_hidden_layers
    with tempfile.TemporaryDirectory(prefix="p2pfusion-draft-") as tmp:
        draft = None if args.draft_layers is None else small_model(Path(tmp), args.draft_layers)
        if args.parts & {"sweep", "spec"}:
            with HostNetwork(3, prefix="p2pfbw", subnet="10.81.0", mbit=args.mbit) as net, WanSwarm(net, [0, 1, 2]) as wan:
                wan.delays(lambda a, b: 0.0)
                wan.start(even_ranges(layers, 3))
                r = uvloop.run(measured(wan, source, draft, args))
            report(r, source, args)
    if "failover" in args.parts:
        expected = reference_tokens(source, args.tokens)
        for setup in ("backup", "self-heal"):
            runs = [failover(source, layers, setup, expected, args) for _ in range(args.stall_runs)]
            stalls = sorted(s for s in runs if s is not None)
            name = "a warm backup" if setup == "backup" else "no backup (a peer moves)"
            name += ", the peer frozen (SIGSTOP)" if args.freeze else ""
            summary = f"p50 {statistics.median(stalls):.2f} s, max {stalls[-1]:.2f} s" if stalls else "no run completed"
            print(f"failover at RTT {args.spec_rtt:.0f} ms with {name}: {len(stalls)} of {len(runs)} generations "
                  f"complete and token-identical; stall {summary}")


def report(r: dict, source, args) -> None:
    if r["per_token"]:
        base = r["per_token"][(0.0, 0.0, 0.0)]
        print(f"model {source.name}, 3 peers on 3 emulated hosts, {args.mbit} Mbit/s links, {args.tokens} greedy "
              f"tokens, {args.runs} runs (medians)")
        print(f"{'RTT ms':>7} {'jitter':>6} {'loss':>5} {'ms/token':>9} {'bound ms':>9} {'ratio':>6} {'first token ms':>15} "
              f"{'4x128 forward s':>16} {'lookup p50/p99 ms':>18} {'join ms':>8}")
        for (rtt, jitter, loss), seconds in r["per_token"].items():
            row = (rtt, jitter, loss)
            bound = base + 2 * rtt / 1000
            p50, p99 = r["lookup"][row]
            print(f"{rtt:>7.0f} {jitter:>6.0f} {loss:>5.2f} {1000 * seconds:>9.1f} {1000 * bound:>9.1f} "
                  f"{seconds / bound:>6.2f} {1000 * r['ttft'][row]:>15.0f} {r['forward'][row]:>16.2f} "
                  f"{f'{1000 * p50:.0f}/{1000 * p99:.0f}':>18} {1000 * r['join'][row]:>8.0f}")
    zero, far = r["users"].get(0.0), r["users"].get(args.spec_rtt)
    if zero is not None and far is not None:  # --rtts may leave out --spec-rtt
        # one token a step: no user's generation ends sooner than a lone user's at that round trip
        alone = args.users * r["alone"][(args.spec_rtt, 0.0, 0.0)]
        bound = min(zero, alone)
        print(f"{args.users} users at once: {zero:.1f} tokens/s at 0 ms (the peers' compute limit here), {far:.1f} at "
              f"{args.spec_rtt:.0f} ms, ratio {far / zero:.2f}; {args.users} lone users' rate at {args.spec_rtt:.0f} ms "
              f"{alone:.1f} tokens/s, so the bound there is {bound:.1f}: ratio {far / bound:.2f}; CPU busy "
              f"{100 * r['busy'][0.0]:.0f} % at 0 ms, {100 * r['busy'][args.spec_rtt]:.0f} % at {args.spec_rtt:.0f} ms")
    for (drafter, group), ratios in r["spec"].items():
        print(f"speculative vs plain at RTT {args.spec_rtt:.0f} ms, {drafter}, {group}: "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
