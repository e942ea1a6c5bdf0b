"""D2O's similarity-guided merging of evicted tokens into kept ones: the helper ``d2o`` uses, and the ``merge``
policy that adds it to any other.

For each evicted token ``e`` of a KV head: ``u_ec = cos(k_e, k_c)`` over the kept tokens ``c`` of that head,
``m_e = max_c u_ec`` and ``c*(e) = argmax``. The threshold is an exponential moving average kept per layer
and sequence: ``tau_1`` = mean ``m`` at the sequence's first eviction, then ``tau_t = beta mean(m_t) + (1 - beta)
tau_{t-1}`` (a sequence that evicts nothing in a step keeps its threshold, so a row of a batch gets the
threshold it would get alone). Tokens with ``m_e < tau`` are dropped; the others merge into ``c*(e)``:

* ``rule="paper"`` (D2O paper): a kept token ``c`` receiving ``E_c`` becomes a softmax-weighted average of
  itself (similarity 1) and its merged tokens, ``w_e = exp(u_ec) / (sum_{E_c} exp(u) + e)``,
  ``w_c = e / (sum_{E_c} exp(u) + e)``, ``k_c <- w_c k_c + sum w_e k_e`` and the same weights for ``v``;
* ``rule="official"`` (D2O code): ``k_c <- (k_c + sum_e m_e k_e) / (1 + |E_c|)``, likewise ``v``.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from kvgates import kernels
from kvgates.policies.base import register_policy
from kvgates.policies.wrappers import Wrapper
from kvgates.runtime.layer import BudgetLayer
from kvgates.runtime.state import LayerState
from kvgates.runtime.stats import AttnStats, Phase

MERGE_RULES = ("paper", "official")


@dataclass
class MergeState(LayerState):
    """The merge threshold ``tau`` ``[B]`` of each sequence on this layer (NaN until its first eviction)."""

    tau: torch.Tensor | None = None


def _slots_of(mask: torch.Tensor, at_least: int = 0, most: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[B, H, n]`` of the slots set in ``mask`` (padded to the largest count, at least ``at_least``) and
    which of them are real. ``most``: the largest count, when the host knows it (else it is read back)."""
    count = max(int(mask.sum(-1).max()) if most is None else most, at_least)
    order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)[..., :count]
    return order, torch.gather(mask, -1, order)


def _gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.gather(t, 2, idx[..., None].expand(*idx.shape, t.shape[-1]))


def best_matches(
    keys: torch.Tensor, evicted: torch.Tensor, kept: torch.Tensor, most: tuple[int, int] | None = None
) -> tuple[torch.Tensor, ...]:
    """For every evicted slot of each head, its most similar kept slot by key cosine similarity.

    Returns ``(evicted slot indices [B, H, E], real [B, H, E], best similarity, kept slot indices [B, H, K],
    target [B, H, E])``: evicted token ``i`` matches kept slot ``kept[..., target[..., i]]``. Evicted keys are
    compared with the kept ones only (``kernels.max_similarity``: tiles of evicted tokens on the CPU, a kernel that
    stores no product on a GPU), so memory follows ``E x K`` tiles rather than every slot against every slot.
    ``most``: the most evicted and kept slots a head has, when the host knows them.
    """
    most_evicted, most_kept = (None, None) if most is None else most
    idx, real = _slots_of(evicted, most=most_evicted)
    kept_idx, kept_real = _slots_of(kept, at_least=1, most=most_kept)
    ke = torch.nn.functional.normalize(_gather_slots(keys, idx).float(), dim=-1)
    kk = torch.nn.functional.normalize(_gather_slots(keys, kept_idx).float(), dim=-1)
    best_t, target_t = kernels.max_similarity(ke, kk, kept_real)
    return (idx, *_matched(real, best_t), kept_idx, target_t)


def best_match_in_slots(keys: torch.Tensor, evicted: torch.Tensor, kept: torch.Tensor, count: int = 1) -> tuple[torch.Tensor, ...]:
    """``best_matches`` where no head evicts more than ``count`` slots (a per-step eviction's decode step; the decode step
    of a static layer, whose heads evict at most their slots over the quota), without listing the kept slots: the
    evicted slots are the first ``count`` set (others, not real, fill the rest), their similarities to every slot
    are one product with the normalised keys, and slots not kept are masked out before the argmax.

    Returns ``(evicted slots [B, H, count], real, best similarity, target [B, H, count])`` with ``target`` a slot of
    ``keys``: the one ``best_matches`` picks, which lists the kept slots in slot order (both argmaxes take the first
    of equal maxima).
    """
    flags = evicted.to(torch.uint8)  # (inductor's CPU code has no max over bool)
    found, idx = flags.max(-1, keepdim=True) if count == 1 else flags.topk(count, dim=-1)
    real = found.bool()
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = torch.matmul(_gather_slots(unit, idx), unit.transpose(-1, -2))
    best, target = sim.masked_fill_(~kept[:, :, None, :] | sim.isnan(), float("-inf")).max(-1)  # as max_similarity's
    return (idx, *_matched(real, best), target)


