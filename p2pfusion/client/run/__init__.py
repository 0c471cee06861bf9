"""Driving a training run of the swarm's own weights (docs/training.md).

`replicas.py` (pure): which replicas a step's micro-batches go through; `driver.py`: the run's
steps and outer steps; `trainer.py`: SwarmTrainer, the synchronous API.
"""
