"""StreamingLLM: attention sinks plus a sliding window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import Policy, register_policy, sink_mask
from kvgates.runtime.stats import AttnStats, Phase


@register_policy
@dataclass
class StreamingLLM(Policy):
    """Keep the first ``sinks`` tokens and the most recent ``budget - sinks`` (Xiao et al. 2023, arXiv:2309.17453).

    Evicts at the end of every prompt chunk and on every decode step once a head holds more than ``budget``.

    Departure from the paper: keys keep their original positions (the paper re-rotates cached keys to their
    slot index); with RoPE models this is the common "no position shift" variant used by most re-implementations.

    Args:
        budget: tokens kept per KV head.
        sinks: number of initial tokens always kept (default 4).
    """

    name = "streaming_llm"
    evicts_in = frozenset({Phase.PREFILL, Phase.DECODE})

    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "sinks")
        self._require_budget(self.sinks, f"sinks={self.sinks}")

    def score(self, layer, stats: AttnStats) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.pos.float(), sink_mask(layer, self.sinks)