def _matched(real: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, best)`` of evicted tokens and their best similarities, where a token with nothing to match (best -inf:
    its head keeps nothing, or every similarity of its is NaN) is no longer real and its best similarity is 0."""
    return real & (best > float("-inf")), best.nan_to_num(0.0, neginf=0.0)


def _weights(best: torch.Tensor, merging: torch.Tensor, rule: str) -> tuple[torch.Tensor, float]:
    """The weight of every evicted token (0 where it does not merge) and a receiving kept token's own weight."""
    if rule == "paper":
        return best.exp() * merging, math.e
    return best * merging, 1.0


def _merge_into_kept(
    stores: tuple[torch.Tensor, ...], idx: torch.Tensor, kept_idx: torch.Tensor, target: torch.Tensor,
    merging: torch.Tensor, w: torch.Tensor, self_w: float, rule: str,
) -> None:
    """Merge every evicted slot ``idx`` that is ``merging`` into kept slot ``kept_idx[target]`` of each of
    ``stores`` (keys, values), in place: computed over the kept slots (the only ones that receive) and written back
    to them."""
    received = torch.zeros(kept_idx.shape, device=w.device).scatter_add_(2, target, merging.float())
    if rule == "paper":
        denom = torch.zeros(kept_idx.shape, device=w.device).scatter_add_(2, target, w) + self_w
    else:
        denom = received + self_w
    receivers = (received > 0)[..., None]
    for store in stores:
        extra = _gather_slots(store, idx).float()
        kept_values = _gather_slots(store, kept_idx)
        acc = kept_values.float() * self_w
        acc.scatter_add_(2, target[..., None].expand_as(extra), extra * w[..., None])
        merged = torch.where(receivers, (acc / denom[..., None]).to(store.dtype), kept_values)
        store.scatter_(2, kept_idx[..., None].expand_as(merged), merged)


def _merge_one(
    stores: tuple[torch.Tensor, ...], idx: torch.Tensor, target: torch.Tensor, merging: torch.Tensor, w: torch.Tensor,
    self_w: float, rule: str,
) -> None:
    """``_merge_into_kept`` where every head evicts at most one slot: a kept slot receives at most one token
    (weights summing to ``self_w + w``, or 1 + 1 with ``rule="official"``) and ``target`` is a slot of the stores,
    so per head one pair of slots (the receiving one, the evicted one) is read and one slot written back."""
    denom = (w + self_w)[..., None] if rule == "paper" else 2.0
    pairs = torch.cat([target, idx], -1)
    for store in stores:
        pair = _gather_slots(store, pairs)
        kept_values, both = pair[:, :, :1], pair.float()
        merged = (both[:, :, :1] * self_w + both[:, :, 1:] * w[..., None]) / denom
        merged = torch.where(merging[..., None], merged.to(store.dtype), kept_values)
        store.scatter_(2, target[..., None].expand_as(merged), merged)


def start_threshold(layer: BudgetLayer, state: MergeState) -> None:
    """Give ``state`` its threshold ``tau`` as a tensor of NaN (no eviction yet) if it has none, so that a compiled
    decode step never creates it (call it at the end of a prompt forward)."""
    if state.tau is None:
        state.tau = torch.full((layer.batch_size,), float("nan"), device=layer.device)


def _merge_into_slots(
    stores: tuple[torch.Tensor, ...], idx: torch.Tensor, target: torch.Tensor, merging: torch.Tensor, w: torch.Tensor,
    self_w: float, rule: str,
) -> None:
    """``_merge_into_kept`` where ``target`` is a slot of the stores (``best_match_in_slots``), fixed shapes (a static
    layer's step), nothing of the size of the stores: the evicted tokens sharing a target are summed among the
    ``E`` of the head (an ``E x E`` match of targets), and only the target slots are read and written back (a slot
    targeted twice gets the same value twice)."""
    same = (target[..., :, None] == target[..., None, :]).float()  # [B, H, E, E]
    received = same @ merging.float()[..., None]
    denom = (same @ w[..., None] if rule == "paper" else received) + self_w
    for store in stores:
        kept_values = _gather_slots(store, target)
        incoming = same @ (_gather_slots(store, idx).float() * w[..., None])
        merged = (kept_values.float() * self_w + incoming) / denom
        spread = target[..., None].expand_as(kept_values)
        store.scatter_(2, spread, torch.where(received > 0, merged.to(store.dtype), kept_values))


