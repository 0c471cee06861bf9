#!/usr/bin/env python
"""A legitimate user's chat through `p2pfusion api` while another client attacks the API, against
the same chat with no attack, in one run; and the API's resident memory before and after.

A local swarm of the default model (peer processes on 0:15 and 15:30) and one `p2pfusion api`
process with its default limits. The attacker connects from 127.0.0.1, the user from 127.0.0.2
(another address, as another machine would be). Each attack runs for WARMUP seconds, then the user
sends `--chats` greedy 24-token chats (non-streamed), one after another, while the attack goes on;
their texts are compared with the no-attack run's, and their median time with the median of as
many chats with no attack. Attacks:
- body-40mib: 4 connections sending 40 MiB chat bodies, over and over (413 before they are read);
- body-4mib: 2 connections sending chats of a 4 MiB message, the most a body may hold;
- stream-flood: 40 streamed chats at once from one address, opened again as each ends;
- prefill-flood: 8 chats at once from one address, each a 1,900-token prompt for 1 new token;
- stop-strings: 4 connections asking for 4 stop strings of 256 KiB each;
- slowloris: 200 connections that send a request's headers, then its body a byte a second.
Printed per attack: the user's median seconds over the no-attack median, whether every text is the same, the
API's RSS before the attack and after it (10 s after it stops), the API process's CPU time over
the attack's wall time (1 core = 100%), and the answers the attacker got. The attacker's threads
run in this process, on the same 2 cores as the swarm and the API.

Usage: python scripts/bench_api_attacks.py [--attacks body-40mib,stream-flood,...] [--chats N] [--requests-per-user N]
       [--peer-args "--decode-threads 1"]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import collections
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx2 as httpx

from p2pfusion.cli.local_swarm import LocalSwarm

ATTACKS = ["body-40mib", "body-4mib", "stream-flood", "prefill-flood", "stop-strings", "slowloris"]
WARMUP = 5.0
SETTLE = 10.0
CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class Attacker:
    """Threads that repeat one attack until stopped, counting the answers they get."""

    def __init__(self, url: str, attack: str):
        self.url, self.attack = url, attack
        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        self.stopped = threading.Event()
        self.answers: collections.Counter[str] = collections.Counter()
        workers = {"body-40mib": 4, "body-4mib": 2, "stream-flood": 40, "prefill-flood": 8, "stop-strings": 4,
                   "slowloris": 1}[attack]
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(30)

    def _loop(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stopped.is_set():
                try:
                    self.answers[self._once(client)] += 1
                except (httpx.HTTPError, OSError) as exc:
                    self.answers[type(exc).__name__] += 1
                    time.sleep(0.1)

    def _once(self, client: httpx.Client) -> str:
        if self.attack == "body-40mib":
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {40 << 20}\r\n\r\n").encode()
            with socket.create_connection((self.host, int(self.port)), timeout=60) as sock:
                sock.sendall(head)
                sent = 0
                try:
                    while sent < 40 << 20 and not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        sock.sendall(b" " * 65536)
                        sent += 65536
                except BlockingIOError:
                    pass
                except OSError:
                    return "closed"
                return sock.recv(12).decode(errors="replace")[9:12] or "closed"
        if self.attack == "body-4mib":
            body = {**CHAT, "messages": [{"role": "user", "content": "x" * ((4 << 20) - 1000)}]}
            response = client.post(self.url + "/v1/chat/completions", json=body)
            return f"{response.status_code} {response.json()['error']['code']}"
        if self.attack == "stream-flood":
            body = {**CHAT, "max_tokens": 200, "stream": True}
            with client.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                response.read()
                return str(response.status_code)
        if self.attack == "prefill-flood":
            words = " ".join(f"w{i % 97}" for i in range(650))  # about 1,900 tokens: the peers take 2,048
            body = {**CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": words}]}
            return str(client.post(self.url + "/v1/chat/completions", json=body).status_code)
        if self.attack == "stop-strings":
            body = {**CHAT, "stop": ["z" * (256 << 10)] * 4}
            return str(client.post(self.url + "/v1/chat/completions", json=body).status_code)
        return self._slowloris()

    def _slowloris(self) -> str:
        socks = []
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n")
        for _ in range(200):
            sock = socket.create_connection((self.host, int(self.port)), timeout=5)
            sock.sendall(head)
            socks.append(sock)
        closed = 0
        while not self.stopped.is_set() and socks:
            time.sleep(1.0)
            for sock in list(socks):
                try:
                    sock.sendall(b" ")
                except OSError:
                    socks.remove(sock)
                    closed += 1
        for sock in socks:
            sock.close()
        return f"{closed} of 200 cut off"


def user_chat(url: str) -> tuple[float | None, str | None]:
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    t0 = time.perf_counter()
    try:
        with httpx.Client(transport=transport, timeout=300) as client:
            response = client.post(url + "/v1/chat/completions", json=CHAT)
    except httpx.HTTPError as exc:
        print(f"  the user's chat failed: {exc}", file=sys.stderr)
        return None, None
    if response.status_code != 200:
        print(f"  the user's chat got {response.status_code}: {response.text[:200]}", file=sys.stderr)
        return None, None
    return time.perf_counter() - t0, response.json()["choices"][0]["message"]["content"]


def start_api(swarm: LocalSwarm, options: list[str]) -> tuple[subprocess.Popen, str]:
    log = open(swarm.workdir / "api.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "p2pfusion.cli.main", "api", "--initial-peers", swarm.maddrs[0],
                             "--port", "0", *options], stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = re.search(r"API at (http://\S+)/v1", (swarm.workdir / "api.log").read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    raise RuntimeError("the API did not start: " + (swarm.workdir / "api.log").read_text()[-1000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--chats", type=int, default=3, help="the user's chats per attack, and with no attack")
    parser.add_argument("--requests-per-user", help="the API's option of that name (default: its default)")
    parser.add_argument("--peer-args", default="", help="run-peer arguments for both peers, e.g. --decode-threads 1")
    args = parser.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    if set(attacks) - set(ATTACKS):
        parser.error(f"unknown attacks: {sorted(set(attacks) - set(ATTACKS))}")
    print(machine_header(), flush=True)
    rows = []
    with LocalSwarm(model=None) as swarm:
        swarm.start([(0, 15), (15, 30)], shlex.split(args.peer_args))
        per_user = [] if args.requests_per_user is None else ["--requests-per-user", args.requests_per_user]
        api, url = start_api(swarm, per_user)
        try:
            user_chat(url)  # warms the route
            base = [user_chat(url) for _ in range(args.chats)]
            base_seconds, base_text = statistics.median(s for s, _ in base), base[0][1]
            for attack in attacks:
                before = rss_mib(api.pid)
                cpu, started = cpu_seconds(api.pid), time.monotonic()
                attacker = Attacker(url, attack)
                time.sleep(WARMUP)
                chats = [user_chat(url) for _ in range(args.chats)]
                attacker.stop()
                failed = any(s is None for s, _ in chats)
                seconds = None if failed else statistics.median(s for s, _ in chats)
                share = (cpu_seconds(api.pid) - cpu) / (time.monotonic() - started)
                time.sleep(SETTLE)
                after = rss_mib(api.pid)
                same = all(text == base_text for _, text in chats)
                rows.append((attack, seconds, same, dict(attacker.answers), before, after, share))
                print(f"  {attack}: {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            api.terminate()
            api.wait(30)
    print(f"no attack: user {base_seconds:.2f} s (median of {args.chats})")
    print(f"{'attack':<13} {'user s':>7} {'vs none':>8} {'text':>6} {'RSS MiB before':>15} {'after':>6} "
          f"{'API CPU':>8}  attacker got")
    for attack, seconds, same, answers, before, after, share in rows:
        shown = "failed" if seconds is None else f"{seconds:.2f}"
        ratio = "-" if seconds is None else f"{seconds / base_seconds:.2f}x"
        print(f"{attack:<13} {shown:>7} {ratio:>8} {'same' if same else 'DIFF':>6} {before:>15.0f} {after:>6.0f} "
              f"{share:>7.0%}  {json.dumps(answers)}")


if __name__ == "__main__":
    main()
