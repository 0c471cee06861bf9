"""p2pfusion: serve and run large language models over a peer-to-peer swarm."""

__version__ = "0.1.0"

__all__ = ["AutoDistributedModelForCausalLM"]


def __getattr__(name: str):
    # imported on first use: torch and transformers are slow to import, and the CLI rarely needs this
    if name == "AutoDistributedModelForCausalLM":
        from p2pfusion.client.model import AutoDistributedModelForCausalLM

        return AutoDistributedModelForCausalLM
    raise AttributeError(f"module 'p2pfusion' has no attribute {name!r}")
