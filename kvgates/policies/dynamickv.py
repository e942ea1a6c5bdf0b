"""DynamicKV: task-adaptive per-layer budgets, reallocated progressively during the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgates.kernels.host import HostRead
from kvgates.policies.base import register_policy
from kvgates.policies.selection import recent_mask
from kvgates.policies.snapkv import WindowScored
from kvgates.runtime.layer import enforce_layers
from kvgates.runtime.state import KnownRange, LayerState, SlotState
from kvgates.runtime.stats import AttnStats, Phase

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


@dataclass
class Reallocation:
    """Budgets ``[n, B]`` for the first ``n`` layers, with each layer's candidate slots (outside the window) and the
    budgets' range per layer, read back to the host when the layers are truncated (``HostRead``)."""

    layers: list
    candidates: list[torch.Tensor]
    budgets: torch.Tensor
    ranges: HostRead


@dataclass
class DynamicKVState(LayerState):
    """The prompt's observation window on this layer, and the quota ``[B, H_kv]`` of the latest reallocation (None
    before this layer's first one: then the layer is cut to ``r_max * b``); the range of the latest quota where
    the host knows it (``known_quota``); a reallocation this layer made whose truncation waits for the next layer
    (``pending``)."""

    window: int = 0
    quota: torch.Tensor | None = None
    pending: Reallocation | None = None


@register_policy
@dataclass
class DynamicKV(WindowScored):
    """DynamicKV (Zhou et al. 2024, arXiv:2412.14838), prompt compression only; decode appends.

    Each layer scores the tokens outside the window by the pooled attention of the last ``window`` queries
    (SnapKV's score, ``WindowScored``) and first keeps the window plus its top ``min(r_max * b, L - window)``
    tokens, ``b = budget - window``, remembering their scores. After every ``update_every`` layers (and the
    last), the global top ``b * H_kv * n`` scores over the ``n`` processed layers are counted per layer and turned
    into budgets with ``dynamickv_allocation`` (they share ``b * N_layers``); each processed layer is truncated
    to the window plus its top ``f_i``. ``f_i`` is clamped to what the layer holds: the official code can select
    window tokens twice there (the clamp fix). A reallocation counts the scores of the tokens each processed layer
    holds when it runs: a layer truncated by an earlier reallocation competes with the tokens it kept, not with
    its first ``r_max * b`` (the paper's Algorithm 1 gathers the layers' scores without saying which). A prompt given
    in chunks runs the whole rule at the end of each chunk, over what each layer holds then, scored by that chunk's
    last ``window`` queries (all of a shorter chunk's, as SnapKV's; the layers' room stays ``b``, so they hold up to
    ``window`` less the chunk's length fewer tokens than their budgets, never more). The truncation of a
    reallocation before the last layer runs at the end of the next layer, with the same result: the budgets' range
    it reads back is ready by then, and on a GPU the next layer's work is still queued behind the truncation's
    launches instead of the device waiting for them.

    Args:
        budget: average tokens per KV head per layer (window included).
        window: observation window (default 8).
        kernel: pooling kernel (default 7); pooling: ``"max"`` or ``"avg"``.
        r_max: a layer may temporarily hold up to ``r_max * b`` tokens (default 10).
        update_every: layers between reallocations, ``m`` (default 4).
        group_reduce: how query heads of a GQA group combine.
    """

    name = "dynamickv"
    state_type = DynamicKVState
    sync_free_decode = True  # decode appends: the layers' budgets are the prompt's, set before a static layout settles
    stackable = True  # a reallocation's truncations select alike layers at once on a GPU

    window: int = 8
    r_max: float = 10.0
    update_every: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "r_max", "update_every")

    def slot_state(self) -> dict[str, SlotState]:
        return {_SCORE: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        if stats.phase is Phase.PREFILL:
            state = self.layer_state(layer)
            state.window, state.quota = stats.window_rows, None
            layer.state[_SCORE] = self.window_scores(layer, stats.window, stats.window_rows)[0]

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.state[_SCORE], recent_mask(layer, self.layer_state(layer).window)

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor:
        state = self.layer_state(layer)
        if state.quota is not None:
            return state.quota
        most = int(self.r_max * (self.budget - self.window))
        cap = (layer.held().amax(-1, keepdim=True) - state.window).clamp(max=most) + state.window
        if layer.packed:  # every sequence holds fill[h] tokens in head h: the host knows the cap
            n = [min(max(layer.fill) - state.window, most) + state.window] * layer.num_kv_heads
            state.known_quota = KnownRange(cap, n, n)
        return cap

    def after_layer(self, layer, stats: AttnStats) -> None:
        if stats.phase is not Phase.PREFILL:
            return
        if layer.rank > 0:  # the previous layer's reallocation, if it made one
            previous = self.layer_state(layer.cache.budget_layers[layer.rank - 1])
            if previous.pending is not None:
                self._truncate(previous.pending)
                previous.pending = None
        if (layer.rank + 1) % self.update_every == 0 or layer.is_last:
            done = self._reallocate(layer.cache.budget_layers[: layer.rank + 1], self.budget - self.window, layer.cache.num_budget_layers)
            if layer.is_last:
                self._truncate(done)
            else:
                self.layer_state(layer).pending = done

    def _reallocate(self, layers, room: int, num_layers: int) -> Reallocation:
        """Re-split ``room * num_layers`` tokens among the processed ``layers`` (for ``_truncate``)."""
        b, device = layers[0].batch_size, layers[0].device  # layers may sit on different devices (device_map)
        candidates = [layer.valid & ~self.score(layer, None)[1] for layer in layers]
        flat = torch.cat(
            [
                layer.state[_SCORE].masked_fill(~cand, float("-inf")).reshape(b, -1).to(device)
                for layer, cand in zip(layers, candidates)
            ],
            dim=1,
        )
        n = len(layers)
        owner = torch.cat([torch.full((layer.state[_SCORE][0].numel(),), i, device=device) for i, layer in enumerate(layers)])
        k = min(room * layers[0].num_kv_heads * n, flat.shape[1])
        top = flat.topk(k, dim=-1)
        hits = torch.where(torch.isfinite(top.values), owner[top.indices], n)  # [B, k]: each hit's layer (n: none)
        counts = torch.zeros((b, n + 1), dtype=torch.long, device=device).scatter_add_(1, hits, torch.ones_like(hits))
        budgets = dynamickv_allocation(counts[:, :n].T, room, num_layers, self.r_max)  # [n, B]
        return Reallocation(layers, candidates, budgets, HostRead(torch.stack([budgets.amin(-1), budgets.amax(-1)], -1)))

    def _truncate(self, done: Reallocation) -> None:
        """Give each layer of ``done`` its budget and truncate it (the reallocation's one read back)."""
        for layer, cand, f, (least, most) in zip(done.layers, done.candidates, done.budgets, done.ranges.tolist()):
            state = self.layer_state(layer)
            f = torch.minimum(f.to(cand.device)[:, None], cand.sum(-1))  # clamp to what the layer holds
            state.quota = f + (layer.valid & ~cand).sum(-1)  # plus the window
            state.known_quota = None
            if layer.packed:  # head h holds fill[h] tokens, the window's newest among them: the quota's range is known
                window = [min(state.window, held) for held in layer.fill]
                state.known_quota = KnownRange(
                    state.quota,
                    [min(least, held - w) + w for held, w in zip(layer.fill, window)],
                    [min(most, held - w) + w for held, w in zip(layer.fill, window)],
                )
        enforce_layers(done.layers)
