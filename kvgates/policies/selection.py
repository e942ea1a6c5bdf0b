"""Selection helpers every policy is built from: top-k with deterministic ties, recent tokens, sinks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvgates.runtime.storage import POS_BIG

if TYPE_CHECKING:
    from kvgates.runtime.layer import BudgetLayer


def topk_mask(
    scores: torch.Tensor,
    k: int | torch.Tensor,
    candidates: torch.Tensor,
    positions: torch.Tensor | None = None,
    sync_free: bool = False,
    excess: int | None = None,
) -> torch.Tensor:
    """Mark the ``k`` highest-scoring candidate slots of every ``[B, H_kv]`` row.

    ``k`` is an int or a tensor broadcastable to ``scores.shape[:-1]`` (per-row budgets); rows with fewer
    candidates keep all of them. With ``positions``, equal scores are broken in favour of the more recent
    token, which makes decisions deterministic (pooled scores tie often); without, ties are arbitrary.
    ``sync_free`` computes the same mask without reading anything back from the device (a compiled decode step,
    ``BudgetLayer.static``): no shortcut for rows dropping one slot, and a tensor ``k`` ranks every slot.
    ``excess``, with ``positions``: an upper bound, known on the host, of how many candidates a row holds beyond
    ``k`` (``BudgetLayer.over_quota_bound``); the same mask again without a read-back (a row dropping at most one
    slot takes the shortcut, a tensor ``k`` ranks every slot), as a per-step eviction on a GPU needs.
    """
    n = scores.shape[-1]
    if isinstance(k, int):
        k = k_t = min(max(k, 0), n)
        if k == 0:
            return torch.zeros_like(candidates)
    else:
        k_t = k.to(scores.device).expand(scores.shape[:-1]).clamp(0, n)
    s = scores.double() if not scores.is_floating_point() else scores
    if positions is not None and not sync_free:
        over = candidates.sum(-1) - k_t
        if (int(over.max()) if excess is None else excess) <= 1:  # the decode case: drop at most one slot per row, no sort
            # (a row over has candidates, so its worst slot is one of them: dropped by an exclusive or)
            return candidates ^ _worst_slot(s, candidates, positions, over > 0)
    if isinstance(k, int):
        kmax = k
    else:
        kmax = n if sync_free or excess is not None else int(k_t.max()) if k_t.numel() else 0
    if kmax == 0:
        return torch.zeros_like(candidates)
    s = s.masked_fill(~candidates, float("-inf"))
    if positions is None:
        idx = s.topk(kmax, dim=-1).indices
    else:
        by_recency = torch.argsort(positions, dim=-1, descending=True, stable=True)
        ranked = torch.argsort(s.gather(-1, by_recency), dim=-1, descending=True, stable=True)[..., :kmax]
        idx = by_recency.gather(-1, ranked)
    take = True if isinstance(k, int) else torch.arange(kmax, device=scores.device) < k_t[..., None]
    return torch.zeros_like(candidates).scatter(-1, idx, take) & candidates


def _worst_slot(
    scores: torch.Tensor, candidates: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | bool
) -> torch.Tensor:
    """One-hot mask of the lowest-scoring candidate of each selected row (ties: the oldest token), i.e. what the
    full ranking of ``topk_mask`` would leave out when it keeps all candidates but one. ``rows``: ``[B, H_kv]``,
    or True for every row."""
    s = (scores if scores.is_floating_point() else scores.double()).masked_fill(~candidates, float("inf"))
    tied = candidates & (s == s.amin(-1, keepdim=True))
    oldest = positions.masked_fill(~tied, torch.iinfo(positions.dtype).max).argmin(-1, keepdim=True)
    return torch.zeros_like(candidates).scatter(-1, oldest, rows if rows is True else rows[..., None])


def recent_mask(layer: BudgetLayer, n: int | torch.Tensor) -> torch.Tensor:
    """The ``n`` most recent tokens held per head (``n`` may be per sequence/head). A head's tokens have distinct
    positions, so ranking every slot (``sync_free``) marks the same ones without reading the largest ``n`` back."""
    if isinstance(n, int):
        return _by_position(layer, n, newest=True)
    return topk_mask(layer.pos, n, layer.valid, sync_free=True)


def sink_mask(layer: BudgetLayer, n: int) -> torch.Tensor:
    """The ``n`` oldest tokens held per head (attention sinks)."""
    return _by_position(layer, n, newest=False)


def _by_position(layer: BudgetLayer, n: int, newest: bool) -> torch.Tensor:
    """The ``n`` newest (or oldest) tokens held per head: what ``topk_mask`` of the positions marks, as the tokens
    at or past the ``n``-th position of each head, found by one top-k of the positions (a head's tokens have
    distinct positions; free slots rank last). No ranking of the slots, no scatter: a few launches per step."""
    n = min(n, layer.pos.shape[-1])
    valid = layer.valid
    if n <= 0:
        return torch.zeros_like(valid)
    if newest:  # free slots hold position -1, below every token
        return (layer.pos >= layer.pos.topk(n, dim=-1).values[..., -1:]) & valid
    held = layer.pos.masked_fill(~valid, POS_BIG)
    return (layer.pos <= held.topk(n, dim=-1, largest=False).values[..., -1:]) & valid


def top_held(layer: BudgetLayer, scores: torch.Tensor, k: int, candidates: torch.Tensor) -> torch.Tensor:
    """``topk_mask`` of ``k`` among ``candidates`` (held slots of ``layer``; ties: more recent) without a read-back
    where the host knows the layer: the candidates beyond ``k`` are at most the held tokens beyond it (``most_held``)."""
    most = layer.most_held
    return topk_mask(scores, k, candidates, layer.pos, sync_free=layer.static, excess=None if most is None else most - k)


def keep_forced_and_top(
    layer: BudgetLayer, scores: torch.Tensor, budget: int | torch.Tensor, forced: torch.Tensor
) -> torch.Tensor:
    """Keep ``forced`` slots plus the best-scoring other valid slots (ties: more recent), up to ``budget`` per head.
    When ``budget`` is the layer's ``quota``, what the host knows of the layer (``over_quota_bound``) spares the
    ranking its read-backs: the tokens over budget are at most the held ones over quota."""
    excess = layer.over_quota_bound if budget is layer.quota else None
    if excess is not None and excess <= 1 and not layer.static:
        return _drop_worst(layer, scores, budget, forced)
    forced = forced & layer.valid
    room = (budget.to(scores.device) if isinstance(budget, torch.Tensor) else budget) - forced.sum(-1)
    return forced | topk_mask(scores, room.clamp(min=0), layer.valid & ~forced, layer.pos, sync_free=layer.static, excess=excess)


def _drop_worst(layer: BudgetLayer, scores: torch.Tensor, budget: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """``keep_forced_and_top`` where the host knows that no head holds more than one token over ``budget`` (a
    per-step eviction's decode step): every head over it drops its lowest-scoring held slot that is not forced
    (ties: the oldest token), found by ``_worst_slot`` without the ranking's counts of forced slots and room
    (nor a count of the held tokens where the host knows that every head holds one over: ``held_over_quota``).
    A head over budget by its forced slots alone drops its one other slot, as the ranking (room 0) does; one
    without any other slot keeps what it holds."""
    valid = layer.valid
    candidates = valid & ~forced
    over = True if layer.held_over_quota == 1 else layer.held() > budget
    worst = _worst_slot(scores, candidates, layer.pos, over)
    return valid ^ (worst & candidates)  # (a held slot, dropped by an exclusive or)


def threshold_quota(layer: BudgetLayer, forced: torch.Tensor, passing: torch.Tensor, budget: int | None) -> torch.Tensor:
    """``[B, H_kv]`` per-head quotas of a threshold policy: the held tokens ``forced`` (a window, sinks) or
    ``passing`` its threshold, at most ``budget`` (None: no cap)."""
    kept = (layer.valid & (forced | passing)).sum(-1)
    return kept if budget is None else kept.clamp(max=budget)
