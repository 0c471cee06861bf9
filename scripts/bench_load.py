#!/usr/bin/env python
"""Many users at once: N concurrent greedy generations from one client process through a local
3-peer swarm, against transformers' batched `generate` of N sequences in the same run; then 4
normal sessions beside an abusive client process, against the same 4 without it.

Per N (default 1, 2, 4, 8, 16): distinct chat prompts, --tokens new tokens each without stopping at
EOS, all sessions started together (asyncio.gather on one RemoteCausalLM, result checks off).
- aggregate decode tokens/s, two ways: "all decoding", the tokens chosen while all N sessions
  were decoding (from the last session's first token to the first session's last), over that
  time, which is what the reference measures; "first to last", tokens after each session's first,
  over the time from the first session's first token to the last session's last token (other
  sessions' prefills, and the last ones finishing alone, included);
- p50 / p99 per-token latency: gaps between successive tokens of a session, pooled over all
  sessions (small N runs again until --min-gaps gaps are pooled);
- errors: sessions that raised; peak RSS: VmHWM of each peer process, reset before each N;
- reference: transformers' `generate` of the N prompts left-padded in one batch, greedy, the same
  tokens, decode only (time of T tokens minus time of 1), the better of 1 thread and all threads,
  run just before the swarm's; with --pairs P, P such pairs per N, and the table shows the pair
  whose ratio is the median.
Abusers (a separate process dialling through libp2p, so that the peers see another client than
the normal sessions' 127.0.0.1):
- sessions: opens sessions of 2,048 positions as fast as peers allow and holds them idle;
- prefills: three loops of 2,048-token prefills.
Results on stdout, logs and progress on stderr.

Usage: python scripts/bench_load.py [--sessions 1,2,4,8,16] [--tokens 64] [--pairs 1] [--abusers sessions,prefills] [--quick]
       [--peer-args "--decode-threads 2"]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import asyncio
import math
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvloop
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError
from p2pfusion.models.source import resolve_model

TOPICS = [
    "a lighthouse keeper", "a lost violin", "the first snow on Mars", "a clockmaker's apprentice",
    "a river that flows uphill", "a library at night", "an old fishing boat", "a robot learning to paint",
    "a village without clocks", "the last tram of the day", "a dragon who hates gold", "a garden on a rooftop",
    "a letter never sent", "a chess game across centuries", "a baker at dawn", "a map with a missing island",
]
ABUSERS = ["sessions", "prefills"]
NORMAL_SESSIONS = 4  # beside the abuser
HOG_LENGTH = 2048
FLOOD_LENGTH = 2048
FLOOD_LOOPS = 3
READY_WITHIN = 120.0  # seconds the bench waits for the abuser to say its abuse is under way
SETTLE = 3.0  # seconds of abuse before the normal sessions start
STATUS = "abuser status:"  # how the abuser's own lines start in its log, among the client library's


@dataclass
class LoadRun:
    """What N concurrent sessions measured, pooled over repeated runs."""

    sessions: int
    tokens: int = 0  # new tokens after each session's first
    seconds: float = 0.0  # decode wall time, summed over runs
    all_tokens: int = 0  # tokens chosen while every session was decoding
    all_seconds: float = 0.0  # how long that was, summed over runs
    gaps: list[float] = field(default_factory=list)  # seconds between successive tokens of a session
    errors: list[str] = field(default_factory=list)
    completed: int = 0  # sessions that generated all their tokens
    peak_rss: list[float] = field(default_factory=list)  # MiB, per peer process

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def all_rate(self) -> float:
        return self.all_tokens / self.all_seconds if self.all_seconds > 0 else 0.0

    def latency(self, q: float) -> float:
        return percentile(self.gaps, q)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return math.nan


def reset_peak_rss(pid: int) -> None:
    """Writing 5 to clear_refs sets VmHWM back to the current RSS (Linux 4.0 and later)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        print(f"peak RSS of {pid} not reset, figures are since its start: {exc}", file=sys.stderr)


def prompts(model: RemoteCausalLM, n: int) -> list[list[int]]:
    return [model.encode(f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}).", chat=True) for i in range(n)]


# --- the reference: transformers' batched generate ---------------------------------------------


