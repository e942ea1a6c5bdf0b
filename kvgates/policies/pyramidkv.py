"""PyramidKV: SnapKV scoring with per-layer budgets that shrink linearly with depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels.host import on_device
from kvgates.policies.base import register_policy
from kvgates.policies.history import History
from kvgates.policies.prompt_length import prompt_lengths
from kvgates.policies.snapkv import SnapKV
from kvgates.runtime.state import KnownRange
from kvgates.runtime.stats import AttnStats, Phase


def pyramid_budgets(budget: int, window: int, prompt_len: int, num_layers: int, beta: int) -> list[int]:
    """Per-layer budgets (window included) of PyramidKV for a prompt of ``prompt_len`` tokens.

    ``min = (C - w) // beta``, ``max = 2 (C - w) - min``; when ``max >= L - w`` the top is clipped to
    ``L - w`` and ``min = 2 (C - w) - max``; layer ``l`` gets ``max - floor(l (max - min) / (N - 1)) + w``,
    so the first layer gets ``max``, the last ``min`` and the layers sum to about ``N * C``. (The official
    code rounds the step itself down, ``max - l * ((max - min) // (N - 1))``, which leaves the last layer
    up to ``N - 1`` tokens above ``min``; the spec's formula is followed here.) A prompt shorter than the window
    clips the top to 0, not to ``L - w``: every layer keeps at least its window, which ``decode=True``'s evictions
    always keep (the first layer's budget of ``L`` tokens was less than them, and the eviction failed).
    """
    if num_layers == 1:
        return [budget]
    room = budget - window
    low = room // beta
    high = 2 * room - low
    if high >= prompt_len - window:
        high = max(prompt_len - window, 0)
        low = 2 * room - high
    return [high - (layer * (high - low)) // (num_layers - 1) + window for layer in range(num_layers)]


@dataclass
class PyramidState(History):
    """SnapKV's decode history, and each sequence's budget on this layer ``[B, 1]``, set at the end of the prompt
    (decode evictions reuse it), with its range on the host (``known_quota``)."""

    layer_budget: torch.Tensor | None = None
    #: Each sequence's prompt length seen so far (``prompt_length.prompt_lengths``), found by the first budgeted layer at
    #: the end of each prompt forward; every layer's pyramid is built from these.
    prompt_lengths: list[int] | None = None
    #: Each sequence's first position ``[B]``, where a prompt forward brought padding (``prompt_length.prompt_lengths``).
    first_position: torch.Tensor | None = None


@register_policy
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069): more cache for lower layers, less for higher ones.

    Total memory matches ``budget`` per layer on average; each layer is compressed with SnapKV's rule (see
    ``SnapKV``) to its own budget from ``pyramid_budgets``. The step uses ``N_layers - 1`` (the paper's
    ``m - 1``). The prompt length ``L`` is each sequence's prompt seen so far when the chunk ends (its real tokens: a
    short row of a padded batch gets the budgets it would get alone; ``prompt_length.prompt_lengths``), the same for every layer: in
    a prompt given in chunks a deeper layer, which holds less, still gets its share of the one pyramid.

    Args:
        beta: ratio controlling the smallest layer budget, ``(budget - window) / beta`` (default 20).
        (other parameters as SnapKV)
    """

    name = "pyramidkv"
    state_type = PyramidState

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "beta")

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor:
        """``[B, 1]``: this layer's pyramid budget for each sequence's own prompt length."""
        state = self.layer_state(layer)
        if (stats is not None and stats.phase is Phase.PREFILL) or state.layer_budget is None:
            first = self.layer_state(layer.cache.budget_layers[0])
            if layer.rank == 0 or first.prompt_lengths is None:  # one answer a prompt forward, not one a layer
                first.prompt_lengths = prompt_lengths(layer, first, stats)
            lengths = first.prompt_lengths
            per_length = {
                n: pyramid_budgets(self.budget, self.window, n, layer.cache.num_budget_layers, self.beta)[layer.rank]
                for n in set(lengths)
            }
            budgets = [per_length[n] for n in lengths]
            state.layer_budget = on_device([[n] for n in budgets], layer.device)
            heads = layer.num_kv_heads
            state.known_quota = KnownRange(state.layer_budget, [min(budgets)] * heads, [max(budgets)] * heads)
        return state.layer_budget
