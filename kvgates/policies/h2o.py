"""H2O: heavy hitters by cumulative attention plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels import GROUP_REDUCTIONS
from kvgates.policies.base import Policy, recent_mask, register_policy
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


@register_policy
@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048).

    Each slot accumulates ``s_j = sum_q A[q, j]`` over every query that has seen it: all prompt rows (computed
    block by block, never an ``L x L`` matrix for all heads at once) and every decode row. Keeps the ``recent``
    most recent tokens plus the top ``budget - recent`` others by ``s``. Evicts at the end of every prompt chunk
    and then one token per decode step.

    Args:
        budget: tokens kept per KV head.
        recent: recent-window size (default ``budget // 2``, the paper's 50/50 split).
        group_reduce: how query heads of a GQA group combine into their KV head's score.
    """

    name = "h2o"
    evicts_in = frozenset({Phase.PREFILL, Phase.DECODE})

    recent: int | None = None
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        budget = self._require_budget()
        if self.recent is None:
            self.recent = budget // 2
        self._at_least(0, "recent")
        self._require_budget(self.recent, f"the recent window ({self.recent})")
        self._one_of("group_reduce", GROUP_REDUCTIONS)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(colsum=True, reduce=self.group_reduce)

    def slot_state(self) -> dict[str, SlotState]:
        return {"h2o_score": SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        layer.state["h2o_score"] += stats.colsum

    def score(self, layer, stats: AttnStats) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.state["h2o_score"], recent_mask(layer, self.recent)
