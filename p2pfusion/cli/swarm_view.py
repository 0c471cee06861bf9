"""`p2pfusion swarm`: the models a swarm serves, each one's stages and peers, what they claim and what we see.

Models come from the DHT's shared model list (each peer lists its model there), so the view needs
no local copy of any model; `--model` picks one by swarm key, by display name, or by a local model
(a folder, `.gguf` file or Hub id) whose weights are hashed to find its key.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from p2pfusion.client.catalog import absent_model, describe
from p2pfusion.client.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.probe import observe_peer
from p2pfusion.dht.records import ModelEntry, PeerRecord, PeerState, span_throughput
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import P2PFusionError, RouteError
from p2pfusion.models.source import resolve_model
from p2pfusion.peer.balance import layer_throughputs

log = logging.getLogger("p2pfusion")


@dataclass
class ModelView:
    entry: ModelEntry
    records: list[PeerRecord]
    observed: dict[str, float]

    def bottleneck(self) -> tuple[float, list[int]]:
        totals = layer_throughputs(self.records, self.entry.num_layers)
        low = min(totals, default=0.0)
        return low, [i for i, t in enumerate(totals) if t == low]

    def to_dict(self) -> dict:
        low, where = self.bottleneck()
        peers = []
        for r in sorted(self.records, key=lambda r: (r.start, r.end, r.state.value, r.peer_id)):
            seen = self.observed.get(r.peer_id)
            peers.append({
                "peer_id": r.peer_id, "layers": [r.start, r.end], "state": r.state.value, "device": r.device,
                "advertised_tokens_per_s": round(r.throughput, 2),
                "observed_tokens_per_s": None if seen is None else round(span_throughput(seen, None, r.span), 2),
                "load_tokens_per_s": round(r.load, 2),
                "moving_to": list(r.moving_to) if r.moving_to else None,
            })
        return {"model": self.entry.name, "key": self.entry.key, "num_layers": self.entry.num_layers, "peers": peers,
                "bottleneck_tokens_per_s": round(low, 2), "bottleneck_layers": _ranges(where)}


def _ranges(layers: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for layer in layers:
        if out and out[-1][1] == layer:
            out[-1][1] = layer + 1
        else:
            out.append([layer, layer + 1])
    return out


def format_table(view: dict) -> str:
    count = len(view["peers"])
    lines = [f"model {view['model']} (key {view['key']}, {view['num_layers']} layers, {count} peer{'s' * (count != 1)})"]
    header = f"  {'layers':>8}  {'state':<8} {'advertised':>10} {'observed':>9} {'load':>6}  {'device':<28} peer"
    lines.append(header)
    for p in view["peers"]:
        observed = "-" if p["observed_tokens_per_s"] is None else f"{p['observed_tokens_per_s']:.1f}"
        moving = f" -> {p['moving_to'][0]}:{p['moving_to'][1]}" if p["moving_to"] else ""
        lines.append(
            f"  {p['layers'][0]:>3}:{p['layers'][1]:<4}  {p['state']:<8} {p['advertised_tokens_per_s']:>10.1f} "
            f"{observed:>9} {p['load_tokens_per_s']:>6.1f}  {p['device'][:28]:<28} {p['peer_id']}{moving}"
        )
    where = ", ".join(f"{a}:{b}" for a, b in view["bottleneck_layers"])
    lines.append(f"  bottleneck: {view['bottleneck_tokens_per_s']:.1f} tokens/s at layers {where}")
    return "\n".join(lines)


def chosen_models(model: str, listed: list[ModelEntry]) -> list[ModelEntry]:
    """The listed models that `model` names: by swarm key or display name, else a local model
    matched by its weights. None listed is a RouteError naming those the swarm serves."""
    named = [e for e in listed if model in (e.key, e.name)]
    if named:
        return named
    if "/" not in model and not Path(model).expanduser().exists():  # neither a path nor a Hub id
        raise RouteError(f"the swarm serves no model named {model}; it serves: {describe(listed)}")
    source = resolve_model(model)
    same = [e for e in listed if e.key == source.key]
    if not same:
        raise absent_model(source.name, source.key, listed)
    return same


async def show_swarm(args) -> None:
    swarm = await join_swarm(args.initial_peers, client_mode=True)
    try:
        listed = await swarm.models()
        entries = listed if args.model is None else chosen_models(args.model, listed)
        views = []
        for entry in entries:
            records = [r for r in await swarm.lookup(entry.key) if r.state != PeerState.OFFLINE]
            health = PeerHealth(observed=load_observed(entry.key))
            if args.probe:
                for record in records:
                    try:
                        await observe_peer(swarm, record, entry.hidden_size, health)
                    except (P2PFusionError, OSError, TimeoutError) as exc:  # shown with no fresh observation
                        log.warning("could not probe %s: %s", record.peer_id, exc)
                save_observed(entry.key, health.observed)
            views.append(ModelView(entry, records, health.observed).to_dict())
    finally:
        await swarm.shutdown()
    if args.json:
        print(json.dumps({"models": views}, indent=2))
    else:
        print("\n\n".join(format_table(v) for v in views) if views else "no models are served in this swarm")
    sys.stdout.flush()