def merge_evicted(
    layer: BudgetLayer, keep: torch.Tensor, state: MergeState, beta: float = 0.7, rule: str = "paper", exact: bool = False,
    static_step: bool = False,
) -> None:
    """Merge the tokens ``keep`` evicts into their most similar kept token, in place on ``layer``'s storage,
    updating the threshold in ``state``. ``exact``: ``keep`` holds ``min(held, quota)`` tokens per head
    (``Policy.exact_quota``), so where the host knows the layer (``BudgetLayer.exact_counts``) it knows how many
    each head evicts and keeps, and nothing is read back; where no head evicts more than one token (a per-step
    eviction's decode step), each evicted token is matched and merged on its own (``best_match_in_slots``). On a
    static layer's decode step (``static_step``: ``AttnStats.static_step``, possibly compiled) nothing is read back
    either: each head evicts at most the layer's ``static_evictions`` slots, which are matched against every slot
    and merged into their targets, and ``state.tau`` must already be a tensor. (Other calls on a static layer, a
    prompt chunk or a multi-token decode call, evict more and take the general path.)"""
    if rule not in MERGE_RULES:
        raise ValueError(f"merge rule must be one of {MERGE_RULES}, got {rule!r}")
    counts = layer.exact_counts() if exact and not static_step else None
    kept_all = keep & layer.valid
    evicted_all = layer.valid ^ kept_all
    if not static_step and not (bool(evicted_all.any()) if counts is None else any(counts.evicted)):
        return
    # A static step (fixed shapes, nothing read back) evicts at most the layer's slots over its smallest quota.
    one = layer.static_evictions <= 1 if static_step else counts is not None and max(counts.evicted) <= 1
    # Pass 1: best match of every evicted token, per group of heads sharing a storage layout.
    matches = []
    for heads, k, v, _ in layer.head_views():
        c = k.shape[2]
        evicted, kept = evicted_all[:, heads, :c], kept_all[:, heads, :c]
        if one or static_step:  # (no kept slot indices: its targets are slots)
            idx, real, best, target = best_match_in_slots(k, evicted, kept, 1 if one else min(layer.static_evictions, c))
            matches.append((k, v, idx, real, best, None, target))
            continue
        most = None if counts is None else (max(counts.evicted[heads]), max(counts.most[heads]))
        matches.append((k, v, *best_matches(k, evicted, kept, most)))
    # The threshold: one EMA per sequence over every evicted token of the layer (``reduce``: no launch adding 0).
    total = functools.reduce(operator.add, [(best * real).sum((1, 2)) for _, _, _, real, best, _, _ in matches])
    count = functools.reduce(operator.add, [real.sum((1, 2)) for _, _, _, real, _, _, _ in matches])
    mean = total / count.clamp(min=1)
    tau = state.tau if state.tau is not None else torch.full_like(mean, float("nan"))
    updated = torch.where(tau.isnan(), mean, beta * mean + (1 - beta) * tau)
    tau = state.tau = torch.where(count > 0, updated, tau)
    # Pass 2: merge.
    for k, v, idx, real, best, kept_idx, target in matches:
        merging = real & (best >= tau[:, None, None])
        if counts is None and not static_step and not bool(merging.any()):  # (else the kept values are written back)
            continue
        w, self_w = _weights(best, merging, rule)
        if one:
            _merge_one((k, v), idx, target, merging, w, self_w, rule)
        elif kept_idx is None:
            _merge_into_slots((k, v), idx, target, merging, w, self_w, rule)
        else:
            _merge_into_kept((k, v), idx, kept_idx, target, merging, w, self_w, rule)


@register_policy
@dataclass
class Merge(Wrapper):
    """D2O-style merging (Wan et al. 2024, arXiv:2406.13035) on top of any policy.

    Whatever the wrapped policy evicts is not simply dropped: each evicted token close enough to a kept token
    of its head (cosine similarity above an EMA threshold) is averaged into it. See ``kvgates.policies.merging``.

    Args:
        budget: as the wrapped policy's.
        base: the wrapped policy's name; base_params: its parameters.
        beta: EMA weight of the merge threshold (default 0.7).
        merge_rule: ``"paper"`` (softmax weights) or ``"official"`` (D2O code's average).
    """

    name = "merge"
    state_type = MergeState

    beta: float = 0.7
    merge_rule: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"{self.name}: beta must be in (0, 1], got {self.beta}")
        self._one_of("merge_rule", MERGE_RULES)

    def select(self, layer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        keep = self.inner.select(layer, stats, quota)
        merge_evicted(
            layer, keep, self.layer_state(layer), self.beta, self.merge_rule, exact=self.exact_quota,
            static_step=stats is not None and stats.static_step,
        )
        return keep

    def after_layer(self, layer, stats: AttnStats) -> None:
        if stats.phase is Phase.PREFILL:
            start_threshold(layer, self.layer_state(layer))
        self.inner.after_layer(layer, stats)

    @property
    def sync_free_decode(self) -> bool:
        """The wrapped policy's: merges read nothing back in a static decode step (``merge_evicted``)."""
        return self.inner.sync_free_decode

    @property
    def exact_quota(self) -> bool:
        """The wrapped policy's: merging changes the kept tokens' keys and values, not which are kept."""
        return self.inner.exact_quota
