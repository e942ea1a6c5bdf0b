"""Policies that wrap a scoring policy: head-wise budgets (Ada-KV) and merging of evicted tokens (D2O-style)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from kvgates.policies.base import POLICIES, Policy, keep_forced_and_top, make_policy, register_policy
from kvgates.policies.merging import MERGE_RULES, merge_evicted
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


def parse_params(params: dict[str, Any] | str) -> dict[str, Any]:
    """Policy parameters from a dict or a ``"key=value,key=value"`` string (values parsed as YAML scalars)."""
    if isinstance(params, dict):
        return dict(params)
    out = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        if "=" not in item:
            raise ValueError(f"expected key=value in base parameters, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


@dataclass
class Wrapper(Policy):
    """A policy that delegates every hook to an inner policy built from ``base`` and ``base_params``."""

    base: str = "snapkv"
    base_params: dict[str, Any] | str = field(default_factory=dict)
    inner: Policy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base not in POLICIES:
            raise ValueError(f"{self.name}: unknown base policy {self.base!r}; available: {', '.join(sorted(POLICIES))}")
        params = parse_params(self.base_params)
        if self.budget is not None:
            params["budget"] = self.budget
        self.inner = make_policy(self.base, **params)
        self.evicts_in = self.inner.evicts_in
        self.ragged_heads = type(self).ragged_heads or self.inner.ragged_heads

    def stats_request(self, phase: Phase) -> StatsRequest:
        return self.inner.stats_request(phase)

    def slot_state(self) -> dict[str, SlotState]:
        return self.inner.slot_state()

    @property
    def decode_interval(self) -> int:
        return self.inner.decode_interval

    @property
    def decode_slack(self) -> int:
        return self.inner.decode_slack

    def layer_budget(self, layer, stats: AttnStats) -> int:
        return self.inner.layer_budget(layer, stats)

    def observe(self, layer, stats: AttnStats) -> None:
        self.inner.observe(layer, stats)

    def score(self, layer, stats: AttnStats) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.score(layer, stats)

    def due(self, layer, stats: AttnStats) -> bool:
        return self.inner.due(layer, stats)

    def decide(self, layer, stats: AttnStats) -> torch.Tensor | None:
        return self.inner.decide(layer, stats)

    def after_step(self, layer, stats: AttnStats, keep: torch.Tensor | None) -> None:
        self.inner.after_step(layer, stats, keep)

    def on_forward_end(self, cache, phase: Phase) -> None:
        self.inner.on_forward_end(cache, phase)


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
    room = (torch.as_tensor(budget, device=scores.device) - n_forced).clamp(min=0)  # B, per head
    b, h, c = scores.shape
    total = room.sum(-1)  # [B]
    flat = scores.float().masked_fill(~cand, float("-inf")).reshape(b, h * c)
    kmax = int(total.max())
    counts = torch.zeros((b, h), dtype=torch.long, device=scores.device)
    if kmax:
        top = flat.topk(min(kmax, h * c), dim=-1)
        take = (torch.arange(top.indices.shape[-1], device=scores.device) < total[:, None]) & torch.isfinite(top.values)
        counts.scatter_add_(1, torch.div(top.indices, c, rounding_mode="floor"), take.long())
    alloc = torch.round(counts * (1 - alpha) + torch.floor(alpha * room)).long()
    return alloc + n_forced


@register_policy
@dataclass
class AdaKV(Wrapper):
    """Ada-KV head-wise budgets (Feng et al. 2024, arXiv:2407.11550) around any scoring policy.

    The wrapped policy (``base``, default SnapKV; PyramidKV, H2O, MorphKV ... work alike) scores the tokens and
    decides when to evict; Ada-KV redistributes the layer's ``H_kv * budget`` tokens among its KV heads with
    ``adakv_head_budgets`` (the ``alpha`` floor keeps every head at least ``floor(alpha * B)``), and each head
    keeps its forced tokens (window, sinks) plus its own top ``B_h``. A sequence's head budgets are set when it
    first exceeds the layer budget (re-set at the end of each later prompt chunk) and kept for decode-time
    evictions; a sequence within the layer budget is left alone, as it would be outside the batch. Storage
    follows the per-head budgets (ragged head capacities), so memory drops with them rather than masking a
    full-size cache.

    Args:
        budget: average tokens per KV head.
        base: the scoring policy's name; base_params: its parameters (dict or ``"k=v,k=v"``).
        alpha: share of the budget guaranteed to every head (default 0.2).
    """

    name = "adakv"
    ragged_heads = True

    alpha: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_budget()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        if type(self.inner).score is Policy.score:
            raise ValueError(f"{self.name}: base policy {self.base!r} does not score tokens; pick a scoring policy")

    def decide(self, layer, stats: AttnStats) -> torch.Tensor | None:
        if not self.inner.due(layer, stats):
            return None
        head_budgets = layer.scratch.get("adakv.head_budgets")  # [B, H_kv], -1 until the sequence is first over
        budget = self.inner.layer_budget(layer, stats)
        layer.budget = budget if not isinstance(budget, torch.Tensor) else int(budget.max())
        held = layer.held()
        if head_budgets is None:
            head_budgets = torch.full_like(held, -1)
        over = (held > torch.as_tensor(budget, device=held.device)).any(-1)
        fresh = over & ((head_budgets < 0).any(-1) | (stats.phase is Phase.PREFILL))
        if not bool(fresh.any()) and not bool(((head_budgets >= 0) & (held > head_budgets)).any()):
            return None
        scores, forced = self.inner.score(layer, stats)
        if bool(fresh.any()):
            computed = adakv_head_budgets(scores, forced, layer.valid, budget, self.alpha)
            head_budgets = torch.where(fresh[:, None], computed, head_budgets)
        layer.scratch["adakv.head_budgets"] = head_budgets
        set_rows = (head_budgets >= 0).all(-1)
        layer.head_budgets = torch.where(set_rows[:, None], head_budgets, torch.full_like(held, layer.budget))
        if bool((held <= layer.head_budgets).all()):
            return None
        keep = keep_forced_and_top(layer, scores, layer.head_budgets, forced)
        return torch.where(set_rows[:, None, None], keep, layer.valid)


@register_policy
@dataclass
class Merge(Wrapper):
    """D2O-style merging (Wan et al. 2024, arXiv:2406.13035) on top of any policy.

    Whatever the wrapped policy evicts is not simply dropped: each evicted token close enough to a kept token
    of its head (cosine similarity above an EMA threshold) is averaged into it. See ``kvgates.policies.merging``.

    Args:
        budget: as the wrapped policy's.
        base: the wrapped policy's name; base_params: its parameters.
        beta: EMA weight of the merge threshold (default 0.7).
        merge_rule: ``"paper"`` (softmax weights) or ``"official"`` (D2O code's average).
    """

    name = "merge"

    beta: float = 0.7
    merge_rule: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"{self.name}: beta must be in (0, 1], got {self.beta}")
        self._one_of("merge_rule", MERGE_RULES)

    def decide(self, layer, stats: AttnStats) -> torch.Tensor | None:
        keep = self.inner.decide(layer, stats)
        if keep is not None:
            merge_evicted(layer, keep, self.beta, self.merge_rule)
        return keep
