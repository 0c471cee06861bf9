"""A fleet simulator for placement: the real balancing policies (peer/balance.py, peer/rebalance.py)
run against hundreds of simulated volunteers, and compared with the best placement a solver finds.

`profiles.py`: the devices, links and models volunteers bring; `fleet.py`: drawing a fleet and
its comings and goings; `optimum.py`: a placement's pipeline throughput (its weakest layer) and
the best one (mixed-integer program, HiGHS through scipy); `swarm.py`: the swarm those policies build, as
peers join, rebalance and leave; `churn.py`: that swarm's life through crashes and arrivals, on
the peers' own timers. `scripts/sim_fleet.py` reports on it.
"""
