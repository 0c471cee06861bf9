"""Generating text through the swarm.

`causal_lm.py`: RemoteCausalLM, what a client's generations share; `conversation.py`: one
generation loop over a session kept across turns; `swarm_lm.py`: SwarmLM and SwarmLMSync, the
Python APIs; `lockstep.py`: decoding sessions stepping in cohorts; `screen.py` (pure) and
`greedy.py`: greedy tokens from the LM head; `sampling.py`, `stops.py`, `text.py`: choosing
tokens, stop strings, text as tokens arrive; `local_layers.py`: the first layers run here.
"""
