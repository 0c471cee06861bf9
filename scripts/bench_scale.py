#!/usr/bin/env python
"""Sixty nodes on one machine: join time, memory, DHT lookups and spread, `p2pfusion swarm` and
`/v1/swarm`, generation, and ten minutes of churn.

The nodes (scripts/scale_fleet.py) are --peers real `run-peer` processes of a small model (the
default model cut to --layers layers, each peer holding at most --max-layers and announcing a
throughput drawn from THROUGHPUTS, so placement has unequal peers to balance) and DHT-only
participants (scripts/scale_node.py) for the rest of --nodes, each with its own libp2p daemon.
After one peer starts the swarm, all others start at once. Then:
1. memory: RSS of each node's Python process and of its daemon, and PSS (shared pages split);
2. lookups of the model's records: the first one of each of --fresh-clients new clients, and one
   from every DHT node at once; each must list every serving peer;
3. spread: a new record is stored; every DHT node reads until it sees it;
4. `p2pfusion swarm --json` and the API's `/v1/swarm` (optionally a screenshot of its dashboard):
   time and whether they list every serving peer;
5. a greedy generation, token-identical to transformers' own on the same small model;
6. churn: every minute for --churn-minutes, a random --churn-share of the nodes are killed
   (SIGKILL, daemon included; --freeze-share of them frozen first: scripts/scale_churn.py) and
   started again, while --users clients generate without pause.
   Every generation must complete, token-identical; coverage is sampled every few seconds.
Usage: python scripts/bench_scale.py [--nodes 60] [--peers 20] [--churn-minutes 10] [--screenshot docs/x.png]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.coverage import layer_throughputs
from p2pfusion.dht.records import PeerRecord, PeerState
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError
from p2pfusion.models.source import resolve_model
from p2pfusion.peer.balance import bottleneck
from bench_poisoned_run import small_model
from scale_churn import churn
from scale_fleet import Fleet, Node
from scale_views import dashboard, swarm_command

THROUGHPUTS = (20.0, 40.0, 80.0)  # one-token steps/s through one layer, drawn per peer
PROMPTS = (
    "Name three colours.", "What is a peer-to-peer network?", "Count from one to five.",
    "Write a haiku about the sea.", "Why is the sky blue?", "Give me a word that rhymes with cat.",
)
TOKENS = 12


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def references(source, tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """Each prompt's ids and transformers' own greedy tokens for it."""
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    encoder = RemoteCausalLM.build(source)
    found = {}
    for prompt in PROMPTS:
        ids = encoder.encode(prompt, chat=True)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
        found[prompt] = ids, out[0, len(ids):].tolist()
    return found


async def start(fleet: Fleet, peers: int, nodes: int) -> None:
    first = Node("peer", 0, fleet.rng.choice(THROUGHPUTS))
    fleet.nodes.append(first)
    t0 = time.time()
    await fleet.launch(first, [])
    if not await fleet.wait_ready(first):
        raise SystemExit(f"the first peer did not start: see {fleet.workdir}/peer0.log")
    rest = [Node("peer", i, fleet.rng.choice(THROUGHPUTS)) for i in range(1, peers)]
    rest += [Node("dht", i) for i in range(nodes - peers)]
    fleet.nodes += rest
    for node in rest:
        await fleet.launch(node, first.maddrs)
    ready = await asyncio.gather(*(fleet.wait_ready(node) for node in rest))
    joins = [n.ready - n.launched for n in rest if n.ready]
    print(f"join: {sum(ready) + 1} of {nodes} nodes up {max(n.ready for n in fleet.live()) - t0:.0f} s after the "
          f"first started ({len(rest)} started at once; each {statistics.median(joins):.0f} s median, "
          f"{max(joins):.0f} s max)")


def memory(fleet: Fleet) -> None:
    for kind in ("peer", "dht"):
        figures = [n.memory() for n in fleet.live() if n.kind == kind]
        if figures:
            rss, daemon, pss = zip(*figures)
            print(f"memory, {len(figures)} {kind} nodes: Python RSS median {statistics.median(rss):.0f} MiB "
                  f"(max {max(rss):.0f}), libp2p daemon RSS median {statistics.median(daemon):.0f} MiB, "
                  f"PSS of both median {statistics.median(pss):.0f} MiB, {sum(pss) / 1024:.1f} GiB in all")


def serving_ids(fleet: Fleet) -> set[str]:
    return {n.peer_id for n in fleet.live() if n.kind == "peer"}


async def lookups(fleet: Fleet, model: str, fresh: int) -> None:
    expected = serving_ids(fleet)
    firsts, complete = [], 0
    for _ in range(fresh):
        client = await join_swarm(fleet.entry_points(), client_mode=True)
        try:
            t0 = time.perf_counter()
            records = await client.lookup(model)
            firsts.append(time.perf_counter() - t0)
            complete += expected <= {r.peer_id for r in records}
        finally:
            await client.shutdown()
    dht = [n for n in fleet.live() if n.kind == "dht"]
    answers = await asyncio.gather(*(n.ask({"lookup": model}) for n in dht))
    seconds = [a["seconds"] for a in answers]
    print(f"lookup, first of {fresh} fresh clients: p50 {1000 * pct(firsts, 0.5):.0f} ms, p99 "
          f"{1000 * pct(firsts, 0.99):.0f} ms, {complete} of {fresh} listed all {len(expected)} serving peers")
    print(f"lookup, {len(dht)} DHT nodes at once: p50 {1000 * pct(seconds, 0.5):.0f} ms, p99 "
          f"{1000 * pct(seconds, 0.99):.0f} ms, {sum(a['records'] >= len(expected) for a in answers)} found every record")


async def spread(fleet: Fleet, client) -> None:
    """Seconds from storing a new record until each DHT node's lookup returns it."""
    probe = f"probe-{int(time.time())}"
    dht = [n for n in fleet.live() if n.kind == "dht"]
    watching = [asyncio.create_task(n.ask({"watch": probe})) for n in dht]
    await asyncio.sleep(1.0)  # every watcher is reading before the record exists
    record = PeerRecord(probe, client.writer_id, [], 0, 1, PeerState.ONLINE, 1.0, None, "probe")
    t0 = time.time()
    await client.announce(record)
    seen = [a["seen"] - t0 for a in await asyncio.gather(*watching) if a["seen"] is not None]
    print(f"spread: a new record seen by {len(seen)} of {len(dht)} DHT nodes; p50 {pct(seen, 0.5):.2f} s, "
          f"last {max(seen):.2f} s after it was stored" if seen else "spread: no DHT node saw the new record")


