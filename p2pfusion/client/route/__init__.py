"""Routes of peers, and the sessions a client runs over them.

`planner.py` (pure): which chain of peers serves a session; `pieces.py` (pure): how a step's
tensors are cut to fit the peers; `session.py`: one session over one route; `failover.py`: a
session that outlives its peers; `access.py`: what a client's sessions share (`SwarmAccess`);
`params.py`: the session's trainable parameters as hops get them; `health.py`: bans, busy peers
and observed speeds; `pings.py`: whether a peer answers; `claims.py` (pure): what a hop's frames
may claim; `allowlist.py` (pure): routing only through trusted peers; `catalog.py`: a model's records;
`tasks.py`: coroutines that succeed or fail together.
"""
