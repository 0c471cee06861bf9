"""What a step carries besides its hidden states: attention masks, position ids and adapter
parameters, in their wire forms, checked on the way in (they come from other machines)."""

from __future__ import annotations

import math

import torch

from p2pfusion.errors import RequestError

MAX_POSITION = 1 << 24


def mask_to_wire(mask: torch.Tensor) -> bytes:
    return mask.to(torch.uint8).contiguous().numpy().tobytes()


def mask_from_wire(raw: bytes, batch: int, length: int) -> torch.Tensor:
    """An attention mask [batch, length] of 0/1 (1: attend), as transformers takes it."""
    if len(raw) != batch * length:
        raise RequestError(f"attention mask must be {batch}x{length} bytes, got {len(raw)}")
    mask = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(batch, length)
    if bool((mask > 1).any()):
        raise RequestError("attention mask values must be 0 or 1")
    return mask.to(torch.long)


def positions_to_wire(positions: torch.Tensor) -> bytes:
    return positions.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()


def positions_from_wire(raw: bytes, batch: int, tokens: int) -> torch.Tensor:
    if len(raw) != 4 * batch * tokens:
        raise RequestError(f"position ids must be {batch}x{tokens} int32 values, got {len(raw)} bytes")
    positions = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(batch, tokens).to(torch.long)
    if bool((positions < 0).any() or (positions >= MAX_POSITION).any()):
        raise RequestError(f"position ids must be in 0..{MAX_POSITION - 1}")
    return positions


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Parameters as one float32 tensor, sent exactly (they are small next to hidden states)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor | None, shapes: list[list[int]]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    if flat is None or flat.dim() != 1 or flat.numel() != sum(sizes):
        got = None if flat is None else list(flat.shape)
        raise RequestError(f"parameters must come as one flat tensor of {sum(sizes)} values, got {got}")
    if flat.dtype != torch.float32:
        raise RequestError(f"parameters must be float32, got {flat.dtype}")
    if not bool(torch.isfinite(flat).all()):
        raise RequestError("parameters contain NaN or infinity")
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]
