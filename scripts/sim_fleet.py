#!/usr/bin/env python
"""How close the swarm's own placement comes to the best one, on simulated fleets of volunteers.

For each seed, a fleet of --peers volunteers is drawn (p2pfusion/sim/profiles.py: devices from
RTX 3060 to A100, Apple and CPU-only machines, home and fibre links, three regions) for each model
(Llama 70B in int8 and int4, 80 layers). They join in random order, each placing itself with the
real policy (peer/balance.py's place_peer, with its round trips to a dozen peers), then rebalance
with the real plan_move until nobody moves (p2pfusion/sim/swarm.py). Demand is saturated. The
swarm's throughput is the maximum flow through its serving peers' ranges (routing done
perfectly); the optimum is the best placement of the same fleet (p2pfusion/sim/optimum.py: a
mixed-integer program solved by HiGHS; for fleets over --exact-up-to peers, its linear relaxation,
an upper bound, so the ratios printed are at most what they would be against the true optimum).
For the first seed it also times the `/v1/swarm` view of the swarm (client/survey.py), on stderr.
Usage: python scripts/sim_fleet.py --peers 100 --seeds 30 [--models llama-70b-int8,llama-70b-int4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from p2pfusion.client.survey import ModelView
from p2pfusion.dht.records import ModelEntry
from p2pfusion.sim.fleet import draw_fleet
from p2pfusion.dht.flow import swarm_flow
from p2pfusion.sim.optimum import best_placement
from p2pfusion.sim.profiles import MODELS
from p2pfusion.sim.swarm import built


def one_seed(peers: int, model, seed: int, exact_up_to: int) -> tuple[float, float, bool]:
    rng = random.Random(seed)
    fleet = draw_fleet(peers, model, rng)
    swarm = built(fleet, model, rng)
    joined = swarm_flow(swarm.records.values(), model.layers)
    swarm.settle()
    settled = swarm_flow(swarm.records.values(), model.layers)
    if seed == 0:
        view_time(list(swarm.records.values()), model)
    best = best_placement([v.capacity for v in fleet], model.layers, relax=peers > exact_up_to)
    reference = best.found if best.exact else best.bound
    return joined / reference, settled / reference, best.exact


def view_time(records: list, model) -> None:
    """How long the `/v1/swarm` JSON's model view (client/survey.py) takes to build for this swarm."""
    view = ModelView(ModelEntry("sim", model.name, model.layers, model.hidden), records, {})
    t0 = time.perf_counter()
    runs = 5
    for _ in range(runs):
        json.dumps(view.to_dict())
    print(f"{model.name}: the /v1/swarm view of {len(records)} peers builds in "
          f"{1000 * (time.perf_counter() - t0) / runs:.1f} ms", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--models", default="llama-70b-int8,llama-70b-int4")
    parser.add_argument("--exact-up-to", type=int, default=20, help="largest fleet solved as an integer program")
    args = parser.parse_args()
    settled_all = []
    for name in args.models.split(","):
        model = MODELS[name]
        t0 = time.perf_counter()
        results = [one_seed(args.peers, model, seed, args.exact_up_to) for seed in range(args.seeds)]
        joined = [r[0] for r in results]
        settled = [r[1] for r in results]
        settled_all += settled
        against = "the optimum" if all(r[2] for r in results) else "the optimum's LP bound"
        print(f"{name}, {args.peers} peers, {args.seeds} seeds, against {against}: after joins mean "
              f"{statistics.mean(joined):.3f} (worst {min(joined):.3f}); after rebalancing mean "
              f"{statistics.mean(settled):.3f} (worst {min(settled):.3f}) [{time.perf_counter() - t0:.0f} s]")
        sys.stdout.flush()
    print(f"{args.peers} peers, {args.seeds} seeds: mean {statistics.mean(settled_all):.2f}, "
          f"worst {min(settled_all):.2f} of the optimum")


if __name__ == "__main__":
    main()
