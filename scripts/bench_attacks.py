#!/usr/bin/env python
"""A legitimate user's generation under each attack of a hostile client or DHT writer, against the
same generation with no attack, in one run.

A fresh local swarm of the default model on two peer processes (0:15 and 15:30) per attack. An
attacker process starts the attack and says when it is under way; 3 s later the user runs
`--users` greedy generations one after another, each from a fresh client (join, route, prefill,
decode), and compares their tokens with transformers'. Printed per attack: the median and the
slowest generation's wall time over the no-attack median, whether every generation's tokens are
identical, and the peers' largest RSS growth. Attacks:
- slowloris: TLS connections from 127.0.0.2 that send a valid hello and then nothing, as fast as
  it can (from the user's own address it would fill that address's cap, which is the user's too);
- amplification: steps whose top-k frame declares [2**29] values in a 2 MiB body, on 2 streams;
- prefill-flood: three clients looping [4, 2048, 576] prefills through the whole route;
- session-flood: 60 sessions of 2,000 prefilled tokens each, left idle;
- sybil-hog: 5 libp2p identities from one address, each opening 70 one-hop sessions at the first
  stage (all 256 of its session slots, if each identity counted on its own);
- dht-wipe: an unsigned store of "gone" under the model's key, with no subkey, every second;
- dht-flood: 2,000 records of 3 KB under the model's key, unsigned, at once;
- tarpit: 20 signed records of fake online peers serving every layer, each with 8 data addresses
  pointing at a TCP tarpit (accepts, never answers).
The clients that open sessions attack from 127.0.0.2 through libp2p: on loopback every direct
connection comes from 127.0.0.1, as the user's do.

Usage: python scripts/bench_attacks.py [--tokens 24] [--users 3] [--attacks slowloris,dht-wipe,...]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import os
import resource
import select
import statistics
import ssl
import subprocess
import sys
import threading
import time

import msgpack
import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.records import PeerRecord, PeerState, model_key
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError
from p2pfusion.models.source import resolve_model
from p2pfusion.net import messages as m
from p2pfusion.net.compression import Codec
from p2pfusion.net.framing import PREFIX, encode, read_frame, write_frame
from p2pfusion.net.addresses import split_addr

PROMPT = "What is the capital of France?"
ATTACKS = [
    "slowloris", "amplification", "prefill-flood", "session-flood", "sybil-hog", "dht-wipe", "dht-flood", "tarpit",
]
ATTACKER_HOST = "127.0.0.2"  # where the clients that open sessions attack from: another address than the user's
SYBILS, SYBIL_SESSIONS = 5, 70
WARMUP = 3.0  # seconds of attack before the user starts


# --- the attacker: one process per attack, until it is killed ---------------------------------


def ready(what: str) -> None:
    """Tell the bench the attack is under way (it starts the user's generation only then)."""
    print(f"ready: {what}", flush=True)


def tell(what: str) -> None:
    print(what, file=sys.stderr, flush=True)


async def _records(maddrs, key):
    client = await join_swarm(maddrs, client_mode=True)
    return client, [r for r in await client.lookup(key) if r.state == PeerState.ONLINE]


async def slowloris(maddrs, key, hidden):
    client, records = await _records(maddrs, key)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    held, failed, rounds = [], 0, 0
    hello = b"".join(bytes(p) for p in encode({"protocol": m.PROTOCOL}))
    while True:
        for record in records:
            host, port = split_addr(record.data_addrs[0])
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, ssl=context, local_addr=(ATTACKER_HOST, 0)), 5
                )
                writer.write(hello)
                held.append(writer)
            except (OSError, TimeoutError):
                failed += 1
                await asyncio.sleep(0.01)
        rounds += 1
        if rounds == 200:
            ready(f"{len(held)} connections opened, {failed} refused")
        if len(held) > 20_000:
            await asyncio.sleep(1)


async def _open_one_hop(client, record, length, batch=1, reply=False):
    """A session of one hop at `record`'s peer: its streams, and (with `reply`) the Open's answer."""
    reader, writer = await client.transport.open(record.peer_id, record.data_addrs, m.PROTOCOL)
    sid = os.urandom(8).hex()
    sink_reader, sink = await client.transport.open(record.peer_id, record.data_addrs, m.PROTOCOL)
    await write_frame(sink, m.to_header(m.Subscribe(sid)))
    await read_frame(sink_reader)
    hop = m.Hop(record.peer_id, record.data_addrs, record.start, record.end)
    await write_frame(writer, m.to_header(m.Open(sid, length, [hop], Codec.NONE, batch=batch)))
    answer, _ = await read_frame(reader)
    return (reader, writer, sink_reader, sink, answer) if reply else (reader, writer, sink_reader, sink)


