"""Checking peers' results, and whom a client stops routing through.

`policy.py` (pure): tolerances, who is at fault, checking routes; `verifier.py`: a session's
results compared with another route's, and the hop at fault found; `distrust.py`: the peers other
clients' fault reports accuse.
"""
