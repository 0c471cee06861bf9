"""A peer's life: join the swarm, measure itself, claim layers, load them, serve, announce, leave.

The decisions (which layers, when to move, when a backup takes over) are pure functions in
`balance`, `rebalance` and `backup`; `upkeep` runs them periodically. This module does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from p2pfusion.dht.records import DEFAULT_SESSION_LIMIT, ModelEntry, PeerRecord, PeerState
from p2pfusion.dht.swarm import SwarmNode
from p2pfusion.errors import BehindNat, ConfigError, ModelError
from p2pfusion.models.formats import WeightFormat, layer_sizes, load_quantizer, weight_format
from p2pfusion.models.source import ModelSource
from p2pfusion.models.stage import Stage, load_config, load_stage
from p2pfusion.models.threads import in_fresh_thread
from p2pfusion.net import circuits, probe, reach
from p2pfusion.net.compression import AUTO, Compression
from p2pfusion.net.links import LinkBook
from p2pfusion.net.secret import SwarmSecret
from p2pfusion.peer.balance import (
    Capacity, Placement, misfit, place_peer, reclaim, stage_most_at_risk, training_stage, yields_to,
)
from p2pfusion.peer.admission import Budget
from p2pfusion.peer.benchmark import ComputeBenchmark, compute_benchmark, device_name, free_memory
from p2pfusion.peer.directory import HopDirectory
from p2pfusion.peer.limits import FIRST_FRAME_TIMEOUT, IDLE_TIMEOUT, ServingLimits, layers_token_bytes
from p2pfusion.peer.memory import (
    KV_RESERVE_TOKENS, default_budget, default_cache_memory, dequantized_temporaries, layers_that_fit, resident_bytes,
)
from p2pfusion.peer.metrics import Exporter, StageMetrics, serve_metrics
from p2pfusion.peer.rebalance import new_layers
from p2pfusion.peer.reports import ReportCheck
from p2pfusion.peer.server import StageServer
from p2pfusion.peer.run_service import ReplicaService, join_run
from p2pfusion.peer.threads import DecodeSettings

log = logging.getLogger(__name__)

LINK_PROBES = 12  # peers whose links a joining peer measures
SETTLE_DELAY = (0.5, 1.5)  # seconds before a joining peer re-checks its claim: a DHT write is seen by then
SETTLE_ROUNDS = 3
TRAINING_COPIES = 6  # float32 copies of its layers a training replica holds


@dataclass
class PeerOptions:
    source: ModelSource
    initial_peers: list[str]
    layers: tuple[int, int] | None = None
    max_layers: int | None = None
    backup: bool = False
    throughput: str = "auto"  # "auto" (cached benchmark), "eval" (measure again) or a number
    decode_threads: str = "auto"  # "auto" (the benchmark's choice), "N" or "N:warm" (--decode-threads)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32  # what the layers compute in
    quant: WeightFormat | None = None  # int8 or int4 weights (--quant); None: weights in `dtype`
    max_memory: int | None = None  # bytes this peer may hold in all (--max-memory); None: peer/memory.py's default
    host: str = "127.0.0.1"
    announce_host: str | None = None  # the address other hosts reach this one at
    port: int = 0
    data_port: int = 0
    identity: str | None = None
    address_file: Path | None = None
    session_limit: int = DEFAULT_SESSION_LIMIT  # the longest session (tokens) it accepts
    compression: Compression = AUTO
    training_memory: int = 1 << 30  # bytes of activations kept for training clients' backward passes
    refresh_period: float = 10.0
    watch_period: float = 2.0
    rebalance_period: float = 120.0
    report_period: float = 60.0  # seconds between the INFO lines on what the peer served
    drain_timeout: float = 10.0
    cache_memory: int | None = None  # bytes of KV cache for all sessions; None: default_cache_memory
    client_share: float = 0.5  # of cache_memory, the most one source (client address, upstream peer) holds
    client_sessions: int = 64  # sessions one source may hold open
    max_sessions: int = 256  # sessions open at once, all sources together
    idle_timeout: float = IDLE_TIMEOUT  # seconds a session may go without a step before it expires
    first_frame_timeout: float = FIRST_FRAME_TIMEOUT
    metrics_port: int | None = None  # Prometheus metrics over HTTP at /metrics (0: a free port); None: not served
    metrics_host: str = "127.0.0.1"
    swarm_secret: SwarmSecret | None = None  # a private swarm's (--swarm-secret)
    train: str | None = None  # a training run's name (--train): this peer is a replica of one of its stages
    run_driver: str | None = None  # the peer id of the only driver it obeys (--run-driver); None: the run's first


class Peer:
    def __init__(self, options: PeerOptions, swarm: SwarmNode):
        self.options = options
        self.swarm = swarm
        self.model = options.source.key  # the swarm knows a model by its weights, not its name
        self.config = load_config(options.source)
        self.num_layers = self.config.num_hidden_layers
        self.server: StageServer | None = None
        self.record: PeerRecord | None = None
        self.capacity: Capacity | None = None
        self.started = time.monotonic()
        self.reload_seconds_per_layer = 1.0  # replaced by the measured time of this peer's own loads
        self.links = LinkBook(swarm.transport)
        self.directory = HopDirectory(lambda: swarm.lookup(self.model, options.train))  # where next hops may be dialled
        swarm.transport.listed = self.directory.listed  # listed peers' streams relay many clients' sessions
        self.reports = ReportCheck(swarm.transport, swarm.peer_id, self.links.round_trips)
        self.metrics = StageMetrics(self.model)
        self.exporter: Exporter | None = None
        self.training: ReplicaService | None = None  # a training replica's protocol (--train)

    async def live_records(self) -> tuple[list[PeerRecord], set[str]]:
        """The model's records, less the peers that clients reported unreachable and that fail our
        own check too (peer/reports.py). Also returns those."""
        records = await self.swarm.lookup(self.model, self.options.train)
        reported = {report.peer_id for report in await self.swarm.unreachable_reports(self.model)}
        gone = await self.reports.gone(records, reported) if reported else set()
        return [r for r in records if r.peer_id not in gone], gone

    def _benchmark(self) -> ComputeBenchmark:
        options, given = self.options, self.options.throughput
        if given not in ("auto", "eval"):
            # not measured: keep torch's own choice of threads
            bench = ComputeBenchmark(float(given), float(given), device_name(options.device), torch.get_num_threads())
        else:
            bench = compute_benchmark(options.source, options.device, options.dtype, options.quant, force=given == "eval")
        if options.decode_threads != "auto":
            threads, _, warm = options.decode_threads.partition(":")
            bench = replace(bench, decode_threads=int(threads), decode_warm=warm == "warm")
            log.info("one-token steps on %s, as --decode-threads says", bench.decode.describe())
        return bench

    def _decode_settings(self, bench: ComputeBenchmark) -> DecodeSettings:
        """The benchmark's threads for one-token steps, then what the served steps say on a CPU
        (peer/threads.py), unless --decode-threads fixed them."""
        tuned = self.options.decode_threads == "auto" and self.options.device == "cpu"
        return replace(bench.decode, tuned=tuned)

    @property
    def format(self) -> WeightFormat:
        return weight_format(self.options.dtype, self.options.quant)

    def _layers_that_fit(self) -> int:
        """Layers this peer's budget holds in its format, read from the weights' headers."""
        options, mib = self.options, 1 << 20
        load_quantizer(self.format)
        used = resident_bytes() if options.device == "cpu" else 0  # a GPU's budget is its own memory
        budget = options.max_memory
        if budget is None:
            budget = default_budget(free_memory(options.device), used)
        layer = max(layer_sizes(options.source.folder, self.num_layers, self.format, options.dtype))
        if options.train is not None:  # weights, their gradients, AdamW's two moments, outer weights and momentum
            layer *= TRAINING_COPIES
        kv = layers_token_bytes(self.config, 1, options.dtype)
        temporaries = 0
        if options.quant is not None and options.device == "cpu":
            float32 = max(layer_sizes(options.source.folder, self.num_layers, WeightFormat.FLOAT32, torch.float32))
            temporaries = dequantized_temporaries(float32)
        fit = min(layers_that_fit(budget, used, layer, kv, options.session_limit, temporaries), self.num_layers)
        if fit < 1:
            raise ModelError(
                f"{budget / mib:.0f} MiB of memory cannot hold one layer of {options.source.name} in {self.format.value} "
                f"({layer / mib:.0f} MiB, and {KV_RESERVE_TOKENS} tokens of KV cache), with {used / mib:.0f} MiB "
                "already in use: raise --max-memory or choose a smaller --quant"
            )
        log.info(
            "%d layers of %.0f MiB (%s) fit in %.0f MiB%s", fit, layer / mib, self.format.value, budget / mib,
            f", with {temporaries / mib:.0f} MiB for dequantized temporaries" if temporaries else "",
        )
        return fit

    async def _measure_links(self, records: list[PeerRecord]) -> tuple[float | None, float | None]:
        """Tokens/s of hidden states and the round trip, to up to LINK_PROBES peers measured at once
        (their round trips also let a claim prefer close neighbours, peer/balance.py), as medians;
        None when alone."""
        others = [r for r in records if r.state != PeerState.OFFLINE and r.peer_id != self.swarm.peer_id]
        speeds = await asyncio.gather(*(self.links.get(r.peer_id, r.data_addrs) for r in others[:LINK_PROBES]))
        speeds = [s for s in speeds if s is not None]  # an unreachable peer is simply not measured
        if not speeds:
            return None, None
        bytes_per_token = self.config.hidden_size * 4  # hidden states travel as float32 unless a link compresses them
        rate = statistics.median(s.bytes_per_second for s in speeds) / bytes_per_token
        return rate, statistics.median(s.rtt for s in speeds)

    def _placement(self, records: list[PeerRecord]) -> Placement:
        if self.options.layers is not None:
            return Placement(*self.options.layers, backup=self.options.backup)
        if self.options.train is not None:
            stage = training_stage(records, self.num_layers, self.capacity.max_layers)
            if stage is None:
                raise ModelError(f"every stage of training run {self.options.train} is longer than the {self.capacity.max_layers} layers this peer holds")
            return Placement(*stage)
        before = next((r for r in records if r.peer_id == self.swarm.peer_id), None)  # a restart
        if before is not None and reclaim(records, self.num_layers, self.capacity, self.swarm.peer_id, (before.start, before.end)):
            log.info("taking back layers %d:%d, which this peer served before its restart", before.start, before.end)
            return Placement(before.start, before.end)
        if self.options.backup:
            stage = stage_most_at_risk(records, self.num_layers, self.capacity.max_layers)
            if stage is not None:
                return Placement(*stage, backup=True)
        return place_peer(records, self.num_layers, self.capacity, self.swarm.peer_id, near=self.links.round_trips())

    async def start(self) -> None:
        await probe.serve_probes(self.swarm.transport)
        await reach.DialBackService(self.swarm.transport).start()
        records, _ = await self.live_records()
        reachable = await self._reachable(records)  # BehindNat: the caller joins again, relayed
        if self.options.metrics_port is not None:  # before any long work: a port taken fails the start
            self.exporter = serve_metrics(self.metrics.registry, self.options.metrics_host, self.options.metrics_port)
        bench = await in_fresh_thread(self._benchmark)  # its torch threads end with it (models/threads.py)
        network_rate, rtt = await self._measure_links(records)
        fit = self._layers_that_fit()
        if self.options.layers is not None and self.options.max_memory is not None:
            start, end = self.options.layers
            if end - start > fit:
                raise ModelError(f"--layers {start}:{end} needs {end - start} layers, but --max-memory holds {fit}")
        max_layers = min(self.options.max_layers or self.num_layers, fit)
        self.capacity = Capacity(bench.decode_rate, network_rate, max_layers)
        placement = self._placement(records)
        clash = None if self.options.train is None else misfit(records, placement.start, placement.end)
        if clash is not None:
            raise ModelError(
                f"layers {placement.start}:{placement.end} overlap stage {clash[0]}:{clash[1]} of training run "
                f"{self.options.train}: a replica serves a stage's exact range, or layers no replica holds"
            )
        self.record = PeerRecord(
            model=self.model, peer_id=self.swarm.peer_id, maddrs=reachable.maddrs,
            # a backup's claim adds no capacity while it loads, as after: others must not plan on it
            start=placement.start, end=placement.end, state=PeerState.BACKUP if placement.backup else PeerState.JOINING,
            compute_rate=bench.decode_rate, network_rate=network_rate, device=f"{self.options.device} ({bench.device_name})",
            batch_rate=bench.batch_rate, rtt=rtt, data_addrs=reachable.data_addrs,
            session_limit=self.options.session_limit, since=time.time(), weights=self.format.value, train_run=self.options.train,
        )
        await self.announce()
        if self.options.layers is None and not placement.backup:
            placement = await self._settle(placement)
        free = self._room()  # before the weights take their part
        stage = await self.load(placement.start, placement.end)
        self.server = StageServer(
            stage, self.swarm.transport, self.links, self.directory, self._serving_limits(stage, free), self.num_layers,
            self.options.session_limit, self.options.compression, self._decode_settings(bench), self.options.training_memory,
            metrics=self.metrics,
        )
        if self.options.train is not None:
            self.training = await join_run(
                self.swarm, self.model, self.options.train, stage, self.server, self.options.run_driver
            )
        await self.server.start()
        await self.announce(state=PeerState.BACKUP if placement.backup else PeerState.ONLINE)
        role = "a warm backup of" if placement.backup else "serving"
        log.info("%s layers %d:%d as %s", role, placement.start, placement.end, self.swarm.peer_id)

    async def _reachable(self, records: list[PeerRecord]) -> reach.Reach:
        """The addresses others reach this peer at, as a neighbour found by dialling them back
        (net/reach.py); the others are left out of its record, with a warning naming the fix. A
        ConfigError when there are none: nobody could use the layers it claimed."""
        transport = self.swarm.transport
        if transport.relayed:
            return await self._through_relays()
        neighbours = [(r.peer_id, r.data_addrs) for r in records if r.state != PeerState.OFFLINE]
        random.shuffle(neighbours)  # joiners spread their dial-backs over the swarm
        for maddr in transport.initial_peers:  # those it joined through: peers of other models answer too
            if "/p2p/" in maddr:
                neighbours.append((maddr.rsplit("/p2p/", 1)[1], []))
        seen, unique = {self.swarm.peer_id}, []
        for peer_id, addrs in neighbours:
            if peer_id not in seen:
                seen.add(peer_id)
                unique.append((peer_id, addrs))
        found = await reach.check(transport, unique, await self.swarm.maddrs(), transport.data_addrs)
        announced = self.options.announce_host
        fix = (
            f"Is {announced} (--announce-host) this host's address, and is the port open to other hosts?"
            if announced is not None else
            "Pass the address other hosts reach this one at with --announce-host (and forward the port behind a NAT)."
        )
        for failed in found.unreachable:
            log.warning("others cannot reach this peer at %s: %s (%s); it is left out of the peer's record. %s",
                        failed.address, failed.reason, found.checker, fix)
        where = "; ".join(f"{d.address}: {d.reason}" for d in found.unreachable)
        # neighbours reached none of its addresses (any left are loopback, which they do not dial):
        # a host behind a NAT, which relays can carry, unless its owner named the address to use
        checked = found.checker.startswith(reach.BY_NEIGHBOURS)
        if found.unreachable and not found.reached_any and checked and announced is None:
            listed = [(r.peer_id, r.maddrs) for r in records if r.state != PeerState.OFFLINE]
            joined = [(m.rsplit("/p2p/", 1)[1], [m]) for m in transport.initial_peers if "/p2p/" in m]
            raise BehindNat(f"no other peer reaches this one at any address it has ({where})",
                            circuits.relay_addresses(listed + joined, self.swarm.peer_id))
        if found.unreachable and not found.maddrs and not found.data_addrs:
            raise ConfigError(f"no address this peer announces can be reached ({where}; {found.checker}), "
                              f"so it claims no layers. {fix}")
        return found

    async def _through_relays(self) -> reach.Reach:
        """Behind a NAT: circuits through the relays it connected to (the swarm's other peers), once
        its daemon had time to ask them for slots (net/circuits.py). A fresh node's first reads
        may list few peers, so it reads again while it waits."""
        transport = self.swarm.transport
        deadline = time.monotonic() + circuits.slot_wait(len(transport.relays))
        while time.monotonic() < deadline:
            records, _ = await self.live_records()
            listed = [(r.peer_id, r.maddrs) for r in records if r.state != PeerState.OFFLINE]
            await circuits.connect_relays(transport.p2p, [p for p in listed if p[0] != self.swarm.peer_id])
            await asyncio.sleep(circuits.SLOT_POLL)
        relayed = await circuits.own_circuits(transport.p2p)
        if not relayed:
            raise ConfigError("others reach this peer at no address, and no relay answers it either: "
                              "open a port to it and pass --announce-host")
        log.info("behind a NAT: others reach this peer through relays (%s)", ", ".join(relayed))
        return reach.Reach(relayed, [], [], "relayed: not checked")

    def _room(self) -> int:
        """Bytes this peer may still fill: its budget less what it holds, or the device's free memory."""
        options = self.options
        if options.max_memory is None:
            return free_memory(options.device)
        return options.max_memory - (resident_bytes() if options.device == "cpu" else 0)

    def _serving_limits(self, stage: Stage, free: int) -> ServingLimits:
        """`free`: bytes the device had free before `stage` was loaded."""
        options, mib = self.options, 1 << 20
        total = options.cache_memory
        if total is None:
            weights = stage.parameter_bytes()
            total = default_cache_memory(free, weights)
            log.info(
                "sessions may reserve %.0f MiB of KV cache: half of the %.0f MiB free less %.0f MiB of weights "
                "(--cache-mib sets it)", total / mib, free / mib, weights / mib,
            )
        else:
            log.info("sessions may reserve %.1f MiB of KV cache", total / mib)
        budget = Budget(total, options.client_share, options.client_sessions, options.max_sessions)
        return ServingLimits(budget, options.idle_timeout, options.first_frame_timeout)

    async def _settle(self, placement: Placement) -> Placement:
        """Look again once our claim is visible: a peer that joined at the same moment may have
        claimed the same layers, and one of the two must choose again (`yields_to`)."""
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(random.uniform(*SETTLE_DELAY))
            records, _ = await self.live_records()
            others = [r for r in records if r.peer_id != self.swarm.peer_id]
            if not yields_to(others, self.record):
                break
            again = place_peer(others, self.num_layers, self.capacity, self.swarm.peer_id, near=self.links.round_trips())
            if again == placement:
                break
            log.info(
                "a peer that joined at the same moment claimed layers overlapping %d:%d; taking %d:%d%s instead",
                placement.start, placement.end, again.start, again.end, " as a backup" if again.backup else "",
            )
            placement = again
            await self.announce(start=again.start, end=again.end, state=PeerState.BACKUP if again.backup else PeerState.JOINING)
            if again.backup:
                break  # a backup claims no capacity: nobody yields to it, nor it to anybody
        return placement

    async def load(self, start: int, end: int):
        """Layers [start, end), sharing those the stage served now holds: a move reads the others only."""
        held = None if self.server is None else self.server.stage
        fresh = new_layers((0, 0) if held is None else (held.start, held.end), (start, end))
        kept = f" ({fresh} to read, the rest kept)" if fresh < end - start else ""
        log.info("loading layers %d:%d of %s%s", start, end, self.model, kept)
        t0 = time.perf_counter()
        options = self.options
        stage = await in_fresh_thread(
            load_stage, options.source, start, end, options.dtype, options.device, options.quant, held,
        )
        if fresh:
            self.reload_seconds_per_layer = (time.perf_counter() - t0) / fresh
        return stage

    async def announce(self, **changes) -> None:
        """Publish this peer's record (with any changes) to the DHT, and list its model."""
        old = self.record
        self.record = replace(old, **changes)
        new = self.record
        loaded = old.state == PeerState.JOINING and new.state in (PeerState.ONLINE, PeerState.BACKUP)
        if (new.start, new.end) != (old.start, old.end) or (new.state != old.state and not loaded):
            # finishing a load keeps the claim's time: joiners order their claims by it (yields_to)
            self.record = replace(new, since=time.time())
        await self.swarm.announce(self.record)
        if self.options.train is None:  # the list names the models served to clients; a replica serves none
            source = self.options.source
            await self.swarm.announce_model(ModelEntry(self.model, source.name, self.num_layers, self.config.hidden_size))

    async def move(self, start: int, end: int, overlap: bool, state: PeerState = PeerState.ONLINE) -> None:
        """Serve [start, end) instead, or with `state` BACKUP keep it warm instead. With `overlap`,
        the old range serves until the new one is loaded; a backup's serves nobody, so it always does."""
        old = (self.record.start, self.record.end)
        overlap = overlap or state == PeerState.BACKUP
        log.info("moving from layers %d:%d to %d:%d (%s)", *old, start, end, "overlapped" if overlap else "with a gap")
        # the record changes at once; its DHT write, which may wait on a silent node, goes on
        # while sessions drain and the layers load
        told = asyncio.ensure_future(
            self.announce(moving_to=(start, end)) if overlap
            else self.announce(start=start, end=end, state=PeerState.JOINING, moving_to=None)
        )
        try:
            if not overlap:
                await self.server.drain(self.options.drain_timeout)
            stage = await self.load(start, end)
        finally:
            await told
        self.server.stage = stage  # sessions opened on the old layers finish there
        self.server.draining = False
        await self.announce(start=start, end=end, state=state, moving_to=None)

    async def leave(self) -> None:
        """Announce offline first, so clients route around this peer, then let sessions finish."""
        if self.record is not None and self.record.state == PeerState.OFFLINE:
            return  # already left
        if self.record is not None:
            await self.announce(state=PeerState.OFFLINE, moving_to=None)
        if self.server is not None:
            await self.server.drain(self.options.drain_timeout)
            await self.server.stop()
        if self.training is not None:
            await self.training.stop()
        if self.exporter is not None:
            await asyncio.to_thread(self.exporter.close)
            self.exporter = None
