#!/usr/bin/env python
"""How close the swarm's own placement comes to the best one, on simulated fleets of volunteers.

For each seed, a fleet of --peers volunteers is drawn (p2pfusion/sim/profiles.py: devices from
RTX 3060 to A100, Apple and CPU-only machines, home and fibre links, three regions) for each model
(Llama 70B in int8 and int4, 80 layers). They join in random order, each placing itself with the
real policy (peer/balance.py's place_peer, with its round trips to a dozen peers), then rebalance
with the real plan_move until nobody moves (p2pfusion/sim/swarm.py). Demand is saturated. The
swarm's throughput is its weakest layer's, the serving peers' rates summed (routing done
perfectly: routes may leave a peer early, so that is the maximum flow, peer/balance.py); the
optimum is the best placement of the same fleet (p2pfusion/sim/optimum.py: a mixed-integer program
solved by HiGHS; for fleets over --exact-up-to peers, its linear relaxation,
an upper bound, so the ratios printed are at most what they would be against the true optimum).
For the first seed it also times the `/v1/swarm` view of the swarm (client/survey.py), on stderr.
With --search-seconds, a central search then moves one peer at a time from the settled placement
(any range, no least gain, no reload cost) while that raises the flow or its weakest layers: a
placement no worse than the swarm's, so a lower bound on the optimum beside the LP's upper one.
With --churn-hours, each settled swarm then lives through that many simulated hours of crashes and
arrivals (p2pfusion/sim/churn.py): its flow against the live fleet's LP bound every 10 minutes,
every stretch in which a layer went unserved, and how many distinct ranges are served and how many
peers load layers, on average.
Each seed's figures go to stderr as it ends (a seed of 1,000 peers takes minutes), beside a
progress bar; --first-seed starts the seeds further on, to add seeds to an earlier run's, and
--jobs simulates that many seeds at once, a process each.
Usage: python scripts/sim_fleet.py --peers 100 --seeds 30 [--first-seed 0] [--models llama-70b-int8,llama-70b-int4]
       [--churn-hours 2] [--search-seconds 600] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial

from tqdm import tqdm

from p2pfusion.client.survey import ModelView
from p2pfusion.dht.records import ModelEntry
from p2pfusion.peer.balance import bottleneck
from p2pfusion.sim.churn import SESSION_MEDIAN, Timeline
from p2pfusion.sim.fleet import draw_fleet, newcomer
from p2pfusion.sim.optimum import best_placement, searched
from p2pfusion.sim.profiles import MODELS
from p2pfusion.sim.swarm import built

CHURN_SAMPLE = 600.0  # seconds of simulated time between samples of a churn trace


@dataclass
class Seed:
    joined: float  # the swarm's flow over the optimum's after every volunteer joined
    settled: float  # ... and after rebalancing
    exact: bool  # the optimum is the integer program's (else its relaxation's bound)
    searched: float | None = None  # what a central search reached from the settled placement, the same way
    churned: list[float] = field(default_factory=list)  # sampled over the churn trace
    ranges: list[int] = field(default_factory=list)  # distinct ranges served, at each sample
    loading: list[int] = field(default_factory=list)  # peers loading layers (joins, moves), at each sample
    gaps: list[float] = field(default_factory=list)  # seconds some layer went unserved, each time


def one_seed(
    peers: int, model, seed: int, exact_up_to: int, churn_hours: float, time_view: bool = False, search: float = 0.0,
) -> Seed:
    rng = random.Random(seed)
    fleet = draw_fleet(peers, model, rng)
    swarm = built(fleet, model, rng)
    joined = bottleneck(swarm.records.values(), model.layers)
    swarm.settle()
    settled = bottleneck(swarm.records.values(), model.layers)
    if time_view:
        view_time(list(swarm.records.values()), model)
    best = best_placement([v.capacity for v in fleet], model.layers, relax=peers > exact_up_to)
    reference = best.found if best.exact else best.bound
    result = Seed(joined / reference, settled / reference, best.exact)
    if search > 0:
        ranges = [(r.start, r.end) if (r := swarm.records[v.peer_id]).serving else None for v in fleet]
        flow, _ = searched([v.capacity for v in fleet], ranges, model.layers, search, random.Random(seed))
        result.searched = flow / reference
    if churn_hours > 0:
        timeline = Timeline(swarm, lambda peer_id: newcomer(peer_id, model, rng))
        timeline.start()

        def sample(t: Timeline) -> None:
            result.churned.append(t.flow() / best_placement(t.live_capacities(), model.layers, relax=True).bound)
            result.ranges.append(len(set(t.serving.values())))
            result.loading.append(len(t.busy))

        timeline.run_until(churn_hours * 3600, CHURN_SAMPLE, sample)
        result.gaps = timeline.gaps
    return result


def timed_seed(
    seed: int, first: int, peers: int, model, exact_up_to: int, churn_hours: float, search: float,
) -> tuple[Seed, float]:
    """`one_seed`, and the seconds it took; the first seed of a run also times the swarm's view."""
    started = time.perf_counter()
    result = one_seed(peers, model, seed, exact_up_to, churn_hours, seed == first, search)
    return result, time.perf_counter() - started


