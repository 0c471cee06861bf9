"""What a peer accepts from the streams it serves: frame sizes per stream, sized to its stage, and
the timeouts and budgets that bound what one client may hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from p2pfusion.models.tuning import MAX_PROMPT_TOKENS, MAX_RANK
from p2pfusion.models.stage import Stage
from p2pfusion.net import messages as m
from p2pfusion.net.framing import FrameLimits
from p2pfusion.net.receipts import RECEIPT_BYTES
from p2pfusion.peer.admission import Budget, kv_bytes_per_token
from p2pfusion.peer.compute import PREFILL_CHUNK

HEADER_BYTES = 256 << 10
# an Open naming the longest route allowed, each hop with all its addresses, fits
FIRST_HEADER_BYTES = 512 << 10
BODY_SLACK = 64 << 10  # a codec's own metadata beside the values
FIRST_FRAME_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0


@dataclass(frozen=True)
class ServingLimits:
    budget: Budget
    idle_timeout: float = IDLE_TIMEOUT  # seconds a session may sit without a frame before it expires
    first_frame_timeout: float = FIRST_FRAME_TIMEOUT  # seconds from a stream's start to its request
    prefill_chunk: int = PREFILL_CHUNK


@dataclass(frozen=True)
class StreamLimits:
    first: FrameLimits  # a stream's first frame: Open, Subscribe or Ping (a Step's tensor is read, to refuse it clearly)
    results: FrameLimits  # on the client's result stream: gradients for training sessions
    relay: FrameLimits  # from the next hop: gradients, errors, notices, adapter gradients


def params_bytes(stage: Stage, model_layers: int) -> int:
    """The largest parameters (adapter) a session may send through this stage: the highest rank on every
    projection and the longest deep prompt, for this stage's layers and every later one (they pass
    through here), as float32."""
    layer = stage.module.layers[0]
    lora = sum(MAX_RANK * (p.in_features + p.out_features) for p in layer.modules() if isinstance(p, nn.Linear))
    per_layer = lora + MAX_PROMPT_TOKENS * stage.hidden_size
    return 4 * per_layer * (model_layers - stage.start)


def token_bytes(stage: Stage) -> int:
    """KV cache one position reserves through the stage's layers."""
    return layers_token_bytes(stage.module.config, stage.end - stage.start, stage.dtype)


def layers_token_bytes(config, layers: int, dtype: torch.dtype) -> int:
    """KV cache one position reserves through `layers` layers of a model with this config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_bytes_per_token(layers, heads, head_dim, dtype.itemsize)


def step_bytes(stage: Stage) -> int:
    """The largest hidden states (or gradient) a step may carry, as float32."""
    return 4 * m.MAX_STEP_TOKENS * stage.hidden_size


def _limits(header: int, decoded: int, kinds: set[str]) -> FrameLimits:
    return FrameLimits(header=header, body=decoded + BODY_SLACK if decoded else 0, decoded=decoded, tensor_kinds=frozenset(kinds))


def stream_limits(stage: Stage, model_layers: int) -> StreamLimits:
    step, params = step_bytes(stage), params_bytes(stage, model_layers)
    return StreamLimits(
        first=_limits(FIRST_HEADER_BYTES, step, {m.Step.kind}),
        results=_limits(HEADER_BYTES, step, {m.Backward.kind}),
        relay=_limits(HEADER_BYTES, max(step, params), {m.Backward.kind, m.ParamGrads.kind}),
    )


def session_limits(stage: Stage, model_layers: int, batch: int, length: int) -> FrameLimits:
    """From the hop before, within one session: steps, whose header carries the attention mask of
    the whole sequence (a byte per position of each sequence) and position ids, and the session's parameters."""
    header = HEADER_BYTES + batch * length + 4 * m.MAX_STEP_TOKENS + model_layers * RECEIPT_BYTES
    return _limits(header, max(step_bytes(stage), params_bytes(stage, model_layers)), {m.Step.kind, m.Params.kind})
