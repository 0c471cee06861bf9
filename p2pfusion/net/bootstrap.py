"""Reaching the initial peers: every one dialled at once.

Given bootstrap peers, the p2pd daemon dials them one after another before it reports ready, and
waits on each. An initial peer that stays silent without refusing (its host suspended, or gone
without a reset) holds the join for the daemon's handshake timeout, about 5 s a peer, and two of
them outlast the daemon's 15 s start (docs/benchmarks.md, "Silent peers"). So nodes here start
their daemon with no bootstrap peer and dial all of them at once: a join goes on once one has
answered and the others have had as long again (at least MIN_DIAL_GRACE), so that those about as
near join it too; dials still under way go on in the background.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from p2pfusion.errors import RouteError
from p2pfusion.net.circuits import LIBP2P_ERRORS, daemon_maddr

log = logging.getLogger(__name__)

DIAL_TIMEOUT = 15.0  # what the daemon's own start allowed its bootstrap
MIN_DIAL_GRACE = 0.1  # seconds the other initial peers get, at least, once one has answered
IDENTITY_TIMEOUT = 5.0  # a search for this node's own peer id that finds nothing in this long finds nobody
IDENTIFY_WAIT = 0.05
EMPTY_TABLE = "failed to find any peer in table"


async def dial(node: P2P, maddr: str) -> bool:
    """Connect `node` to the peer at `maddr` (a full address, ending in /p2p/ and its id)."""
    try:
        address, _, peer = maddr.rpartition("/p2p/")
        addrs = [daemon_maddr(address)] if address else []
        await asyncio.wait_for(node._client.connect(PeerID.from_base58(peer), addrs), DIAL_TIMEOUT)
        return True
    except LIBP2P_ERRORS as exc:
        log.debug("no connection to initial peer %s: %r", maddr, exc)
        return False


async def dial_all(node: P2P, initial_peers: list[str]) -> tuple[list[str], set[asyncio.Task]]:
    """The initial peers `node` connected to, and the dials still under way (for the caller to keep
    or cancel): all dialled at once, waiting for the first to answer, then as long again for the
    rest. No peer reached means none answered within DIAL_TIMEOUT."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    dials = {asyncio.ensure_future(dial(node, maddr)): maddr for maddr in dict.fromkeys(initial_peers)}
    reached, pending, deadline = [], set(dials), None
    while pending:
        timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        reached += [dials[task] for task in done if task.result()]
        if reached and deadline is None:
            deadline = loop.time() + max(loop.time() - start, MIN_DIAL_GRACE)
    return reached, pending


async def reach(node: P2P, initial_peers: list[str]) -> tuple[list[str], set[asyncio.Task]]:
    """`dial_all`, and a RouteError when initial peers were given and none answered."""
    reached, pending = await dial_all(node, initial_peers)
    if initial_peers and not reached:
        for task in pending:
            task.cancel()
        raise RouteError(
            f"no initial peer is reachable: {', '.join(initial_peers)} (is a peer running there? an address "
            "from an earlier run is stale once its peer stopped)"
        )
    return reached, pending


async def identity_taken(peer_id: str, initial_peers: list[str]) -> bool:
    """Whether a peer reachable through `initial_peers` runs with `peer_id` already: a throwaway
    daemon joins through them and looks that id up in libp2p's DHT, as hivemind's own check does."""
    probe = await P2P.create(dht_mode="client")
    try:
        reached, pending = await dial_all(probe, initial_peers)
        for task in pending:
            task.cancel()
        return bool(reached) and await asyncio.wait_for(_found(probe, PeerID.from_base58(peer_id)), IDENTITY_TIMEOUT)
    except LIBP2P_ERRORS:
        return False
    finally:
        await probe.shutdown()


async def _found(probe: P2P, peer_id: PeerID) -> bool:
    while True:
        try:
            await probe._client.connect(peer_id, [])
            return True
        except ControlFailure as exc:
            # the daemon's DHT lists a connected peer once it has identified it, a moment after the dial
            if EMPTY_TABLE not in str(exc):
                return False
        await asyncio.sleep(IDENTIFY_WAIT)
