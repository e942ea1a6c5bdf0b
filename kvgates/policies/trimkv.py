"""TRIM-KV: learned retention gates; each head keeps the tokens whose decayed retention is highest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates import kernels
from kvgates.policies.base import Schedule, register_policy
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.selection import recent_mask
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats

LOG_BETA = "log_beta"


def current_positions(layer) -> torch.Tensor:
    """``[B]`` position of the newest token held by each sequence of ``layer``."""
    return layer.pos.amax(dim=(1, 2))


@register_policy
@dataclass
class TrimKV(LearnedPolicy):
    """TRIM-KV ("Cache What Lasts", 2025): retention-gated eviction with a per-head budget.

    Each new token gets ``log beta`` per KV head from its layer's retention gate (computed inside the forward
    from the normed hidden state). Token ``i`` retains ``beta_i ** (t - i)`` at time ``t``; when a head holds
    more than ``budget + buffer`` tokens it keeps the top ``budget`` by ``(t - pos) * log_beta`` (ties: more
    recent first), plus an optional always-kept recent ``window``. Gates that output ``log beta = 0`` keep the
    most recent tokens (a sliding window) and, with a budget no smaller than the sequence, change nothing.

    Args:
        budget: M, tokens per KV head (match the adapter's training budget).
        gates: a ``RetentionGates`` adapter (folder, Hub id or object); strict: require the training model.
        buffer: evict only when a head exceeds ``budget + buffer`` (amortises evictions).
        window: recent tokens always kept.
    """

    name = "trimkv"
    gate_kinds = ("retention", "retention-global")

    buffer: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "buffer", "window")
        self._require_budget(self.window, f"the recent window ({self.window})")

    @property
    def schedule(self) -> Schedule:
        return Schedule(prefill=True, decode_every=1, tolerance=self.buffer)

    def slot_state(self) -> dict[str, SlotState]:
        return {LOG_BETA: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        self.record(layer, stats, LOG_BETA)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = kernels.retention_scores(layer.state[LOG_BETA], layer.pos, current_positions(layer))
        return scores, recent_mask(layer, self.window)
