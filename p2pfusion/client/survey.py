"""What a swarm serves and how well, as JSON: the models, each one's layer coverage and gaps, its
peers (state, layers, device, advertised and observed speed, load, backup role) and its bottleneck.

`p2pfusion swarm` prints it and the HTTP API serves it (`GET /v1/swarm`), so both show the same.
A record lives in the DHT for up to RECORD_TTL after its peer died, and a peer may be listed at
addresses nobody reaches, so each peer is asked whether it answers (its echo protocol, served from
the moment it joins). One that does not is shown as "unreachable", with the reason, and its layers
count as not served. A view is kept SNAPSHOT_TTL for whoever asks again meanwhile, so any number of
open pages cost one DHT read and one round of pings per SNAPSHOT_TTL, and a killed peer shows as
unreachable from the next page refresh after that, until its record expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2pfusion.client.route.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.route.session import RouteSession
from p2pfusion.dht.coverage import layer_throughputs
from p2pfusion.dht.records import ModelEntry, PeerRecord, PeerState, span_throughput
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import P2PFusionError
from p2pfusion.net.probe import silent_peers

log = logging.getLogger(__name__)

PROBE_STEPS = 4  # one-token steps a peer is timed over
# peers timed at once: one by one, `p2pfusion swarm` took 17 s for 20 peers on a loaded machine,
# and would take minutes for hundreds; a probe's few hidden states load no link
PROBES_AT_ONCE = 8
PING_TIMEOUT = 2.0  # a live peer echoes in milliseconds; a killed one refuses the dial at once
SNAPSHOT_TTL = 1.5  # seconds a view (reachability included) is shared by those who ask for it
MAX_RTTS = 4096  # peers whose echo times a dashboard keeps


def ranges(layers: list[int]) -> list[list[int]]:
    """Sorted layer indices as [start, end) runs."""
    out: list[list[int]] = []
    for layer in layers:
        if out and out[-1][1] == layer:
            out[-1][1] = layer + 1
        else:
            out.append([layer, layer + 1])
    return out


@dataclass
class ModelView:
    """One model's listed records, why those that did not answer are unreachable, and this
    machine's observed speeds of its peers."""

    entry: ModelEntry
    records: list[PeerRecord]
    observed: dict[str, float]
    unreachable: dict[str, str] = field(default_factory=dict)  # peer id -> why

    def to_dict(self) -> dict:
        live = [r for r in self.records if r.peer_id not in self.unreachable]
        totals = layer_throughputs(live, self.entry.num_layers)
        low = min(totals, default=0.0)
        where = [i for i, t in enumerate(totals) if t == low]
        gaps = [i for i, t in enumerate(totals) if t <= 0]
        lost = layer_throughputs([r for r in self.records if r.peer_id in self.unreachable], self.entry.num_layers)
        peers = sorted(self.records, key=lambda r: (r.start, r.end, r.state.value, r.peer_id))
        stages: dict[tuple[int, int], list[PeerRecord]] = {}  # one pass: a thousand peers' view stays fast
        for r in live:
            stages.setdefault((r.start, r.end), []).append(r)
        return {
            "model": self.entry.name, "key": self.entry.key, "num_layers": self.entry.num_layers,
            "layer_tokens_per_s": [round(t, 2) for t in totals],
            "gaps": ranges(gaps),
            # gaps that listed peers claim, but could not be reached at
            "unreachable_claims": ranges([i for i in gaps if lost[i] > 0]),
            "bottleneck_tokens_per_s": round(low, 2), "bottleneck_layers": ranges(where),
            "peers": [self._peer(r, stages.get((r.start, r.end), [])) for r in peers],
        }

    def _peer(self, r: PeerRecord, same_range: list[PeerRecord]) -> dict:
        """`same_range`: the live records of r's layers."""
        seen = self.observed.get(r.peer_id)
        stage = [p for p in same_range if p.peer_id != r.peer_id]
        why = self.unreachable.get(r.peer_id)
        return {
            "peer_id": r.peer_id, "layers": [r.start, r.end], "state": r.state.value if why is None else "unreachable",
            "claimed_state": r.state.value, "unreachable": why, "device": r.device,
            "weights": r.weights,
            "advertised_tokens_per_s": round(r.throughput, 2),
            "observed_tokens_per_s": None if seen is None else round(span_throughput(seen, None, r.span), 2),
            "load_tokens_per_s": round(r.load, 2),
            "sessions": r.sessions, "queued": r.queued, "cache_used": r.cache_used, "cache_total": r.cache_total,
            "session_limit": r.session_limit,
            "moving_to": list(r.moving_to) if r.moving_to else None,
            # a backup takes over from the serving peers of its layers; a serving peer, from its layers' backups
            "backup_for": [p.peer_id for p in stage if p.serving] if r.state == PeerState.BACKUP else None,
            "backed_up_by": [p.peer_id for p in stage if p.state == PeerState.BACKUP] if r.serving else None,
        }


