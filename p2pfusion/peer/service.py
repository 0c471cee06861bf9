"""Run a peer as a service: start it, keep up its duties, and leave cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Sequence
from dataclasses import replace

from p2pfusion.dht.swarm import SwarmNode, join_swarm
from p2pfusion.errors import BehindNat, ConfigError, RouteError
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import load_config
from p2pfusion.peer.balance import choose_model
from p2pfusion.peer.ports import keep_ports, kept_ports, listening_ports
from p2pfusion.peer.runtime import Peer, PeerOptions
from p2pfusion.peer.upkeep import Upkeep

log = logging.getLogger(__name__)


async def serve(options: PeerOptions, on_ready=None, others: Sequence[ModelSource] = ()) -> None:
    """Run a peer until SIGINT or SIGTERM. `on_ready(maddrs)` is called once it serves. With
    `others`, the peer serves whichever of them and `options.source` the swarm needs most."""
    swarm = await _join(options)
    if others:
        options = replace(options, source=await _needed_most(swarm, [options.source, *others]))
    peer = Peer(options, swarm)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        # The libraries' long-lived objects (torch, transformers, hivemind) stay out of later garbage
        # collections: a full one over them took 0.2 s here, a stall in every session served.
        # Done before serving, so no session waits for it.
        gc.collect()
        gc.freeze()
        try:
            await peer.start()
        except BehindNat as exc:
            log.warning("%s: joining again, to serve through relays", exc)
            await swarm.shutdown()
            swarm = None  # nothing to shut down if joining again fails
            swarm = await _join(options, relays=exc.relays)
            peer = Peer(options, swarm)
            await peer.start()
        maddrs = peer.record.maddrs  # those others reached when checked (net/reach.py)
        if options.address_file is not None:
            tmp = options.address_file.with_suffix(".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(options.address_file)
        if on_ready is not None:
            on_ready(maddrs)
        async with Upkeep(peer):
            await stop.wait()
        log.info("leaving the swarm")
        await peer.leave()
    finally:
        if options.address_file is not None:  # a stopped peer's address would only mislead whoever reads it next
            options.address_file.unlink(missing_ok=True)
        if swarm is not None:
            await swarm.shutdown()


async def _join(options: PeerOptions, relays: list[str] | None = None) -> SwarmNode:
    """The peer's node, on the ports its identity kept from its last run unless told others;
    given `relays`, behind a NAT (net/circuits.py)."""
    port, data_port = kept_ports(options.identity, options.port, options.data_port)

    async def join(port: int, data_port: int) -> SwarmNode:
        return await join_swarm(
            options.initial_peers, options.host, port, options.identity, data_port=data_port,
            announce_host=options.announce_host, secret=options.swarm_secret, relays=relays,
        )

    try:
        swarm = await join(port, data_port)
    except (ConfigError, RouteError) as exc:
        if (port, data_port) == (options.port, options.data_port) or "in use" not in str(exc):
            raise
        log.warning("the ports this identity used last (%d, %d) are taken: listening on new ones, so its "
                    "address changes", port, data_port)
        swarm = await join(options.port, options.data_port)
    listening = listening_ports(await swarm.maddrs(), swarm.transport.data_addrs)
    if listening is not None:
        keep_ports(options.identity, *listening)
    return swarm


async def _needed_most(swarm: SwarmNode, sources: list[ModelSource]) -> ModelSource:
    by_key = {source.key: source for source in sources}
    models = {key: (await swarm.lookup(key), load_config(source).num_hidden_layers) for key, source in by_key.items()}
    chosen = by_key[choose_model(models)]
    log.info("serving %s, which the swarm needs most of the %d models offered", chosen.name, len(by_key))
    return chosen