def results_of(work, seeds: range, jobs: int):
    """Each seed's `work`, in the seeds' order, `jobs` seeds at a time."""
    if jobs == 1:
        yield from map(work, seeds)
        return
    with multiprocessing.Pool(min(jobs, len(seeds))) as pool:
        yield from pool.imap(work, seeds)


def view_time(records: list, model) -> None:
    """How long the `/v1/swarm` JSON's model view (client/survey.py) takes to build for this swarm."""
    view = ModelView(ModelEntry("sim", model.name, model.layers, model.hidden), records, {})
    t0 = time.perf_counter()
    runs = 5
    for _ in range(runs):
        json.dumps(view.to_dict())
    print(f"{model.name}: the /v1/swarm view of {len(records)} peers builds in "
          f"{1000 * (time.perf_counter() - t0) / runs:.1f} ms", file=sys.stderr)


def report_churn(name: str, results: list[Seed], hours: float) -> None:
    means = [statistics.mean(r.churned) for r in results]
    lows = [min(r.churned) for r in results]
    gaps = [g for r in results for g in r.gaps]
    print(f"{name}, over {hours:g} h of churn (sessions: median {SESSION_MEDIAN / 3600:g} h), against the live "
          f"fleet's LP bound every {CHURN_SAMPLE / 60:.0f} min: mean {statistics.mean(means):.3f} (worst seed's mean "
          f"{min(means):.3f}, lowest sample {min(lows):.3f}); a layer unserved {len(gaps)} times, longest "
          f"{max(gaps, default=0.0):.0f} s, {sum(gaps) / len(results):.0f} s per seed in all; on average "
          f"{statistics.mean(n for r in results for n in r.ranges):.1f} distinct ranges served and "
          f"{statistics.mean(n for r in results for n in r.loading):.1f} peers loading layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed's number")
    parser.add_argument("--models", default="llama-70b-int8,llama-70b-int4")
    parser.add_argument("--churn-hours", type=float, default=0.0, help="then volunteers come and go this long")
    parser.add_argument("--exact-up-to", type=int, default=20, help="largest fleet solved as an integer program")
    parser.add_argument("--search-seconds", type=float, default=0.0,
                        help="then a central search moves one peer at a time from the settled placement, this long at most")
    parser.add_argument("--jobs", type=int, default=1, help="seeds simulated at once, one process each")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    settled_all = []
    for name in args.models.split(","):
        model = MODELS[name]
        t0 = time.perf_counter()
        results = []
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        work = partial(timed_seed, first=args.first_seed, peers=args.peers, model=model, exact_up_to=args.exact_up_to,
                       churn_hours=args.churn_hours, search=args.search_seconds)
        with tqdm(seeds, desc=name, unit="seed", file=sys.stderr) as bar:
            for seed, (result, seconds) in zip(bar, results_of(work, seeds, args.jobs)):
                results.append(result)
                search = "" if result.searched is None else f", a central search from there {result.searched:.3f}"
                churn = "" if not result.churned else (
                    f", over churn {statistics.mean(result.churned):.3f} (lowest {min(result.churned):.3f})")
                bar.write(f"{name} seed {seed}: after joins {result.joined:.3f}, after rebalancing "
                          f"{result.settled:.3f}{search}{churn} ({seconds:.0f} s)", file=sys.stderr)
        joined = [r.joined for r in results]
        settled = [r.settled for r in results]
        settled_all += settled
        against = "the optimum" if all(r.exact for r in results) else "the optimum's LP bound"
        print(f"{name}, {args.peers} peers, {args.seeds} seeds, against {against}: after joins mean "
              f"{statistics.mean(joined):.3f} (worst {min(joined):.3f}); after rebalancing mean "
              f"{statistics.mean(settled):.3f} (worst {min(settled):.3f}) [{time.perf_counter() - t0:.0f} s]")
        if args.search_seconds > 0:
            found = [r.searched for r in results]
            print(f"{name}: a central search from the settled placements reached mean {statistics.mean(found):.3f} "
                  f"(worst {min(found):.3f}); the swarm's own over it: mean "
                  f"{statistics.mean(r.settled / r.searched for r in results):.3f}")
        if args.churn_hours > 0:
            report_churn(name, results, args.churn_hours)
        sys.stdout.flush()
    print(f"{args.peers} peers, {args.seeds} seeds: mean {statistics.mean(settled_all):.2f}, "
          f"worst {min(settled_all):.2f} of the optimum")


if __name__ == "__main__":
    main()
