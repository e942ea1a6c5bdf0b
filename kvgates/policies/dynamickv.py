"""DynamicKV: task-adaptive per-layer budgets, reallocated progressively during the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels import GROUP_REDUCTIONS
from kvgates.policies.base import Policy, keep_forced_and_top, recent_mask, register_policy
from kvgates.policies.snapkv import pool_outside_window
from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest

_SCORE = "dynamickv_score"


def dynamickv_allocation(counts: torch.Tensor, room: int, num_layers: int, r_max: float) -> torch.Tensor:
    """Per-layer budgets (window excluded) from the top-k counts of the processed layers.

    ``counts`` is ``[n, B]``: how many of the global top ``room * H_kv * n`` scores fall in each processed
    layer. Following the paper's Algorithm 1: ``Z_i = floor(B_l * c_i / max(c))`` with ``B_l = r_max * room``,
    ``r = sum(Z) / (room * N)`` and ``f_i = floor(Z_i / r)``, so the processed layers share ``room * N``.
    """
    counts = counts.float()
    top = counts.amax(0, keepdim=True).clamp(min=1)
    z = torch.floor(r_max * room * counts / top)
    r = z.sum(0, keepdim=True) / (room * num_layers)
    return torch.where(r > 0, torch.floor(z / r.clamp(min=1e-12)), torch.full_like(z, room)).long()


@register_policy
@dataclass
class DynamicKV(Policy):
    """DynamicKV (Zhou et al. 2024, arXiv:2412.14838), prompt compression only; decode appends.

    Each layer scores the tokens outside the window by the pooled attention of the last ``window`` queries
    (SnapKV's score, ``pool_outside_window``) and first keeps the window plus its top ``min(r_max * b,
    L - window)`` tokens, ``b = budget - window``, remembering their scores. After every ``update_every`` layers (and the last), the global top
    ``b * H_kv * n`` scores over the ``n`` processed layers are counted per layer and turned into budgets with
    ``dynamickv_allocation`` (they share ``b * N_layers``); each processed layer is truncated to the window
    plus its top ``f_i``. ``f_i`` is clamped to what the layer holds: the official code can select window
    tokens twice there (the clamp fix).

    Args:
        budget: average tokens per KV head per layer (window included).
        window: observation window (default 8).
        kernel: pooling kernel (default 7); pooling: ``"max"`` or ``"avg"``.
        r_max: a layer may temporarily hold up to ``r_max * b`` tokens (default 10).
        update_every: layers between reallocations, ``m`` (default 4).
        group_reduce: how query heads of a GQA group combine.
    """

    name = "dynamickv"

    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    r_max: float = 10.0
    update_every: int = 4
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._observation_window()
        self._at_least(1, "r_max", "update_every")
        self._one_of("group_reduce", GROUP_REDUCTIONS)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return StatsRequest(window=self.window, reduce=self.group_reduce) if phase is Phase.PREFILL else StatsRequest()

    def slot_state(self) -> dict[str, SlotState]:
        return {_SCORE: SlotState()}

    def _window(self, layer) -> torch.Tensor:
        return recent_mask(layer, layer.scratch["dynamickv.window"])

    def decide(self, layer, stats: AttnStats) -> torch.Tensor | None:
        if stats.phase is not Phase.PREFILL:
            return None
        window = stats.window_rows
        layer.scratch["dynamickv.window"] = window
        scores, _ = pool_outside_window(layer, stats.window, window, self.kernel, self.pooling)
        layer.state[_SCORE].copy_(scores)
        room = self.budget - self.window
        cap = min(int(self.r_max * room), int(layer.held().max()) - window)
        layer.budget = cap + window
        if int(layer.held().max()) > cap + window:
            layer.evict(keep_forced_and_top(layer, scores, cap + window, self._window(layer)), slack=self.decode_slack)
        cache = layer.cache
        rank, total = cache.budget_rank(layer.layer_idx), cache.num_budget_layers
        if (rank + 1) % self.update_every == 0 or rank == total - 1:
            self._reallocate(cache.budget_layers[: rank + 1], room, total)
        return None

    def _reallocate(self, layers, room: int, num_layers: int) -> None:
        """Re-split ``room * num_layers`` tokens among the processed ``layers`` and truncate them."""
        b, device = layers[0].batch_size, layers[0].device  # layers may sit on different devices (device_map)
        candidates = [layer.valid & ~self._window(layer) for layer in layers]
        flat = torch.cat(
            [
                layer.state[_SCORE].masked_fill(~cand, float("-inf")).reshape(b, -1).to(device)
                for layer, cand in zip(layers, candidates)
            ],
            dim=1,
        )
        owner = torch.cat([torch.full((layer.state[_SCORE][0].numel(),), i) for i, layer in enumerate(layers)])
        k = min(room * layers[0].num_kv_heads * len(layers), flat.shape[1])
        top = flat.topk(k, dim=-1)
        counts = torch.zeros((len(layers), b), dtype=torch.long)
        for row in range(b):
            hits = owner[top.indices[row][torch.isfinite(top.values[row])].cpu()]
            counts[:, row] = torch.bincount(hits, minlength=len(layers))
        budgets = dynamickv_allocation(counts, room, num_layers, self.r_max)
        for layer, cand, f in zip(layers, candidates, budgets):
            f = torch.minimum(f.to(cand.device)[:, None], cand.sum(-1))  # clamp to what the layer holds
            window = self._window(layer)
            layer.budget = int(f.max()) + int(window.sum(-1).max())
            keep = keep_forced_and_top(layer, layer.state[_SCORE], f + window.sum(-1), window)
            if bool((keep != layer.valid).any()):
                layer.evict(keep, slack=self.decode_slack)
