"""Plain-torch semantics of every kvgates kernel.

Each function here defines what its Triton counterpart (``kvgates.kernels.triton_ops``) must compute; the
dispatch in ``kvgates.kernels`` calls these on CPU and the Triton versions on CUDA. Layout conventions:

* a dense slot layout is ``[B, H_kv, C, D]`` for keys/values and ``[B, H_kv, C]`` for slot positions
  (int64, ``-1`` = empty slot);
* the *flat* layout of a cache layer keeps keys/values as ``[B, S, D]`` where KV head ``h`` owns the rows
  ``offset[h] : offset[h] + caps[h]`` (heads may have different capacities); positions and per-slot state stay
  padded to ``[B, H_kv, C_max(, F)]``, and padded index ``j >= caps[h]`` is never valid. The ``*_flat``
  functions take that layout; with equal capacities it is exactly the dense layout viewed flat;
* queries are ``[B, H, q, D]`` with ``H = G * H_kv``; query head ``i`` reads KV head ``i // G`` (the
  ``repeat_kv`` convention of transformers);
* slot ``s`` is visible to a query at position ``p`` iff ``pos[s] >= 0`` and ``pos[s] <= p``. Visibility
  never depends on slot order, so evicted slots can be reused by later tokens.

Probabilities and scores are returned in float32 whatever the input dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from kvgates.kernels.host import launch_bound, on_device

__all__ = [
    "GROUP_REDUCTIONS",
    "group_reduce",
    "visibility",
    "attention_probs",
    "masked_attention",
    "masked_attention_colmax",
    "masked_attention_colsum",
    "own_block_start",
    "decode_attention",
    "column_sums",
    "column_max",
    "causal_attention_stats",
    "pool_by_position",
    "dense_groups",
    "decode_attention_flat",
    "window_scores",
    "window_scores_flat",
    "compact_slots",
    "scatter_flat",
    "max_similarity",
    "merge_sets",
    "retention_scores",
    "retention_sum",
]

GROUP_REDUCTIONS = ("sum", "mean", "max")

#: Attention scores (or mask entries) that may exist at once when a long prompt chunk attends over many slots:
#: query rows are processed in tiles of ``row_tile`` rows, so memory follows the chunk and the slots held
#: (linearly), never their product for every head (16 MiB of float32 scores; on the CPU, tiles four times this
#: size were slower, as they fall out of its caches).
TILE_ELEMENTS = 1 << 22
#: ``TILE_ELEMENTS`` on a GPU (256 MiB of float32), where a tile costs its launches rather than cache misses: D2O's
#: match of 7K evicted keys against 1K kept ones of 8 KV heads (an 8K prompt at batch 1) is one tile, not 14.
GPU_TILE_ELEMENTS = 1 << 26


#: Query rows per tile of ``causal_attention_stats`` (per head; CPU, SmolLM2's 9 heads at 2K-8K: 64-128 rows
#: are fastest, 1.05-1.07x faster than 28-56), and at most ``FUSED_TILE_ELEMENTS`` scores per tile (its buffer).
FUSED_TILE_ROWS = 64
FUSED_TILE_ELEMENTS = 1 << 23

#: Largest number of parts the CPU's batched products split each KV head's rows of a tile into (``_balanced_parts``),
#: and the fewest rows a part keeps: a product of many small parts runs slower than it gains.
MAX_ROW_PARTS = 4
MIN_PART_ROWS = 32


#: The parts ``row_parts`` forces on the split products (None: ``_balanced_parts`` chooses).
_FORCED_PARTS: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvgates_row_parts", default=None)


@contextlib.contextmanager
def row_parts(parts: int) -> Iterator[None]:
    """Within the block, the CPU's split products (``_balanced_parts``) split each KV head's rows into ``parts`` parts
    (1: unsplit) instead of the balancing choice, wherever a part keeps at least ``MIN_PART_ROWS`` rows: how
    ``bench/cpu_attention.py`` times each split against the default on a machine's threads. The results are the same
    whatever the parts; a GPU is never split."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"row_parts: parts must be a positive integer, got {parts!r}")
    token = _FORCED_PARTS.set(parts)
    try:
        yield
    finally:
        _FORCED_PARTS.reset(token)