def local_rate(local, batch: list[list[int]], tokens: int, pad: int) -> tuple[float, int]:
    """Aggregate decode tokens/s of one left-padded batch, and the thread count that gave it."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            local.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad)
        return time.perf_counter() - t

    default = torch.get_num_threads()
    best = (0.0, default)
    try:
        for threads in sorted({1, os.cpu_count() or default}):
            torch.set_num_threads(threads)
            timed(2)  # warm-up
            rate = len(batch) * (tokens - 1) / max(timed(tokens) - timed(1), 1e-9)
            best = max(best, (rate, threads))
    finally:
        torch.set_num_threads(default)
    return best


# --- the swarm: N sessions from one client -------------------------------------------------------


async def concurrent(model: RemoteCausalLM, batch: list[list[int]], tokens: int, run: LoadRun, bar: tqdm) -> None:
    """Generate for every prompt at once; add the tokens, decode time, gaps and errors to `run`."""
    times: list[list[float]] = [[] for _ in batch]

    def on_token(stamps: list[float]):
        def record(_token: int) -> None:
            stamps.append(time.perf_counter())
            bar.update(1)
        return record

    results = await asyncio.gather(
        *(model.generate(ids, tokens, stop_at_eos=False, on_token=on_token(stamps), decode=False)
          for ids, stamps in zip(batch, times)),
        return_exceptions=True,
    )
    for result in results:
        if not isinstance(result, BaseException):
            run.completed += 1
        elif isinstance(result, (P2PFusionError, OSError, TimeoutError)):
            run.errors.append(str(result).splitlines()[0] if str(result) else repr(result))
        else:
            raise result
    started = [stamps for stamps in times if stamps]
    if started:
        run.seconds += max(s[-1] for s in started) - min(s[0] for s in started)
        run.tokens += sum(len(s) - 1 for s in started)
        run.gaps += [b - a for s in started for a, b in zip(s, s[1:])]
    if started and len(started) == len(batch):
        begin, end = max(s[0] for s in started), min(s[-1] for s in started)
        if end > begin:
            run.all_seconds += end - begin
            run.all_tokens += sum(begin < t <= end for s in started for t in s)


async def measure(model: RemoteCausalLM, batch: list[list[int]], tokens: int, min_gaps: int, pids: list[int]) -> LoadRun:
    run = LoadRun(len(batch))
    repeats = max(1, math.ceil(min_gaps / (len(batch) * max(tokens - 1, 1))))
    for pid in pids:
        reset_peak_rss(pid)
    with tqdm(total=repeats * len(batch) * tokens, desc=f"{len(batch)} sessions", unit="tok", file=sys.stderr,
              leave=False, mininterval=2.0) as bar:
        for _ in range(repeats):
            await concurrent(model, batch, tokens, run, bar)
    run.peak_rss = [peak_rss_mib(pid) for pid in pids]
    return run


# --- the abuser: a client process of its own, until it is killed -----------------------------


def via_libp2p(client) -> None:
    """Dial peers through libp2p only, so that the peers see this process as a client of its own
    (on loopback every direct connection comes from 127.0.0.1, the normal sessions' address too)."""
    direct = client.transport.open
    client.transport.open = lambda peer_id, addrs, protocol, timeout=15.0: direct(peer_id, [], protocol, timeout)


async def abuse(kind: str, maddrs: list[str]) -> None:
    client = await join_swarm(maddrs, client_mode=True)
    via_libp2p(client)
    model = RemoteCausalLM.build(resolve_model(None), client, verify=0.0)
    hidden = model.config.hidden_size
    tally = {"held": 0, "refused": 0, "prefills": 0}
    held, last_refusal, start = [], [""], time.monotonic()
    told = asyncio.Event()

    def ready(why: str) -> None:
        if not told.is_set():
            told.set()
            print(f"ready: {why}; {tally}", flush=True)

    def refused(exc: Exception) -> None:
        tally["refused"] += 1
        last_refusal[0] = str(exc).splitlines()[0][:160] if str(exc) else repr(exc)
        ready(f"first refusal: {last_refusal[0]}")

    async def hog() -> None:
        while True:
            try:
                session = await model.open_session(HOG_LENGTH)
                await session.step(torch.randn(1, 16, hidden))
                held.append(session)
                tally["held"] = len(held)
            except (P2PFusionError, OSError, TimeoutError) as exc:
                refused(exc)
                await asyncio.sleep(1.0)

    async def flood() -> None:
        while True:
            try:
                session = await model.open_session(FLOOD_LENGTH)
                try:
                    await session.step(torch.randn(1, FLOOD_LENGTH, hidden))
                finally:
                    await session.close()
                tally["prefills"] += 1
                ready("a prefill went through")
            except (P2PFusionError, OSError, TimeoutError) as exc:
                refused(exc)
                await asyncio.sleep(0.5)

    async def report() -> None:
        while True:
            await asyncio.sleep(5.0)
            if time.monotonic() - start > 30:
                ready("30 s of abuse")
            print(f"{STATUS} {tally}, last refusal: {last_refusal[0] or '-'}", file=sys.stderr, flush=True)

    workers = [hog() for _ in range(4)] if kind == "sessions" else [flood() for _ in range(FLOOD_LOOPS)]
    await asyncio.gather(report(), *workers)


async def start_abuser(kind: str, maddrs: list[str], workdir: Path) -> subprocess.Popen:
    """The abuser in a process group of its own (its libp2p daemon goes with it), once under way."""
    log = open(workdir / f"abuser-{kind}.log", "w")
    proc = subprocess.Popen([sys.executable, __file__, "--abuser", kind, "--maddrs", *maddrs], stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True)
    said, _, _ = await asyncio.to_thread(select.select, [proc.stdout], [], [], READY_WITHIN)
    line = proc.stdout.readline().strip() if said else ""
    print(f"abuser {kind}: {line or f'not ready within {READY_WITHIN:.0f} s'}", file=sys.stderr)
    await asyncio.sleep(SETTLE)
    return proc


def stop_abuser(proc: subprocess.Popen, kind: str, workdir: Path) -> str:
    """Kill the abuser's process group; its last status line."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    said = [line for line in (workdir / f"abuser-{kind}.log").read_text().splitlines() if line.startswith(STATUS)]
    return said[-1].removeprefix(STATUS).strip() if said else ""


# --- the run and its report ----------------------------------------------------------------------


@dataclass
class Row:
    run: LoadRun
    local: float  # the reference's aggregate tokens/s
    threads: int  # the reference's thread count


async def bench(args, source, local, pad: int, swarm: LocalSwarm) -> tuple[list[Row], dict[str, tuple[LoadRun, str]]]:
    client = await join_swarm(swarm.maddrs, client_mode=True)
    pids = [p.pid for p in swarm.processes]
    try:
        model = RemoteCausalLM.build(source, client, verify=0.0)
        warm = prompts(model, 2)
        await asyncio.gather(*(model.generate(ids, 2, stop_at_eos=False, decode=False) for ids in warm))
        rows = []
        for n in args.sessions:
            batch = prompts(model, n)
            pairs = []
            for _ in range(args.pairs):  # the reference, then the swarm, right after it
                rate, threads = local_rate(local, batch, args.tokens, pad)
                run = await measure(model, batch, args.tokens, args.min_gaps, pids)
                pairs.append(Row(run, rate, threads))
                print(f"{n} sessions: {run.all_rate:.1f} tok/s all decoding, {run.rate:.1f} first to last "
                      f"(local batched {rate:.1f} on {threads} threads: {run.all_rate / rate:.2f}), "
                      f"p50 {run.latency(0.5) * 1e3:.0f} ms, p99 {run.latency(0.99) * 1e3:.0f} ms, "
                      f"{len(run.errors)} errors{': ' + run.errors[0] if run.errors else ''}", file=sys.stderr)
            rows.append(median_pair(pairs))
        abused: dict[str, tuple[LoadRun, str]] = {}
        normal = prompts(model, NORMAL_SESSIONS)
        for kind in ["none", *args.abusers]:
            proc = None if kind == "none" else await start_abuser(kind, swarm.maddrs, swarm.workdir)
            try:
                run = await measure(model, normal, args.tokens, args.min_gaps, pids)
            finally:
                said = "-" if proc is None else stop_abuser(proc, kind, swarm.workdir)
            abused[kind] = (run, said)
            print(f"abuser {kind}: normal sessions p99 {run.latency(0.99) * 1e3:.0f} ms, {len(run.errors)} errors; "
                  f"abuser's last word: {said}", file=sys.stderr)
        return rows, abused
    finally:
        await client.shutdown()


def median_pair(pairs: list[Row]) -> Row:
    """The pair whose ratio (all decoding) is the median of theirs (the lower middle one of an even
    count): a pair's two sides ran within seconds of each other, so their ratio is what holds
    when the machine's speed moves between pairs."""
    ranked = sorted(pairs, key=lambda row: row.run.all_rate / row.local)
    return ranked[(len(ranked) - 1) // 2]


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "PASS" if ok else "FAIL"


def report(rows: list[Row], abused: dict[str, tuple[LoadRun, str]], tokens: int) -> None:
    print("\nswarm tok/s: while all sessions decode / from the first token to the last (see the top)")
    print(f"{'sessions':>8} {'swarm tok/s':>13} {'local tok/s':>11} {'threads':>7} {'ratios':>11} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'gaps':>5} {'errors':>6}  peak RSS MiB per peer")
    for row in rows:
        r = row.run
        rates = f"{r.all_rate:.1f} / {r.rate:.1f}"
        ratios = f"{r.all_rate / row.local:.2f} / {r.rate / row.local:.2f}"
        print(f"{r.sessions:>8} {rates:>13} {row.local:>11.1f} {row.threads:>7} {ratios:>11} "
              f"{r.latency(0.5) * 1e3:>7.1f} {r.latency(0.99) * 1e3:>7.1f} {len(r.gaps):>5} {len(r.errors):>6}  "
              f"{' / '.join(f'{m:.0f}' for m in r.peak_rss)}")
    base = abused.get("none", (None, ""))[0]
    if abused:
        print(f"\n{NORMAL_SESSIONS} normal sessions of {tokens} tokens beside an abuser")
        print(f"{'abuser':>9} {'p50 ms':>7} {'p99 ms':>7} {'p99 vs none':>11} {'completed':>9} {'errors':>6}  abuser's last word")
        for kind, (run, said) in abused.items():
            vs = run.latency(0.99) / base.latency(0.99) if base else math.nan
            done = f"{run.completed}/{run.completed + len(run.errors)}"
            print(f"{kind:>9} {run.latency(0.5) * 1e3:>7.1f} {run.latency(0.99) * 1e3:>7.1f} {vs:>10.2f}x "
                  f"{done:>9} {len(run.errors):>6}  {said[:120]}")
    by_n = {row.run.sessions: row for row in rows}
    one, eight = by_n.get(1), by_n.get(8)
    ratio = eight.run.all_rate / eight.local if eight else None
    p99 = eight.run.latency(0.99) / one.run.latency(0.99) if eight and one else None
    errors = sum(len(row.run.errors) for row in rows) + sum(len(run.errors) for run, _ in abused.values())
    print("\ntargets")
    print(f"  aggregate at N=8, all decoding, >= 0.8 x local batched generate at batch 8: "
          f"{'-' if ratio is None else f'{ratio:.2f}'} {verdict(None if ratio is None else ratio >= 0.8)}"
          f"{'' if ratio is None else f' (first to last token: {eight.run.rate / eight.local:.2f})'}")
    print(f"  p99 at N=8 <= 3x p99 at N=1: {'-' if p99 is None else f'{p99:.2f}x'} "
          f"{verdict(None if p99 is None else p99 <= 3)}")
    print(f"  zero errors: {errors} {verdict(errors == 0)}")
    for kind, (run, _) in abused.items():
        if kind != "none" and base:
            vs = run.latency(0.99) / base.latency(0.99)
            print(f"  normal p99 beside the {kind} abuser <= 2x without: {vs:.2f}x {verdict(vs <= 2)}; "
                  f"every normal session completed: {verdict(not run.errors)}")


def peer_reports(swarm: LocalSwarm) -> None:
    """Each peer's last periodic report (sessions, tokens served), for the log."""
    for i in range(len(swarm.processes)):
        lines = [line for line in (swarm.workdir / f"peer{i}.log").read_text().splitlines() if "tokens served" in line]
        if lines:
            print(f"peer {i}: {lines[-1]}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,2,4,8,16", help="concurrent session counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per session")
    parser.add_argument("--abusers", default=",".join(ABUSERS), help="abusive clients to run beside 4 normal ones")
    parser.add_argument("--min-gaps", type=int, default=256, help="token gaps pooled per N (small N run again)")
    parser.add_argument("--pairs", type=int, default=1,
                        help="reference and swarm runs per N, one after the other; the table shows the median pair")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--peer-args", default="", help="more run-peer arguments, e.g. '--decode-threads 2'")
    parser.add_argument("--quick", action="store_true", help="1, 2 and 4 sessions of 16 tokens, for development")
    parser.add_argument("--abuser", choices=ABUSERS, help=argparse.SUPPRESS)
    parser.add_argument("--maddrs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.abuser:
        uvloop.run(abuse(args.abuser, args.maddrs))
        return
    print(machine_header(), flush=True)
    if args.quick:
        args.sessions, args.tokens, args.min_gaps = "1,2,4", 16, 32
    try:
        args.sessions = [int(n) for n in args.sessions.split(",") if n]
    except ValueError:
        parser.error(f"--sessions takes comma-separated counts, got {args.sessions!r}")
    args.abusers = [a for a in args.abusers.split(",") if a]
    if unknown := set(args.abusers) - set(ABUSERS):
        parser.error(f"unknown abusers {sorted(unknown)}; known: {', '.join(ABUSERS)}")
    if args.tokens < 2 or min(args.sessions, default=1) < 1 or args.pairs < 1:
        parser.error("--tokens must be at least 2, and --pairs and every session count at least 1")

    source = resolve_model(None)
    local = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    eos = local.config.eos_token_id
    pad = local.config.pad_token_id if local.config.pad_token_id is not None else eos[0] if isinstance(eos, list) else eos
    print(f"model {source.name}, {args.tokens} tokens per session, sessions {args.sessions}, "
          f"abusers {args.abusers}, torch threads {torch.get_num_threads()}", file=sys.stderr)
    with LocalSwarm(model=None) as swarm:
        swarm.start(even_ranges(local.config.num_hidden_layers, args.peers), args.peer_args.split())
        rows, abused = uvloop.run(bench(args, source, local, pad, swarm))
        peer_reports(swarm)
    report(rows, abused, args.tokens)


if __name__ == "__main__":
    main()
