"""MorphKV: a constant-size cache of recent tokens plus the old tokens they attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import Policy, Schedule, register_policy
from kvgates.policies.history import FUSIONS, History, fuse, history_state, push_rows
from kvgates.policies.selection import recent_mask
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

_ROWS = "morph_rows"


@register_policy
@dataclass
class MorphKV(Policy):
    """MorphKV (Ghadia et al. 2025, "Dialogue Without Limits", arXiv:2503.00979).

    Holds exactly ``budget`` = C tokens per KV head: the ``recent`` = R most recent tokens plus the C - R older
    tokens most correlated with them. Each KV head keeps a ring buffer of the attention rows of its recent
    queries over the slots, every row summed over the query heads of the group (paper, Algorithm 1). At a
    decode step the rows of tokens t-1 ... t-R (not the current one) are fused per old slot, ``sum``
    (``F_j = sum_r A_r[j]``) or ``max``, and the top C - R old slots are kept with the R recent ones. The ring
    holds R + 1 rows: the current query's row is recorded before the decision and left out of it. A slot
    written after a row was recorded reads 0 in it; evicting a slot drops its column. At the end of each prompt
    chunk the same rule runs with the prompt's last R queries, which the ring then holds for the first decode steps (a
    chunk shorter than R takes the rest from the chunks before it). A decode step of several tokens (speculative
    decoding) records all their rows.

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
    state_type = History
    sync_free_decode = True

    recent: int = 30
    fusion: str = "sum"
    evict_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "recent", "evict_every")
        self._require_budget(self.recent, f"the recent window ({self.recent})")
        self._one_of("fusion", FUSIONS)

    @property
    def schedule(self) -> Schedule:
        return Schedule(prefill=True, decode_every=self.evict_every)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(rows=self.recent, reduce="sum")

    def slot_state(self) -> dict[str, SlotState]:
        return {_ROWS: history_state(self.recent + 1)}

    def observe(self, layer, stats: AttnStats) -> None:
        push_rows(layer, _ROWS, self.layer_state(layer), stats.rows)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The ring's R + 1 rows less one: at a decode step its newest (the current query's); at the end of a prompt
        # chunk, which recorded its last R rows (or all of a shorter chunk's), its oldest.
        newest = self.layer_state(layer).newest
        decoding = stats is not None and stats.phase is Phase.DECODE
        fused = fuse(layer, _ROWS, self.fusion, newest if decoding else (newest + 1) % (self.recent + 1))
        return fused, recent_mask(layer, self.recent)
