"""D2O: layer budgets from prefill attention variance, H2O-style eviction with sinks, merging of evicted tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels import GROUP_REDUCTIONS
from kvgates.policies.base import Policy, keep_forced_and_top, recent_mask, register_policy, sink_mask
from kvgates.policies.merging import MERGE_RULES, merge_evicted
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

_SCORE = "d2o_score"


def layer_variance(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """D2O's per-layer ``v_l`` ``[B]``: per head the variance over tokens of the attention column sums,
    min-max normalised across the layer's heads, averaged over heads."""
    n = valid.sum(-1).clamp(min=1)
    s = torch.where(valid, scores, torch.zeros_like(scores))
    mean = s.sum(-1) / n
    var = torch.where(valid, (scores - mean[..., None]) ** 2, torch.zeros_like(scores)).sum(-1) / n  # [B, H]
    lo, hi = var.amin(-1, keepdim=True), var.amax(-1, keepdim=True)
    norm = torch.where(hi > lo, (var - lo) / (hi - lo).clamp(min=1e-30), torch.zeros_like(var))
    return norm.mean(-1)


def d2o_layer_ratios(variances: torch.Tensor, rho: torch.Tensor, min_ratio: float = 0.01) -> torch.Tensor:
    """``r_l = clamp(softmax_l(-v_l) * N * rho, min_ratio, 1)`` for ``variances`` ``[N, B]`` and ``rho`` ``[B]``."""
    n = variances.shape[0]
    return (torch.softmax(-variances, dim=0) * n * rho[None]).clamp(min_ratio, 1.0)


@register_policy
@dataclass
class D2O(Policy):
    """Dynamic Discriminative Operations (Wan et al. 2024, arXiv:2406.13035).

    Layer level, once per prompt: each KV head's column sums of the causal prompt attention give a variance
    over tokens; per layer the variances are min-max normalised across heads and averaged into ``v_l``, and
    layer ``l`` keeps ``r_l = clamp(softmax_l(-v_l) N rho, 0.01, 1)`` of the prompt, where ``rho = budget /
    prompt length`` (so layers average ``budget`` tokens); a prompt that fits ``budget`` is left whole and
    every layer gets ``budget`` for later evictions. Layer budgets are split heavy:recent = 3:1.
    Token level: H2O eviction (cumulative attention over prompt and decode queries) with ``sinks`` always
    kept, at the end of every prompt (all layers at once, after the last one, since the allocation needs every
    layer) and one token per decode step. Evicted tokens merge into their most similar kept token when the
    similarity passes the EMA threshold (``kvgates.policies.merging``).

    Departures: the official code never compresses layers 0, 1 and the last (``protect_edge_layers=True``
    reproduces it; off by default, matching the paper); ``merge_rule="official"`` gives the code's merge
    average. The layer variances come from the first prompt forward; later chunks reuse them with the
    prompt length seen so far.

    Args:
        budget: average tokens per KV head per layer.
        sinks: initial tokens always kept (default 4).
        heavy, recent: heavy:recent split of each layer's budget (default 3:1).
        beta: EMA weight of the merge threshold (default 0.7).
        merge: merge evicted tokens (default True); merge_rule: ``"paper"`` | ``"official"``.
        protect_edge_layers: never compress layers 0, 1 and the last (official code).
        group_reduce: how query heads of a GQA group combine into their KV head's scores.
    """

    name = "d2o"
    evicts_in = frozenset({Phase.PREFILL, Phase.DECODE})

    sinks: int = 4
    heavy: int = 3
    recent: int = 1
    beta: float = 0.7
    merge: bool = True
    merge_rule: str = "paper"
    protect_edge_layers: bool = False
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_budget(self.sinks, f"sinks={self.sinks}")
        if self.heavy < 0 or self.recent < 0 or self.heavy + self.recent == 0:
            raise ValueError(f"{self.name}: heavy:recent must be non-negative and not both 0, got {self.heavy}:{self.recent}")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"{self.name}: beta must be in (0, 1], got {self.beta}")
        self._one_of("merge_rule", MERGE_RULES)
        self._one_of("group_reduce", GROUP_REDUCTIONS)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(colsum=True, reduce=self.group_reduce)

    def slot_state(self) -> dict[str, SlotState]:
        return {_SCORE: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        layer.state[_SCORE] += stats.colsum

    def keep_mask(self, layer, budget: torch.Tensor) -> torch.Tensor:
        """Sinks + the recent share of ``budget`` (``[B, 1]``) + the top cumulative scores for the rest."""
        recent = torch.round(budget * self.recent / (self.heavy + self.recent)).long()
        forced = sink_mask(layer, self.sinks) | recent_mask(layer, recent)
        return keep_forced_and_top(layer, layer.state[_SCORE], budget, forced)

    def _evict(self, layer, budget: torch.Tensor) -> torch.Tensor | None:
        if bool((layer.held() <= budget).all()):
            return None
        keep = self.keep_mask(layer, budget)
        if self.merge:
            merge_evicted(layer, keep, self.beta, self.merge_rule)
        return keep

    def decide(self, layer, stats: AttnStats) -> torch.Tensor | None:
        if stats.phase is Phase.PREFILL or layer.head_budgets is None:
            return None  # the prompt is compressed for all layers at once in on_forward_end
        return self._evict(layer, layer.head_budgets)

    def on_forward_end(self, cache, phase: Phase) -> None:
        if phase is not Phase.PREFILL:
            return
        layers = cache.budget_layers
        for layer in layers:
            if "d2o.variance" not in layer.scratch:
                layer.scratch["d2o.variance"] = layer_variance(layer.state[_SCORE], layer.valid)
        # Prompt length seen so far, per sequence: its newest position + 1 (positions never shift).
        prompt = (layers[0].pos.amax(dim=(1, 2)) + 1).clamp(min=1).float()
        rho = self.budget / prompt
        # Layers may sit on different devices (device_map="auto"): decide on the first layer's, apply on each's own.
        variances = torch.stack([layer.scratch["d2o.variance"].to(prompt.device) for layer in layers])
        ratios = d2o_layer_ratios(variances, rho)
        for rank, layer in enumerate(layers):
            budget = torch.round(ratios[rank] * prompt).long().clamp(min=self.sinks + 1)[:, None]  # [B, 1]
            # A prompt that fits the budget is not compressed; later tokens are evicted at the uniform budget.
            budget = torch.where(prompt[:, None] <= self.budget, torch.full_like(budget, self.budget), budget)
            if self.protect_edge_layers and rank in (0, 1, len(layers) - 1):
                budget = prompt[:, None].long()
            layer.head_budgets = budget.to(layer.device).expand(-1, layer.num_kv_heads).contiguous()
            layer.budget = int(budget.max())
            keep = self._evict(layer, layer.head_budgets)
            if keep is not None:
                layer.evict(keep, slack=self.decode_slack)
