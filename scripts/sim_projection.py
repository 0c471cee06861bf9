#!/usr/bin/env python
"""FusionAI's projection in the fleet simulator: 50 RTX 3080-class volunteers against one server
of 4 H100s, serving the same model, and where the volunteers' throughput goes.

FusionAI projects that 50 RTX 3080s match 4 H100s in throughput when the work is placed well. For
each model (Llama 70B, int8 and int4) and each mix of upload links (home links drawn as in
scripts/sim_fleet.py, or fibre for every volunteer), over --seeds fleets (they differ in links and
regions), everything is a ratio to the server's throughput: its best placement (four peers whose
links, inside one server, never bound them), which is its summed compute spread over the layers.
For the volunteers:
- peak: their summed compute over the server's (sim/profiles.py: the same share of peak for both);
- links: the best placement their upload links allow (sim/optimum.py's LP bound, an upper bound);
- swarm: what the real policies place (joins, then rebalancing: sim/swarm.py), routed perfectly.
Where the rest goes: from peak to links, hidden states a volunteer cannot send fast enough; from
links to swarm, placement, of which the slowest stage (the weakest layer against the mean layer)
is the imbalance. Memory per peer costs hops, and throughput only through the links (a peer's
work is the lesser of its compute and the layers it holds times its upload rate): the table gives
the layers a volunteer holds and the fewest hops of a route through the settled swarm, against
the server's.
Usage: python scripts/sim_projection.py [--peers 50] [--servers 4] [--seeds 10] [--models llama-70b-int8,llama-70b-int4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass

from tqdm import tqdm

from p2pfusion.dht.coverage import layer_throughputs
from p2pfusion.sim.fleet import REGIONS, Volunteer, drawn_link, equipped
from p2pfusion.sim.optimum import best_placement
from p2pfusion.sim.profiles import DEVICES, H100, LINKS, MODELS, ModelShape, max_layers
from p2pfusion.sim.swarm import built, fewest_hops

RTX_3080 = next(d for d in DEVICES if d.name.startswith("RTX 3080"))
FIBRE = next(link for link in LINKS if link.name == "fibre")


@dataclass(frozen=True)
class Projection:
    links: float  # the volunteers' best placement under their links, over the server's throughput
    swarm: float  # the swarm's own placement, over the server's throughput
    slowest: float  # the swarm's weakest layer over its mean layer
    hops: int  # the fewest peers a route through the settled swarm passes


def one_fleet(peers: int, model: ModelShape, seed: int, fibre: bool, server: float) -> Projection:
    rng = random.Random(seed)
    fleet: list[Volunteer] = [
        equipped(f"v{i}", model, RTX_3080, FIBRE if fibre else drawn_link(rng), rng.randrange(REGIONS))
        for i in range(peers)
    ]
    swarm = built(fleet, model, rng)
    swarm.settle()
    records = list(swarm.records.values())
    sums = layer_throughputs(records, model.layers)
    bound = best_placement([v.capacity for v in fleet], model.layers, relax=True).bound
    return Projection(bound / server, min(sums) / server, min(sums) / statistics.mean(sums),
                      fewest_hops(records, model.layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=50, help="RTX 3080 volunteers")
    parser.add_argument("--servers", type=int, default=4, help="H100s in the server")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--models", default="llama-70b-int8,llama-70b-int4")
    args = parser.parse_args()
    if min(args.peers, args.servers, args.seeds) < 1:
        parser.error("--peers, --servers and --seeds must be at least 1")
    peak = args.peers * RTX_3080.tflops / (args.servers * H100.tflops)
    print(f"{args.peers} RTX 3080s against {args.servers} H100s: peak compute {peak:.2f} of the server's")
    lines, summary = [], []
    for name in args.models.split(","):
        model = MODELS[name]
        servers = [equipped(f"h{i}", model, H100, None, 0).capacity for i in range(args.servers)]
        server = best_placement(servers, model.layers).found
        held = min(max_layers(H100, model), model.layers)
        for fibre in (False, True):
            links = "fibre for all" if fibre else "home links"
            results = [one_fleet(args.peers, model, s, fibre, server)
                       for s in tqdm(range(args.seeds), desc=f"{name}, {links}", unit="fleet", file=sys.stderr)]
            lines.append(
                f"| {name} | {links} | {peak:.2f} | {_spread([r.links for r in results])} | "
                f"{_spread([r.swarm for r in results])} | {_spread([r.slowest for r in results])} | "
                f"{max_layers(RTX_3080, model)}, {_spread([r.hops for r in results], '.1f')} | {held}, {-(-model.layers // held)} |"
            )
            summary.append(f"{name} {links} {statistics.mean(r.swarm for r in results):.2f}")
    print("| model | volunteers' links | peak | links: best placement | the swarm's placement | "
          "slowest stage / mean layer | a 3080: layers, fewest hops | an H100: layers, fewest hops |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print(f"{args.peers} RTX 3080s against {args.servers} H100s, {args.seeds} seeds: the swarm carries "
          + ", ".join(summary) + " of the server's throughput")


def _spread(values: list[float], fmt: str = ".3f") -> str:
    """Mean (lowest to highest) over the seeds."""
    return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


if __name__ == "__main__":
    main()
