"""p2pfusion: serve and run large language models over a peer-to-peer swarm.

Everything a user's code needs is imported from here (docs/python_api.md, docs/finetuning.md,
docs/training.md); the modules behind these names are the package's own business and may move.
Names load on first use: torch and transformers are slow to import, and the CLI rarely needs them.
"""

import importlib
import logging

__version__ = "0.1.0"

# Importing torchao (transformers does whenever it is installed) logs that kernels for GPUs this
# machine lacks failed to load, and torch logs deprecations of its compiler's internals: nothing a
# user can act on, read as a broken install. Quiet unless the user set these loggers' levels.
for _noisy in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_noisy).level == logging.NOTSET:
        logging.getLogger(_noisy).setLevel(logging.ERROR)
del _noisy

_EXPORTS = {
    # generating: many sessions from asyncio code or threads, or the engine itself
    "SwarmLM": "p2pfusion.client.generate.swarm_lm",
    "SwarmLMSync": "p2pfusion.client.generate.swarm_lm",
    "TokenStream": "p2pfusion.client.generate.swarm_lm",
    "Piece": "p2pfusion.client.generate.swarm_lm",
    "Correction": "p2pfusion.client.generate.swarm_lm",
    "Generated": "p2pfusion.client.generate.conversation",
    "Conversation": "p2pfusion.client.generate.conversation",
    "RemoteCausalLM": "p2pfusion.client.generate.causal_lm",
    # the client every front end builds on, and its options
    "ClientOptions": "p2pfusion.client.options",
    "ClientCore": "p2pfusion.client.core",
    "connect": "p2pfusion.client.core",
    "Codec": "p2pfusion.net.compression",
    "AUTO": "p2pfusion.net.compression",
    "WeightFormat": "p2pfusion.models.formats",
    # fine-tuning through the swarm's frozen layers
    "AutoDistributedModelForCausalLM": "p2pfusion.client.tune.distributed",
    "Adapter": "p2pfusion.client.tune.adapter",
    "TuningConfig": "p2pfusion.client.tune.adapter",
    # training the swarm's own weights
    "SwarmTrainer": "p2pfusion.client.run.trainer",
    "RunConfig": "p2pfusion.client.run.driver",
    # what goes wrong, by whose move it is (p2pfusion/errors.py)
    **{name: "p2pfusion.errors" for name in (
        "P2PFusionError", "ModelError", "ConfigError", "ProofError", "RouteError", "RequestError", "PromptTooLong",
        "PeerFailed", "PeerBusy",
    )},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pfusion' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
