"""How a client uses the swarm: one typed set of options, which every front end (the CLI's infer,
chat and api, SwarmLM, the fine-tuning model, a training run's driver) builds its client from
(client/core.py).

Options are parsed once, here: a field given as a user would write it (a codec's name, a file's
path, a format's name) is read into its type when the options are made, and a bad one is a
one-line error then, before any model loads or any peer is asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2pfusion.client.checks.policy import DEFAULT_RATE, check_rate
from p2pfusion.client.route.allowlist import trusted_peers
from p2pfusion.errors import RequestError
from p2pfusion.models.formats import DTYPES, WeightFormat, minimum_format
from p2pfusion.net.compression import AUTO, Auto, Codec, Compression, parse_compression
from p2pfusion.net.secret import SwarmSecret, load_secret


@dataclass(frozen=True)
class ClientOptions:
    # the codec hidden states travel in on every link, or AUTO: each link's own choice
    compression: Compression = AUTO
    verify: float = DEFAULT_RATE  # chance a step's results are checked against other peers; a generation's end always is
    dtype: torch.dtype = torch.float32  # of the client's hidden states and its local parts
    swarm_secret: SwarmSecret | None = None  # a private swarm's (given as the secret file's path)
    # the only peers routes, failovers and checks may use (given as a trusted-peers file's path, or
    # peer ids or multiaddrs naming them); None: any peer
    trusted_peers: frozenset[str] | None = None
    local_layers: int = 0  # run at least the first K layers on the client (generate/local_layers.py)
    min_precision: WeightFormat = WeightFormat.INT4  # the least precise weight format a route may use
    screen_head: bool = True  # greedy tokens through the float16 screen of the LM head (generate/screen.py)
    canaries: float = 0.0  # chance a generation is followed by a canary session (client/generate/canary.py)
    # "auto": speculative decoding (client/generate/draft.py) where the layers can drop rejected drafts; "off"
    speculate: str = "auto"
    # a small model with the same tokenizer that drafts for speculative decoding (client/generate/draft_model.py),
    # as a folder, .gguf file or Hub id; None: drafts are looked up in the text
    draft_model: str | None = None

    def __post_init__(self):
        read = {
            "compression": _compression(self.compression),
            "verify": check_rate(self.verify),
            "dtype": _dtype(self.dtype),
            "swarm_secret": load_secret(self.swarm_secret),
            "trusted_peers": trusted_peers(self.trusted_peers),
            "local_layers": _whole(self.local_layers, "local_layers"),
            "min_precision": minimum_format(self.min_precision),
            "screen_head": _flag(self.screen_head, "screen_head"),
            "canaries": check_rate(self.canaries, "canaries"),
            "speculate": _choice(self.speculate, "speculate", ("auto", "off")),
            "draft_model": _draft_model(self.draft_model, self.speculate),
        }
        for name, value in read.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, options: ClientOptions | None = None, settings: Mapping[str, Any] | None = None) -> ClientOptions:
        """`options`, or options made of `settings` (a front end's keyword arguments), not both."""
        settings = dict(settings or {})
        if options is not None and settings:
            raise RequestError(f"pass options= or settings ({', '.join(settings)}), not both")
        if options is not None:
            if not isinstance(options, ClientOptions):
                raise RequestError("options must be a ClientOptions")
            return options
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise RequestError(f"unknown client option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return cls(**settings)


def _compression(value: object) -> Compression:
    if isinstance(value, (Codec, Auto)):
        return value
    if isinstance(value, str):
        try:
            return parse_compression(value)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
    raise RequestError(f"compression is a codec's name or 'auto', got {value!r}")


def _dtype(value: object) -> torch.dtype:
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if value not in DTYPES.values():
        raise RequestError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    return value


def _whole(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"{name} is a whole number of layers (0: none), got {value!r}")
    return value


def _choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise RequestError(f"{name} is one of {', '.join(choices)}, got {value!r}")
    return value


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} is True or False, got {value!r}")
    return value


def _draft_model(value: object, speculate: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise RequestError("draft_model must be a model's folder, .gguf file or Hub id")
    if speculate == "off":
        raise RequestError("a draft model drafts for speculative decoding: it needs speculate \"auto\", not \"off\"")
    return str(value)
