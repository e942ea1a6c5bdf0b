"""TRIM-KV: learned retention gates; each head keeps the tokens whose decayed retention is highest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvgates import kernels
from kvgates.policies.base import Schedule, register_policy
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.selection import recent_mask, top_held
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats, Phase

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
    sync_free_decode = True

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


@dataclass
class GateKept(LearnedPolicy):
    """Mixin putting a retention-gate adapter inside an attention-scored policy (this framework's combinations).

    Listed before the policy it extends (``class TrimKVMorph(GateKept, MorphKV)``): besides what that policy
    always keeps (its ``reserved`` window of recent tokens), each KV head keeps the ``gate_keep`` other tokens of
    highest decayed retention ``(t - pos) * log_beta`` (TRIM-KV's score, from the adapter's gates), and the
    policy's own attention scores choose the rest. A gate scores a token once, when it is written, without
    knowing what later queries will ask of it; attention scores rank by what recent queries read and lose the
    tokens they have not read yet (a needle before its question). Together each covers the other's blind spot.
    ``gate_keep = 0`` is the base policy.

    Gates run only in the forwards whose scores an eviction can read: every forward for a policy that evicts
    while decoding, prompt chunks only for one that compresses the prompt.
    """

    gate_kinds = ("retention", "retention-global")
    #: The base policy's parameter counting the recent tokens it always keeps.
    reserved: ClassVar[str] = "window"

    gate_keep: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "gate_keep")
        kept = getattr(self, self.reserved)
        if kept + self.gate_keep > self.budget:
            raise ValueError(
                f"{self.name}: {self.reserved} ({kept}) + gate_keep ({self.gate_keep}) must fit the budget ({self.budget})"
            )

    def slot_state(self) -> dict[str, SlotState]:
        return {**super().slot_state(), LOG_BETA: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        super().observe(layer, stats)
        if stats.phase is Phase.PREFILL or self.schedule.decode_every > 0:
            self.record(layer, stats, LOG_BETA)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores, kept = super().score(layer, stats)
        retention = kernels.retention_scores(layer.state[LOG_BETA], layer.pos, current_positions(layer))
        return scores, kept | top_held(layer, retention, self.gate_keep, layer.valid & ~kept)
