"""StreamingLLM: attention sinks plus a sliding window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import PerStepEviction, register_policy
from kvgates.policies.selection import sink_mask
from kvgates.runtime.rope import Rotary, rotary_of
from kvgates.runtime.stats import AttnStats


@register_policy
@dataclass
class StreamingLLM(PerStepEviction):
    """Keep the first ``sinks`` tokens and the most recent ``budget - sinks`` (Xiao et al. 2023, arXiv:2309.17453).

    Evicts at the end of every prompt chunk and on every decode step once a head holds more than ``budget``, or
    with ``slack`` = s once it holds more than ``budget + s`` (amortised eviction, ``PerStepEviction``: the
    window then grows to ``budget - sinks + s`` tokens before it is cut back).

    By default keys keep their original positions (the common "no position shift" variant). With
    ``rerotate=True`` attention runs at the paper's shifted positions: every cached token is attended as if it
    sat at its rank in the cache and the query at the next one (queries and keys are re-rotated on the fly,
    which RoPE allows because rotations compose; storage keeps the original rotation). Re-rotation reads the
    model's rotary frequencies and layout (halves or interleaved pairs, ``kvgates.runtime.rope``), so the policy
    must be ``attach``-ed to the model; a model whose RoPE is neither layout is refused there.

    Args:
        budget: tokens kept per KV head.
        sinks: number of initial tokens always kept (default 4).
        rerotate: attend at positions within the cache (the paper's position shift).
        slack: amortised eviction (``PerStepEviction``); 0 evicts on every step.
    """

    name = "streaming_llm"

    sinks: int = 4
    rerotate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "sinks")
        self._require_budget(self.sinks, f"sinks={self.sinks}")
        self._rotary: Rotary | None = None

    @property
    def sync_free_decode(self) -> bool:
        """Re-rotation sorts positions per step on the host's terms (``position_shift``); no static cache for it."""
        return not self.rerotate

    @property
    def position_window(self) -> int | None:
        return self.budget + self.slack if self.rerotate else None

    def attach(self, model) -> StreamingLLM:
        if self.rerotate:
            self._rotary = rotary_of(model)
        return self

    def position_shift(self, layer, q_pos: torch.Tensor) -> tuple[Rotary, torch.Tensor, torch.Tensor] | None:
        if not self.rerotate:
            return None
        if self._rotary is None:
            raise RuntimeError(f"{self.name}: rerotate=True reads the model's rotary frequencies; call policy.attach(model)")
        held = torch.where(layer.valid, layer.pos, torch.iinfo(layer.pos.dtype).max)
        ordered, order = held.sort(-1)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
        key_delta = torch.where(layer.valid, rank - layer.pos, torch.zeros_like(rank))
        # Every head holds the same tokens (sinks + window), so the first head's order ranks the queries.
        query_rank = torch.searchsorted(ordered[:, 0].contiguous(), q_pos.contiguous())
        return self._rotary, key_delta, query_rank - q_pos

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.pos.float(), sink_mask(layer, self.sinks)
