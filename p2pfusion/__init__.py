"""p2pfusion: serve and run large language models over a peer-to-peer swarm."""

__version__ = "0.1.0"

__all__ = ["AutoDistributedModelForCausalLM", "SwarmLM", "SwarmLMSync", "SwarmTrainer"]


def __getattr__(name: str):
    # imported on first use: torch and transformers are slow to import, and the CLI rarely needs this
    if name == "AutoDistributedModelForCausalLM":
        from p2pfusion.client.tune.distributed import AutoDistributedModelForCausalLM

        return AutoDistributedModelForCausalLM
    if name in ("SwarmLM", "SwarmLMSync"):
        from p2pfusion.client.generate import swarm_lm

        return getattr(swarm_lm, name)
    if name == "SwarmTrainer":
        from p2pfusion.client.run.trainer import SwarmTrainer

        return SwarmTrainer
    raise AttributeError(f"module 'p2pfusion' has no attribute {name!r}")
