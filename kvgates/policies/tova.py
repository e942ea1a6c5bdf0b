"""TOVA: keep the tokens the current query attends to most."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import PerStepEviction, register_policy
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


@register_policy
@dataclass
class TOVA(PerStepEviction):
    """Token Omission Via Attention (Oren et al. 2024, arXiv:2401.06104).

    After each forward, ``m_j`` = mean over query heads of the last query's attention to token ``j``; keep the
    top ``budget`` tokens. By default one token set is shared by all KV heads of a layer (the paper's
    layer-wise rule, scores averaged over every query head); ``per_head=True`` ranks each KV head on its own
    group's mean. No sinks, no window. Evicts at the end of every prompt chunk and on every decode step, or every
    ``slack + 1`` steps (amortised eviction, ``PerStepEviction``: the tokens evicted at once are ranked by the
    evicting step's query alone, where per-step eviction ranks each by the query of its own step).

    Args:
        budget: tokens kept per KV head.
        per_head: rank per KV head instead of one set per layer.
        slack: amortised eviction (``PerStepEviction``); 0 evicts on every step.
    """

    name = "tova"
    decode_stats_for_eviction_only = True  # the evicting step's query alone ranks the tokens
    sync_free_decode = True

    per_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_budget()

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(rows=1, reduce="mean")

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = stats.rows[:, :, -1]
        if not self.per_head:
            # Shared selection needs the heads' slots to hold the same tokens; TOVA's own evictions keep them so
            # (a device-side assert: on a GPU the step does not wait for it, and its message is lost there).
            torch._assert_async(
                (layer.pos == layer.pos[:, :1]).all(), "tova: KV heads of a layer hold different tokens; use per_head=True"
            )
            scores = scores.mean(1, keepdim=True).expand_as(scores)
        return scores, torch.zeros_like(layer.valid)
