"""TRIM-KV global: one budget shared by every layer and KV head, filled by comparable retention scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.policies.base import NEVER, Schedule, register_policy
from kvgates.policies.selection import top_held, topk_mask
from kvgates.policies.trimkv import TrimKV
from kvgates.runtime.state import LayerState
from kvgates.runtime.stats import AttnStats


def global_keep(
    scores: list[torch.Tensor],
    valid: list[torch.Tensor],
    forced: list[torch.Tensor],
    positions: list[torch.Tensor],
    total: int,
    held: int | None = None,
) -> list[torch.Tensor]:
    """Keep masks per layer: the forced slots plus the best-scoring others over *all* layers and heads, so that
    each sequence keeps ``total`` tokens in all (ties: more recent first). ``held``: the tokens every sequence
    holds, when the host knows it; the candidates beyond the room are then at most ``held - total``, and the
    ranking reads nothing back."""
    b = scores[0].shape[0]

    def flat(ts: list[torch.Tensor]) -> torch.Tensor:  # [B, 1, all slots of all layers and heads]
        return torch.cat([t.reshape(b, 1, -1) for t in ts], dim=-1)

    all_valid, all_forced = flat(valid), flat(forced) & flat(valid)
    room = (total - all_forced.sum(-1)).clamp(min=0)
    excess = None if held is None else held - total
    keep = all_forced | topk_mask(flat(scores), room, all_valid & ~all_forced, flat(positions), excess=excess)
    out, start = [], 0
    for s in scores:
        n = s[0].numel()
        out.append(keep[:, 0, start : start + n].reshape(s.shape))
        start += n
    return out


@dataclass
class GlobalKeep(LayerState):
    """This layer's share of the latest global decision while it is being enforced: the kept slots, how many each
    head keeps (the layer's quota) and, per head, their least and largest number over the batch (on the host)."""

    keep: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    kept_range: tuple[list[int], list[int]] | None = None


@register_policy
@dataclass
class TrimKVGlobal(TrimKV):
    """Global TRIM-KV (DBTrimKV, "Make Each Token Count", 2026): one top-k across layers and heads.

    With global retention gates (a final projection and bias shared by all layers) scores are comparable
    everywhere, so after each forward the cache keeps the ``budget * N_layers * H_kv`` tokens with the highest
    ``(t - pos) * log_beta`` over every (layer, head, token), with at least ``min_per_head`` (and the recent
    ``window``) per head. Layers and heads end up with different sizes; storage follows them (ragged heads).

    Args:
        budget: average tokens per KV head (the global budget is this times layers times KV heads).
        gates: ``GlobalRetentionGates`` (per-layer ``RetentionGates`` are accepted for ablations).
        min_per_head: tokens every head keeps whatever its scores.
        buffer: evict only when the total exceeds the global budget by more than this.
        window: recent tokens every head always keeps.
    """

    name = "trimkv-global"
    sync_free_decode = False  # one selection across layers, ragged heads
    exact_quota = True  # each layer's quota is what its share of the selection keeps (never more than it holds)
    ragged_heads = True
    state_type = GlobalKeep

    min_per_head: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "min_per_head")
        if self.window + self.min_per_head > self.budget:  # every head would keep more than its share of the budget
            raise ValueError(
                f"{self.name}: window ({self.window}) + min_per_head ({self.min_per_head}) must fit the budget ({self.budget})"
            )

    @property
    def schedule(self) -> Schedule:
        return NEVER  # decided for all layers at once, after the last one of every forward (``after_layer``)

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor:
        return self.layer_state(layer).kept

    def quota_range(self, layer, quota: torch.Tensor) -> tuple[list[int], list[int]] | None:
        state = self.layer_state(layer)
        return state.kept_range if quota is state.kept else None  # (a wrapper's own quota: not this range)

    def select(self, layer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        return self.layer_state(layer).keep

    def after_layer(self, layer, stats: AttnStats) -> None:
        if not layer.is_last:
            return
        layers = layer.cache.budget_layers
        device = layers[0].device  # layers may sit on different devices (device_map): decide on the first's
        total = self.budget * len(layers) * layers[0].num_kv_heads
        held = sum(other.held().sum(-1).to(device) for other in layers)  # [B]
        over = held > total + self.buffer  # only these sequences evict
        # What every sequence holds, on the host, when every layer is packed (then every sequence is over or none).
        fills = [other.fill if other.packed else None for other in layers]
        held_all = None if None in fills else sum(map(sum, fills))
        if not (bool(over.any()) if held_all is None else held_all > total + self.buffer):
            return
        scores, valid, forced, positions = [], [], [], []
        for other in layers:
            s, window = self.score(other, None)
            scores.append(s.to(device))
            valid.append(other.valid.to(device))
            forced.append((window | top_held(other, s, self.min_per_head, other.valid)).to(device))
            positions.append(other.pos.to(device))
        states = [self.layer_state(other) for other in layers]
        for other, state, keep in zip(layers, states, global_keep(scores, valid, forced, positions, total, held_all)):
            state.keep = torch.where(over.to(other.device)[:, None, None], keep.to(other.device), other.valid)
            state.kept = state.keep.sum(-1)
        # Every layer's storage follows what its heads keep: one read for all layers (their range over the batch).
        ranges = torch.stack([torch.stack([s.kept.amin(0), s.kept.amax(0)]).to(device) for s in states]).tolist()
        for other, state, kept_range in zip(layers, states, ranges):
            state.kept_range = tuple(kept_range)
            other.enforce(None)
            state.keep = state.kept = state.kept_range = None