async def generation(source, client, expected) -> None:
    model = RemoteCausalLM.build(source, client)
    ids, tokens = expected[PROMPTS[0]]
    t0 = time.perf_counter()
    result = await model.generate(ids, len(tokens), stop_at_eos=False)
    print(f"generation: {len(tokens)} tokens in {time.perf_counter() - t0:.1f} s, "
          f"{'token-identical to transformers' if result.token_ids == tokens else 'TOKENS DIFFER'}")


def coverage_line(records: list[PeerRecord], num_layers: int) -> str:
    online = [r for r in records if r.state == PeerState.ONLINE]
    covered = sum(t > 0 for t in layer_throughputs(online, num_layers))
    backups = sum(r.state == PeerState.BACKUP for r in records)
    return (f"{len(online)} online, {backups} backups, {covered}/{num_layers} layers covered, "
            f"bottleneck {bottleneck(online, num_layers):.0f} tokens/s")


async def run(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="p2pfusion-scale-"))
    print(f"work folder: {workdir}", file=sys.stderr)
    folder = small_model(workdir / "model", args.layers)
    source = resolve_model(str(folder))
    expected = references(source, TOKENS)
    fleet = Fleet(folder, workdir, ["--max-layers", str(args.max_layers), "--decode-threads", "1", "--cache-mib", "64"])
    try:
        await start(fleet, args.peers, args.nodes)
        memory(fleet)
        client = await join_swarm(fleet.entry_points(), client_mode=True)
        try:
            records = await client.lookup(source.key)
            print(f"placement: {coverage_line(records, args.layers)}")
            await lookups(fleet, source.key, args.fresh_clients)
            await spread(fleet, client)
            await swarm_command(fleet, source, serving_ids(fleet))
            await dashboard(fleet, source, serving_ids(fleet), args.screenshot)
            await generation(source, client, expected)
            if args.churn_minutes > 0:
                await churn(fleet, source, client, expected, args)
        finally:
            await client.shutdown()
    finally:
        fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=60)
    parser.add_argument("--peers", type=int, default=20, help="of the nodes, how many run-peer processes")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-layers", type=int, default=2)
    parser.add_argument("--fresh-clients", type=int, default=10)
    parser.add_argument("--churn-minutes", type=float, default=10.0)
    parser.add_argument("--churn-share", type=float, default=0.2)
    parser.add_argument("--freeze-share", type=float, default=0.0,
                        help="of each minute's victims, the share frozen (SIGSTOP) for a while before the kill")
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--screenshot", type=Path, help="save the API's swarm dashboard here")
    args = parser.parse_args()
    print(machine_header())
    print(f"python scripts/bench_scale.py {' '.join(sys.argv[1:])}")
    try:
        uvloop.run(run(args))
    except P2PFusionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
