"""TRIM-KV gates and MorphKV's attention together: the gates keep what lasts, recent queries choose the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates import kernels
from kvgates.policies.base import register_policy
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.morphkv import MorphKV
from kvgates.policies.selection import topk_mask
from kvgates.policies.trimkv import LOG_BETA, current_positions
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats


@register_policy
@dataclass
class TrimKVMorph(MorphKV, LearnedPolicy):
    """A retention-gate adapter inside MorphKV's selection (this framework's own combination).

    Each KV head holds ``budget`` tokens: the ``recent`` most recent ones, the ``gate_keep`` older ones whose
    decayed retention ``(t - pos) * log_beta`` is highest (TRIM-KV's score, from the adapter's gates), and, for
    what is left, the older tokens the recent queries attended to most (MorphKV's fused attention rows). A gate
    scores a token once, when it is written, without knowing what later queries will ask of it; MorphKV ranks
    by what the latest queries read and loses the tokens they have not read yet (a needle before its question).
    Together each covers the other's blind spot.

    ``gate_keep = 0`` is MorphKV; ``gate_keep = budget - recent`` is TRIM-KV with an always-kept recent
    window of ``recent`` (both tested). Decode steps need MorphKV's attention rows, so it costs what MorphKV
    costs plus the gates.

    Args:
        budget: tokens per KV head.
        gates: a ``RetentionGates`` adapter (folder, Hub id or object); strict: require the training model.
        gate_keep: older tokens kept by gate retention (at most ``budget - recent``).
        recent, fusion, evict_every: as MorphKV.
    """

    name = "trimkv-morph"
    gate_kinds = ("retention", "retention-global")

    gate_keep: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "gate_keep")
        if self.recent + self.gate_keep > self.budget:
            raise ValueError(
                f"{self.name}: recent ({self.recent}) + gate_keep ({self.gate_keep}) must fit the budget ({self.budget})"
            )

    def slot_state(self) -> dict[str, SlotState]:
        return {**super().slot_state(), LOG_BETA: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        super().observe(layer, stats)
        self.record(layer, stats, LOG_BETA)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        fused, recent = super().score(layer, stats)
        retention = kernels.retention_scores(layer.state[LOG_BETA], layer.pos, current_positions(layer))
        return fused, recent | topk_mask(retention, self.gate_keep, layer.valid & ~recent, layer.pos)
