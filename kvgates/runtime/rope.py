"""Re-rotating post-RoPE queries and keys to other positions (StreamingLLM's position shift).

RoPE turns feature pairs of a vector at position ``p`` by angles ``p * inv_freq``; rotations compose, so a vector
already rotated for ``p`` is moved to position ``p + delta`` by rotating it by ``delta * inv_freq``. The scaling
some RoPE variants fold into cos/sin was applied once when the model rotated; a shift is a pure rotation.

Models pair features in one of two layouts: halves (feature ``i`` with ``i + R/2``: Llama, Mistral, Qwen, Phi,
Gemma) or interleaved (``2i`` with ``2i + 1``: Cohere, GLM), over the first ``R = 2 * len(inv_freq)`` features
(partial rotary leaves the rest). ``rotary_of`` finds the layout by checking that a shift reproduces the model's
own rotation, and refuses a model where neither layout does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from kvgates.errors import UnsupportedModelError

LAYOUTS = ("halves", "interleaved")


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding as far as shifting needs it: ``inv_freq`` (float32) and the pairing layout."""

    inv_freq: torch.Tensor
    layout: str = "halves"


def rotary_frequencies(model: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    """The model's rotary embedding module and its ``inv_freq`` (one rotary embedding shared by all layers)."""
    found = {id(m): m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    if len(found) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} has {len(found)} rotary embeddings; position shifting needs exactly one"
        )
    module = next(iter(found.values()))
    return module, module.inv_freq.float()


def shift_rotary(x: torch.Tensor, delta: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate ``x`` ``[..., D]`` (already RoPE'd in ``rotary``'s layout) by ``delta`` positions.

    ``delta`` broadcasts against ``x.shape[:-1]``. With partial rotary embeddings only the first
    ``2 * len(inv_freq)`` features turn.
    """
    rot = 2 * rotary.inv_freq.numel()
    angles = delta.to(torch.float32)[..., None] * rotary.inv_freq.to(x.device)  # [..., rot/2]
    head, tail = x[..., :rot].float(), x[..., rot:]
    if rotary.layout == "interleaved":  # pairs (2i, 2i + 1)
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        turned = torch.stack([-head[..., 1::2], head[..., 0::2]], dim=-1).flatten(-2)
    else:  # pairs (i, i + rot/2)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        turned = torch.cat([-head[..., rot // 2 :], head[..., : rot // 2]], -1)
    return torch.cat([(head * cos + turned * sin).to(x.dtype), tail], -1)


def rotary_of(model: nn.Module) -> Rotary:
    """The rotary embedding of ``model``, in the layout whose shift reproduces the model's own RoPE.

    Raises ``UnsupportedModelError`` when there is no single rotary embedding, the modeling code has no
    ``apply_rotary_pos_emb``, or neither layout turns a key at one position into the model's key at another.
    """
    module, inv_freq = rotary_frequencies(model)
    name = type(model).__name__
    apply = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if apply is not None:
        x = torch.randn(1, 1, 2, head_dim, generator=torch.Generator().manual_seed(0)).to(inv_freq.device)
        at = torch.tensor([[3, 3]], device=x.device)
        moved = torch.tensor([[3, 40]], device=x.device)
        with torch.no_grad():
            start = apply(x, x, *module(x, at))[0]
            target = apply(x, x, *module(x, moved))[0]
        for layout in LAYOUTS:
            rotary = Rotary(inv_freq, layout)
            if torch.allclose(shift_rotary(start, (moved - at)[:, None], rotary), target, atol=1e-4, rtol=1e-4):
                return rotary
    raise UnsupportedModelError(
        f"{name}'s rotary embedding is neither the halves nor the interleaved RoPE layout (or kvgates cannot find "
        "its apply_rotary_pos_emb), so streaming_llm rerotate=True cannot shift its keys; use rerotate=False"
    )
