"""Fine-tuning through the swarm's frozen layers: the client trains an adapter, peers apply it.

`adapter.py`: the trainable parameters and their PEFT files; `steps.py`: forward and backward
passes with failover; `layers.py`: the swarm as an autograd function; `distributed.py`:
AutoDistributedModelForCausalLM, a transformers model whose decoder is the swarm.
"""
