"""What a user's machine runs to use the swarm; it meets the peers only through `net/` and `dht/`.

Rooms, from the bottom up; each imports only the rooms below it (tests/test_import_rule.py):
- `route/`: routes of peers and the sessions over them: choosing a route, one route's session,
  failing over, what the client knows of peers and believes of their claims.
- `checks/`: checking peers' results against other peers, and whom the client stops trusting.
- the modules here: `options.py` (ClientOptions), `core.py` (ClientCore, the one place a client is
  assembled), `loop.py` (the asyncio thread behind the synchronous APIs), `survey.py` (the
  swarm's view for `p2pfusion swarm` and the web page).
- `tune/`: fine-tuning an adapter through the swarm's frozen layers (AutoDistributedModelForCausalLM).
- `run/`: driving a training run of the swarm's own weights (SwarmTrainer).
- `generate/`: generating text (RemoteCausalLM, Conversation, SwarmLM).

A decode step's path: `generate/swarm_lm.py` (SwarmLM.generate) -> `generate/causal_lm.py`
(RemoteCausalLM.generate) -> `generate/conversation.py` (Conversation.generate: embed the token,
step, choose the next) -> `route/failover.py` (ResilientSession.step: replay around a failed peer)
-> `route/session.py` (RouteSession.step: frames to the first hop, results from the last).
"""
