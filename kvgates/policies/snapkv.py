"""SnapKV: prompt compression by the attention of an observation window; the window scoring DynamicKV shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates import kernels
from kvgates.kernels import GROUP_REDUCTIONS
from kvgates.policies.base import PROMPT, Policy, Schedule, register_policy
from kvgates.policies.history import History, fuse, history_state, push_rows
from kvgates.policies.selection import recent_mask
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

_HISTORY = "snapkv_rows"


def pool_outside_window(
    layer, scores: torch.Tensor, window: int, kernel: int, pooling: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pooled scores, window mask)``: SnapKV's smoothing of per-slot ``scores`` ``[B, H_kv, C]``.

    Only the tokens outside the ``window`` most recent ones are scored: they are pooled along token order among
    themselves (the window's own, typically large, self-attention never enters the pooling, as in SnapKV's and
    kvpress's code) and the window is kept whole. The pooled values of window slots are meaningless.
    """
    in_window = recent_mask(layer, window)
    outside = torch.where(in_window, torch.full_like(layer.pos, -1), layer.pos)  # window slots pool as padding
    return kernels.pool_by_position(scores, outside, kernel, pooling), in_window


@dataclass
class WindowScored(Policy):
    """Base of policies scoring the prompt by the attention of its last ``window`` queries, pooled along token
    order outside the window (``pool_outside_window``); the window itself is always kept."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "window")
        self._require_budget(self.window, f"the observation window ({self.window})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: pooling kernel must be a positive odd number, got {self.kernel}")
        self._one_of("pooling", ("max", "avg"))
        self._one_of("group_reduce", GROUP_REDUCTIONS)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(window=self.window, reduce=self.group_reduce) if phase is Phase.PREFILL else StatsRequest()

    def window_scores(self, layer, scores: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pooled scores, window mask)`` of per-slot window attention ``scores`` over ``window`` queries."""
        return pool_outside_window(layer, scores, window, self.kernel, self.pooling)


@register_policy
@dataclass
class SnapKV(WindowScored):
    """SnapKV (Li et al. 2024, arXiv:2404.14469).

    At the end of each prompt chunk: ``a_j = sum over the last `window` queries of A[q, j]`` for the tokens
    outside the window, smoothed by 1-D pooling along token order among those tokens only
    (``pool_outside_window``), and each KV head keeps the window plus the top ``budget - window`` others.
    Decode appends without eviction, unless ``decode=True``: then every ``decode_every`` steps the rule is
    re-applied with the last ``window`` decode queries' rows.

    When a chunk is shorter than the window, the window shrinks to the chunk.

    Args:
        budget: tokens kept per KV head.
        window: observation window (default 32).
        kernel: pooling kernel, odd (default 7; 1 disables pooling).
        pooling: ``"max"`` (default) or ``"avg"``.
        group_reduce: how query heads of a GQA group combine (default mean), in each attention call: with ``max`` the
            prompt's window is the group's largest window sum, a ``decode=True`` window the sum of its steps' group maxima.
        decode: also compress during decode.
        decode_every: decode steps between compressions when ``decode=True``.
    """

    name = "snapkv"
    state_type = History
    sync_free_decode = True

    decode: bool = False
    decode_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "decode_every")
        if self.decode_every != 1 and not self.decode:
            raise ValueError(f"{self.name}: decode_every={self.decode_every} spaces decode compressions, which run only with decode=True")

    @property
    def schedule(self) -> Schedule:
        return Schedule(prefill=True, decode_every=self.decode_every) if self.decode else PROMPT

    def stats_request(self, phase: Phase) -> StatsRequest:
        if phase is Phase.DECODE and self.decode:
            return StatsRequest(rows=self.window, reduce=self.group_reduce)
        return super().stats_request(phase)

    def slot_state(self) -> dict[str, SlotState]:
        return {_HISTORY: history_state(self.window)} if self.decode else {}

    def observe(self, layer, stats: AttnStats) -> None:
        if self.decode and stats.phase is Phase.DECODE:
            push_rows(layer, _HISTORY, self.layer_state(layer), stats.rows)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        if stats is not None and stats.phase is Phase.PREFILL:
            return self.window_scores(layer, stats.window, stats.window_rows)
        return self.window_scores(layer, fuse(layer, _HISTORY, "sum"), self.window)
