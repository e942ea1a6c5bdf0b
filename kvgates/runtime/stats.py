"""What a policy asks the attention function for, and what it gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvgates.kernels.reference import GROUP_REDUCTIONS


class Phase(enum.Enum):
    """Which kind of forward a layer is in: the prompt (in one call or chunks) or a decode step (one token, or
    several when speculative decoding verifies them). ``BudgetLayer.phase`` decides from what the cache has seen."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class StatsRequest:
    """Statistics a policy needs from one attention call.

    Attributes:
        rows: probabilities of the last ``rows`` query rows of this forward over the slots, row by row (0 = none).
        window: probabilities of the last ``window`` query rows summed over rows (observation-window score).
        colsum: sum of the probabilities of every (real) query row of this forward, per slot.
        colmax: the largest probability any (real) query row of a prompt forward gives each slot (KVzip).
        reduce: how the query heads of a GQA group are combined into their KV head (sum | mean | max).
    """

    rows: int = 0
    window: int = 0
    colsum: bool = False
    colmax: bool = False
    reduce: str = "mean"

    def __post_init__(self) -> None:
        if self.rows < 0 or self.window < 0:
            raise ValueError(f"rows and window must be >= 0, got {self.rows}, {self.window}")
        if self.reduce not in GROUP_REDUCTIONS:
            raise ValueError(f"reduce must be one of {GROUP_REDUCTIONS}, got {self.reduce!r}")

    @property
    def empty(self) -> bool:
        return self.rows == 0 and self.window == 0 and not self.colsum and not self.colmax


NO_STATS = StatsRequest()


@dataclass
class AttnStats:
    """Statistics of one attention call, GQA-reduced to KV heads, float32, over the padded slot axis.

    Attributes:
        phase: prompt (chunk) or decode step.
        new_slots: ``[B, H_kv, n]`` slot index each of the ``n`` new tokens was written to (padding tokens' slots
            stay empty).
        rows: ``[B, H_kv, r, C]`` probabilities of the last ``r`` query rows (padded rows are zero), or None.
        window: ``[B, H_kv, C]`` probabilities of the last ``w`` real query rows summed over rows, or None;
            ``window_rows`` says how many rows there were (fewer than asked when the chunk is shorter).
        colsum: ``[B, H_kv, C]`` summed probabilities of all real query rows, or None.
        colmax: ``[B, H_kv, C]`` largest probability of any real query row of a prompt forward, or None.
        static_step: a static layer's single-token decode step (``BudgetLayer.step_static``: fixed shapes, nothing
            read back, possibly compiled), not an eager call.
    """

    phase: Phase
    new_slots: torch.Tensor
    rows: torch.Tensor | None = None
    window: torch.Tensor | None = None
    window_rows: int = 0
    colsum: torch.Tensor | None = None
    colmax: torch.Tensor | None = None
    static_step: bool = False
