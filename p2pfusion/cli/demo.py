"""`p2pfusion demo`: 3 local peers serve the default model; one inference runs through them,
or (`--api`) the OpenAI-compatible API serves them until Ctrl-C."""

from __future__ import annotations

import logging
import sys
import time

import uvloop

from p2pfusion.cli.commands import serve_api
from p2pfusion.cli.local_swarm import LocalSwarm, even_ranges
from p2pfusion.client.generate.causal_lm import RemoteCausalLM
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.models.source import resolve_model
from p2pfusion.models.stage import load_config

log = logging.getLogger("p2pfusion.demo")


async def _ask(source, maddrs: list[str], prompt: str, max_new_tokens: int):
    swarm = await join_swarm(maddrs, client_mode=True)
    try:
        model = RemoteCausalLM.build(source, swarm)
        ids = model.encode(prompt, chat=True)

        def show(_token: int) -> None:
            print(".", end="", file=sys.stderr, flush=True)

        # a dot per token on a terminal; in a redirected log they would only be noise
        return await model.generate(ids, max_new_tokens, on_token=show if sys.stderr.isatty() else None)
    finally:
        await swarm.shutdown()


def demo(args) -> None:
    source = resolve_model(None)  # converts and caches the default model once, before peers start
    num_layers = load_config(source).num_hidden_layers
    ranges = even_ranges(num_layers, args.peers)
    sock = None
    if args.api:  # the port before the peers: one in use fails at once
        from p2pfusion.api.app import listen

        sock = listen("127.0.0.1", args.port)
    t0 = time.perf_counter()
    with LocalSwarm(model=None) as swarm:
        log.info("starting %d peers on 127.0.0.1 serving layers %s", args.peers, ranges)
        swarm.start(ranges)
        log.info("swarm ready in %.1f s; first peer: %s", time.perf_counter() - t0, swarm.maddrs[0])
        if sock is not None:
            uvloop.run(serve_api(sock, swarm.maddrs, None))
            log.info("stopping the peers")
            return
        result = uvloop.run(_ask(source, swarm.maddrs, args.prompt, args.max_new_tokens))
        if sys.stderr.isatty():
            print(file=sys.stderr)
        log.info("stopping the peers")
    speed = max(len(result.token_ids) - 1, 1) / max(result.decode_seconds, 1e-9)
    print(f"prompt: {args.prompt}")
    print(f"answer: {result.text.strip()}")
    print(f"{len(result.token_ids)} tokens, {speed:.1f} tokens/s through {args.peers} peers")