async def amplification(maddrs, key, hidden):
    client, records = await _records(maddrs, key)
    body = bytes(2 << 20)
    spec = {"codec": "topk", "dtype": "float32", "shape": [2**29], "k": 0, "parts": [len(body) // 2, len(body) // 2]}

    sent = [0]

    async def stream(record):
        while True:
            try:
                reader, writer, *_ = await _open_one_hop(client, record, 64)
                while True:
                    header = {"kind": "step", "step": 1, "timings": [], "tensor": spec}
                    packed = msgpack.packb(header, use_bin_type=True)
                    writer.write(PREFIX.pack(len(packed), len(body)) + packed + body)
                    await writer.drain()
                    reply, _ = await asyncio.wait_for(read_frame(reader), 30)
                    sent[0] += 1
                    if sent[0] == 4:
                        ready(f"bombs answered with: {str(reply.get('message'))[:80]}")
            except (OSError, EOFError, TimeoutError, P2PFusionError) as exc:
                tell(f"amplification stream: {exc!r}"[:200])
                await asyncio.sleep(0.1)

    await asyncio.gather(*(stream(records[i % len(records)]) for i in range(2)))


async def from_elsewhere(maddrs):
    """A client node whose streams come from ATTACKER_HOST, as from another host: its libp2p
    daemon listens there (so it dials from there), and it dials peers through libp2p only (a
    direct connection on loopback comes from 127.0.0.1, the user's address)."""
    client = await join_swarm(maddrs, host=ATTACKER_HOST, client_mode=True)
    direct = client.transport.open
    client.transport.open = lambda peer_id, addrs, protocol, timeout=15.0: direct(peer_id, [], protocol, timeout)
    return client


async def sybil_hog(maddrs, key, hidden):
    """Many libp2p identities from one host, each opening as many one-hop sessions at the first
    stage as it may: together they get what one address gets."""
    clients = [await from_elsewhere(maddrs) for _ in range(SYBILS)]
    first = min((r for r in await clients[0].lookup(key) if r.state == PeerState.ONLINE), key=lambda r: r.start)
    held, refused = [], 0
    for client in clients:
        for _ in range(SYBIL_SESSIONS):
            try:
                opened = await asyncio.wait_for(_open_one_hop(client, first, 64, reply=True), 30)
            except (OSError, EOFError, TimeoutError, P2PFusionError):
                refused += 1
                continue
            if opened[4].get("kind") == "ack":
                held.append(opened)
            else:
                refused += 1
    ready(f"{SYBILS} identities hold {len(held)} sessions at layers {first.start}:{first.end}; {refused} refused")
    await asyncio.Event().wait()


async def prefill_flood(maddrs, key, hidden):
    source = resolve_model(None)
    client = await from_elsewhere(maddrs)
    model = RemoteCausalLM.build(source, client)

    done = [0]

    async def loop():
        while True:
            try:
                session = await model.core.session(2048, batch=4).open()
                try:
                    await session.step(torch.randn(4, 2048, hidden))
                    done[0] += 1
                    if done[0] == 1:
                        ready("a [4, 2048] prefill went through")
                finally:
                    await session.close()
            except P2PFusionError as exc:
                tell(f"prefill flood: {exc}"[:200])
                await asyncio.sleep(0.5)

    ready("prefills sent")
    await asyncio.gather(*(loop() for _ in range(3)))


async def session_flood(maddrs, key, hidden):
    source = resolve_model(None)
    client = await from_elsewhere(maddrs)
    model = RemoteCausalLM.build(source, client)
    held, refused = [], []
    for i in range(60):  # the user starts once 3 are held (each takes seconds); the rest open while it generates
        try:
            session = await model.core.session(2048).open()
            await session.step(torch.randn(1, 2000, hidden))
            held.append(session)
        except P2PFusionError as exc:
            refused.append(str(exc))
        if i == 2:
            ready(f"{len(held)} sessions of 2,000 tokens held")
    tell(f"{len(held)} sessions held, {len(refused)} refused{': ' + refused[0][:160] if refused else ''}")
    await asyncio.Event().wait()


async def dht_wipe(maddrs, key, hidden):
    client = await join_swarm(maddrs, client_mode=True)
    stored = await client.dht.store(model_key(key), "gone", expiration_time=time.time() + 120)
    ready(f"wipe stored: {stored}")
    while True:
        await asyncio.sleep(1)
        await client.dht.store(model_key(key), "gone", expiration_time=time.time() + 120)


async def dht_flood(maddrs, key, hidden):
    client = await join_swarm(maddrs, client_mode=True)
    junk = {"junk": "x" * 3000}
    stored = await asyncio.gather(*(
        client.dht.store(model_key(key), subkey=f"junk{i}", value=junk, expiration_time=time.time() + 900)
        for i in range(2000)
    ))
    ready(f"{sum(stored)} of {len(stored)} junk records stored")
    await asyncio.Event().wait()


async def tarpit(maddrs, key, hidden):
    held = []

    async def accept(reader, writer):
        held.append(writer)  # never answers, never closes

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fakes = []
    for _ in range(20):  # a peer of its own per record: records are bound to their signer
        node = await join_swarm(maddrs)
        record = PeerRecord(
            model=key, peer_id=node.peer_id, maddrs=[], start=0, end=30, state=PeerState.ONLINE,
            compute_rate=1e9, network_rate=None, device="tarpit", data_addrs=[f"127.0.0.1:{port}"] * 8,
            since=time.time(),
        )
        fakes.append((node, record))
    stored = [await node.announce(record) for node, record in fakes]
    ready(f"{sum(stored)} of {len(fakes)} tarpit records stored")
    while True:
        await asyncio.sleep(10)
        for node, record in fakes:
            await node.announce(record)


WORKERS = {
    "slowloris": slowloris, "amplification": amplification, "prefill-flood": prefill_flood,
    "session-flood": session_flood, "sybil-hog": sybil_hog, "dht-wipe": dht_wipe, "dht-flood": dht_flood,
    "tarpit": tarpit,
}


def worker(name: str, maddrs: list[str], key: str, hidden: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    uvloop.run(WORKERS[name](maddrs, key, hidden))


# --- the user and the measurements ---------------------------------------------------------


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class RssWatch:
    """The largest RSS of each peer process while it runs, sampled every 0.2 s."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak = pids, {pid: rss_mib(pid) for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            for pid in self.pids:
                try:
                    self.peak[pid] = max(self.peak[pid], rss_mib(pid))
                except OSError:
                    pass

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        return self.peak


async def _user(source, maddrs, tokens):
    t0 = time.perf_counter()
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client)
        ids = model.encode(PROMPT, chat=True)
        result = await model.generate(ids, tokens)
    finally:
        await client.shutdown()
    return time.perf_counter() - t0, result.token_ids


def run_user(source, maddrs, tokens, timeout=300.0):
    try:
        return uvloop.run(asyncio.wait_for(_user(source, maddrs, tokens), timeout))
    except (P2PFusionError, TimeoutError, OSError) as exc:
        print(f"  the user's generation failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--users", type=int, default=3, help="generations a row, one after another (default 3)")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--maddrs", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.maddrs, args.key, args.hidden)
        return
    print(machine_header(), flush=True)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attacks: {sorted(unknown)}")
    source = resolve_model(None)
    reference = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    ids = RemoteCausalLM.build(source).encode(PROMPT, chat=True)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)[0, len(ids):].tolist()
    hidden = reference.config.hidden_size
    del reference
    rows = []
    for attack in ["none", *attacks]:
        with LocalSwarm(model=None) as swarm:  # a fresh swarm per attack: one attack's damage stays its own
            swarm.start([(0, 15), (15, 30)])
            pids = [p.pid for p in swarm.processes]
            base = {pid: rss_mib(pid) for pid in pids}
            run_user(source, swarm.maddrs, 2)  # warms the peers' first steps, as the no-attack run is warmed
            attacker = None
            if attack != "none":
                cmd = [sys.executable, __file__, "--worker", attack, "--key", source.key, "--hidden", str(hidden),
                       "--maddrs", *swarm.maddrs]
                log = open(swarm.workdir / "attacker.log", "w")
                attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
                # "ready: ..." once the attack is under way
                line = attacker.stdout.readline().strip() if select.select([attacker.stdout], [], [], 120)[0] else ""
                said = (swarm.workdir / "attacker.log").read_text()[-300:]
                print(f"  {attack}: attacker {line or 'not ready within 120 s: ' + said}", file=sys.stderr)
                time.sleep(WARMUP)
            watch = RssWatch(pids)
            runs = [run_user(source, swarm.maddrs, args.tokens) for _ in range(args.users)]
            peak = watch.stop()
            if attacker is not None:
                attacker.kill()
                attacker.wait()
                said = (swarm.workdir / "attacker.log").read_text().strip().splitlines()
                if said:
                    print(f"  {attack}: attacker's last line: {said[-1][:200]}", file=sys.stderr)
            growth = max(peak[pid] - base[pid] for pid in pids)
            seconds = None if any(s is None for s, _ in runs) else [s for s, _ in runs]
            same = all(tokens == expected for _, tokens in runs)
            rows.append((attack, seconds, same, growth))
            shown = "failed" if seconds is None else ", ".join(f"{s:.2f}" for s in seconds) + " s"
            print(f"  {attack}: user {shown}, tokens {'identical' if same else 'DIFFER'}, "
                  f"peer RSS +{growth:.0f} MiB", file=sys.stderr)
    baseline = None if rows[0][1] is None else statistics.median(rows[0][1])
    print(f"{args.users} generations a row, one after another; the ratios are the median's and the slowest's over the "
          "no-attack median")
    print(f"{'attack':<15} {'median s':>9} {'vs none':>8} {'slowest':>8} {'tokens':>10} {'peer RSS +MiB':>14}")
    for attack, seconds, same, growth in rows:
        if seconds is None or baseline is None:
            print(f"{attack:<15} {'failed':>9} {'-':>8} {'-':>8} {'identical' if same else 'DIFFER':>10} {growth:>14.0f}")
            continue
        median = statistics.median(seconds)
        print(f"{attack:<15} {median:>9.2f} {median / baseline:>7.2f}x {max(seconds) / baseline:>7.2f}x "
              f"{'identical' if same else 'DIFFER':>10} {growth:>14.0f}")


if __name__ == "__main__":
    main()