async def time_peer(
    swarm: SwarmNode, record: PeerRecord, hidden_size: int, health: PeerHealth, dtype: torch.dtype = torch.float32
) -> float:
    """This client's own measurement of a peer, network included: one-token steps through its
    layers in a one-hop session. Updates `health` (routing trusts it over the peer's advertised
    speed) and returns the layer-rate."""
    session = await RouteSession(swarm.transport, [record], PROBE_STEPS + 1).open()
    try:
        await session.step(torch.randn(1, 1, hidden_size, dtype=dtype))
        t0 = time.perf_counter()
        for _ in range(PROBE_STEPS):
            await session.step(torch.randn(1, 1, hidden_size, dtype=dtype))
        seconds = (time.perf_counter() - t0) / PROBE_STEPS
    finally:
        await session.close()
    health.observe(record.peer_id, record.span, seconds)
    return record.span / seconds


async def unanswered(swarm: SwarmNode, records: list[PeerRecord], rtts: dict[str, float]) -> dict[str, str]:
    """The peers of `records` that do not echo now, all asked at once, and why; `rtts`: the round
    trips of their earlier echoes (a frozen peer is given up after a few of them, net/probe.py),
    updated, and trimmed to the MAX_RTTS latest."""
    peers = {r.peer_id: r.data_addrs for r in records}
    silent = await silent_peers(swarm.transport, peers, PING_TIMEOUT, rtts)
    for peer_id in list(rtts)[:max(len(rtts) - MAX_RTTS, 0)]:
        del rtts[peer_id]
    return silent


class SwarmStatus:
    """The swarm's view for one client: `healths` holds the PeerHealth of the models it generates
    with (their observed speeds are fresh); other models' speeds are what this machine saved."""

    def __init__(self, swarm: SwarmNode, healths: dict[str, PeerHealth] | None = None):
        self.swarm = swarm
        self.healths = dict(healths or {})
        self._lock = asyncio.Lock()
        self._snapshot: tuple[float, dict] | None = None
        self._rtts: dict[str, float] = {}  # peer id -> its last echo's round trip

    def health(self, key: str) -> PeerHealth:
        if key not in self.healths:
            self.healths[key] = PeerHealth(observed=load_observed(key))
        return self.healths[key]

    async def view(self, entry: ModelEntry, probe: bool = False) -> dict:
        """One model's view. `probe` first times each live peer from here (a short session each)."""
        listed = [r for r in await self.swarm.lookup(entry.key) if r.state != PeerState.OFFLINE]
        unreachable = await unanswered(self.swarm, listed, self._rtts)
        health = self.health(entry.key)
        if probe:
            gate = asyncio.Semaphore(PROBES_AT_ONCE)

            async def probe_one(record: PeerRecord) -> None:
                async with gate:
                    try:
                        await time_peer(self.swarm, record, entry.hidden_size, health)
                    except (P2PFusionError, OSError, TimeoutError) as exc:  # shown with no fresh observation
                        log.warning("could not probe %s: %s", record.peer_id, exc)

            await asyncio.gather(*(probe_one(r) for r in listed if r.peer_id not in unreachable))
            save_observed(entry.key, health.observed)
        return ModelView(entry, listed, dict(health.observed), unreachable).to_dict()

    async def views(
        self, choose: Callable[[list[ModelEntry]], list[ModelEntry]] | None = None, probe: bool = False
    ) -> list[dict]:
        """The views of the models the swarm lists (those `choose` picks, if given), by name then key."""
        listed = await self.swarm.models()
        entries = listed if choose is None else choose(listed)
        return list(await asyncio.gather(*(self.view(e, probe) for e in entries)))

    async def snapshot(self) -> dict:
        """`{"models": [...]}`, shared by callers within SNAPSHOT_TTL of each other."""
        async with self._lock:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] >= SNAPSHOT_TTL:
                views = await self.views()
                self._snapshot = (time.monotonic(), {"models": views})
            return self._snapshot[1]
