#!/usr/bin/env python
"""What a volunteer and a user wait for: cold starts and restarts, against local references.

Each figure is measured in this one run, next to a reference doing the comparable local work:
1. `p2pfusion infer` through a 3-peer local swarm of the default model, as a fresh process: time
   to its first line on stderr, to its first token on stdout, and to its exit; against a fresh
   process that loads the model with transformers and generates the same tokens locally.
2. The model's swarm key: hashing the default model's weights the first time (an empty digest
   cache), and resolving it again (cached); against one sha256 over the weight files' bytes, the
   least any digest of the weights can cost.
3. A peer restart: from launching `run-peer` to serving, for a peer with a new identity and for
   one restarted with its kept `--identity` right after `kill -9` (it checks that no running peer
   uses its key, and takes its old layers back).
4. A local swarm's launch (what `p2pfusion demo` waits for): three peers of the default model
   forked from a fork server, against the same three started as fresh processes, in turns.

Usage: python scripts/bench_startup.py [--runs 3] [--tokens 16]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.models.fingerprint import swarm_key, weight_files
from p2pfusion.models.source import resolve_model

PROMPT = "What is a DHT?"
LOCAL = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**ids, max_new_tokens=tokens, do_sample=False)[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
"""


def _timed_process(cmd: list[str]) -> tuple[float | None, float | None, float, str]:
    """Seconds to the first stderr bytes, to the first stdout bytes, and to the exit; and stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    firsts: dict[str, float] = {}
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def watch(name: str, stream) -> None:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):
            firsts.setdefault(name, time.perf_counter() - t0)
            chunks[name].append(chunk)

    readers = [threading.Thread(target=watch, args=(n, s)) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    proc.wait()
    total = time.perf_counter() - t0
    for reader in readers:
        reader.join()
    return firsts.get("err"), firsts.get("out"), total, b"".join(chunks["out"]).decode()


def _median(rows: list[tuple], i: int) -> float:
    return statistics.median(r[i] for r in rows if r[i] is not None)


def cold_inference(source, runs: int, tokens: int) -> None:
    with LocalSwarm(model=None) as swarm:
        swarm.start([(0, 10), (10, 20), (20, 30)])
        ours = [_timed_process([sys.executable, "-m", "p2pfusion.cli.main", "infer", "--chat", "--max-new-tokens",
                                str(tokens), *[a for m in swarm.maddrs for a in ("--initial-peers", m)], PROMPT])
                for _ in range(runs)]
    local = [_timed_process([sys.executable, "-c", LOCAL, str(source.folder), PROMPT, str(tokens)]) for _ in range(runs)]
    same = all(o[3].strip() == local[0][3].strip() for o in ours)
    print(f"cold `infer` ({tokens} tokens, 3 local peers): first stderr line {_median(ours, 0):.2f} s, first token "
          f"{_median(ours, 1):.2f} s, exit {_median(ours, 2):.2f} s; local transformers process: answer {_median(local, 1):.2f} s, "
          f"exit {_median(local, 2):.2f} s; exit ratio {_median(ours, 2) / _median(local, 2):.2f}; same text: {same}")


def swarm_keys(source, runs: int) -> None:
    firsts, cached, plain = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            key = swarm_key(source.folder, Path(cache))
            firsts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            swarm_key(source.folder, Path(cache))
            cached.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for path in weight_files(source.folder):
            with open(path, "rb") as f:
                hashlib.file_digest(f, "sha256")
        plain.append(time.perf_counter() - t0)
    first, again, whole = (statistics.median(x) for x in (firsts, cached, plain))
    print(f"swarm key {key}: first {first:.2f} s, cached {again * 1000:.1f} ms; one sha256 over the files "
          f"{whole:.2f} s; first / that {first / whole:.2f}")


def restarts(runs: int) -> None:
    fresh, kept = [], []
    # peers started afresh: a volunteer's restart includes its imports
    with tempfile.TemporaryDirectory() as keys, LocalSwarm(model=None, fork=False) as swarm:
        swarm.start([(0, 10), (20, 30)])
        args = ["--max-layers", "10", "--identity", str(Path(keys, "volunteer.key"))]
        for _ in range(runs):
            t0 = time.perf_counter()
            proc = swarm.launch((10, 20))
            swarm.wait_ready(proc)
            fresh.append(time.perf_counter() - t0)
            proc.terminate()
            proc.wait()
        proc = swarm.launch(None, args)
        swarm.wait_ready(proc)
        for _ in range(runs):
            proc.kill()
            proc.wait()
            t0 = time.perf_counter()
            proc = swarm.launch(None, args)
            swarm.wait_ready(proc)
            kept.append(time.perf_counter() - t0)
    print(f"peer start to serving: new identity {statistics.median(fresh):.2f} s; restart with its kept identity "
          f"after kill -9 {statistics.median(kept):.2f} s; ratio {statistics.median(kept) / statistics.median(fresh):.2f}")


def local_launches(runs: int) -> None:
    timed: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(runs):
        for fork in (True, False):
            t0 = time.perf_counter()
            with LocalSwarm(model=None, fork=fork) as swarm:
                swarm.start([(0, 10), (10, 20), (20, 30)])
                timed[fork].append(time.perf_counter() - t0)
    forked, fresh = statistics.median(timed[True]), statistics.median(timed[False])
    print(f"a local swarm of 3 peers serving: forked {forked:.2f} s, fresh processes {fresh:.2f} s; "
          f"ratio {forked / fresh:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    source = resolve_model(None)
    swarm_keys(source, args.runs)
    restarts(args.runs)
    local_launches(args.runs)
    cold_inference(source, args.runs, args.tokens)


if __name__ == "__main__":
    main()
