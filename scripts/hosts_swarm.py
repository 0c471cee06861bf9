#!/usr/bin/env python
"""A swarm of the default model across separate hosts: each peer in its own network namespace with
its own IP on a bridge, and a private inference from this machine's own namespace, outside them all.

It shows the multi-host recipe of the README at work: a long-lived bootstrap peer listening on
0.0.0.0 with `--announce-host`, fixed ports and `--identity`; volunteers joining through its one
published address; then the bootstrap host going down while the swarm keeps serving. It prints the
answer, each host's traffic, and the time each step took. Needs root (ip netns); it removes its
namespaces and bridge when it ends. Addresses are 10.78.0.0/24, inside those namespaces only.
Usage: sudo .venv/bin/python scripts/hosts_swarm.py [--prompt TEXT] [--max-new-tokens 32]
(sudo starts a bare environment: name the virtualenv's interpreter, not `python`)
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

try:
    import uvloop

    from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
    from p2pfusion.cli.local_swarm import LocalSwarm
    from p2pfusion.client.generate.causal_lm import RemoteCausalLM
    from p2pfusion.dht.swarm import join_swarm
    from p2pfusion.models.source import resolve_model
except ImportError as exc:  # sudo's python is not the virtualenv's
    sys.exit(f"hosts_swarm.py: {sys.executable} cannot import {exc.name}: run it with the virtualenv's "
             "interpreter, e.g. sudo .venv/bin/python scripts/hosts_swarm.py")


async def ask(source, maddrs: list[str], prompt: str, tokens: int) -> str:
    client = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client)
        result = await model.generate(model.encode(prompt, chat=True), tokens)
        return f"{result.text.strip()!r} ({len(result.token_ids)} tokens, recoveries {result.recoveries})"
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"hosts_swarm: error: {reason}", file=sys.stderr)
        sys.exit(2)
    source = resolve_model(None)  # converted once, before the peers start
    keys = Path(tempfile.mkdtemp(prefix="p2pfusion-hosts-"))
    t0 = time.perf_counter()
    with HostNetwork(4) as net, LocalSwarm(model=None) as swarm:
        boot = swarm.launch((0, 10), [
            "--host", "0.0.0.0", "--announce-host", net.host(0), "--port", "31337", "--data-port", "31338",
            "--identity", str(keys / "boot.key"),
        ], prefix=net.prefix_of(0))
        published = swarm.wait_ready(boot)
        print(f"bootstrap peer on host {net.host(0)}: {published[0]}", file=sys.stderr)
        others = [swarm.launch(r, ["--host", net.host(i)], prefix=net.prefix_of(i))
                  for i, r in ((1, (10, 20)), (2, (20, 30)), (3, (0, 10)))]
        for proc in others:
            swarm.wait_ready(proc)
        print(f"4 hosts serving in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        sent = [net.bytes_sent(i) for i in range(4)]
        print("answer:", uvloop.run(ask(source, published, args.prompt, args.max_new_tokens)))
        for i in range(4):
            print(f"  host {net.host(i)} sent {(net.bytes_sent(i) - sent[i]) / 1e3:.0f} kB")
        boot.send_signal(signal.SIGTERM)
        boot.wait(30)
        fallback = [*published, swarm.wait_ready(others[0])[0]]
        print("bootstrap host down; answer through the others:",
              uvloop.run(ask(source, fallback, args.prompt, args.max_new_tokens)))


if __name__ == "__main__":
    main()
