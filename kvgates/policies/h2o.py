"""H2O: heavy hitters by cumulative attention plus a recent window; the cumulative score D2O and KVMerger share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels import GROUP_REDUCTIONS
from kvgates.policies.base import PerStepEviction, Policy, register_policy
from kvgates.policies.selection import recent_mask
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

#: Per-slot state: the attention a token has received, summed over every query that saw it.
CUMULATIVE = "cumulative_attention"


@dataclass
class CumulativeAttention(Policy):
    """Base of policies that score a token by the attention it received from every query so far (prompt rows,
    computed tile by tile, and decode rows), aggregated over each GQA group by ``group_reduce`` in each forward: with
    ``max``, the sum of every forward's group maximum (it depends on how a prompt was chunked), not the group's largest sum."""

    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._one_of("group_reduce", GROUP_REDUCTIONS)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(colsum=True, reduce=self.group_reduce)

    def slot_state(self) -> dict[str, SlotState]:
        return {CUMULATIVE: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        if stats.colsum is not None:
            layer.state[CUMULATIVE] += stats.colsum


@register_policy
@dataclass
class H2O(CumulativeAttention, PerStepEviction):
    """Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048).

    Each slot accumulates ``s_j = sum_q A[q, j]`` over every query that has seen it: all prompt rows (computed
    tile by tile, never an ``L x L`` matrix for all heads at once) and every decode row. Keeps the ``recent``
    most recent tokens plus the top ``budget - recent`` others by ``s``. Evicts at the end of every prompt chunk
    and then one token per decode step, or ``slack + 1`` tokens every ``slack + 1`` steps (amortised eviction,
    ``PerStepEviction``: the recent window then spans the newest ``recent`` tokens at the evicting step).

    Args:
        budget: tokens kept per KV head.
        recent: recent-window size in tokens (default ``budget // 2``, the paper's 50/50 split).
        group_reduce: how query heads of a GQA group combine into their KV head's score.
        slack: amortised eviction (``PerStepEviction``); 0 evicts on every step.
    """

    name = "h2o"
    sync_free_decode = True

    recent: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        budget = self._require_budget()
        if self.recent is None:
            self.recent = budget // 2
        self._at_least(0, "recent")
        self._require_budget(self.recent, f"the recent window ({self.recent})")

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.state[CUMULATIVE], recent_mask(layer, self.recent)
