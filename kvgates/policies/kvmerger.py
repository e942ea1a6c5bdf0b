"""KVMerger: merge runs of consecutive, similar keys into their most attended token."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kvgates import kernels
from kvgates.kernels.host import launch_bound as kernels_launch_bound
from kvgates.policies.base import register_policy
from kvgates.policies.h2o import CUMULATIVE, CumulativeAttention
from kvgates.policies.selection import recent_mask, top_held
from kvgates.runtime.state import LayerState
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase, StatsRequest

#: Thresholds of KVMerger's calibration grid scanned at once on the CPU (``KVMerger._largest_feasible``): the grid
#: is scanned from its largest thresholds down in groups of this many, and stops at the first group with a feasible
#: one. On a GPU the whole grid is one group: every group costs a scan's launches and host reads, which an early
#: stop saves on the CPU (the low thresholds' long sets are its slowest walks) but not on a GPU.
FEASIBLE_GROUP = 4

#: Tokens after each anchor whose similarities ``MergingScan`` computes for every anchor at once; a set longer than
#: this is measured on its own in the scan's walk. On SmolLM2-135M's 4K prefill on the CPU 192 took the least time of 128-320
#: (a wider window costs its band, a narrower one more walk steps); the sets found do not depend on it.
SCAN_WINDOW = 192

#: ``SCAN_WINDOW`` on a GPU, where the band (``[B, H, L, window]`` float32) fits ``GPU_BAND_ELEMENTS`` (1 GiB; else the
#: largest window that fits, at least ``SCAN_WINDOW``): each set longer than the window costs a step of the scan's
#: walk, about 15 launches (on SmolLM2-135M's 4K prefill at budget 256, 14.0 steps a layer at 192, 4.9 at 384, 0.7 at
#: 768), where a wider band costs a GPU little.
GPU_SCAN_WINDOW = 1024
GPU_BAND_ELEMENTS = 1 << 28

#: Tokens after each anchor that ``kernels.triton_ops.merging_set_ends`` compares for every anchor at once where the
#: kernels run Triton (``MergingScan.fused``); ``merging_chain`` measures a set on chain that is longer one token
#: block at a time. Without a window, every anchor of a long run of mergeable tokens (a prompt whose heavy hitters
#: cluster at its start) would be compared with the whole run: quadratic in the run's length.
FUSED_WINDOW = 256

#: Anchors per block of ``MergingScan``'s similarity band on the CPU (each block's product stays cache-sized). On a GPU,
#: where every block costs its launches and not its arithmetic, a block holds up to ``GPU_SCAN_ELEMENTS`` similarities
#: (128 MiB in float32: at 8K tokens, 8 KV heads, batch 1 and a window of 1,024, 1,600 anchors, where 128 made 64 blocks).
SCAN_BLOCK = 128
GPU_SCAN_ELEMENTS = 1 << 25

#: Steps of ``MergingScan``'s walk between two reads of whether it is done, on a GPU (one on the CPU): a read makes
#: the host wait for the device, and a step past the end changes nothing.
GPU_WALK_STEPS = 4


class MergingScan:
    """KVMerger's merging sets of one layer's keys, for any thresholds (``starts``).

    ``keys`` ``[B, H, L, D]`` are in position order. Scanning left to right, a mergeable token joins the open
    set when its cosine similarity with the set's first token (the anchor) exceeds the threshold; otherwise it
    opens a new set. A non-mergeable token (heavy hitter, window, empty) closes the open set.

    The scan is computed without a loop over tokens. The set anchored at token ``i`` ends at the first later
    token that is not mergeable or not similar enough to ``i``; the next anchor is the first mergeable token from
    there (``next(i)``), and the anchors are the chain ``first mergeable, next(first), ...``. ``next`` is found
    for every token at once from its similarities with the ``window`` tokens after it (computed once, for every
    threshold), and the chain is walked by pointer doubling. Only a set longer than ``window`` needs more: its
    anchor's similarities with every token, once per such set on the chain.

    ``launch_bound`` (default: on a GPU, ``kvgates.kernels.host.launch_bound``) trades arithmetic and memory for
    fewer launches and host reads, with the same sets: a wider window by default (``GPU_SCAN_WINDOW``), larger blocks
    of the band (``GPU_SCAN_ELEMENTS``), every doubling computed rather than a read to stop early,
    ``GPU_WALK_STEPS`` walk steps per read.

    ``fused`` (default: where the kernels run Triton, ``kvgates.kernels.backend``) takes two kernels instead:
    ``kernels.triton_ops.merging_set_ends`` ends every anchor's set within the window (``FUSED_WINDOW`` by default)
    from similarities it never stores, and ``kernels.triton_ops.merging_chain`` follows each chain in one program a
    row, measuring on the sets the window did not end: no band (1 GiB on a GPU), no walk nor its host reads, no
    pointer doubling (two launches a level over ``[E, B, H, L]`` tables).
    """

    def __init__(
        self, keys: torch.Tensor, mergeable: torch.Tensor, window: int | None = None, launch_bound: bool | None = None,
        fused: bool | None = None,
    ):
        b, h, n, _ = keys.shape
        self.launch_bound = kernels_launch_bound(keys.device) if launch_bound is None else launch_bound
        self.fused = kernels.backend(keys) == "triton" if fused is None else fused
        self.kn = torch.nn.functional.normalize(keys.float(), dim=-1)
        self.n = n
        self.idx = torch.arange(n + 1, device=keys.device)
        # For ``_set_end``: the tokens that stop every set (not mergeable), so a set ends at the first token flagged
        # or not similar enough (at the end, ``n``, when none does).
        self.blocked = ~mergeable[:, :, None, :]
        # first_from[j]: the first mergeable token at or after j (n: none), j = 0 .. n.
        open_at = torch.cat([mergeable, mergeable.new_ones((b, h, 1))], -1)
        self.first_from = torch.where(open_at, self.idx, n).flip(-1).cummin(-1).values.flip(-1)
        # stop[b, h, i]: the first token after i that is not mergeable (n: none); no set anchored at i reaches it.
        stop_at = torch.cat([~mergeable, mergeable.new_ones((b, h, 1))], -1)
        self.stop = torch.where(stop_at, self.idx, n).flip(-1).cummin(-1).values.flip(-1)[..., 1:].contiguous()
        if self.fused:  # the kernels measure every set: no band, no walk
            self.w = max(0, FUSED_WINDOW if window is None else window)
            return
        if window is None:
            window = SCAN_WINDOW
            if self.launch_bound:
                window = max(SCAN_WINDOW, min(GPU_SCAN_WINDOW, GPU_BAND_ELEMENTS // (b * h * max(1, n))))
        # drops[b, h, i, o]: minus the least similarity to anchor i among tokens i+1 .. i+1+o, non-decreasing in o
        # (entries past ``stop`` or the end are not read as such: ``_ends`` caps the sets at ``stop``).
        self.w = w = max(0, min(window, n - 1))
        self.drops = self.kn.new_empty((b, h, n, w))
        block = SCAN_BLOCK  # anchors per matmul, and per prefix maximum
        if self.launch_bound:  # the largest block within GPU_SCAN_ELEMENTS: block * (block + w) per head
            block = max(SCAN_BLOCK, int((math.sqrt(w * w + 4 * GPU_SCAN_ELEMENTS / (b * h)) - w) / 2))
        neg = -self.kn
        order = torch.empty((b, h, block, w), dtype=torch.long, device=keys.device)  # cummax's indices, unused
        for start in range(0, n, block):
            r = min(block, n - start)
            near = torch.matmul(neg[:, :, start : start + r], self.kn[:, :, start : start + r + w].transpose(-1, -2))
            if start + r + w > n:  # the last blocks: columns past the end (never read as such: ``stop``)
                near = torch.nn.functional.pad(near, (0, start + r + w - n))
            # near[.., i, i + 1 + o]: minus anchor i's similarity with the o-th token after it, a strided view.
            band = near.as_strided((b, h, r, w), (h * r * (r + w), r * (r + w), r + w + 1, 1), near.storage_offset() + 1)
            torch.cummax(band, -1, out=(self.drops[:, :, start : start + r], order[:, :, :r]))

    def _ends(self, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[E, B, H, L]``: where the set anchored at each token stops for each threshold of ``eps`` ``[E, B]``, and
        which of them are known: those within the window. From the kernel (``fused``) the second is None: its ends
        are capped at the window's end, and ``merging_chain`` measures on the sets it did not end."""
        if self.fused:
            from kvgates.kernels import triton_ops

            return triton_ops.merging_set_ends(self.kn, self.stop, eps, self.w), None
        n, idx = self.n, self.idx
        b, h = self.stop.shape[:2]
        thresh = (-eps).T[:, None, None, :].expand(-1, h, n, -1).contiguous()  # [B, H, L, E], minus eps
        # How many of the tokens after each anchor join its set within the window, per threshold.
        joined = torch.searchsorted(self.drops, thresh).permute(3, 0, 1, 2)  # [E, B, H, L]
        end = torch.minimum(joined + idx[1:], self.stop)
        return end, (end - idx[:n] <= self.w) | (end >= n)

    def starts(self, eps: torch.Tensor, cap: torch.Tensor | None = None) -> torch.Tensor:
        """Which tokens open a new merging set, ``[E, B, H, L]``, for each threshold in ``eps`` (``[E, B]``).

        ``cap`` ``[E, B, H]``: the most sets of a head that matter, per threshold. Where the kernel follows the chains
        (``fused``), a head with more is marked at its first ``cap + 1`` sets only; elsewhere every set is marked."""
        e = eps.shape[0]
        n, idx, first_from = self.n, self.idx, self.first_from
        b, h = first_from.shape[:2]
        end, resolved = self._ends(eps)
        if resolved is None:  # the kernel follows each chain, measuring on the sets longer than the window
            from kvgates.kernels import triton_ops

            cap = torch.full((e, b, h), n, device=end.device) if cap is None else cap
            return triton_ops.merging_chain(self.kn, self.stop, first_from, end, eps, cap, self.w)
        # Unresolved anchors (sets longer than the window) point to themselves, and so does the end (n).
        end = torch.nn.functional.pad(end, (0, 1), value=n)
        resolved = torch.nn.functional.pad(resolved, (0, 1), value=True)
        nxt = torch.where(resolved, first_from.expand(e, -1, -1, -1).gather(-1, end), idx)
        jumps = [nxt]  # jumps[k] = next applied 2^k times (chains only move forward)
        while (1 << (len(jumps) - 1)) <= n:
            doubled = jumps[-1].gather(-1, jumps[-1])
            if not self.launch_bound and torch.equal(doubled, jumps[-1]):  # every chain has reached its end
                break
            jumps.append(doubled)
        # Walk: from each segment's first anchor the table jumps to the next unresolved anchor (or the end); that
        # set is measured directly and the walk resumes at the anchor after it. A finished row stays at the end (n).
        sources = torch.zeros((e, b, h, n + 1), dtype=torch.int32, device=nxt.device)
        at = first_from[..., :1].expand(e, -1, -1, -1)  # [E, B, H, 1]
        last, steps = jumps[-1], GPU_WALK_STEPS if self.launch_bound else 1
        for step in itertools.count(1):
            sources.scatter_(-1, at, 1)
            stuck = last.gather(-1, at)
            if step % steps == 0 and not bool((stuck < n).any()):  # the loop's host sync (a finished row stays at n)
                break
            sources.scatter_(-1, stuck, 1)
            at = first_from.expand(e, -1, -1, -1).gather(-1, self._set_end(eps, stuck))
        # Every anchor reached from a source: T_k = T_{k+1} + jumps[k](T_{k+1}), from the longest jump down.
        marked = sources
        for jump in reversed(jumps[:-1]):
            marked = marked.scatter_reduce(-1, jump, marked, "amax")
        return marked[..., :n] > 0

    def _set_end(self, eps: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """``[E, B, H, 1]``: for the sets anchored at ``anchor`` ``[E, B, H, 1]`` and joined by the whole window after
        it, the first later token that does not join (``L`` when every later token joins, and for anchor ``L``)."""
        kn, n = self.kn, self.n
        rows = anchor[..., 0].permute(1, 2, 0)  # [B, H, E]
        anchor_key = kn.gather(2, rows.clamp(max=n - 1)[..., None].expand(-1, -1, -1, kn.shape[-1]))  # [B, H, E, D]
        sim = torch.matmul(anchor_key, kn.transpose(-1, -2))  # [B, H, E, L]
        stops = (sim <= eps.T[:, None, :, None]).logical_or_(self.blocked).logical_and_(self.idx[:n] > (rows + self.w)[..., None])
        return torch.where(stops, self.idx[:n], n).amin(-1).permute(2, 0, 1)[..., None]


def merging_set_starts(
    keys: torch.Tensor, mergeable: torch.Tensor, eps: torch.Tensor, window: int | None = None, launch_bound: bool | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Which tokens open a new merging set, ``[E, B, H, L]``, for each threshold in ``eps`` (``[E, B]``) (see
    ``MergingScan``)."""
    return MergingScan(keys, mergeable, window, launch_bound, fused).starts(eps)


@dataclass
class KVMergerState(LayerState):
    """The similarity threshold ``epsilon`` ``[B]`` the latest merge used on this layer."""

    epsilon: torch.Tensor | None = None


@register_policy
@dataclass
class KVMerger(CumulativeAttention):
    """KVMerger (Wang et al. 2024, "Model Tells You Where to Merge", arXiv:2407.08454); prompt only.

    The ``heavy`` tokens with the largest aggregated attention (cumulative over the prompt's queries,
    ``CumulativeAttention``, so attention sinks are among them) and the last ``window`` tokens are never merged. The other tokens of
    each KV head, in position order, form merging sets of consecutive tokens: a set grows while the next
    token's key has cosine similarity above ``epsilon`` with the set's first key. In each set the pivot is the
    token with the largest aggregated attention; with ``g_i = exp(-||k_p - k_i||^2 / (2 sigma^2))`` and
    ``w_i = g_i / sum g``, the pivot becomes ``k_p = sum w_i k_i``, ``v_p = sum w_i v_i`` and the set collapses
    into the pivot's slot.

    ``epsilon`` is per layer: by default it is calibrated per layer and sequence (largest value on a refined
    grid) so every head ends within ``budget``; a fixed ``epsilon`` is lowered the same way when it would
    exceed the budget. The paper's sigma rule is ambiguous: by default sigma is the mean distance of a set's
    keys to its pivot; a number fixes it. The paper scales value weights by the set size; ``scale_values``
    turns that on. No official code exists; this follows the paper and ../shared/spec/policies.md. Decode
    appends.

    Args:
        budget: tokens per KV head after merging.
        window: recent tokens never merged (default 16).
        heavy: heavy hitters never merged (default ``budget // 8``, at least 1).
        epsilon: fixed similarity threshold, or None to calibrate.
        sigma: Gaussian kernel width, or None for the mean key distance to the pivot.
        scale_values: scale value weights by the set size (paper).
        grid: thresholds per round of the calibration (two rounds, the second between the first's best and the next).
        group_reduce: how query heads combine into the aggregated attention.
    """

    name = "kvmerger"
    state_type = KVMergerState
    sync_free_decode = True  # decode appends: the merges are the prompt's, made before a static layout settles

    window: int = 16
    heavy: int | None = None
    epsilon: float | None = None
    sigma: float | None = None
    scale_values: bool = False
    grid: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        budget = self._require_budget()
        if self.heavy is None:
            self.heavy = max(1, budget // 8)
        self._at_least(0, "window", "heavy")
        # With every run merged into one token, a head holds at most heavy + window + (heavy + 1) tokens.
        self._require_budget(2 * self.heavy + self.window, f"2 * heavy + window ({2 * self.heavy + self.window})")
        if self.epsilon is not None and not -1.0 <= self.epsilon <= 1.0:
            raise ValueError(f"{self.name}: epsilon is a cosine similarity in [-1, 1], got {self.epsilon}")
        if self.sigma is not None and not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"{self.name}: sigma must be a positive finite number, got {self.sigma}")
        self._at_least(2, "grid")

    def stats_request(self, phase: Phase) -> StatsRequest:
        return super().stats_request(phase) if phase is Phase.PREFILL else NO_STATS  # decode appends

    def protected(self, layer) -> torch.Tensor:
        """Slots never merged: the recent window and the heavy hitters among the others."""
        window = recent_mask(layer, self.window)
        return window | top_held(layer, layer.state[CUMULATIVE], self.heavy, layer.valid & ~window)

    def calibrate(
        self, keys: torch.Tensor, mergeable: torch.Tensor, fixed: torch.Tensor, budget: torch.Tensor, launch_bound: bool | None = None,
        fused: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence ``[B]``: the largest threshold (up to ``epsilon``) keeping every head within ``budget``
        (``[B, H_kv]``),
        and the merging-set starts ``[B, H, L]`` it gives (from the scan that chose it). ``launch_bound``, ``fused``:
        the scan's (``MergingScan``)."""
        b = keys.shape[0]
        hi = torch.full((b,), 1.0001 if self.epsilon is None else self.epsilon, device=keys.device)
        lo = torch.full((b,), -1.0001, device=keys.device)  # merges every run: always feasible
        scan = MergingScan(keys, mergeable, launch_bound=launch_bound, fused=fused)
        for _ in range(2):  # a grid, then a finer grid between the best feasible value and the next one
            frac = torch.linspace(0.0, 1.0, self.grid, device=keys.device)[:, None]
            eps = lo[None] + frac * (hi - lo)[None]  # [E, B]
            best, starts = self._largest_feasible(scan, eps, fixed, budget)
            step = (hi - lo) / (self.grid - 1)
            lo = torch.gather(eps, 0, best[None])[0]
            hi = torch.where(best < self.grid - 1, lo + step, lo)
        return lo, starts

    def _largest_feasible(
        self, scan: MergingScan, eps: torch.Tensor, fixed: torch.Tensor, budget: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, the largest index of the grid ``eps`` ``[E, B]`` whose threshold keeps every head within
        ``budget`` (index 0 counts as feasible), and its merging-set starts ``[B, H, L]``. On the CPU the grid is
        scanned from its largest thresholds down, ``FEASIBLE_GROUP`` at a time, until every sequence has found one:
        the thresholds below are never scanned (low thresholds make long sets, the scan's slowest). On a GPU it is
        scanned at once (``MergingScan.launch_bound``)."""
        e, b = eps.shape
        group = e if scan.launch_bound else FEASIBLE_GROUP
        rows = torch.arange(b, device=eps.device)
        best = torch.zeros(b, dtype=torch.long, device=eps.device)
        found = torch.zeros(b, dtype=torch.bool, device=eps.device)
        chosen = None
        for top in range(e, 0, -group):
            low = max(0, top - group)
            # Past its budget a head's sets need not be listed; index 0's are, since it may be chosen over its budget.
            cap = (budget - fixed).expand(top - low, -1, -1).clone()
            if low == 0:
                cap[0] = scan.n
            starts = scan.starts(eps[low:top], cap)  # [e, B, H, L]
            ok = (starts.sum(-1) + fixed[None] <= budget).all(-1)  # [e, B]
            ok[0] |= low == 0
            last = (ok * torch.arange(1, top - low + 1, device=eps.device)[:, None]).amax(0) - 1  # [B], -1: none
            new = ~found & (last >= 0)
            best = torch.where(new, low + last, best)
            picked = starts[last.clamp(min=0), rows]
            chosen = picked if chosen is None else torch.where(new[:, None, None], picked, chosen)
            found |= new
            if low > 0 and bool(found.all()):  # (the last group needs no read: index 0 is feasible)
                break
        return best, chosen

    def select(self, layer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        """Merge the mergeable tokens of ``layer`` in place; return the keep mask (protected tokens + pivots)."""
        (_, k, v, pos), = layer.head_views()
        protected = self.protected(layer) & layer.valid
        # After a prompt forward into empty storage, or an eviction that compacted, the slots hold positions in order
        # and the host knows it: nothing to sort or permute.
        in_order = layer.in_position_order
        order = None if in_order else torch.argsort(torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max), dim=-1, stable=True)
        fewer_reads = kernels_launch_bound(k.device)

        def gather(t: torch.Tensor) -> torch.Tensor:  # slot order -> position order
            if in_order:
                return t
            return torch.gather(t, 2, order.reshape(*order.shape, *[1] * (t.dim() - 3)).expand(*order.shape, *t.shape[3:]))

        ks = gather(k.float())
        mergeable = gather((layer.valid & ~protected)[..., None])[..., 0]
        score = gather(layer.state[CUMULATIVE][..., None])[..., 0]
        eps, starts = self.calibrate(ks, mergeable, protected.sum(-1), quota)  # starts: [B, H, L]
        self.layer_state(layer).epsilon = eps
        merged_k, merged_v, is_pivot = kernels.merge_sets(ks, gather(v), starts, mergeable, score, self.sigma, self.scale_values)
        # Each set's merge is written to its pivot's slot (through the permutation ``order``); other slots keep theirs.
        # On a GPU every slot is written, so that nothing is read back to list the pivots (on the CPU, the pivots alone).
        if fewer_reads:
            for store, merged in ((k, merged_k), (v, merged_v)):
                if in_order:
                    store.copy_(merged)
                else:
                    store.scatter_(2, order[..., None].expand_as(merged), merged.to(store.dtype))
        else:
            rows, heads, tokens = is_pivot.nonzero(as_tuple=True)
            slot = tokens if in_order else order[rows, heads, tokens]
            for store, merged in ((k, merged_k), (v, merged_v)):
                store[rows, heads, slot] = merged[rows, heads, tokens].to(store.dtype)
        keep_sorted = gather(protected[..., None])[..., 0] | is_pivot
        return keep_sorted if in_order else torch.zeros_like(layer.valid).scatter(2, order, keep_sorted)
