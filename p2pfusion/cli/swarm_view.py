"""`p2pfusion swarm`: the models a swarm serves, each one's stages and peers, what they claim and what we see.

Models come from the DHT's shared model list (each peer lists its model there), so the view needs
no local copy of any model; `--model` picks one by swarm key, by display name, or by a local model
(a folder, `.gguf` file or Hub id) whose weights are hashed to find its key. The view itself, and
its JSON, come from client/survey.py, which the HTTP API's dashboard serves too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from p2pfusion.client.route.catalog import absent_model, describe
from p2pfusion.client.survey import SwarmStatus
from p2pfusion.dht.records import ModelEntry
from p2pfusion.dht.swarm import join_swarm
from p2pfusion.errors import RouteError
from p2pfusion.models.source import resolve_model
from p2pfusion.net.secret import load_secret

MIB = 1 << 20
MAX_DEVICE = 48  # characters of a device's name in the table (the JSON has it whole)


def _spans(runs: list[list[int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in runs)


def _role(peer: dict) -> str:
    if peer["backup_for"] is not None:
        backed = len(peer["backup_for"])
        return f"backup of {backed} peer{'s' * (backed != 1)}" if backed else "backup, stage lost"
    backups = peer["backed_up_by"] or []
    return f"{len(backups)} backup{'s' * (len(backups) != 1)}" if backups else "-"


def _cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut at a word's end, with an ellipsis when cut."""
    if len(text) <= width:
        return text
    head = text[:width - 1]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + "…"


def format_table(view: dict) -> str:
    count = len(view["peers"])
    lines = [f"model {view['model']} (key {view['key']}, {view['num_layers']} layers, {count} peer{'s' * (count != 1)})"]
    role_width = max([len("role"), *(len(_role(p)) for p in view["peers"])])
    device_width = min(max([len("device"), *(len(p["device"]) for p in view["peers"])]), MAX_DEVICE)
    header = (
        f"  {'layers':>8}  {'state':<11} {'advertised':>10} {'observed':>9} {'load':>6} {'sessions':>8} "
        f"{'cache MiB':>11}  {'role':<{role_width}} {'format':<8} {'device':<{device_width}} peer"
    )
    lines.append(header)
    for p in view["peers"]:
        observed = "-" if p["observed_tokens_per_s"] is None else f"{p['observed_tokens_per_s']:.1f}"
        moving = f" -> {p['moving_to'][0]}:{p['moving_to'][1]}" if p["moving_to"] else ""
        cache = f"{p['cache_used'] / MIB:.0f}/{p['cache_total'] / MIB:.0f}" if p["cache_total"] else "-"
        lines.append(
            f"  {p['layers'][0]:>3}:{p['layers'][1]:<4}  {p['state']:<11} {p['advertised_tokens_per_s']:>10.1f} "
            f"{observed:>9} {p['load_tokens_per_s']:>6.1f} {p['sessions']:>8} {cache:>11}  {_role(p):<{role_width}} {p['weights']:<8} "
            f"{_cut(p['device'], device_width):<{device_width}} {p['peer_id']}{moving}"
        )
    for p in view["peers"]:
        if p["unreachable"] is not None:
            lines.append(f"  unreachable: {p['peer_id']} ({p['claimed_state']}, layers {p['layers'][0]}:{p['layers'][1]}): "
                         f"{p['unreachable']}")
    if view["gaps"]:
        claimed = view["unreachable_claims"]
        lines.append(f"  not served: layers {_spans(view['gaps'])}"
                     + (f" (listed peers claim {_spans(claimed)}, but cannot be reached)" if claimed else ""))
    lines.append(
        f"  bottleneck: {view['bottleneck_tokens_per_s']:.1f} tokens/s at layers {_spans(view['bottleneck_layers'])}"
    )
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
    swarm = await join_swarm(args.initial_peers, client_mode=True, secret=load_secret(args.swarm_secret))
    try:
        choose = None if args.model is None else (lambda listed: chosen_models(args.model, listed))
        views = await SwarmStatus(swarm).views(choose, probe=args.probe)
    finally:
        await swarm.shutdown()
    if args.json:
        print(json.dumps({"models": views}, indent=2))
    else:
        print("\n\n".join(format_table(v) for v in views) if views else "no models are served in this swarm")
    sys.stdout.flush()
