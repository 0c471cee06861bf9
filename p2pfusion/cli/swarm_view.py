"""`p2pfusion swarm`: every stage of a model, the peers serving it, what they claim and what we see."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

from p2pfusion.client.health import PeerHealth, load_observed, save_observed
from p2pfusion.client.probe import observe_peer
from p2pfusion.dht.records import PeerRecord, PeerState, span_throughput
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import ModelError
from p2pfusion.models.source import default_model_path, resolve_model
from p2pfusion.models.stage import load_config
from p2pfusion.peer.balance import layer_throughputs

log = logging.getLogger("p2pfusion")


@dataclass
class ModelView:
    model: str
    num_layers: int | None
    records: list[PeerRecord]
    observed: dict[str, float]

    def bottleneck(self) -> tuple[float, list[int]]:
        layers = self.num_layers or max((r.end for r in self.records), default=0)
        totals = layer_throughputs(self.records, layers)
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
        return {"model": self.model, "num_layers": self.num_layers, "peers": peers,
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
    lines = [f"model {view['model']} ({view['num_layers'] or '?'} layers)"]
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


def _local_model(model: str | None, listed: str | None):
    """The model's source and config when this machine has it (needed to probe), else None."""
    try:
        if model is not None:
            source = resolve_model(model)
        elif listed == default_model_path().stem.split(".")[0]:
            source = resolve_model(None)
        else:
            return None
        return source, load_config(source)
    except ModelError:
        return None  # listed without probing


async def show_swarm(args) -> None:
    swarm = await join_swarm(args.initial_peers, client_mode=True)
    try:
        local = _local_model(args.model, None) if args.model else None
        if args.model and local is None:
            models = [args.model]
        else:
            models = [local[0].name] if local else await swarm.models()
        views = []
        for name in models:
            found = local or _local_model(None, name)
            config = found[1] if found else None
            records = [r for r in await swarm.lookup(name) if r.state != PeerState.OFFLINE]
            health = PeerHealth(observed=load_observed(name))
            if config is not None and args.probe:
                for record in records:
                    try:
                        await observe_peer(swarm, record, config.hidden_size, health)
                    except Exception as exc:  # an unreachable peer shows with no fresh observation
                        log.warning("could not probe %s: %s", record.peer_id, exc)
                save_observed(name, health.observed)
            num_layers = config.num_hidden_layers if config is not None else None
            views.append(ModelView(name, num_layers, records, health.observed).to_dict())
    finally:
        await swarm.shutdown()
    if args.json:
        print(json.dumps({"models": views}, indent=2))
    else:
        print("\n\n".join(format_table(v) for v in views) if views else "no models are served in this swarm")
    sys.stdout.flush()
