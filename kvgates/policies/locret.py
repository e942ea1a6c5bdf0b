"""Locret: learned retaining heads score cached tokens; chunked prefill keeps the top-scored ones."""

from __future__ import annotations

from dataclasses import dataclass

from kvgates.policies.base import register_policy
from kvgates.policies.learned import WriteScored

SCORE = "locret_score"


@register_policy
@dataclass
class Locret(WriteScored):
    """Locret (Huang et al. 2024, arXiv:2410.01805): retaining heads predict each token's causal importance.

    Each new token gets a score per KV head from its layer's retaining head (over the raw q/k/v projections,
    computed inside the forward). Meant for chunked prefill (``generate(..., prefill_chunk_size=...)``): after
    each prompt chunk every head keeps its top ``budget`` tokens, always including the chunk's last
    ``stabilizers`` tokens (Locret fails without them) and the most recent ``local`` tokens. Decode appends, or
    with ``decode_evict=True`` evicts by score at the same budget.

    Departure: the runtime cannot tell the last prompt chunk from the others, so it is compressed too (Locret
    appends it whole); protecting the most recent ``local`` tokens keeps the end of the prompt as Locret's
    ``n_loc`` does.

    Args:
        budget: b, tokens per KV head.
        gates: a ``RetainingHeads`` adapter; strict: require the training model.
        stabilizers: n_s, last tokens of each chunk always kept.
        local: n_loc, most recent tokens never evicted.
        decode_evict: evict by score during decode instead of appending.
    """

    name = "locret"
    gate_kinds = ("retaining-head",)
    score_state = SCORE

    stabilizers: int = 32
    local: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "stabilizers", "local")
        self._require_budget(self.protected, f"the protected recent tokens (max(stabilizers, local) = {self.protected})")

    @property
    def protected(self) -> int:
        return max(self.stabilizers, self.local)
