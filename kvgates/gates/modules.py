"""The learned eviction modules: TRIM-KV retention gates (per layer, and the global variant) and Locret
retaining heads. One module per gated decoder layer, small next to the LLM; each maps a layer's inputs to one
score per (token, KV head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def _init_linear(layer: nn.Linear, std: float = 0.02) -> None:
    nn.init.normal_(layer.weight, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class RetentionGate(nn.Module):
    """TRIM-KV retention gate of one layer: normed hidden state -> ``log beta`` per KV head.

    ``Linear(d_model, hidden, bias) -> activation -> Linear(hidden, H_kv, no bias) + per-head bias b`` and
    ``log_beta = logsigmoid(.)``. Weights start at N(0, 0.02) and ``b`` large (18) so ``beta ~ 1`` (keep
    everything) at the start of training. Token ``i`` then retains ``beta_i ** (t - i)`` at time ``t``.
    """

    def __init__(self, hidden_size: int, num_kv_heads: int, gate_hidden: int = 512, activation: str = "silu", init_bias: float = 18.0):
        super().__init__()
        self.up = nn.Linear(hidden_size, gate_hidden, bias=True)
        self.act = ACT2FN[activation]
        self.down = nn.Linear(gate_hidden, num_kv_heads, bias=False)
        self.bias = nn.Parameter(torch.full((num_kv_heads,), float(init_bias)))
        _init_linear(self.up)
        _init_linear(self.down)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> ``log_beta`` ``[..., H_kv]`` (<= 0), float32 (beta near 1 needs the range). The bias
        is added in float32 whatever the gate's dtype (``_biased``)."""
        # Functional calls on the submodules' parameters: this runs for every layer at every decode step.
        x = self.act(F.linear(hidden, self.up.weight, self.up.bias))
        return _biased(F.linear(x, self.down.weight), self.bias)


class GlobalRetentionTrunk(nn.Module):
    """Per-layer part of the global retention gate (DBTrimKV): ``d_model -> hidden -> hidden`` with activations."""

    def __init__(self, hidden_size: int, gate_hidden: int = 512, activation: str = "silu"):
        super().__init__()
        self.up = nn.Linear(hidden_size, gate_hidden, bias=True)
        self.mid = nn.Linear(gate_hidden, gate_hidden, bias=True)
        self.act = ACT2FN[activation]
        _init_linear(self.up)
        _init_linear(self.mid)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.act(F.linear(hidden, self.up.weight, self.up.bias))
        return self.act(F.linear(x, self.mid.weight, self.mid.bias))


class SharedRetentionHead(nn.Module):
    """The final projection and bias of the global retention gate, shared by every layer so that scores are
    comparable across layers and heads."""

    def __init__(self, num_kv_heads: int, gate_hidden: int = 512, init_bias: float = 18.0):
        super().__init__()
        self.down = nn.Linear(gate_hidden, num_kv_heads, bias=False)
        self.bias = nn.Parameter(torch.full((num_kv_heads,), float(init_bias)))
        _init_linear(self.down)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return _biased(F.linear(features, self.down.weight), self.bias)


def _biased(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``logsigmoid(logits + bias)`` in float32: a retention gate's bias is large (about 8 trained, 18 at init), and
    added in bfloat16 (a gate run in a bf16 model's dtype) it rounds the sum to 1/32, losing most of what the
    projection adds (``log_beta`` of a shipped TRIM-KV gate was off by 0.8% in the median, 1.9% at the 90th
    percentile, against 0.4% and 0.9% with the sum in float32); training under autocast adds it in float32 too."""
    return F.logsigmoid(logits.float() + bias.float())


class RetainingHead(nn.Module):
    """Locret retaining head of one layer: ``concat[q, k, v]`` (raw projections, pre-RoPE) -> score per KV head.

    ``Linear(in, hidden, no bias) -> activation -> Linear(hidden, H_kv, no bias)``, N(0, 0.02) init. Trained to
    regress the causal importance of each cached token (the max pre-softmax logit later queries give it).
    """

    def __init__(self, in_features: int, num_kv_heads: int, head_hidden: int = 1024, activation: str = "silu"):
        super().__init__()
        self.up = nn.Linear(in_features, head_hidden, bias=False)
        self.act = ACT2FN[activation]
        self.down = nn.Linear(head_hidden, num_kv_heads, bias=False)
        _init_linear(self.up)
        _init_linear(self.down)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[..., q_dim + 2 kv_dim]`` -> ``[..., H_kv]``."""
        return F.linear(self.act(F.linear(qkv, self.up.weight)), self.down.weight)