def _balanced_parts(products: int, rows: int, device: torch.device) -> int:
    """Into how many parts a tile's batched product splits each KV head's ``rows`` rows (``causal_attention_stats``'
    and ``_prob_tiles``' query rows, ``_chunk_colmax``'s slots), so that the products (``products`` of them unsplit:
    batch x KV heads) are a multiple of the CPU's threads. A tile whose rows the parts do not divide runs whole.

    The CPU's batched matrix product shares its batch among the threads: SmolLM2's 3 KV heads at batch 1 on 2
    threads left one thread a head idle. 2 parts of each head's rows (6 products) made one layer's prefill attention
    at 4K 1.1-1.25x faster (1.52x sdpa's time to 1.35x, and 1.74x to 1.39x, in paired rounds), with the same results;
    3 or 4 parts were slower than 2. 1 on a GPU, where nothing is gained, where the products already divide evenly,
    and where no split of at most ``MAX_ROW_PARTS`` parts of at least ``MIN_PART_ROWS`` rows does. ``row_parts``
    forces a number of parts instead (``bench/cpu_attention.py``)."""
    if device.type != "cpu":
        return 1
    forced = _FORCED_PARTS.get()
    if forced is not None:
        return forced if rows // forced >= MIN_PART_ROWS else 1
    threads = torch.get_num_threads()
    for parts in range(1, MAX_ROW_PARTS + 1):
        if (products * parts) % threads == 0 and (parts == 1 or rows // parts >= MIN_PART_ROWS):
            return parts
    return 1


def _split_tile(tile: int, parts: int, heads: int = 1) -> int:
    """``tile`` (rows of ``heads`` heads each, the rows a KV head's product holds: ``heads x tile``) rounded down to the
    fewest rows whose products ``parts`` divides, so that every whole tile splits (``_balanced_parts``)."""
    step = parts // math.gcd(heads, parts)
    return tile - tile % step if tile > step else tile


def _per_part(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` ``[B, H_kv, ...]`` in float32 as ``[B, H_kv, parts, ...]``: the other operand of a product split into
    ``parts`` (``_balanced_parts``), a copy a part, batch-strided so that no product copies it; for one part a view
    (``x`` itself in float32: a layer's cache is not copied for a product that does not split)."""
    x = x.float()[:, :, None]
    return x if parts == 1 else x.expand(-1, -1, parts, *x.shape[3:]).contiguous()


def row_tile(batch: int, heads: int, slots: int, device: torch.device | None = None) -> int:
    """Query rows per tile so that ``batch x heads x rows x slots`` stays within ``TILE_ELEMENTS`` (on a launch-bound
    ``device``, ``host.launch_bound``: a GPU, ``GPU_TILE_ELEMENTS``)."""
    elements = GPU_TILE_ELEMENTS if device is not None and launch_bound(device) else TILE_ELEMENTS
    return max(1, elements // max(1, batch * heads * slots))


def group_reduce(x: torch.Tensor, num_kv_heads: int, mode: str) -> torch.Tensor:
    """Reduce ``[B, H, ...]`` over each GQA group to ``[B, H_kv, ...]`` with ``sum``, ``mean`` or ``max``."""
    b, h = x.shape[:2]
    grouped = x.reshape(b, num_kv_heads, h // num_kv_heads, *x.shape[2:])
    if mode == "sum":
        return grouped.sum(2)
    if mode == "mean":
        return grouped.mean(2)
    if mode == "max":
        return grouped.amax(2)
    raise ValueError(f"group reduction must be one of {GROUP_REDUCTIONS}, got {mode!r}")


def visibility(slot_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, q, C]`` bool: slot holds a token whose position is at most the query's position."""
    sp = slot_pos[:, :, None, :]
    return (sp >= 0) & (sp <= q_pos[:, None, :, None])


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, H_kv, G, q, C]`` float32 logits ``scale * q . k``.

    The group and row axes are folded into one before the matmul, so keys are never broadcast (copied) per
    query head.
    """
    b, h, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (h // hkv) * n, d).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale
    return scores.view(b, hkv, h // hkv, n, -1)


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention probabilities of each query row over the slots, ``[B, H, q, C]`` float32.

    Rows with no visible slot (a padded query before any real token) are all zero.
    """
    b, h, n, _ = q.shape
    scores = _grouped_scores(q, k, scale)
    mask = visibility(slot_pos, q_pos)[:, :, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return probs.reshape(b, h, n, -1)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` over the slots under position visibility, ``[B, H, q, D]`` in the input dtype.

    The visibility mask is built from positions one tile of query rows at a time (``row_tile``), so a long chunk
    never holds a ``[B, H, q, C]`` mask.
    """
    b, h, n, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    tile = row_tile(b, h, c)
    out = []
    for start in range(0, n, tile):
        stop = min(n, start + tile)
        mask = visibility(slot_pos, q_pos[:, start:stop])
        # A row that sees nothing would give NaN; such rows (padded queries) are discarded by the caller.
        mask = mask | ~mask.any(-1, keepdim=True)
        mask = mask[:, :, None].expand(b, hkv, h // hkv, stop - start, c).reshape(b, h, stop - start, c)
        out.append(F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def _prob_tiles(
    q: torch.Tensor, k: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor, scale: float
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, probs)`` for each tile of ``row_tile`` query rows: ``probs`` ``[B, H_kv, G, stop - start, C]``
    float32 softmax probabilities under position visibility; a row that sees nothing, and every padded row
    (``q_valid`` False), is zero. The scores are made (scale folded into the queries), masked and normalised in one
    buffer allocated once, so a tile's probabilities are overwritten by the next tile's."""
    b, h, n, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g = h // hkv
    tile, parts = _prob_tile_plan(q, k)
    q_pos = torch.where(q_valid, q_pos, torch.full_like(q_pos, -1))  # sees no slot
    scaled = q.float() * scale
    kt = _per_part(k, parts).transpose(-1, -2)
    empty = (slot_pos < 0)[:, :, None, :]
    buffer = torch.empty(b * h * tile * c, dtype=torch.float32, device=q.device)
    for start in range(0, n, tile):
        stop = min(n, start + tile)
        r = stop - start
        p = parts if (g * r) % parts == 0 else 1  # (a last, shorter tile may not split)
        rows = scaled[:, :, start:stop].reshape(b, hkv, p, g * r // p, d)
        probs = torch.matmul(rows, kt[:, :, :p], out=buffer[: b * h * r * c].view(b, hkv, p, g * r // p, c)).view(b, hkv, g, r, c)
        probs.masked_fill_((empty | (slot_pos[:, :, None, :] > q_pos[:, None, start:stop, None]))[:, :, None], float("-inf"))
        yield start, stop, _softmax_last(probs).nan_to_num_(0.0)


def _split_plan(q: torch.Tensor, k: torch.Tensor, tile: int) -> tuple[int, int]:
    """For tiles of ``tile`` query rows of ``q`` ``[B, H, n, D]`` over keys ``k`` ``[B, H_kv, ...]``: the parts each KV
    head's rows of a tile are split into (``_balanced_parts``) and the tile rounded to a multiple of what they divide
    (``_split_tile``: else every tile would run whole, beside the copies made for the split), as ``(tile, parts)``."""
    b, h = q.shape[:2]
    g = h // k.shape[1]
    parts = _balanced_parts(b * k.shape[1], g * tile, q.device)
    return _split_tile(tile, parts, g), parts


def _prob_tile_plan(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """``_prob_tiles``' query rows per tile (``row_tile``) and the parts of its split (``_split_plan``)."""
    b, h, n, _ = q.shape
    return _split_plan(q, k, max(1, min(n, row_tile(b, h, k.shape[2]))))  # (no rows: no tile)


def _softmax_last(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension: in place on the CPU (its softmax reads each row before writing it, while
    the row sits in its caches); CUDA's allocator makes a copy cheap."""
    return torch.softmax(scores, -1, out=scores) if scores.device.type == "cpu" else torch.softmax(scores, -1)


def masked_attention_colmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    row_weight: torch.Tensor | None = None,
    col_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_attention`` and ``column_max`` (with its ``row_weight``) from one softmax: ``(out [B, H, q, D] in
    q's dtype, colmax [B, H, C] float32)``. Padded rows (``q_valid`` False) get an output the caller discards (zero)
    and raise no maximum. ``row_weight`` ``[B, q]`` (>= 0) multiplies each row's probabilities; ``col_weight``
    ``[B, H, C]`` (>= 0) multiplies each query head's maxima per slot, and a slot whose weights are all zero gets 0,
    which the CPU's chunk path below does not score.

    On the CPU, a chunk that attends over older tokens and its own (``own_block_start``: what KVzip's reconstruction
    forwards are) takes the chunk path, ``_chunk_colmax``: two calls of the fused flash kernel give the output and
    each row's log-sum-exp, and the maxima are taken from those without a softmax. Otherwise the probabilities are
    made one tile of rows at a time (``_prob_tiles``). (On CUDA, ``kvgates.kernels`` runs the Triton kernel of any
    layout, ``triton_ops.masked_attention_colmax``.)"""
    b, h, n, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    own = own_block_start(slot_pos, q_pos, q_valid) if q.device.type == "cpu" else None
    if own is not None:
        return _chunk_colmax(q, k, v, own, scale, row_weight, col_weight)
    best = q.new_zeros((b, hkv, h // hkv, c), dtype=torch.float32)
    weight = None if row_weight is None else row_weight.float()
    out = _tiled_attention(q, k, v, slot_pos, q_pos, q_valid, scale, lambda start, stop, probs: _raise_maxima(best, probs, weight, start, stop))
    best = best.reshape(b, h, c)
    return out, best if col_weight is None else best * col_weight


def masked_attention_colsum(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_attention`` and ``column_sums`` from one softmax, one tile of rows at a time (``_prob_tiles``):
    ``(out [B, H, q, D] in q's dtype, colsum [B, H, C] float32)``, a prompt chunk's attention over what the cache
    holds with the column sums H2O, D2O and KVMerger accumulate. Padded rows (``q_valid`` False) get an output the
    caller discards (zero) and add nothing."""
    b, h, _, _ = q.shape
    hkv, c = k.shape[1], k.shape[2]
    sums = q.new_zeros((b, hkv, h // hkv, c), dtype=torch.float32)
    out = _tiled_attention(q, k, v, slot_pos, q_pos, q_valid, scale, lambda start, stop, probs: sums.add_(probs.sum(3)))
    return out, sums.reshape(b, h, c)


def _tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor,
    scale: float, reduce: Callable[[int, int, torch.Tensor], object],
) -> torch.Tensor:
    """Attention under position visibility, ``[B, H, q, D]`` in q's dtype, from the probabilities of ``_prob_tiles``;
    each tile's ``(start, stop, probs)`` is then handed to ``reduce`` (the statistics taken from them; it may
    overwrite them)."""
    b, h, n, _ = q.shape
    hkv, c = k.shape[1], k.shape[2]
    _, parts = _prob_tile_plan(q, k)
    vp = _per_part(v, parts)  # as ``_prob_tiles``' keys
    out = q.new_empty((b, n, h, v.shape[-1]), dtype=torch.float32).transpose(1, 2)
    for start, stop, probs in _prob_tiles(q, k, slot_pos, q_pos, q_valid, scale):
        g, r = probs.shape[2], stop - start
        p = parts if (g * r) % parts == 0 else 1
        out[:, :, start:stop] = torch.matmul(probs.view(b, hkv, p, g * r // p, c), vp[:, :, :p]).view(b, h, r, -1)
        reduce(start, stop, probs)
    return out.to(q.dtype)


def own_block_start(slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor) -> int | None:
    """The first slot of the queries' own tokens when ``C - q`` older tokens come first: every query row is real, their
    positions increase, the last ``q`` slots of every head hold those positions in order, and every slot before them
    holds a token older than the first query. Query ``t`` then sees every older slot and its own block's first
    ``t + 1`` slots: plain attention over the older slots and causal attention over its own. None otherwise (empty
    or reused slots, padded rows)."""
    n, c = q_pos.shape[1], slot_pos.shape[2]
    first = c - n
    if n == 0 or first < 0 or not bool(q_valid.all()) or not bool((q_pos[:, 1:] > q_pos[:, :-1]).all()):
        return None
    own, older = slot_pos[..., first:], slot_pos[..., :first]
    if not torch.equal(own, q_pos[:, None, :].expand_as(own)):
        return None
    return first if bool(((older >= 0) & (older < q_pos[:, None, :1])).all()) else None


def _chunk_colmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float, row_weight: torch.Tensor | None,
    col_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_attention_colmax`` of a chunk whose own tokens fill the slots from ``first`` on (``own_block_start``),
    on the CPU.

    The output is two fused flash calls merged by their log-sum-exps: the older slots without a mask (query heads
    folded into rows, so grouped keys are never repeated), the own block causal. The largest weighted probability of
    slot ``j`` is ``exp(max_t (scale q_t . k_j - lse_t + log w_t))``: one product of the queries, with the column
    ``log w_t - lse_t`` appended, and the keys, with a column of ones appended; no softmax is made. Only slots with a
    positive ``col_weight`` (from the first to the last) are scored, a tile of slots at a time (``TILE_ELEMENTS``)."""
    b, h, n, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g = h // hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qf, kf, vf = q.float(), k.float(), v.float()
    own_k, own_v = kf[:, :, first:].repeat_interleave(g, 1), vf[:, :, first:].repeat_interleave(g, 1)
    out, lse = flash(qf, own_k, own_v, is_causal=True, scale=scale)
    if first:
        older, older_lse = flash(qf.reshape(b, hkv, g * n, d), kf[:, :, :first], vf[:, :, :first], scale=scale)
        older, older_lse = older.reshape(b, h, n, -1), older_lse.reshape(b, h, n)
        total = torch.logaddexp(lse, older_lse)
        out = older * (older_lse - total).exp()[..., None] + out * (lse - total).exp()[..., None]
        lse = total
    best = q.new_zeros((b, h, c), dtype=torch.float32)
    lo, hi = _scored_span(col_weight, c)
    if hi == lo:
        return out.to(q.dtype), best
    shift = -lse if row_weight is None else row_weight.float().log()[:, None] - lse
    tile = max(1, TILE_ELEMENTS // max(1, b * h * n))
    # Each KV head's slots of a tile in ``parts`` products, over as many copies of its rows (``_balanced_parts``).
    parts = _balanced_parts(b * hkv, min(tile, hi - lo), q.device)
    tile = _split_tile(tile, parts)
    rows = _per_part(torch.cat([qf * scale, shift[..., None]], -1).reshape(b, hkv, g * n, d + 1), parts).transpose(-1, -2)
    keys = torch.cat([kf[:, :, lo:hi], kf.new_ones((b, hkv, hi - lo, 1))], -1)  # the scored span only
    buffer = torch.empty(b * h * min(tile, hi - lo) * n, dtype=torch.float32, device=q.device)  # one, for every tile
    for start in range(lo, hi, tile):
        stop = min(hi, start + tile)
        p = parts if (stop - start) % parts == 0 else 1  # (a last, shorter tile may not split)
        part = (b, hkv, p, (stop - start) // p)
        out_tile = buffer[: b * h * (stop - start) * n].view(*part, g * n)
        top = torch.matmul(keys[:, :, start - lo : stop - lo].view(*part, d + 1), rows[:, :, :p], out=out_tile)
        top = top.view(b, hkv, stop - start, g, n)  # [.., slot, head, row]
        if stop > first:  # own slots: row t sees own slot j from t = j on
            j = torch.arange(max(start, first), stop, device=q.device) - first
            top[:, :, max(start, first) - start :].masked_fill_((torch.arange(n, device=q.device) < j[:, None])[:, None], float("-inf"))
        best[..., start:stop] = top.amax(-1).exp_().permute(0, 1, 3, 2).reshape(b, h, stop - start)
    return out.to(q.dtype), best if col_weight is None else best * col_weight


def _scored_span(col_weight: torch.Tensor | None, slots: int) -> tuple[int, int]:
    """``(lo, hi)``: the slots from the first to the last with a positive ``col_weight`` ``[B, H, C]`` in any row or
    head (all ``slots`` without weights; ``lo == hi`` when none is positive), the only ones whose maxima the chunk
    path computes (one read-back; the Triton kernel skips slots weighing 0 on the device)."""
    if col_weight is None:
        return 0, slots
    wanted = (col_weight > 0).flatten(0, 1).any(0).nonzero()
    return (int(wanted[0]), int(wanted[-1]) + 1) if len(wanted) else (0, 0)


def _raise_maxima(best: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor | None, start: int, stop: int) -> None:
    """Raise ``best`` ``[B, H_kv, G, C]`` to each column's largest probability in the tile of rows ``[start, stop)``
    (``_prob_tiles``), each row's first multiplied by ``weight`` ``[B, q]`` if given (probabilities are >= 0 and
    padded rows zero: only a weight needs multiplying)."""
    if weight is not None:
        probs.mul_(weight[:, None, None, start:stop, None])
    torch.maximum(best, probs.amax(3), out=best)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor | None,
    scale: float,
    reduce: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per sequence over the slots, plus each slot's attention probability.

    Args:
        q: ``[B, H, D]`` the current query (its own key is already in a slot).
        k, v: ``[B, H_kv, C, D]``.
        slot_pos: ``[B, H_kv, C]``; every valid slot is visible (it holds a past or the current token). None: every
            slot holds a token (a packed layer's held slice), nothing to mask.
        scale: softmax scale.
        reduce: ``"sum"`` returns probabilities summed over each GQA group ``[B, H_kv, C]``;
            ``"none"`` returns them per query head ``[B, H, C]``.

    Returns:
        ``(out [B, H, D] in q's dtype, probs float32)``; empty slots get probability 0 (a head of only empty slots gives
        a zero output), and a NaN key a NaN output, as sdpa's.
    """
    b, h, d = q.shape
    scores = _grouped_scores(q[:, :, None], k, scale)[:, :, :, 0]  # [B, H_kv, G, C]
    if slot_pos is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # a head holding nothing attends to nothing (zero); a NaN key gives NaN, as sdpa and the kernel do
        empty = slot_pos < 0
        scores = scores.masked_fill(empty[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill_(empty.all(-1)[:, :, None, None], 0.0)
    out = torch.matmul(probs, v.float()).reshape(b, h, d).to(q.dtype)  # [B, H_kv, G, C] @ [B, H_kv, C, D]
    if reduce == "sum":
        return out, probs.sum(2)
    if reduce == "none":
        return out, probs.reshape(b, h, -1)
    raise ValueError(f"reduce must be 'sum' or 'none', got {reduce!r}")


def column_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sum over the (valid) query rows of their attention probabilities per slot, ``[B, H, C]`` float32.

    The rows are processed one tile at a time (``row_tile``: at most ``TILE_ELEMENTS`` probabilities exist at
    once); the masked softmax and the row sum run in place on that tile.
    """
    return _column_reduce(q, k, slot_pos, q_pos, q_valid, scale, "sum")


def column_max(
    q: torch.Tensor,
    k: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest attention probability any (valid) query row gives each slot, ``[B, H, C]`` float32 (0 for a
    slot no valid row sees), each row's probabilities first multiplied by ``row_weight`` ``[B, q]`` (>= 0) if
    given. Tiled like ``column_sums``."""
    return _column_reduce(q, k, slot_pos, q_pos, q_valid, scale, "max", row_weight)


def _column_reduce(
    q: torch.Tensor,
    k: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    how: str,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    b, h, n, _ = q.shape
    hkv = k.shape[1]
    total = q.new_zeros((b, hkv, h // hkv, k.shape[2]), dtype=torch.float32)
    weight = None if row_weight is None else row_weight.float()
    for start, stop, probs in _prob_tiles(q, k, slot_pos, q_pos, q_valid, scale):
        if how == "sum":  # padded rows are zero (``column_sums`` weighs no rows)
            total += probs.sum(3)
        else:
            _raise_maxima(total, probs, weight, start, stop)
    return total.reshape(b, h, -1)


@torch.no_grad()
def causal_attention_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, colsum: bool = True, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Causal attention of a prompt over its own keys, and the statistics of its probabilities a policy asks for.

    Args:
        q: ``[B, H, n, D]`` the prompt's queries; k, v: ``[B, H_kv, n, D]`` its keys and values (query ``i`` sees
            keys ``0 .. i``, the prompt's causal mask; no padding).
        scale: softmax scale.
        colsum: whether to return the column sums of every query row's probabilities (H2O, D2O, KVMerger).
        window: how many last query rows to sum probabilities over (observation-window scores of SnapKV,
            PyramidKV, Ada-KV, DynamicKV); 0 for none, at most ``n`` are used.

    Returns:
        ``(out [B, H, n, D] in q's dtype, colsum [B, H, n] float32 or None, window [B, H, n] float32 or None)``,
        per query head: ``colsum[b, h, j]`` is the sum over every query of its probability on key ``j``
        (``column_sums`` of the same rows), ``window[b, h, j]`` the sum over the last ``window`` queries.
        With column sums the rows are processed one tile at a time (``FUSED_TILE_ROWS`` rows, at most
        ``FUSED_TILE_ELEMENTS`` scores; on the CPU each KV head's rows in as many products as balance its threads,
        ``_balanced_parts``), and a tile of rows ``[start, stop)`` scores only the keys ``[0, stop)`` it can see,
        so the probabilities that give the output give both statistics. Every tile's scores are written into one
        buffer allocated once and normalised there by a softmax (in place on the CPU, ``_softmax_last``). Without
        column sums the output is sdpa's and the window rows are scored on their own. An inference kernel: no
        gradient flows through it.
    """
    b, h, n, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    w = min(window, n)
    if not colsum:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != hkv)
        if not w:
            return out, None, None
        pos = torch.arange(n, device=q.device).expand(b, hkv, n)
        rows = torch.arange(n - w, n, device=q.device).expand(b, w)
        return out, None, attention_probs(q[:, :, n - w :], k, pos, rows, scale).sum(2)
    # Written in [B, n, H, D] memory, the layout attention returns to the model in: transposing it back is free.
    out = q.new_empty((b, n, h, v.shape[-1])).transpose(1, 2)
    sums = q.new_zeros((b, hkv, g, n), dtype=torch.float32)
    win = q.new_zeros((b, hkv, g, n), dtype=torch.float32) if w else None
    qs = (q.float() * scale).view(b, hkv, g, n, d)
    tile, parts = _stats_tile_plan(q, k)
    kt, vp = _per_part(k, parts).transpose(-1, -2), _per_part(v, parts)
    scores = torch.empty(b * h * tile * n, dtype=torch.float32, device=q.device)
    future = torch.ones((tile, tile), dtype=torch.bool, device=q.device).triu_(1)
    for start in range(0, n, tile):
        stop = min(n, start + tile)
        r = stop - start
        p = parts if (g * r) % parts == 0 else 1  # (a last, shorter tile may not split)
        rows_q = qs[:, :, :, start:stop].reshape(b, hkv, p, g * r // p, d)
        buffer = scores[: b * h * r * stop].view(b, hkv, p, g * r // p, stop)
        e = torch.matmul(rows_q, kt[:, :, :p, :, :stop], out=buffer).view(b, hkv, g, r, stop)
        e[..., start:].masked_fill_(future[:r, :r], float("-inf"))
        e = _softmax_last(e)  # shifted by each row's maximum: no overflow to check, no host sync
        sums[..., :stop] += e.sum(-2)
        if win is not None and stop > n - w:  # this tile holds window rows: the same probabilities, those rows only
            win[..., :stop] += e[..., max(0, n - w - start) :, :].sum(-2)
        out[:, :, start:stop] = torch.matmul(e.view(b, hkv, p, g * r // p, stop), vp[:, :, :p, :stop]).view(b, h, r, -1)
    return out, sums.view(b, h, n), None if win is None else win.view(b, h, n)


def _stats_tile_plan(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """``causal_attention_stats``' query rows per tile (column sums: ``FUSED_TILE_ROWS``, at most
    ``FUSED_TILE_ELEMENTS`` scores) and the parts of its split, each over its own copy of the head's keys and values
    (``_split_plan``)."""
    b, h, n, _ = q.shape
    return _split_plan(q, k, max(1, min(n, FUSED_TILE_ROWS, FUSED_TILE_ELEMENTS // max(1, b * h * n))))  # (no rows: no tile)


def pool_by_position(scores: torch.Tensor, slot_pos: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """1-D pooling of per-slot scores along position order (stride 1, same padding).

    Slots are sorted by position first, so pooling neighbours are neighbouring *tokens* even after slot reuse.
    Empty slots sort last and score 0, which acts as the zero padding of ``avg_pool1d`` (padding counted).
    """
    if kernel <= 1:
        return scores
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd to keep positions aligned, got {kernel}")
    shape = scores.shape
    flat_scores = scores.reshape(-1, shape[-1])
    flat_pos = slot_pos.reshape(-1, shape[-1])
    big = torch.iinfo(flat_pos.dtype).max
    order = torch.argsort(torch.where(flat_pos >= 0, flat_pos, big), dim=-1, stable=True)
    ordered = torch.gather(flat_scores, -1, order).masked_fill(torch.gather(flat_pos, -1, order) < 0, 0.0)
    pad = kernel // 2
    if mode == "max":
        pooled = F.max_pool1d(ordered[:, None], kernel, stride=1, padding=pad)[:, 0]
    elif mode == "avg":
        pooled = F.avg_pool1d(ordered[:, None], kernel, stride=1, padding=pad, count_include_pad=True)[:, 0]
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    out = torch.empty_like(flat_scores).scatter_(-1, order, pooled)
    return out.reshape(shape)


def dense_groups(
    keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, caps: list[int]
) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Flat storage as dense ``(heads, k [B, h, c, D], v, pos [B, h, c])`` views: one group when every head has
    the same capacity, else one group per head."""
    b, hkv = keys.shape[0], len(caps)
    d, dv = keys.shape[-1], values.shape[-1]
    if len(set(caps)) <= 1:
        c = caps[0] if caps else 0
        return [(slice(0, hkv), keys.view(b, hkv, c, d), values.view(b, hkv, c, dv), pos[:, :, :c])]
    groups, off = [], 0
    for h, c in enumerate(caps):
        groups.append(
            (slice(h, h + 1), keys[:, off : off + c].view(b, 1, c, d), values[:, off : off + c].view(b, 1, c, dv), pos[:, h : h + 1, :c])
        )
        off += c
    return groups


def _pad_slots(parts: list[torch.Tensor], cmax: int) -> torch.Tensor:
    return torch.cat([F.pad(p, (0, cmax - p.shape[-1])) for p in parts], dim=1)


def decode_attention_flat(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    caps: list[int],
    scale: float,
    reduce: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` over flat (possibly ragged) storage; probabilities padded to ``C_max``."""
    g = q.shape[1] // len(caps)
    outs, probs = [], []
    for heads, k, v, p in dense_groups(keys, values, pos, caps):
        o, pr = decode_attention(q[:, heads.start * g : heads.stop * g], k, v, p, scale, reduce)
        outs.append(o)
        probs.append(pr)
    return torch.cat(outs, dim=1), _pad_slots(probs, pos.shape[-1])


def window_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    reduce: str = "sum",
) -> torch.Tensor:
    """Observation-window score ``[B, H_kv, C]``: attention probabilities of the window rows ``q`` ``[B, H, w, D]``
    that ``q_valid`` (``[B, w]``, bool: a padding row is not) marks, summed over rows, then over (``sum``) or averaged
    across (``mean``) each GQA group."""
    probs = attention_probs(q, k, slot_pos, q_pos, scale) * q_valid[:, None, :, None]
    return group_reduce(probs.sum(2), k.shape[1], reduce)


def window_scores_flat(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    caps: list[int],
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    reduce: str = "sum",
) -> torch.Tensor:
    """``window_scores`` over flat (possibly ragged) storage, padded to ``C_max``."""
    g = q.shape[1] // len(caps)
    parts = [
        window_scores(q[:, heads.start * g : heads.stop * g], k, p, q_pos, q_valid, scale, reduce)
        for heads, k, _, p in dense_groups(keys, values, pos, caps)
    ]
    return _pad_slots(parts, pos.shape[-1])


def compact_slots(
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    state: torch.Tensor,
    index: torch.Tensor,
    old_caps: list[int],
    new_caps: list[int],
    state_init: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild a layer's storage: new slot ``j`` of head ``h`` takes old slot ``index[b, h, j]``.

    Args:
        keys, values: flat ``[B, S, D]`` storage laid out by ``old_caps``.
        pos: ``[B, H_kv, C_old]``; state: ``[B, H_kv, C_old, F]`` float32 per-slot policy state.
        index: ``[B, H_kv, C_new]`` with ``C_new = max(new_caps)``. Entries at ``j >= new_caps[h]`` are ignored;
            an entry ``>= old_caps[h]`` makes an empty slot (zero key/value, position -1, ``state_init``).
        state_init: ``[F]`` initial state of an empty slot.

    Returns:
        ``(keys, values, pos, state)`` laid out by ``new_caps``.
    """
    b, hkv = pos.shape[:2]
    cnew = index.shape[-1]
    old_caps_t = on_device(old_caps, pos.device)[None, :, None]
    new_exists = (torch.arange(cnew, device=pos.device)[None, :] < on_device(new_caps, pos.device)[:, None])[None]
    src_ok = (index < old_caps_t) & new_exists
    safe = torch.where(src_ok, index, torch.zeros_like(index)).clamp(max=max(pos.shape[-1] - 1, 0))
    offsets = on_device([sum(old_caps[:h]) for h in range(hkv)], pos.device)[None, :, None]
    flat_src = torch.cat([(safe + offsets)[:, h, : new_caps[h]] for h in range(hkv)], dim=1)
    flat_ok = torch.cat([src_ok[:, h, : new_caps[h]] for h in range(hkv)], dim=1)[..., None]
    if keys.shape[1]:
        new_k = torch.gather(keys, 1, flat_src[..., None].expand(*flat_src.shape, keys.shape[-1]))
        new_v = torch.gather(values, 1, flat_src[..., None].expand(*flat_src.shape, values.shape[-1]))
        new_k, new_v = torch.where(flat_ok, new_k, 0), torch.where(flat_ok, new_v, 0)
    else:
        new_k = keys.new_zeros((b, flat_src.shape[1], keys.shape[-1]))
        new_v = values.new_zeros((b, flat_src.shape[1], values.shape[-1]))
    if pos.shape[-1]:
        new_pos = torch.where(src_ok, torch.gather(pos, 2, safe), torch.full_like(safe, -1))
        new_state = torch.gather(state, 2, safe[..., None].expand(b, hkv, cnew, state.shape[-1]))
        new_state = torch.where(src_ok[..., None], new_state, state_init.to(state.dtype))
    else:
        new_pos = torch.full_like(index, -1)
        new_state = state_init.to(state.dtype).expand(b, hkv, cnew, state.shape[-1]).clone()
    return new_k, new_v, new_pos, new_state


def scatter_flat(tensors: list[torch.Tensor], index: torch.Tensor, updates: list[torch.Tensor]) -> None:
    """In-place write ``t[b, index[b, j]] = u[b, j]``; ``updates`` are ``[B, H_kv, n, D]`` flattened to ``[B, H_kv*n, D]``."""
    for t, u in zip(tensors, updates):
        u = u.reshape(index.shape[0], index.shape[1], t.shape[-1]).to(t.dtype)
        t.scatter_(1, index[..., None].expand(*index.shape, t.shape[-1]), u)


def max_similarity(rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row ``[B, H, E, D]``, its largest dot product with the ``valid`` (``[B, H, K]``) columns ``[B, H, K,
    D]`` and the first column that reaches it: ``(best [B, H, E] float32, target [B, H, E] int64)``; ``-inf`` (and
    column 0) where a head has no valid column. A NaN product (a NaN or infinite key) matches nothing, as an invalid
    column: a row with no other match gets ``-inf``. One tile of rows at a time (``row_tile``): ``E x K`` products are
    never held at once. D2O's match of each evicted key with its most similar kept key (unit keys: cosine
    similarities)."""
    b, h, e, _ = rows.shape
    if cols.shape[2] == 0:  # nothing to match (a max over no column would raise)
        return rows.new_full((b, h, e), float("-inf"), dtype=torch.float32), torch.zeros((b, h, e), dtype=torch.long, device=rows.device)
    rows, cols_t = rows.float(), cols.float().transpose(-1, -2)  # (the kernel's precision, and its float32 result)
    tile = row_tile(b, h, cols.shape[2], rows.device)
    invalid = ~valid[:, :, None, :]
    best, target = [], []
    for start in range(0, e, tile):
        sim = torch.matmul(rows[:, :, start : start + tile], cols_t)
        top = sim.masked_fill_(invalid | sim.isnan(), float("-inf")).max(-1)
        best.append(top.values)
        target.append(top.indices)
    if not best:
        return rows.new_zeros((b, h, 0)), torch.zeros((b, h, 0), dtype=torch.long, device=rows.device)
    return torch.cat(best, -1), torch.cat(target, -1)


def merge_sets(
    keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, mergeable: torch.Tensor, score: torch.Tensor,
    sigma: float | None = None, scale_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVMerger's merge of each merging set into its pivot, for keys ``[B, H, L, D]`` and values ``[B, H, L, Dv]`` in
    position order.

    A set opens at each mergeable token of ``starts`` (``[B, H, L]``, bool) and runs over the mergeable tokens
    (``mergeable``) after it up to the next start or unmergeable token; the first mergeable token after an unmergeable
    one must open a set (as ``MergingScan``'s starts do). The pivot is the set's first token of largest ``score``
    (``[B, H, L]``). With ``d_i = ||k_i - k_p||``, ``sigma`` (None: the mean ``d_i`` of the set's other tokens, at
    least 1e-6), ``g_i = exp(-d_i^2 / (2 sigma^2))`` and ``w_i = g_i / sum g``, the pivot's key becomes ``sum w_i k_i``
    and its value ``sum w_i v_i`` (times the set's size with ``scale_values``). Returns ``(keys, values, is_pivot
    [B, H, L])``: every token but the pivots keeps its own key and value; computed in float32, returned in the
    inputs' dtypes."""
    kf, vf = keys.float(), values.float()
    n = keys.shape[2]
    set_id = torch.where(mergeable, starts.long().cumsum(-1) - 1, 0)  # sets are runs: a scatter per set
    shape = (*set_id.shape[:2], max(n, 1))  # (at most one set a token: nothing is read back to count them)
    masked_score = torch.where(mergeable, score.float(), float("-inf"))
    best = torch.full(shape, float("-inf"), device=keys.device).scatter_reduce(2, set_id, masked_score, "amax")
    idx = torch.arange(n, device=keys.device).expand_as(set_id)
    is_best = mergeable & (masked_score == torch.gather(best, 2, set_id))
    pivot = torch.full(shape, n, device=keys.device).scatter_reduce(2, set_id, torch.where(is_best, idx, n), "amin")
    pivot_of = torch.gather(pivot, 2, set_id).clamp(max=n - 1)  # each token's set's pivot
    dist = (kf - torch.gather(kf, 2, pivot_of[..., None].expand_as(kf))).norm(dim=-1)
    member = mergeable.float()
    size = torch.zeros(shape, device=keys.device).scatter_add_(2, set_id, member)
    if sigma is None:
        spread = torch.zeros(shape, device=keys.device).scatter_add_(2, set_id, dist * member) / (size - 1).clamp(min=1)
        width = torch.gather(spread, 2, set_id).clamp(min=1e-6)
    else:
        width = torch.full_like(dist, sigma)
    g = torch.exp(-(dist**2) / (2 * width**2)) * member
    norm = torch.zeros(shape, device=keys.device).scatter_add_(2, set_id, g)
    w = g / torch.gather(norm, 2, set_id).clamp(min=1e-30)
    wv = w * torch.gather(size, 2, set_id) if scale_values else w
    is_pivot = mergeable & (idx == pivot_of)
    merged = []
    for own, weight in ((kf, w), (vf, wv)):
        ids = set_id[..., None].expand_as(own)
        total = torch.zeros((*shape, own.shape[-1]), device=keys.device).scatter_add_(2, ids, own * weight[..., None])
        merged.append(torch.where(is_pivot[..., None], torch.gather(total, 2, ids), own))
    return merged[0].to(keys.dtype), merged[1].to(values.dtype), is_pivot


def retention_scores(log_beta: torch.Tensor, slot_pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """TRIM-KV decayed retention ``(t - pos) * log_beta`` per slot, float32 (half precision would round the ages: bfloat16
    holds whole numbers only up to 256); empty slots get ``-inf``.

    Args:
        log_beta: ``[B, H_kv, C]`` float (<= 0).
        slot_pos: ``[B, H_kv, C]``.
        t: ``[B]`` current position of each sequence.
    """
    age = (t[:, None, None] - slot_pos).float()
    return (age * log_beta.float()).masked_fill(slot_pos < 0, float("-inf"))


def _age(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``([len(rows), n] ages t - i clamped at 0, [len(rows), n] future i > t)`` for the rows ``t`` in ``rows``, over
    the keys ``i < n = max(rows) + 1``: keys after every row weigh 0 and are left out."""
    n = int(rows.max()) + 1
    age = (rows[:, None] - torch.arange(n, device=rows.device)[None, :]).to(dtype)
    future = age < 0
    return age.clamp_(min=0), future


class _RetentionSum(torch.autograd.Function):
    """``S_t = sum_{i <= t} exp((t - i) lb_i)`` for the requested rows ``t``, ``block`` rows at a time in the forward
    and the backward: memory is ``block x T`` per row of ``log_beta``, never ``T x T`` for all of them; each block
    reads only the keys up to its last row (half the work of the whole square on average)."""

    @staticmethod
    def forward(ctx, log_beta: torch.Tensor, rows: torch.Tensor, block: int) -> torch.Tensor:
        lb = log_beta if log_beta.dtype == torch.float64 else log_beta.float()
        out = lb.new_empty((*lb.shape[:-1], rows.numel()))
        for start in range(0, rows.numel(), block):
            age, future = _age(rows[start : start + block], lb.dtype)
            # lb <= 0 and age >= 0: every term is in (0, 1], so a plain sum is stable. Future tokens weigh 0.
            terms = (age * lb[..., None, : age.shape[-1]]).exp_().masked_fill_(future, 0.0)
            out[..., start : start + block] = terms.sum(-1)
        ctx.save_for_backward(lb, rows)
        ctx.block = block
        return out.to(log_beta.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        lb, rows = ctx.saved_tensors
        g = grad.to(lb.dtype)
        out = torch.zeros_like(lb)
        for start in range(0, rows.numel(), ctx.block):
            age, future = _age(rows[start : start + ctx.block], lb.dtype)
            n = age.shape[-1]
            # dS_t / dlb_i = (t - i) exp((t - i) lb_i) for i <= t, weighted by each row's gradient and summed.
            term = (age * lb[..., None, :n]).exp_().mul_(age).masked_fill_(future, 0.0)
            out[..., :n] += (g[..., None, start : start + ctx.block] @ term).squeeze(-2)
        return out.to(grad.dtype), None, None


def retention_sum(log_beta: torch.Tensor, rows: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    """Training-time retention mass ``S_t = sum_{i <= t} beta_i^(t - i)``, differentiable.

    Args:
        log_beta: ``[..., T]`` (<= 0, as retention gates give).
        rows: 1-D positions ``t`` to compute (default: all ``T``); the result is ``[..., len(rows)]``. The capacity
            loss only needs ``t`` beyond the budget, and a strided subset of those estimates its mean.
        block: rows processed at once; memory stays ``block x T`` per leading index in the forward and the
            backward (the Triton kernel keeps one tile per program instead).
    """
    if rows is None:
        rows = torch.arange(log_beta.shape[-1], device=log_beta.device)
    return _RetentionSum.apply(log_beta, rows.to(device=log_beta.device, dtype=torch.int64), block)
