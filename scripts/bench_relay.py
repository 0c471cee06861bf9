#!/usr/bin/env python
"""A relayed hop: what a peer behind a NAT costs a user, against the same stage served directly.

Five hosts in network namespaces on a bridge serve the default model: four serve layers 0:15 (the
relays a peer behind a NAT connects to), and layers 15:30 are served first by a fifth public host
(hidden states reach it over a direct TLS connection), then, that peer stopped, by a peer on a LAN
behind a masquerading router that takes no inbound connection: no neighbour reaches it, so it
joins again through relays (net/circuits.py). The client finds it through a relay and asks it to
call back; the hidden states then cross the connection it dials out through its NAT. For each,
from this machine's own namespace, it times the first two-token generation (connections, link
probes and, relayed, the call back), then greedy generation (`--runs` of `--tokens` tokens,
prefill excluded), and checks that both give the same tokens. Needs root, iproute2 and iptables;
removes its namespaces when it ends.
Usage: sudo .venv/bin/python scripts/bench_relay.py [--tokens 32] [--runs 3]
"""

from __future__ import annotations

from bench_machine import machine_header  # first: it loads the package before torch, as the CLI does

import argparse
import signal
import statistics
import sys
import time

import uvloop

from p2pfusion.cli.hosts import HostNetwork, nat_unavailable
from p2pfusion.cli.local_swarm import LocalSwarm
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model

PROMPT = "List the planets of the solar system, one per line, with one fact about each."
RELAYS = 4


async def measure(source, maddrs: list[str], gateway: str, args) -> tuple[list[float], list[int], float]:
    """Milliseconds per generated token in each run, the tokens, and the first generation's seconds."""
    # the client listens at its address on the bridge, as one on the internet at its public address
    client = await join_swarm(maddrs, host=gateway, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, client)
        ids = model.encode(PROMPT, chat=True)
        t0 = time.perf_counter()
        await model.generate(ids, 2, stop_at_eos=False)  # warm-up: connections and link probes
        first = time.perf_counter() - t0
        per_token, tokens = [], []
        for _ in range(args.runs):
            out = await model.generate(ids, args.tokens, stop_at_eos=False)
            per_token.append(1000 * out.decode_seconds / (len(out.token_ids) - 1))
            tokens = out.token_ids
        return per_token, tokens, first
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    reason = nat_unavailable()
    if reason is not None:
        sys.exit(f"bench_relay: error: {reason}")
    print(machine_header(), flush=True)
    source = resolve_model(None)
    results = {}
    with HostNetwork(RELAYS + 1, prefix="p2pfrel", subnet="10.75.0", behind_nat=1) as net, LocalSwarm(model=None) as swarm:
        swarm.wait_ready(swarm.launch((0, 15), ["--host", net.host(0)], prefix=net.prefix_of(0)))
        for proc in [swarm.launch((0, 15), ["--host", net.host(i)], prefix=net.prefix_of(i)) for i in range(1, RELAYS)]:
            swarm.wait_ready(proc)
        public = swarm.launch((15, 30), ["--host", net.host(RELAYS)], prefix=net.prefix_of(RELAYS))
        swarm.wait_ready(public)
        results["direct"] = uvloop.run(measure(source, swarm.maddrs, net.gateway, args))
        public.send_signal(signal.SIGTERM)
        public.wait(60)
        t0 = time.monotonic()
        natted = swarm.launch((15, 30), ["--host", "0.0.0.0"], prefix=net.natted_prefix_of(0))
        swarm.wait_ready(natted, timeout=300)
        joined = time.monotonic() - t0
        results["relayed"] = uvloop.run(measure(source, swarm.maddrs, net.gateway, args))
    direct, relayed = (statistics.median(results[k][0]) for k in ("direct", "relayed"))
    print(f"the peer behind the NAT served {joined:.0f} s after it started (a dial-back, a second join, "
          "and the wait for relays' slots included)")
    for name, (per_token, _, first) in results.items():
        print(f"layers 15:30 {name}: first generation {first:.2f} s; {', '.join(f'{t:.1f}' for t in per_token)} "
              f"ms per token (median {statistics.median(per_token):.1f})")
    same = results["direct"][1] == results["relayed"][1]
    print(f"a relayed hop costs {relayed - direct:.1f} ms per token ({relayed / direct:.2f}x the direct route); "
          f"tokens {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
