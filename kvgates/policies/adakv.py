"""Ada-KV: head-wise quotas around any scoring policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import Policy, register_policy
from kvgates.policies.wrappers import Wrapper
from kvgates.runtime.state import LayerState
from kvgates.runtime.stats import AttnStats, Phase


def adakv_head_budgets(
    scores: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor, budget: int | torch.Tensor, alpha: float
) -> torch.Tensor:
    """Ada-KV per-head budgets ``[B, H_kv]`` (forced tokens included) for a layer budget of ``budget`` per head
    (an int or ``[B, 1]`` per sequence).

    With ``B = budget - forced`` per head and candidates the non-forced tokens: take the top ``H_kv * B``
    candidate scores across the layer's heads, ``n_h`` = how many fall in head ``h``, and give head ``h``
    ``round(n_h (1 - alpha) + floor(alpha B))`` tokens plus its forced ones.
    """
    forced = forced & valid
    cand = valid & ~forced
    n_forced = forced.sum(-1)
    room = (budget - n_forced).clamp(min=0)  # B, per head (an int budget needs no tensor of its own)
    b, h, c = scores.shape
    total = room.sum(-1)  # [B]
    flat = scores.float().masked_fill(~cand, float("-inf")).reshape(b, h * c)
    kmax = h * budget if isinstance(budget, int) else int(total.max())  # (an int budget bounds it on the host: no read)
    counts = torch.zeros((b, h), dtype=torch.long, device=scores.device)
    if kmax:
        top = flat.topk(min(kmax, h * c), dim=-1)
        take = (torch.arange(top.indices.shape[-1], device=scores.device) < total[:, None]) & torch.isfinite(top.values)
        counts.scatter_add_(1, torch.div(top.indices, c, rounding_mode="floor"), take.long())
    # In float64, as the spec's arithmetic in Python: float32 rounds ``alpha * B`` below a whole number for some alphas
    # (0.53 * 100 gave 52.99999, floored to 52) and ``n_h (1 - alpha)`` across a half.
    alloc = torch.round(counts.double() * (1 - alpha) + torch.floor(alpha * room.double())).long()
    return alloc + n_forced


@dataclass
class AdaKVState(LayerState):
    """Each sequence's head budgets ``[B, H_kv]`` on this layer (-1 until the sequence first exceeds the budget)."""

    head_quota: torch.Tensor | None = None


@register_policy
@dataclass
class AdaKV(Wrapper):
    """Ada-KV head-wise budgets (Feng et al. 2024, arXiv:2407.11550) around any scoring policy.

    The wrapped policy (``base``, default SnapKV; PyramidKV, H2O, MorphKV ... work alike) scores the tokens and
    decides when to evict; Ada-KV redistributes about the layer's ``H_kv * budget`` tokens among its KV heads with
    ``adakv_head_budgets`` (the ``alpha`` floor keeps every head at least ``floor(alpha * B)``; the paper's rounding,
    as its code's: the heads' budgets may sum to a few tokens less, or up to half a token a head more), and each head
    keeps its forced tokens (window, sinks) plus its own top ``B_h``. A sequence's head budgets are set when it
    first exceeds the layer budget (re-set at the end of each later prompt chunk) and kept for decode-time
    evictions; a sequence within the layer budget is left alone, as it would be outside the batch. Storage
    follows the per-head budgets (ragged heads), so memory drops with them rather than masking a full-size cache.
    ``ragged=False`` gives every head as many slots as the largest head budget instead: the same tokens kept and
    the same outputs, more memory, and a decode step that attends over all heads in one call (with ragged storage
    each head is attended on its own; on CPU, SmolLM2-135M at 4K/256, batch 1: 1.05x against 1.07x the
    DynamicCache step of the same size, see docs/results.md).

    Args:
        budget: average tokens per KV head.
        base: the scoring policy's name; base_params: its parameters (dict or ``"k=v,k=v"``).
        alpha: share of the budget guaranteed to every head (default 0.2).
        ragged: storage follows each head's budget (default True); False pads every head to the largest.
    """

    name = "adakv"
    state_type = AdaKVState

    alpha: float = 0.2
    ragged: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ragged_heads = self.ragged or self.inner.ragged_heads
        self._require_budget()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        if type(self.inner).score is Policy.score:
            raise ValueError(f"{self.name}: base policy {self.base!r} does not score tokens; pick a scoring policy")

    @property
    def sync_free_decode(self) -> bool:
        """Uniform storage (``ragged=False``) around a base that evicts only the prompt and runs in a static cache
        itself: decode steps append (a static layout has one slot count for every head, which ragged storage gives up
        by design)."""
        return not self.ragged_heads and not self.schedule.decode_every and self.inner.sync_free_decode

    @property
    def exact_quota(self) -> bool:
        """Where the wrapped policy selects with the base selection: a head budget is its forced tokens plus a share of
        the room (never fewer than they), so that selection keeps exactly ``min(held, quota)`` under head budgets as
        under the base's own. (A base whose ``select`` keeps a mask of its own, as global TRIM-KV's does, is not.)"""
        return type(self.inner).select is Policy.select and self.inner.exact_quota

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor:
        """Head budgets of the sequences that have them; the wrapped policy's budget for the others."""
        state = self.layer_state(layer)
        inner = self.inner.quota(layer, stats)
        layer_quota = layer.quota_tensor(inner)
        if state.head_quota is None:
            state.head_quota = torch.full_like(layer_quota, -1)
        prompt = stats is not None and stats.phase is Phase.PREFILL
        if layer.decoding and not self.schedule.decode_every:
            # Decoding under a base that evicts only the prompt: nothing is evicted, so a sequence that outgrew the
            # layer budget since gets no head budgets (a static layout, settled again after a new turn, asks for the
            # quota to size its slots; a prompt-only base has no scores then: SnapKV's KeyError on its decode rows).
            return torch.where(state.head_quota >= 0, state.head_quota, layer_quota)
        fresh = (layer.held() > layer_quota).any(-1) & ((state.head_quota < 0).any(-1) | prompt)
        if prompt and layer.packed and isinstance(inner, int):  # every sequence holds fill[h]: the host knows, no read
            anybody = any(f > inner for f in layer.fill)
        else:
            anybody = bool(fresh.any())
        if anybody:
            scores, forced = self.inner.score(layer, stats)
            budget = inner if isinstance(inner, int) else layer_quota[:, :1]
            computed = adakv_head_budgets(scores, forced, layer.valid, budget, self.alpha)
            state.head_quota = torch.where(fresh[:, None], computed, state.head_quota)
        return torch.where(state.head_quota >= 0, state.head_quota, layer_quota)
