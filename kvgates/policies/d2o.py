"""D2O: layer budgets from prefill attention variance, H2O-style eviction with sinks, merging of evicted tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvgates.kernels.host import on_device
from kvgates.policies.base import PerStepEviction, Schedule, register_policy
from kvgates.policies.h2o import CUMULATIVE, CumulativeAttention
from kvgates.policies.merging import MERGE_RULES, MergeState, merge_evicted, start_threshold
from kvgates.policies.prompt_length import prompt_lengths
from kvgates.policies.selection import keep_forced_and_top, recent_mask, sink_mask
from kvgates.runtime.layer import enforce_layers
from kvgates.runtime.state import KnownRange
from kvgates.runtime.stats import AttnStats, Phase


def layer_variance(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """D2O's per-layer ``v_l`` ``[B]``: per head the variance over tokens of the attention column sums,
    min-max normalised across the layer's heads, averaged over heads. With two KV heads every layer's ``v_l`` is 0.5
    (with one, 0): a model of so few KV heads (Qwen2.5's smaller sizes) gets every layer the same budget, as the
    paper's rule gives it."""
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


@dataclass
class D2OState(MergeState):
    """D2O's values on one layer: its prompt variance ``v_l`` ``[B]`` (from the first prompt forward that brought the
    sequence a token; NaN before) and each
    sequence's layer budget ``[B, 1]`` (set at the end of every prompt forward), with its range on the host
    (``known_quota``)."""

    variance: torch.Tensor | None = None
    layer_budget: torch.Tensor | None = None
    #: Each sequence's first position ``[B]`` (on the first layer), where a prompt forward brought padding (``prompt_lengths``).
    first_position: torch.Tensor | None = None


@register_policy
@dataclass
class D2O(CumulativeAttention, PerStepEviction):
    """Dynamic Discriminative Operations (Wan et al. 2024, arXiv:2406.13035).

    Layer level, once per prompt: each KV head's column sums of the causal prompt attention give a variance
    over tokens; per layer the variances are min-max normalised across heads and averaged into ``v_l``, and
    layer ``l`` keeps ``r_l = clamp(softmax_l(-v_l) N rho, 0.01, 1)`` of the prompt, where ``rho = budget /
    prompt length`` (so layers average ``budget`` tokens); a prompt that fits ``budget`` is left whole and
    every layer gets ``budget`` for later evictions. A layer's budget keeps ``recent_share`` of it as the recent
    window and the rest as heavy hitters (the paper's heavy:recent = 3:1 is 0.25).
    Token level: H2O's cumulative attention (``CumulativeAttention``, over prompt and decode queries) with
    ``sinks`` always kept, at the end of every prompt (all layers at once, after the last one, since the
    allocation needs every layer) and one token per decode step, or ``slack + 1`` tokens every ``slack + 1``
    steps (amortised eviction, ``PerStepEviction``; the merge threshold then moves once per eviction). Evicted tokens merge into their most similar
    kept token when the similarity passes the EMA threshold (``kvgates.policies.merging``).

    Departures: the official code never compresses layers 0, 1 and the last (``protect_edge_layers=True``
    reproduces it; off by default, matching the paper); ``merge_rule="official"`` gives the code's merge
    average. A sequence's layer variances come from the first prompt forward that brings it a token (a left-padded row
    of a batch prefilled in chunks may have only padding in the first); later chunks reuse them with the prompt length
    seen so far.

    Args:
        budget: average tokens per KV head per layer.
        sinks: initial tokens always kept (default 4).
        recent_share: share of each layer's budget kept as the recent window (default 0.25, i.e. heavy:recent 3:1).
        beta: EMA weight of the merge threshold (default 0.7).
        merge: merge evicted tokens (default True); merge_rule: ``"paper"`` | ``"official"``.
        protect_edge_layers: never compress layers 0, 1 and the last (official code): their budget is the prompt's
            length, or ``budget`` where that is larger.
        group_reduce: how query heads of a GQA group combine into their KV head's scores.
        slack: amortised eviction (``PerStepEviction``); 0 evicts on every step.
    """

    name = "d2o"
    state_type = D2OState
    sync_free_decode = True  # its merges read nothing back in a static decode step (``merge_evicted``)
    stackable = True  # the prompt eviction after the last layer selects and merges alike layers at once on a GPU

    sinks: int = 4
    recent_share: float = 0.25
    beta: float = 0.7
    merge: bool = True
    merge_rule: str = "paper"
    protect_edge_layers: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "sinks")
        self._require_budget(self.sinks, f"sinks={self.sinks}")
        if not 0.0 <= self.recent_share <= 1.0:
            raise ValueError(f"{self.name}: recent_share must be in [0, 1], got {self.recent_share}")
        # The spec's edge case: a budget no larger than what it always keeps is refused (it held sinks + recent).
        recent = int(self._recent(torch.tensor([self.budget])))
        self._require_budget(self.sinks + recent, f"sinks + the budget's recent share ({self.sinks} + {recent})")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"{self.name}: beta must be in (0, 1], got {self.beta}")
        self._one_of("merge_rule", MERGE_RULES)
        if not self.merge:
            defaults = {f.name: f.default for f in fields(self)}
            unread = [f"{name}={getattr(self, name)!r}" for name in ("beta", "merge_rule") if getattr(self, name) != defaults[name]]
            if unread:
                raise ValueError(f"{self.name}: {', '.join(unread)} would shape the merges, which merge=False turns off")
        # Every layer budget is at least ``sinks + 1`` (``_allocate``) unless the edge layers keep their prompt; the
        # sinks and the recent share of a budget that small fit it, then those of any larger one do (both grow by at
        # most one token a token), and ``select`` keeps exactly min(held, budget).
        smallest = torch.tensor([self.sinks + 1])
        self._exact_quota = not self.protect_edge_layers and bool(self.sinks + self._recent(smallest) <= smallest)

    @property
    def exact_quota(self) -> bool:
        """Whether every layer budget leaves room for the forced slots (see ``__post_init__``)."""
        return self._exact_quota

    def _recent(self, quota: torch.Tensor) -> torch.Tensor:
        """The recent window of each layer budget in ``quota``."""
        return torch.round(quota * self.recent_share).long()

    @property
    def schedule(self) -> Schedule:
        # The prompt is compressed for all layers at once, after the last one (``after_layer``).
        return Schedule(prefill=False, decode_every=1, tolerance=self.slack)

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor | int:
        layer_budget = self.layer_state(layer).layer_budget
        return self.budget if layer_budget is None else layer_budget

    def select(self, layer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        """Sinks + the recent share of ``quota`` + the top cumulative scores for the rest; evicted tokens merge."""
        forced = sink_mask(layer, self.sinks) | recent_mask(layer, self._recent(quota))
        keep = keep_forced_and_top(layer, layer.state[CUMULATIVE], quota, forced)
        if self.merge:
            merge_evicted(
                layer, keep, self.layer_state(layer), self.beta, self.merge_rule, exact=self.exact_quota,
                static_step=stats is not None and stats.static_step,
            )
        return keep

    def after_layer(self, layer, stats: AttnStats) -> None:
        if stats.phase is not Phase.PREFILL:
            return
        state = self.layer_state(layer)
        if state.variance is None or layer.padded:  # here, not after the last layer: its launches hide behind later layers'
            # A sequence holding no token yet (its forwards so far all padding) has no variance: NaN until it has one.
            # (It took the variance of nothing, 0 at every layer, and with it every layer the same budget.)
            variance = layer_variance(layer.state[CUMULATIVE], layer.valid).masked_fill(~layer.valid.any(-1).any(-1), float("nan"))
            state.variance = variance if state.variance is None else torch.where(state.variance.isnan(), variance, state.variance)
        start_threshold(layer, state)
        if layer.is_last:
            self._allocate(layer.cache.budget_layers, stats)

    def _allocate(self, layers, stats: AttnStats) -> None:
        """Give every layer its budget from the prompt variances (each layer's, from the end of its first prompt
        forward) and compress it."""
        states = [self.layer_state(layer) for layer in layers]
        # Prompt length seen so far, per sequence, its padding left out (a left-padded row without ``position_ids`` got
        # the padded length's ratios, and evicted where alone it kept its prompt whole); no layer has evicted yet.
        prompt = on_device(prompt_lengths(layers[0], states[0], stats), layers[0].device, torch.float32)
        # Layers may sit on different devices (device_map="auto"): decide on the first layer's, apply on each's own.
        variances = torch.stack([state.variance.to(prompt.device) for state in states]).nan_to_num(0.0)  # (NaN: holds nothing)
        ratios = d2o_layer_ratios(variances, self.budget / prompt)
        # Every layer's budgets at once ([N, B]): a launch each, not one a layer.
        budgets = torch.round(ratios * prompt).long().clamp(min=self.sinks + 1)
        # A prompt that fits the budget is not compressed; later tokens are evicted at the uniform budget.
        budgets = torch.where(prompt <= self.budget, self.budget, budgets)
        if self.protect_edge_layers:  # their whole prompt, and no less than the budget the others decode at: a short
            edges = sorted({0, 1, len(layers) - 1} & set(range(len(layers))))  # prompt's left them fewer tokens than those
            budgets[edges] = torch.maximum(budgets[edges], prompt.long())
        # One read of every layer's budget range (the layers' evictions need it on the host), not one a layer.
        ranges = torch.stack([budgets.amin(-1), budgets.amax(-1)], -1).tolist()
        for layer, state, budget, (least, most) in zip(layers, states, budgets, ranges):
            state.layer_budget = budget[:, None].to(layer.device)
            state.known_quota = KnownRange(state.layer_budget, [least] * layer.num_kv_heads, [most] * layer.num_kv_heads)
        enforce_layers(layers)
