"""MorphKV: a constant-size cache of recent tokens plus the old tokens they attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import Policy, recent_mask, register_policy
from kvgates.policies.history import fuse, history_state, load_rows, push_row
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

_ROWS = "morph_rows"


@register_policy
@dataclass
class MorphKV(Policy):
    """MorphKV (Ghadia et al. 2025, "Dialogue Without Limits", arXiv:2503.00979).

    Holds exactly ``budget`` = C tokens per KV head: the ``recent`` = R most recent tokens plus the C - R older
    tokens most correlated with them. Each KV head keeps a ring buffer of the attention rows of its last R
    queries over the slots, every row summed over the query heads of the group (paper, Algorithm 1). At a
    decode step the rows of tokens t-1 ... t-R (not the current one) are fused per old slot, ``sum``
    (``F_j = sum_r A_r[j]``) or ``max``, and the top C - R old slots are kept with the R recent ones; then the
    current query's row enters the buffer. A slot written after a row was recorded reads 0 in it; evicting a
    slot drops its column. At the end of each prompt chunk the same rule runs with the chunk's last R
    queries, which then seed the buffer.

    Departures from the official code: it keeps C + 1 tokens and renormalises each row's softmax over the old
    tokens only; here exactly C tokens are kept and rows are the probabilities over every held token (a
    row-constant factor, so ``max`` fusion ranks identically and ``sum`` fusion weighs rows as the paper's
    equations do).

    Paper settings: long responses R=30, C=600, sum; LongGenBench R=200, C=4000, max; long context R=32,
    C=2000, sum.

    Args:
        budget: C, tokens per KV head.
        recent: R, the recent window whose attention selects old tokens (default 30).
        fusion: ``"sum"`` or ``"max"`` over the window's rows.
        evict_every: decode steps between evictions (the cache then holds up to C + evict_every - 1).
    """

    name = "morphkv"
    evicts_in = frozenset({Phase.PREFILL, Phase.DECODE})

    recent: int = 30
    fusion: str = "sum"
    evict_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "recent", "evict_every")
        self._require_budget(self.recent, f"the recent window ({self.recent})")
        self._one_of("fusion", ("sum", "max"))

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(rows=self.recent if phase is Phase.PREFILL else 1, reduce="sum")

    def slot_state(self) -> dict[str, SlotState]:
        return {_ROWS: history_state(self.recent)}

    @property
    def decode_interval(self) -> int:
        return self.evict_every

    def observe(self, layer, stats: AttnStats) -> None:
        if stats.phase is Phase.PREFILL:
            load_rows(layer, _ROWS, stats.rows)

    def score(self, layer, stats: AttnStats) -> tuple[torch.Tensor, torch.Tensor]:
        return fuse(layer, _ROWS, self.fusion), recent_mask(layer, self.recent)

    def after_step(self, layer, stats: AttnStats, keep: torch.Tensor | None) -> None:
        if stats.phase is Phase.DECODE:
            push_row(layer, _ROWS, stats.rows[:, :, -1])
