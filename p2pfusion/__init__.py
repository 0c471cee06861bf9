"""p2pfusion: serve and run large language models over a peer-to-peer swarm.

Everything a user's code needs is imported from here (docs/python_api.md, docs/finetuning.md,
docs/training.md); the modules behind these names are the package's own business and may move.
Names load on first use: torch and transformers are slow to import, and the CLI rarely needs them.
"""

import importlib
import logging
import os
import sys

__version__ = "0.1.0"

# Peers and clients idle while other stages compute, often on the same cores. After each parallel
# op, libgomp's threads spin before they sleep: by default 300,000 pauses, 6 ms of a core on an
# Intel Xeon VM (0.4 ms with 10,000), so a client's head held a core through the first peer's step
# there (20 ms against 16 for the others, docs/benchmarks.md). 10,000 keeps the threads warm
# between one step's ops; never spinning (OMP_WAIT_POLICY=PASSIVE) made batch steps 18% slower.
# libgomp reads it when torch loads: code that imported torch first keeps its own.
if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

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
