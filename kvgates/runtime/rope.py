"""Re-rotating post-RoPE queries and keys to other positions (StreamingLLM's position shift).

RoPE turns a vector at position ``p`` by angles ``p * inv_freq``; rotations compose, so a vector already
rotated for ``p`` is moved to position ``p + delta`` by rotating it by ``delta * inv_freq``. The scaling some
RoPE variants fold into cos/sin was applied once when the model rotated; a shift is a pure rotation.
"""

from __future__ import annotations

import torch
from torch import nn

from kvgates.errors import UnsupportedModelError


def rotary_frequencies(model: nn.Module) -> torch.Tensor:
    """The model's RoPE ``inv_freq`` (one rotary embedding shared by all layers), float32."""
    found = {id(m): m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} has {len(found)} rotary embeddings; position shifting needs exactly one"
        )
    return next(iter(found.values())).float()


def shift_rotary(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., D]`` (already RoPE'd, transformers' rotate-half layout) by ``delta`` positions.

    ``delta`` broadcasts against ``x.shape[:-1]``. With partial rotary embeddings only the first
    ``2 * len(inv_freq)`` features turn.
    """
    rot = 2 * inv_freq.numel()
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(x.device)  # [..., rot/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    head, tail = x[..., :rot].float(), x[..., rot:]
    half = rot // 2
    rotated = head * cos + torch.cat([-head[..., half:], head[..., :half]], -1) * sin
    return torch.cat([rotated.to(x.dtype), tail], -1)
