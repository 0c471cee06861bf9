#!/usr/bin/env python
"""The HTTP API's overhead: streamed chat completions from a `p2pfusion api` process against the
client core that `p2pfusion infer` runs (`RemoteCausalLM.generate` in this process), on the same
local swarm of the default model, in one run.

- one stream at a time, --runs times, the two sides alternating (so load from other tenants of the
  machine hits both alike): time to first token (from sending the request, or calling generate, to
  the first token's text) and decode tokens/s (tokens after the first, over the time from the first
  token to the last); medians, and the API's ratio to the core's;
- --concurrent streams at once, distinct prompts, after one such round through each side that is
  not counted (peers and clients learn how to run batched steps from the first ones): aggregate
  tokens/s (tokens after each stream's first, over the time from the first stream's first token
  to the last stream's last token), and "all decoding" (tokens chosen while every stream was
  decoding, over that time, as in bench_load.py), through the API and the core, each over
  transformers' batched generate of the same prompts (decode only, the better of 1 and all
  threads, as bench_load.py measures it), run just before them; --rounds times, the API going
  first in the first round and the core in the next, in turn, and the report shows the round
  whose API ratio is the median.
  With --users N, the API's streams come from N loopback addresses (127.0.0.2 on), as N people's
  would: the API shares the peers' compute among its users, each with a unit of its own there.
The API is read as a client reads it: server-sent events over HTTP (httpx), chunks parsed as JSON.
Both sides are greedy, stop at EOS and check peers' results at the default rate, so they generate
the same tokens. Results on stdout, logs and progress on stderr.

Usage: python scripts/bench_api.py [--tokens 64] [--runs 5] [--concurrent 8] [--users 1] [--rounds 1] [--peers 3]
       [--peer-args ARGS]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import torch
import uvloop
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import ModelSource, resolve_model
from p2pfusion.models.stage import load_config
from bench_load import local_rate

TOPICS = [
    "a lighthouse keeper", "a lost violin", "the first snow on Mars", "a clockmaker's apprentice",
    "a river that flows uphill", "a library at night", "an old fishing boat", "a robot learning to paint",
    "a village without clocks", "the last tram of the day", "a dragon who hates gold", "a garden on a rooftop",
]
READY_WITHIN = 180.0  # seconds for the API process to load the model and join the swarm


def prompt(i: int) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]}."


@dataclass
class Stream:
    """When one stream started and when each of its tokens came (perf_counter seconds)."""

    started: float
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0  # tokens generated (the API's usage, or the core's token count)

    @property
    def first_token(self) -> float:
        return self.stamps[0] - self.started

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / max(self.stamps[-1] - self.stamps[0], 1e-9)


def all_decoding(streams: list[Stream]) -> float:
    """Tokens chosen while every stream was decoding (from the last stream's first token to the
    first stream's last), over that time: what a batched generate measures, as in bench_load.py."""
    start, end = max(s.stamps[0] for s in streams), min(s.stamps[-1] for s in streams)
    if end <= start:
        return aggregate(streams)
    return sum(start < t <= end for s in streams for t in s.stamps) / (end - start)


def aggregate(streams: list[Stream]) -> float:
    """Tokens after each stream's first, over the first stream's first token to the last one's last."""
    seconds = max(s.stamps[-1] for s in streams) - min(s.stamps[0] for s in streams)
    return sum(s.tokens - 1 for s in streams) / max(seconds, 1e-9)


# --- the two sides -------------------------------------------------------------------------------


async def via_api(http: httpx2.AsyncClient, url: str, model: str, text: str, tokens: int) -> Stream:
    body = {
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    stream = Stream(time.perf_counter())
    async with http.stream("POST", f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stream.stamps.append(time.perf_counter())
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
    return stream


async def via_core(model: RemoteCausalLM, text: str, tokens: int) -> Stream:
    stream = Stream(time.perf_counter())
    result = await model.generate(model.encode(text, chat=True), tokens, on_token=lambda _: stream.stamps.append(
        time.perf_counter()
    ))
    stream.tokens = len(result.token_ids)
    return stream


# --- the run -------------------------------------------------------------------------------------


def start_api(swarm: LocalSwarm, streams: int) -> tuple[subprocess.Popen, str]:
    """`p2pfusion api` on a free port, once it serves; its log is in the swarm's workdir. The
    bench's `streams` concurrent streams stand for as many users, all on one address here."""
    log = swarm.workdir / "api.log"
    cmd = [sys.executable, "-m", "p2pfusion.cli.main", "api", "--initial-peers", swarm.maddrs[0], "--port", "0",
           "--requests-per-user", str(streams)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"API at (http://\S+/v1)", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"p2pfusion api did not start; its log: {log}\n{log.read_text()[-2000:]}")


@dataclass
class Round:
    """The concurrent streams through both sides, and the reference run just before them."""

    local: tuple[float, int]  # transformers' batched generate: tokens/s, threads
    api: list[Stream]
    core: list[Stream]

    def ratio(self) -> float:
        return all_decoding(self.api) / self.local[0]


@dataclass
class Results:
    api: list[Stream] = field(default_factory=list)
    core: list[Stream] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)


async def bench(
    args, source: ModelSource, maddrs: list[str], url: str, reference: Callable[[], tuple[float, int]]
) -> Results:
    swarm = await join_swarm(maddrs, client_mode=True)
    results = Results()
    try:
        model = RemoteCausalLM.build(source, swarm)
        async with contextlib.AsyncExitStack() as clients:
            http = await clients.enter_async_context(httpx2.AsyncClient(timeout=600))
            users = [http] if args.users == 1 else [
                await clients.enter_async_context(httpx2.AsyncClient(
                    timeout=600, transport=httpx2.AsyncHTTPTransport(local_address=f"127.0.0.{2 + i}")
                ))
                for i in range(args.users)
            ]
            await via_api(http, url, source.name, prompt(0), 2)  # warm-up: connections, links, caches
            await via_core(model, prompt(0), 2)
            for run in range(args.runs):
                results.api.append(await via_api(http, url, source.name, prompt(0), args.tokens))
                results.core.append(await via_core(model, prompt(0), args.tokens))
                api, core = results.api[-1], results.core[-1]
                print(f"run {run}: first token API {api.first_token * 1e3:.0f} ms, core {core.first_token * 1e3:.0f} "
                      f"ms; decode API {api.rate:.1f} tok/s, core {core.rate:.1f} tok/s ({api.tokens} tokens)",
                      file=sys.stderr)
            many = [prompt(i) for i in range(args.concurrent)]

            async def through_api() -> list[Stream]:
                return list(await asyncio.gather(*(
                    via_api(users[i % len(users)], url, source.name, p, args.tokens) for i, p in enumerate(many)
                )))

            async def through_core() -> list[Stream]:
                return list(await asyncio.gather(*(via_core(model, p, args.tokens) for p in many)))

            # warm-up at this size: the peers' threads for batched steps, and each client's cohorts
            # and head, are learned from the first such steps; whichever side ran first paid for both
            await through_api()
            await through_core()
            for n in range(args.rounds):
                local = reference()
                if n % 2:  # the sides take turns going first, as a machine's load drifts within a round
                    core, api = await through_core(), await through_api()
                else:
                    api, core = await through_api(), await through_core()
                results.rounds.append(Round(local, api, core))
                print(f"{args.concurrent} streams through the API: {aggregate(api):.1f} tok/s, in the core "
                      f"{aggregate(core):.1f} (all decoding {all_decoding(api):.1f} and {all_decoding(core):.1f}; "
                      f"local batched {local[0]:.1f}: API {results.rounds[-1].ratio():.2f})", file=sys.stderr)
        return results
    finally:
        await swarm.shutdown()


def local_reference(source: ModelSource, concurrent: int, tokens: int) -> Callable[[], tuple[float, int]]:
    """transformers' batched generate of the concurrent streams' prompts, to run: tokens/s, threads."""
    local = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    eos = local.config.eos_token_id
    pad = local.config.pad_token_id if local.config.pad_token_id is not None else eos[0] if isinstance(eos, list) else eos
    encoder = RemoteCausalLM.build(source)
    batch = [encoder.encode(prompt(i), chat=True) for i in range(concurrent)]
    return lambda: local_rate(local, batch, tokens, pad)


def report(r: Results, args) -> None:
    med = statistics.median
    ttft = [a.first_token / c.first_token for a, c in zip(r.api, r.core)]
    rates = [a.rate / c.rate for a, c in zip(r.api, r.core)]
    ranked = sorted(r.rounds, key=Round.ratio)
    shown = ranked[(len(ranked) - 1) // 2]  # the lower middle one of an even count
    many_api, many_core = aggregate(shown.api), aggregate(shown.core)
    print(f"\n{'':<28} {'API':>9} {'core':>9} {'ratio':>6}  runs (API / core)")
    print(f"{'first token, ms':<28} {med(a.first_token for a in r.api) * 1e3:>9.0f} "
          f"{med(c.first_token for c in r.core) * 1e3:>9.0f} {med(ttft):>6.2f}  {', '.join(f'{x:.2f}' for x in ttft)}")
    print(f"{'decode tok/s, 1 stream':<28} {med(a.rate for a in r.api):>9.1f} {med(c.rate for c in r.core):>9.1f} "
          f"{med(rates):>6.2f}  {', '.join(f'{x:.2f}' for x in rates)}")
    print(f"{f'aggregate tok/s, {args.concurrent} streams':<28} {many_api:>9.1f} {many_core:>9.1f} "
          f"{many_api / many_core:>6.2f}")
    together_api, together_core = all_decoding(shown.api), all_decoding(shown.core)
    print(f"{f'the same, all decoding':<28} {together_api:>9.1f} {together_core:>9.1f} {together_api / together_core:>6.2f}")
    rate, threads = shown.local
    print(f"{f'local batched generate of {args.concurrent}':<28} {rate:>9.1f} tok/s on {threads} threads: "
          f"all decoding, API {together_api / rate:.2f}, core {together_core / rate:.2f} of it (target 0.8); "
          f"first to last, API {many_api / rate:.2f}, core {many_core / rate:.2f}")
    if len(r.rounds) > 1:
        print(f"{'':<28} the median of {len(r.rounds)} rounds; API ÷ local in each: "
              f"{', '.join(f'{x.ratio():.2f}' for x in r.rounds)}")
    overhead = 1 - med(rates)
    print(f"\ntarget: the API costs at most 5% of decode tokens/s: {overhead * 100:+.1f}% "
          f"{'PASS' if overhead <= 0.05 else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="most new tokens per stream")
    parser.add_argument("--runs", type=int, default=5, help="single streams per side")
    parser.add_argument("--concurrent", type=int, default=8, help="streams at once")
    parser.add_argument("--users", type=int, default=1, help="addresses the concurrent API streams come from")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of concurrent streams, each after its reference")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--peer-args", default="", help="more run-peer arguments, e.g. '--decode-threads 2'")
    args = parser.parse_args()
    print(machine_header(), flush=True)
    if args.tokens < 2 or min(args.runs, args.concurrent, args.users, args.rounds, args.peers) < 1:
        parser.error("--tokens must be at least 2, and --runs, --concurrent, --users, --rounds and --peers at least 1")
    if args.users > 250:
        parser.error("--users is at most 250 (addresses 127.0.0.2 to 127.0.0.251)")

    source = resolve_model(None)
    layers = load_config(source).num_hidden_layers
    print(f"model {source.name}, {args.tokens} tokens per stream, {args.runs} runs, {args.concurrent} concurrent, "
          f"{args.peers} peers", file=sys.stderr)
    reference = local_reference(source, args.concurrent, args.tokens)
    with LocalSwarm(model=None) as swarm:
        swarm.start(even_ranges(layers, args.peers), args.peer_args.split())
        api, url = start_api(swarm, args.concurrent)
        try:
            results = uvloop.run(bench(args, source, swarm.maddrs, url, reference))
        finally:
            api.terminate()
            api.wait(30)
        print(f"API log: {Path(swarm.workdir) / 'api.log'}", file=sys.stderr)
    report(results, args)


if __name__ == "__main__":
    main()
