"""Triton kernels of the cache runtime. Each function has the signature and semantics of its namesake in
``kvgates.kernels.reference`` (the tests hold them to it, on CPU under ``TRITON_INTERPRET=1``); ``decode_attention_flat``
and ``causal_attention_stats`` also take a launch configuration (``bench/kernels.py``'s sweeps pass each one).

* ``decode_attention_flat`` — flash decoding over flat (ragged) storage: the slots are split across programs
  (about two per SM whatever the batch, so batch 1 fills the GPU too), each writing a partial output, max and
  normaliser; the query heads of a GQA group share every key/value load; each slot's logit is written once. A
  second kernel combines the splits (the global normaliser) and turns the logits into probabilities (summed
  over the group), so policies need no second pass over the keys.
* ``window_scores_flat`` — observation-window scoring: a row-statistics pass (the slots split across programs,
  as in decoding) and a column pass over the keys, one ``BLOCK_R x BLOCK_N`` tile at a time (the ``w x C``
  probabilities never exist); a small kernel combines the splits' row statistics in between (three launches a call,
  two with one split).
* ``causal_attention_stats`` — prefill attention (flash-attention forward, storing each row's logsumexp) and,
  in a second key-block-major pass that recomputes the logits, the column sums and window scores of its
  probabilities: each program owns a block of keys and loops over the query rows that see them (no atomics,
  no host sync, fp32 accumulation).
* ``masked_attention_colmax`` / ``masked_attention_colsum`` — attention under position visibility (any slot layout:
  padded rows, empty or reused slots) and each slot's largest weighted probability (KVzip's reconstruction
  forwards) or their sum (H2O, D2O, KVMerger over a prompt chunk after others): the same two passes, the mask read
  from the slots' and rows' positions.
* ``pool_by_position`` — 1-D pooling along token order through a slot permutation.
* ``compact_slots`` — keys, values, positions and per-slot state of a layer rebuilt in one launch.
* ``max_similarity`` — D2O's most similar kept key for each evicted one: the running maximum over tiles of products,
  none stored (float32 in three TF32 passes on a GPU).
* ``merging_set_ends`` / ``merging_chain`` — where KVMerger's merging sets end within a window, for every anchor and
  threshold, from similarities computed a tile at a time and never stored; then the chain of anchors from the first,
  one program a row, measuring on the sets the window did not end (no torch namesakes: ``MergingScan`` computes the
  same sets on the CPU from a band of similarities, a walk and pointer doubling).
* ``merge_sets`` — KVMerger's merges: each set found from its anchor, its pivot, spread and weighted sums, one block of
  anchors a program, written to the pivot (the torch reference's scatters over ``[B, H, L, D]`` float32 tensors in
  one launch).
* ``retention_scores`` / ``retention_sum`` — TRIM-KV decayed scores, and the capacity-loss retention mass with
  its backward, tiled so no ``T x T`` matrix is formed.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any

import torch
import triton
import triton.language as tl

from kvgates.kernels.host import PREFILL_CONFIG_ENV, on_device

_LOG2E = 1.4426950408889634


def _pow2(n: int, lo: int = 16) -> int:
    """The least power of two at least ``n`` and ``lo``."""
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied only if its last axis is not contiguous (the kernels take every other stride)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers. (``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions:
    from Python a call costs microseconds, and a decode step's launch computed nine of them.)"""
    return -(-a // b)


@lru_cache(maxsize=256)
def _layout(caps: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, caps) of a flat layout as int32 device tensors, cached per layout (copied without a host sync: a
    ragged policy's new layouts come mid-prefill)."""
    offsets = [sum(caps[:h]) for h in range(len(caps))]
    return on_device(offsets, device, torch.int32), on_device(list(caps), device, torch.int32)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter computes ``tl.dot`` on bfloat16 wrongly; there, dots run in float32."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (one under the CPU interpreter): launches that split work to fill
    the device size their grids by it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


@triton.jit
def _program_head(pid, H, G, OFFS, CAPS):
    """(batch, KV head, flat offset, capacity) of a program that handles one KV head of one sequence."""
    hkv = H // G
    h = pid % hkv
    return (pid // hkv).to(tl.int64), h, tl.load(OFFS + h).to(tl.int64), tl.load(CAPS + h)


# ---------------------------------------------------------------------------------------------- decode attention
@triton.jit
def _decode_partial(
    Q, K, V, POS, OFFS, CAPS, LOGITS, M_PART, L_PART, O_PART,
    scale_log2, H, G, D, SPLIT,
    sqb, sqh, skb, sks, svb, svs, spb, sph, slb, slh, smb, smh, sob, soh, sos,
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    b, h, off, cap = _program_head(tl.program_id(0), H, G, OFFS, CAPS)
    split = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    qh = h * G + g
    q = tl.load(Q + b * sqb + qh[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, cap)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        p = tl.load(POS + b * spb + h * sph + n, mask=nm, other=-1)
        ok = nm & (p >= 0)
        rows = (off + n)[:, None]
        k = tl.load(K + b * skb + rows * sks + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        tl.store(LOGITS + b * slb + qh[:, None] * slh + n[None, :], s, mask=gm[:, None] & nm[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pe = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pe, 1)
        v = tl.load(V + b * svb + rows * svs + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(pe.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    tl.store(M_PART + b * smb + qh * smh + split, m_i, mask=gm)
    tl.store(L_PART + b * smb + qh * smh + split, l_i, mask=gm)
    tl.store(O_PART + b * sob + qh[:, None] * soh + split * sos + d[None, :], acc, mask=gm[:, None] & dm[None, :])


@triton.jit
def _decode_finish(
    M_PART, L_PART, O_PART, OUT, LOGITS, CAPS, PROBS, H, G, NS, D, C_MAX,
    smb, smh, sob, soh, sos, sb, sh, slb, slh, spb, sph,
    REDUCE_SUM: tl.constexpr, NS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
):
    """Combine the splits of each query head of one KV head into its global max and normaliser; the first
    program of the KV head also combines their outputs; every program normalises one block of slots' logits
    into probabilities (summed over the group or per head)."""
    pid = tl.program_id(0)
    b = (pid // (H // G)).to(tl.int64)
    h = pid % (H // G)
    cap = tl.load(CAPS + h)
    blk = tl.program_id(1)
    s = tl.arange(0, NS_PAD)
    sm = s < NS
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    n = blk * BLOCK + tl.arange(0, BLOCK)
    inside = n < C_MAX
    live = n < cap
    acc = tl.zeros([BLOCK], tl.float32)
    for gi in range(G):
        qh = h * G + gi
        m = tl.load(M_PART + b * smb + qh * smh + s, mask=sm, other=float("-inf"))
        lsum = tl.load(L_PART + b * smb + qh * smh + s, mask=sm, other=0.0)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a head with no valid slot: every logit is -inf
        w = tl.exp2(m - top)
        total = tl.sum(w * lsum, 0)
        norm = tl.where(total > 0, total, 1.0)
        if blk == 0:
            o = tl.load(O_PART + b * sob + qh * soh + s[:, None] * sos + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
            out = tl.sum(w[:, None] * o, 0) / norm
            tl.store(OUT + b * sb + qh * sh + d, out.to(OUT.dtype.element_ty), mask=dm)
        logit = tl.load(LOGITS + b * slb + qh * slh + n, mask=live, other=float("-inf"))
        p = tl.where(live, tl.exp2(logit - top) / norm, 0.0)
        if REDUCE_SUM:
            acc += p
        else:
            tl.store(PROBS + b * spb + qh * sph + n, p, mask=inside)
    if REDUCE_SUM:
        tl.store(PROBS + b * spb + h * sph + n, acc, mask=inside)


def _decode_config(d: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Launch configuration of the decode kernels: the slots a loop iteration loads (``BLOCK_N``), the programs the
    slots are split across (``programs_per_sm`` a multiprocessor, whatever the batch) and the partial pass's warps
    and pipeline stages (``bench/kernels.py --sweep-decode`` measures the alternatives on a GPU). Two programs a
    multiprocessor: on an H100 (batch 1, bfloat16, head dim 128) the fastest of 72 configurations at 16K and 32K slots,
    51.7 and 76.7 us against 55.4 and 84.9 with four (the tile and the warps moved it by less than 3%)."""
    return {"BLOCK_N": 64 if d <= 64 else 32, "programs_per_sm": 2, "num_warps": 4, "num_stages": 3}


def decode_attention_flat(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    caps: list[int],
    scale: float,
    reduce: str = "sum",
    cfg: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``decode_attention_flat``; ``cfg``: a launch configuration other than ``_decode_config``'s (the
    sweep in ``bench/kernels.py`` passes each one it measures)."""
    if reduce not in ("sum", "none"):
        raise ValueError(f"reduce must be 'sum' or 'none', got {reduce!r}")
    b, h, d = q.shape
    hkv = len(caps)
    g = h // hkv
    cmax = pos.shape[-1]
    dev = q.device
    if cmax == 0 or b == 0:
        return torch.zeros((b, h, d), dtype=q.dtype, device=dev), torch.zeros((b, hkv if reduce == "sum" else h, cmax), device=dev)
    # Every entry is written by the kernels: no fill launches (a batch-1 step is bound by launches).
    out = torch.empty((b, h, d), dtype=q.dtype, device=dev)
    probs = torch.empty((b, hkv if reduce == "sum" else h, cmax), dtype=torch.float32, device=dev)
    q, keys, values, pos = q.contiguous(), keys.contiguous(), values.contiguous(), pos.contiguous()
    offs, caps_t = _layout(tuple(caps), str(dev))
    cfg = cfg or _decode_config(d, q.dtype, dev)
    block_n = cfg["BLOCK_N"]
    splits = max(1, min(_cdiv(cmax, block_n), _cdiv(_multiprocessors(dev) * cfg["programs_per_sm"], b * hkv)))
    split = _cdiv(_cdiv(cmax, splits), block_n) * block_n
    splits = _cdiv(cmax, split)
    logits = torch.empty((b, h, cmax), dtype=torch.float32, device=dev)
    m_part = torch.empty((b, h, splits), dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty((b, h, splits, d), dtype=torch.float32, device=dev)
    block_d = _pow2(d)
    _decode_partial[(b * hkv, splits)](
        q, keys, values, pos, offs, caps_t, logits, m_part, l_part, o_part,
        scale * _LOG2E, h, g, d, split,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        pos.stride(0), pos.stride(1), logits.stride(0), logits.stride(1), m_part.stride(0), m_part.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        G_PAD=_pow2(g), BLOCK_N=block_n, BLOCK_D=block_d, PREC=_precision(q.dtype), UPCAST=_upcast(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    block = 128
    _decode_finish[(b * hkv, _cdiv(cmax, block))](
        m_part, l_part, o_part, out, logits, caps_t, probs, h, g, splits, d, cmax,
        m_part.stride(0), m_part.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        out.stride(0), out.stride(1), logits.stride(0), logits.stride(1), probs.stride(0), probs.stride(1),
        REDUCE_SUM=reduce == "sum", NS_PAD=_pow2(splits, 2), BLOCK_D=block_d, BLOCK=block,
    )
    return out, probs


# ---------------------------------------------------------------------------------------------- window scores
@triton.jit
def _window_row_stats(
    Q, K, POS, OFFS, CAPS, QPOS, PART,
    scale_log2, H, G, W, D, SPLIT,
    sqb, sqh, sqw, skb, sks, spb, sph, sqpb, sxp, sxb, sxh, sxw,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Max and normaliser of a block of window rows over one split of a head's slots, stored in planes 0 and 1 of
    ``PART`` (``_window_combine`` combines the splits)."""
    b, h, off, cap = _program_head(tl.program_id(0), H, G, OFFS, CAPS)
    rb = tl.program_id(1)
    split = tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < G * W
    gi = r // W
    wi = r % W
    qh = h * G + gi
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(Q + b * sqb + qh[:, None] * sqh + wi[:, None] * sqw + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    qp = tl.load(QPOS + b * sqpb + wi, mask=rm, other=-1)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    end = tl.minimum(split * SPLIT + SPLIT, cap)
    for n0 in range(split * SPLIT, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        p = tl.load(POS + b * spb + h * sph + n, mask=nm, other=-1)
        k = tl.load(K + b * skb + (off + n)[:, None] * sks + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * scale_log2
        vis = (p[None, :] >= 0) & (p[None, :] <= qp[:, None]) & nm[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    part = PART + b * sxb + qh * sxh + wi * sxw + split
    tl.store(part, m_i, mask=rm)
    tl.store(part + sxp, l_i, mask=rm)


@triton.jit
def _window_combine(PART, ROWS, NS, SXP, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Combine each window row's splits (``NS`` of them, ``CHUNK`` at a time) into its global max and normaliser,
    written over its first split's (a program owns its rows: nothing else reads them meanwhile)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rm = r < ROWS
    row = PART + r.to(tl.int64) * NS
    m_run = tl.full([BLOCK], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, NS, CHUNK):
        sp = s0 + tl.arange(0, CHUNK)
        mask = rm[:, None] & (sp[None, :] < NS)
        m_s = tl.load(row[:, None] + sp[None, :], mask=mask, other=float("-inf"))
        l_s = tl.load(row[:, None] + SXP + sp[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no slot: -inf and 0, as one split's
        l_run = l_run * tl.exp2(m_run - shift) + tl.sum(l_s * tl.exp2(m_s - shift[:, None]), 1)
        m_run = m_new
    tl.store(row, m_run, mask=rm)
    tl.store(row + SXP, l_run, mask=rm)


@triton.jit
def _window_columns(
    Q, K, POS, OFFS, CAPS, QPOS, QVALID, PART, OUT,
    scale_log2, H, G, W, D, C_MAX,
    sqb, sqh, sqw, skb, sks, spb, sph, sqpb, sxp, sxb, sxh, sxw, svb, sob, soh,
    MEAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    b, h, off, cap = _program_head(tl.program_id(0), H, G, OFFS, CAPS)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < cap
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    p = tl.load(POS + b * spb + h * sph + n, mask=nm, other=-1)
    k = tl.load(K + b * skb + (off + n)[:, None] * sks + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    col = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)  # per row of a step, summed over rows once (as _column_step's)
    for r0 in range(0, G * W, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rm = r < G * W
        gi = r // W
        wi = r % W
        qh = h * G + gi
        q = tl.load(Q + b * sqb + qh[:, None] * sqh + wi[:, None] * sqw + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        qp = tl.load(QPOS + b * sqpb + wi, mask=rm, other=-1)
        qv = tl.load(QVALID + b * svb + wi, mask=rm, other=0)
        stats = PART + b * sxb + qh * sxh + wi * sxw  # the rows' global max and normaliser (the first split's)
        m = tl.load(stats, mask=rm, other=0.0)
        lsum = tl.load(stats + sxp, mask=rm, other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * scale_log2
        vis = (rm & (qv != 0) & (lsum > 0))[:, None] & nm[None, :] & (p[None, :] >= 0) & (p[None, :] <= qp[:, None])
        prob = tl.where(vis, tl.exp2(s - m[:, None]) / tl.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
        col += prob
    col = tl.sum(col, 0)
    if MEAN:
        col = col / G
    tl.store(OUT + b * sob + h * soh + n, col, mask=n < C_MAX)


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
    if reduce not in ("sum", "mean"):
        raise ValueError(f"the Triton window score reduces groups by 'sum' or 'mean', got {reduce!r}")
    b, h, w, d = q.shape
    hkv = len(caps)
    g = h // hkv
    cmax = pos.shape[-1]
    dev = q.device
    if cmax == 0 or w == 0 or b == 0:
        return torch.zeros((b, hkv, cmax), dtype=torch.float32, device=dev)
    # Three launches at most and no fill (a small batch's scoring is bound by launches): row statistics, their
    # splits' combine (where there are several), and the column pass, which writes every slot of ``out``. Inputs are
    # copied only where their last axis is not contiguous (a window sliced off the queries is not, as a whole).
    q, keys, pos, q_pos = (_unit_last(x) for x in (q, keys, pos, q_pos))
    q_valid = _unit_last((q_valid if q_valid.dtype == torch.bool else q_valid != 0).view(torch.int8))
    out = torch.empty((b, hkv, cmax), dtype=torch.float32, device=dev)
    offs, caps_t = _layout(tuple(caps), str(dev))
    block_r, block_n, block_d = 32, 64 if d <= 64 else 32, _pow2(d)
    # The slots split across programs so that a small batch still fills the device.
    row_blocks = _cdiv(g * w, block_r)
    splits = max(1, min(_cdiv(cmax, block_n), _cdiv(4 * _multiprocessors(dev), b * hkv * row_blocks)))
    split = _cdiv(_cdiv(cmax, splits), block_n) * block_n
    splits = _cdiv(cmax, split)
    part = torch.empty((2, b, h, w, splits), dtype=torch.float32, device=dev)  # each row's max and normaliser a split
    strides = (
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), pos.stride(0), pos.stride(1), q_pos.stride(0)
    )
    part_strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
    meta = {"BLOCK_R": block_r, "BLOCK_N": block_n, "BLOCK_D": block_d, "PREC": _precision(q.dtype), "UPCAST": _upcast(q.dtype)}
    _window_row_stats[(b * hkv, row_blocks, splits)](
        q, keys, pos, offs, caps_t, q_pos, part, scale * _LOG2E, h, g, w, d, split, *strides, *part_strides, **meta
    )
    if splits > 1:  # once for every row (each column program would otherwise combine them again, in registers)
        block = 64
        _window_combine[(_cdiv(b * h * w, block),)](part, b * h * w, splits, part.stride(0), BLOCK=block, CHUNK=16)
    _window_columns[(b * hkv, _cdiv(cmax, block_n))](
        q, keys, pos, offs, caps_t, q_pos, q_valid, part, out, scale * _LOG2E, h, g, w, d, cmax, *strides,
        *part_strides, q_valid.stride(0), out.stride(0), out.stride(1), MEAN=reduce == "mean", **meta,
    )
    return out


# ---------------------------------------------------------------------------------------------- prefill with scores
@triton.jit
def _prefill_program(H, G, N, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, LAST_FIRST: tl.constexpr = False):
    """(batch, query head, its KV head, first index, indices, their mask, feature indices, their mask) of a prefill
    program: axis 1 is the (sequence, query head), axis 0 the block of rows (or keys) it owns, the last block first
    with ``LAST_FIRST``. A GPU starts programs in the order of their ids, axis 0 fastest: the causal forward's last
    row blocks, which see the most keys, go first, so that the launch does not end on them (flash attention's order);
    the column pass's first key blocks, seen by the most rows, come first as they are."""
    bh = tl.program_id(1)
    qh = bh % H
    block = tl.num_programs(0) - 1 - tl.program_id(0) if LAST_FIRST else tl.program_id(0)
    start = block * BLOCK
    idx = start + tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_D)
    return (bh // H).to(tl.int64), qh, qh // G, start, idx, idx < N, d, d < D


@triton.jit
def _causal_block(
    q, k_base, v_base, m, n, m_i, l_i, acc, N, skn, svn, d, dm, scale_log2,
    DIAGONAL: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step of query rows ``m`` over keys ``n``: below the diagonal every key is visible;
    on it, row ``i`` sees keys up to ``i`` (and key ``m0``, so every row's running max stays finite)."""
    nm = n < N
    k = tl.load(k_base + n[:, None] * skn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    s = _dot(q, tl.trans(k), PREC, UPCAST) * scale_log2
    if DIAGONAL:
        s = tl.where((n[None, :] <= m[:, None]) & nm[None, :], s, float("-inf"))
    v = tl.load(v_base + n[:, None] * svn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    return _online_softmax(s, v, m_i, l_i, acc, PREC, UPCAST)


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step of rows over keys with base-2 logits ``s`` (``-inf``: hidden) and values ``v``: the
    rows' new (running max, normaliser, accumulator). A row that has seen no key yet keeps its max at ``-inf`` and
    adds nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)


@triton.jit
def _prefill_forward(
    Q, K, V, OUT, LSE,
    scale_log2, N, H, G, D,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Flash-attention forward of one block of query rows of one head under the causal mask; also stores each
    row's base-2 logsumexp of its scaled logits (the normaliser the column pass needs)."""
    b, qh, kh, m0, m, mm, d, dm = _prefill_program(H, G, N, D, BLOCK_M, BLOCK_D, True)
    q = tl.load(Q + b * sqb + qh * sqh + m[:, None] * sqn + d[None, :], mask=mm[:, None] & dm[None, :], other=0.0)
    k_base = K + b * skb + kh * skh
    v_base = V + b * svb + kh * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, m0, BLOCK_N):  # keys before the block's first row: visible to every row, no mask
        m_i, l_i, acc = _causal_block(
            q, k_base, v_base, m, n0 + tl.arange(0, BLOCK_N), m_i, l_i, acc, N, skn, svn, d, dm, scale_log2, False, PREC, UPCAST
        )
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, N), BLOCK_N):  # the diagonal: row i sees keys up to i
        m_i, l_i, acc = _causal_block(
            q, k_base, v_base, m, n0 + tl.arange(0, BLOCK_N), m_i, l_i, acc, N, skn, svn, d, dm, scale_log2, True, PREC, UPCAST
        )
    out = acc / l_i[:, None]
    tl.store(OUT + b * sob + qh * soh + m[:, None] * son + d[None, :], out.to(OUT.dtype.element_ty), mask=mm[:, None] & dm[None, :])
    tl.store(LSE + (b * H + qh) * N + m, m_i + tl.log2(l_i), mask=mm)


@triton.jit
def _column_step(
    q_base, lse_base, k, r0, n, col, win, N, W, sqn, d, dm, scale_log2,
    DIAGONAL: tl.constexpr, COLS: tl.constexpr, WIN: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Add the probabilities of query rows ``r0..r0 + BLOCK_M`` over keys ``n`` to the keys' column sums (every row)
    and window scores (rows of the last ``W``), both kept per row of the step (``[BLOCK_M, BLOCK_N]``, summed over
    rows once, after the last step: a sum across rows spans warps, a reduction through shared memory at every step).
    A row past the prompt reads its logsumexp as ``+inf``, so its probabilities are 0 without a mask; only
    ``DIAGONAL`` steps, where a row may precede a key, mask the causal triangle, and only steps that reach the
    window mask rows for it (steps before it add nothing to the window)."""
    r = r0 + tl.arange(0, BLOCK_M)
    rm = r < N
    q = tl.load(q_base + r[:, None] * sqn + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    lse = tl.load(lse_base + r, mask=rm, other=float("inf"))
    p = tl.exp2(_dot(q, tl.trans(k), PREC, UPCAST) * scale_log2 - lse[:, None])
    if DIAGONAL:
        p = tl.where(r[:, None] >= n[None, :], p, 0.0)
    if COLS:
        col += p
        if WIN:
            if r0 + BLOCK_M > N - W:
                win += tl.where((r >= N - W)[:, None], p, 0.0)
    elif WIN:  # the rows start inside the window
        win += p
    return col, win


@triton.jit
def _prefill_columns(
    Q, K, LSE, COLSUM, WINDOW,
    scale_log2, N, H, G, D, W,
    sqb, sqh, sqn, skb, skh, skn,
    COLS: tl.constexpr, WIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Column pass of one block of ``BLOCK_N`` keys of one query head: recompute the logits of every query row that
    sees them (or of the last ``W`` rows only), ``BLOCK_M`` rows a step, normalise them by the rows' logsumexp and
    sum them per key. Steps that start before the block's last key (and before the prompt's end) are masked by the
    causal triangle, the later ones are not. Each program owns its keys' sums: no atomics."""
    b, qh, kh, n0, n, nm, d, dm = _prefill_program(H, G, N, D, BLOCK_N, BLOCK_D)
    k = tl.load(K + b * skb + kh * skh + n[:, None] * skn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    q_base = Q + b * sqb + qh * sqh
    lse_base = LSE + (b * H + qh) * N
    col = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    win = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if COLS:
        start = n0
    else:
        start = tl.maximum(n0, N - W)
    diagonal = tl.minimum(n0 + BLOCK_N, N)
    for r0 in range(start, diagonal, BLOCK_M):  # steps with a row before one of the keys
        col, win = _column_step(
            q_base, lse_base, k, r0, n, col, win, N, W, sqn, d, dm, scale_log2, True, COLS, WIN, BLOCK_M, PREC, UPCAST
        )
    below = start + tl.cdiv(tl.maximum(diagonal - start, 0), BLOCK_M) * BLOCK_M
    for r0 in range(below, N, BLOCK_M):  # every row sees every key
        col, win = _column_step(
            q_base, lse_base, k, r0, n, col, win, N, W, sqn, d, dm, scale_log2, False, COLS, WIN, BLOCK_M, PREC, UPCAST
        )
    if COLS:
        tl.store(COLSUM + (b * H + qh) * N + n, tl.sum(col, 0), mask=nm)
    if WIN:
        tl.store(WINDOW + (b * H + qh) * N + n, tl.sum(win, 0), mask=nm)


_LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


#: ``KVGATES_PREFILL_CONFIG``'s ``"attention"``: what computes the prefill's attention and each row's log-sum-exp
#: before the column pass: kvgates' Triton forward, or torch's fused attention (``_sdpa_attention``); the default is
#: ``_default_attention``'s.
PREFILL_ATTENTION = ("triton", "sdpa")


def _default_attention(device: torch.device) -> str:
    """``"sdpa"`` (cuDNN's attention, where ``_cudnn_takes`` the queries) on a Hopper or later GPU, ``"triton"``
    elsewhere. On an H200 (stop 60, 16 layers of Llama-3.1-8B's shape, bf16, 8K, batch 1) it took the scoring
    prefills from 1.18-1.43x a plain sdpa prefill to 1.13-1.38x; older GPUs' cuDNN attention is unmeasured here."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.backends.cudnn.is_available():
        return "sdpa" if torch.cuda.get_device_capability(device) >= (9, 0) else "triton"
    return "triton"


@lru_cache(maxsize=8)
def _prefill_override(text: str) -> dict[str, Any]:
    """``KVGATES_PREFILL_CONFIG``'s value, parsed and checked once (each prefill call looks it up here; the dicts
    returned are shared, not to be modified): blocks powers of two from 16 (``tl.dot``'s least), warps powers of two
    up to 32, stages from 1; ``"attention"`` one of ``PREFILL_ATTENTION``."""
    try:
        override = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{PREFILL_CONFIG_ENV} is not JSON ({err}): {text!r}") from None
    if not isinstance(override, dict) or not set(override) <= {"forward", "columns", "attention"}:
        raise ValueError(f'{PREFILL_CONFIG_ENV} must be an object with "forward", "columns" and/or "attention", got {text!r}')
    if override.get("attention", "triton") not in PREFILL_ATTENTION:
        raise ValueError(f"{PREFILL_CONFIG_ENV}'s \"attention\" must be one of {', '.join(PREFILL_ATTENTION)}, got {override['attention']!r}")
    for name, launch in override.items():
        if name == "attention":
            continue
        if not isinstance(launch, dict) or not set(launch) <= set(_LAUNCH_KEYS):
            raise ValueError(f"{PREFILL_CONFIG_ENV}'s {name!r} must be an object of {', '.join(_LAUNCH_KEYS)}, got {launch!r}")
        for key, value in launch.items():
            number = type(value) is int  # (not bool)
            power = number and value > 0 and not value & (value - 1)
            if key.startswith("BLOCK") and not (power and value >= 16):
                raise ValueError(f"{PREFILL_CONFIG_ENV}'s {name}.{key} must be a power of two from 16, got {value!r}")
            if key == "num_warps" and not (power and value <= 32):
                raise ValueError(f"{PREFILL_CONFIG_ENV}'s {name}.num_warps must be a power of two up to 32, got {value!r}")
            if key == "num_stages" and not (number and value >= 1):
                raise ValueError(f"{PREFILL_CONFIG_ENV}'s {name}.num_stages must be a whole number from 1, got {value!r}")
    return override


def _prefill_config(d: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Launch configurations of the prefill kernels: the forward's (``BLOCK_M`` query rows a program, ``BLOCK_N``
    keys a step; ``BLOCK_M`` a multiple of ``BLOCK_N``) and the column pass's (``BLOCK_N`` keys a program,
    ``BLOCK_M`` query rows a step), each with its warps and pipeline stages (``bench/kernels.py --sweep-prefill``
    measures the alternatives on a GPU); the masked kernels' two passes take the same. Small blocks under the CPU
    interpreter, so that short test prompts span several of them. Rows wider than 256 bytes (float32 at head dim 128)
    get half the tiles and two stages: the large ones need 225 KiB of shared memory, more than an A100 has
    (``bench/triton_compile.py``). ``KVGATES_PREFILL_CONFIG`` (``PREFILL_CONFIG_ENV``) overrides any of them, and its
    ``"attention"`` (``cfg["attention"]``; by default ``_default_attention``'s) chooses torch's fused attention
    (``"sdpa"``) or the Triton forward (``"triton"``)."""
    if device.type != "cuda":
        forward, columns = (32, 16, 4, 1), (16, 16, 4, 1)
    elif d * dtype.itemsize > 256:
        forward, columns = (64, 32, 4, 2), (32, 32, 4, 2)
    elif d > 64:
        # The column pass: the H200's fastest two of 36 at head dim 128, bf16, 8K (597 us against the former (64, 64,
        # 8, 3)'s 776 us; stop 59). The forward stays: its fastest stood alone among its neighbours.
        forward, columns = (128, 64, 8, 3), (64, 128, 4, 2)
    else:
        forward, columns = (128, 64, 4, 3), (64, 64, 4, 3)
    cfg = {"forward": dict(zip(_LAUNCH_KEYS, forward)), "columns": dict(zip(_LAUNCH_KEYS, columns)), "attention": _default_attention(device)}
    override = os.environ.get(PREFILL_CONFIG_ENV)
    if override:
        for name, launch in _prefill_override(override).items():
            if name == "attention":
                cfg[name] = launch
            else:
                cfg[name].update(launch)
        fwd = cfg["forward"]
        if fwd["BLOCK_M"] % fwd["BLOCK_N"]:
            raise ValueError(
                f"{PREFILL_CONFIG_ENV} gives the prefill forward BLOCK_M {fwd['BLOCK_M']} and BLOCK_N {fwd['BLOCK_N']} here (with "
                "the defaults it leaves): BLOCK_M must be a multiple of BLOCK_N"
            )
    return cfg


def causal_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    colsum: bool = True,
    window: int = 0,
    cfg: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The reference's ``causal_attention_stats``; ``cfg``: launch configurations other than ``_prefill_config``'s
    (the sweep in ``bench/kernels.py`` passes each one it measures). With ``cfg["attention"] == "sdpa"`` torch's
    fused attention computes the attention and each row's log-sum-exp (``_sdpa_attention``) where it can, in place of
    the Triton forward; the column pass is the same."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    if v.shape[-1] != d:
        raise ValueError(f"the fused prefill kernel needs values as wide as keys, got {v.shape[-1]} and {d}")
    cfg = cfg or _prefill_config(d, q.dtype, q.device)
    fwd, cols = cfg["forward"], cfg["columns"]
    if fwd["BLOCK_M"] % fwd["BLOCK_N"]:
        raise ValueError(f"the prefill forward's BLOCK_M must be a multiple of its BLOCK_N, got {fwd['BLOCK_M']} and {fwd['BLOCK_N']}")
    w = min(window, n)
    dev = q.device
    sums = torch.empty((b, h, n), dtype=torch.float32, device=dev) if colsum else None
    win = torch.empty((b, h, n), dtype=torch.float32, device=dev) if w else None
    common = dict(BLOCK_D=_pow2(d), PREC=_precision(q.dtype), UPCAST=_upcast(q.dtype))
    sdpa = cfg.get("attention") == "sdpa" and (not q.is_cuda or _cudnn_takes(q))
    if sdpa and n and b:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse = _sdpa_attention(q, k, v, scale)
    else:
        # Written in [B, n, H, D] memory, the layout attention returns to the model in: transposing it back is free.
        out = torch.empty((b, n, h, d), dtype=q.dtype, device=dev).transpose(1, 2)
        if n == 0 or b == 0:
            return out, sums, win
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        lse = torch.empty((b, h, n), dtype=torch.float32, device=dev)
        _prefill_forward[(_cdiv(n, fwd["BLOCK_M"]), b * h)](
            q, k, v, out, lse, scale * _LOG2E, n, h, h // hkv, d,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            **fwd, **common,
        )
    if sums is not None or win is not None:
        _prefill_columns[(_cdiv(n, cols["BLOCK_N"]), b * h)](
            q, k, lse, lse if sums is None else sums, lse if win is None else win, scale * _LOG2E, n, h, h // hkv, d, w,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            COLS=sums is not None, WIN=win is not None, **cols, **common,
        )
    return out, sums, win


def _cudnn_takes(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention takes these queries on any GPU kvgates targets: 16-bit, head dim a multiple of 8 up
    to 128. The aten op is called directly, past sdpa's own checks: elsewhere the Triton forward runs."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 128


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention ``[B, H, n, D]`` and each row's log-sum-exp ``[B, H, n]`` (float32, base 2: as the column pass
    reads it) from torch's fused attention: cuDNN's on a GPU (``_cudnn_takes``; its grouped KV heads as they are), the CPU's
    flash attention elsewhere. On an H200 cuDNN's causal attention took 0.90 ms a layer at 8K against the Triton
    forward's 1.28 (stop 59's profile)."""
    b, h, n, _ = q.shape
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, (lse.reshape(b, h, n).float() * _LOG2E).contiguous()


@triton.jit
def _visible(POS, QPOS, b, kh, qpos, n, nm, H_KV, C):
    """``[rows, keys]``: which keys ``n`` rows at positions ``qpos`` see (a held slot at or before the row)."""
    pos = tl.load(POS + (b * H_KV + kh) * C + n, mask=nm, other=-1)
    return (pos[None, :] >= 0) & (pos[None, :] <= qpos[:, None])


@triton.jit
def _masked_forward(
    Q, K, V, POS, QPOS, OUT, LSE,
    scale_log2, N, C, H, G, H_KV, D,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Flash-attention forward of one block of query rows of one head over every slot it sees (``_visible``); also
    stores each row's base-2 logsumexp (``+inf`` for a row that sees nothing, whose output is 0)."""
    b, qh, kh, m0, m, mm, d, dm = _prefill_program(H, G, N, D, BLOCK_M, BLOCK_D)
    q = tl.load(Q + b * sqb + qh * sqh + m[:, None] * sqn + d[None, :], mask=mm[:, None] & dm[None, :], other=0.0)
    qpos = tl.load(QPOS + b * N + m, mask=mm, other=-1)
    k_base = K + b * skb + kh * skh
    v_base = V + b * svb + kh * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, C, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < C
        k = tl.load(k_base + n[:, None] * skn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * svn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        s = tl.where(_visible(POS, QPOS, b, kh, qpos, n, nm, H_KV, C), _dot(q, tl.trans(k), PREC, UPCAST) * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PREC, UPCAST)
    seen = l_i > 0
    norm = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / norm[:, None], 0.0)
    tl.store(OUT + b * sob + qh * soh + m[:, None] * son + d[None, :], out.to(OUT.dtype.element_ty), mask=mm[:, None] & dm[None, :])
    tl.store(LSE + (b * H + qh) * N + m, tl.where(seen, m_i + tl.log2(norm), float("inf")), mask=mm)


@triton.jit
def _masked_columns(
    Q, K, POS, QPOS, LSE, WEIGHT, COLW, OUT,
    scale_log2, N, C, H, G, H_KV, D,
    sqb, sqh, sqn, skb, skh, skn,
    WEIGHTED: tl.constexpr, COLS: tl.constexpr, SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Column pass of one block of slots of one query head: recompute the logits of every row, normalise the
    visible ones by the rows' logsumexp, weigh them by the rows' ``WEIGHT`` (``WEIGHTED``) and keep each slot's
    largest (or, with ``SUM``, their sum), times the slot's ``COLW`` (``COLS``). A block whose slots all weigh 0 for
    this head skips the rows, and no key of a slot weighing 0 is read (KVzip scores the chunk being reconstructed
    only). Results are kept per row of the step and reduced over rows once, after the last step (as
    ``_column_step``'s). Each program owns its slots' results: no atomics, no host sync."""
    b, qh, kh, n0, n, nm, d, dm = _prefill_program(H, G, C, D, BLOCK_N, BLOCK_D)
    rows, live = N, nm
    if COLS:
        cw = tl.load(COLW + (b * H + qh) * C + n, mask=nm, other=0.0)
        rows, live = tl.where(tl.max(cw, 0) > 0, N, 0), cw > 0
    k = tl.load(K + b * skb + kh * skh + n[:, None] * skn + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rows, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        rm = r < N
        q = tl.load(Q + b * sqb + qh * sqh + r[:, None] * sqn + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        lse = tl.load(LSE + (b * H + qh) * N + r, mask=rm, other=float("inf"))
        visible = _visible(POS, QPOS, b, kh, tl.load(QPOS + b * N + r, mask=rm, other=-1), n, nm, H_KV, C)
        p = tl.where(visible, tl.exp2(_dot(q, tl.trans(k), PREC, UPCAST) * scale_log2 - lse[:, None]), 0.0)
        if WEIGHTED:
            p = p * tl.load(WEIGHT + b * N + r, mask=rm, other=0.0)[:, None]
        if SUM:
            acc += p
        else:
            acc = tl.maximum(acc, p)
    if SUM:
        result = tl.sum(acc, 0)
    else:
        result = tl.max(acc, 0)
    if COLS:
        result = result * cw
    tl.store(OUT + (b * H + qh) * C + n, result, mask=nm)


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
    return _masked_stats(q, k, v, slot_pos, q_pos, q_valid, scale, row_weight, col_weight, False)


def masked_attention_colsum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _masked_stats(q, k, v, slot_pos, q_pos, q_valid, scale, None, None, True)


def _masked_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor,
    scale: float, row_weight: torch.Tensor | None, col_weight: torch.Tensor | None, total: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_masked_forward``, then ``_masked_columns``: ``(out [B, H, q, D] in q's dtype, [B, H, C] float32)``, each
    slot's probabilities, weighted by ``row_weight``, summed (``total``) or their largest, times ``col_weight``;
    padded rows (``q_valid`` False) see no slot: an output of 0, nothing added."""
    b, h, n, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    if v.shape[-1] != d:
        raise ValueError(f"the fused prefill kernel needs values as wide as keys, got {v.shape[-1]} and {d}")
    # Written in [B, q, H, D] memory, the layout attention returns to the model in: transposing it back is free.
    out = torch.empty((b, n, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    if n == 0 or b == 0 or c == 0:
        return out.zero_(), torch.zeros((b, h, c), dtype=torch.float32, device=q.device)
    result = torch.empty((b, h, c), dtype=torch.float32, device=q.device)  # the column pass writes every slot's
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    pos = slot_pos.contiguous()
    qpos = torch.where(q_valid, q_pos, -1)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    cfg = _prefill_config(d, q.dtype, q.device)
    fwd, cols = cfg["forward"], cfg["columns"]
    common = dict(BLOCK_D=_pow2(d), PREC=_precision(q.dtype), UPCAST=_upcast(q.dtype))
    _masked_forward[(_cdiv(n, fwd["BLOCK_M"]), b * h)](
        q, k, v, pos, qpos, out, lse, scale * _LOG2E, n, c, h, h // hkv, hkv, d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        **fwd, **common,
    )
    rows = lse if row_weight is None else row_weight.float().contiguous()
    slots = lse if col_weight is None else col_weight.float().contiguous()
    _masked_columns[(_cdiv(c, cols["BLOCK_N"]), b * h)](
        q, k, pos, qpos, lse, rows, slots, result, scale * _LOG2E, n, c, h, h // hkv, hkv, d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        WEIGHTED=row_weight is not None, COLS=col_weight is not None, SUM=total, **cols, **common,
    )
    return out, result


# ---------------------------------------------------------------------------------------------- pooling
@triton.jit
def _pool_ordered(
    SCORES, ORDER, POS, OUT, C,
    KERNEL: tl.constexpr, MAX: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    im = i < C
    if MAX:
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
    for o in tl.static_range(KERNEL):
        j = i + (o - KERNEL // 2)
        jm = (j >= 0) & (j < C) & im
        slot = tl.load(ORDER + row * C + j, mask=jm, other=0)
        valid = tl.load(POS + row * C + slot, mask=jm, other=-1) >= 0
        v = tl.load(SCORES + row * C + slot, mask=jm & valid, other=0.0)
        if MAX:  # a NaN score spreads to its neighbours, as in torch's max pooling
            acc = tl.maximum(acc, tl.where(jm, v, float("-inf")), propagate_nan=tl.PropagateNan.ALL)
        else:
            acc += v
    if not MAX:
        acc = acc / KERNEL
    slot_i = tl.load(ORDER + row * C + i, mask=im, other=0)
    tl.store(OUT + row * C + slot_i, acc, mask=im)


def pool_by_position(scores: torch.Tensor, slot_pos: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    if kernel <= 1:
        return scores
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd to keep positions aligned, got {kernel}")
    if mode not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    shape = scores.shape
    c = shape[-1]
    flat_scores = scores.reshape(-1, c).float().contiguous()
    flat_pos = slot_pos.reshape(-1, c).contiguous()
    big = torch.iinfo(flat_pos.dtype).max
    order = torch.argsort(torch.where(flat_pos >= 0, flat_pos, big), dim=-1, stable=True).contiguous()
    out = torch.empty_like(flat_scores)
    if c:
        block = 128
        _pool_ordered[(flat_scores.shape[0], _cdiv(c, block))](
            flat_scores, order, flat_pos, out, c, KERNEL=kernel, MAX=mode == "max", BLOCK=block
        )
    return out.reshape(shape).to(scores.dtype)


# ---------------------------------------------------------------------------------------------- compaction
@triton.jit
def _compact(
    K, V, POS, STATE, INDEX, OLD_OFFS, OLD_CAPS, NEW_OFFS, NEW_CAPS, INIT,
    K_OUT, V_OUT, POS_OUT, STATE_OUT,
    HKV, D, DV, F, C_OLD, C_NEW,
    skb, sks, svb, svs, sokb, soks, sovb, sovs,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    nb = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = pid % HKV
    j = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    jm = j < C_NEW
    new_cap = tl.load(NEW_CAPS + h)
    old_cap = tl.load(OLD_CAPS + h)
    old_off = tl.load(OLD_OFFS + h).to(tl.int64)
    new_off = tl.load(NEW_OFFS + h).to(tl.int64)
    exists = jm & (j < new_cap)
    src = tl.load(INDEX + (b * HKV + h) * C_NEW + j, mask=jm, other=0)
    ok = exists & (src < old_cap)
    src = tl.where(ok, src, 0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    kv = tl.load(K + b * skb + (old_off + src)[:, None] * sks + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
    tl.store(K_OUT + b * sokb + (new_off + j)[:, None] * soks + d[None, :], kv, mask=exists[:, None] & (d[None, :] < D))
    dv = tl.arange(0, BLOCK_DV)
    vv = tl.load(V + b * svb + (old_off + src)[:, None] * svs + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
    tl.store(V_OUT + b * sovb + (new_off + j)[:, None] * sovs + dv[None, :], vv, mask=exists[:, None] & (dv[None, :] < DV))
    p = tl.load(POS + (b * HKV + h) * C_OLD + src, mask=ok, other=-1)
    tl.store(POS_OUT + (b * HKV + h) * C_NEW + j, p, mask=jm)
    if BLOCK_F > 0:
        f = tl.arange(0, BLOCK_F)
        fm = f < F
        init = tl.load(INIT + f, mask=fm, other=0.0)
        st = tl.load(STATE + ((b * HKV + h) * C_OLD + src)[:, None] * F + f[None, :], mask=ok[:, None] & fm[None, :], other=0.0)
        st = tl.where(ok[:, None], st, init[None, :])
        tl.store(STATE_OUT + ((b * HKV + h) * C_NEW + j)[:, None] * F + f[None, :], st, mask=jm[:, None] & fm[None, :])


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
    b, hkv = pos.shape[:2]
    c_old, c_new, f = pos.shape[-1], index.shape[-1], state.shape[-1]
    dev = pos.device
    total = sum(new_caps)
    new_k = keys.new_empty((b, total, keys.shape[-1]))
    new_v = values.new_empty((b, total, values.shape[-1]))
    new_pos = torch.empty((b, hkv, c_new), dtype=pos.dtype, device=dev)
    new_state = torch.empty((b, hkv, c_new, f), dtype=state.dtype, device=dev)
    if c_new == 0 or b == 0:
        return new_k, new_v, new_pos, new_state
    keys, values, pos, state = keys.contiguous(), values.contiguous(), pos.contiguous(), state.contiguous()
    index = index.to(torch.int64).contiguous()
    old_offs, old_caps_t = _layout(tuple(old_caps), str(dev))
    new_offs, new_caps_t = _layout(tuple(new_caps), str(dev))
    if c_old == 0:  # nothing to read: point every source past its head's (zero) capacity
        pos = torch.full((b, hkv, 1), -1, dtype=pos.dtype, device=dev)
        state = state_init.to(state.dtype).expand(b, hkv, 1, f).contiguous()
        keys = keys.new_zeros((b, 1, keys.shape[-1]))
        values = values.new_zeros((b, 1, values.shape[-1]))
        c_old = 1
    block_n = 64
    _compact[(b * hkv, _cdiv(c_new, block_n))](
        keys, values, pos, state, index, old_offs, old_caps_t, new_offs, new_caps_t, state_init.float().contiguous(),
        new_k, new_v, new_pos, new_state,
        hkv, keys.shape[-1], values.shape[-1], f, c_old, c_new,
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        BLOCK_N=block_n, BLOCK_D=_pow2(keys.shape[-1]), BLOCK_DV=_pow2(values.shape[-1]),
        BLOCK_F=_pow2(f, 1) if f else 0,
    )
    return new_k, new_v, new_pos, new_state


# ---------------------------------------------------------------------------------------------- KVMerger's sets
#: Thresholds past the caller's in ``merging_set_ends``'s padded block: below every cosine similarity, never a stop.
_NO_THRESHOLD = -3.0


@triton.jit
def _merging_set_ends(
    KN, STOP, EPS, END, H, N, D, E, W,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
):
    """One block of anchors of one (sequence, KV head): for each threshold, the first later token within the window
    whose similarity with the anchor is at most the threshold, else the window's end or the anchor's ``STOP``,
    whichever comes first. Blocks of later tokens are compared until every anchor's every threshold has its end."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_E)
    rows = KN + bh * N * D
    anchors = tl.load(rows + i[:, None] * D + d[None, :], mask=(i[:, None] < N) & (d[None, :] < D), other=0.0)
    stop = tl.load(STOP + bh * N + i, mask=i < N, other=0).to(tl.int32)
    bound = tl.minimum(stop, i + 1 + W)
    end = tl.where(e[None, :] < E, bound[:, None], i[:, None] + 1)  # (padded thresholds: nothing to compare)
    j0 = pid * BLOCK_I + 1
    while j0 < tl.max(tl.max(end, 1), 0):
        j = j0 + tl.arange(0, BLOCK_J)
        keys = tl.load(rows + j[:, None] * D + d[None, :], mask=(j[:, None] < N) & (d[None, :] < D), other=0.0)
        sim = tl.dot(anchors, tl.trans(keys), input_precision=PREC)  # [BLOCK_I, BLOCK_J]
        later = (j[None, :] > i[:, None]) & (j[None, :] < N)
        for k in tl.static_range(BLOCK_E):
            eps = tl.load(EPS + b * BLOCK_E + k)
            first = tl.min(tl.where(later & (sim <= eps), j[None, :], N), 1)
            end = tl.where(e[None, :] == k, tl.minimum(end, first[:, None]), end)
        j0 += BLOCK_J
    out = END + e[None, :].to(tl.int64) * tl.num_programs(1) * N + bh * N + i[:, None]
    tl.store(out, end.to(tl.int64), mask=(i[:, None] < N) & (e[None, :] < E))


def merging_set_ends(kn: torch.Tensor, stop: torch.Tensor, eps: torch.Tensor, window: int) -> torch.Tensor:
    """Where KVMerger's merging set anchored at each token ends, for every threshold, within a window.

    ``kn`` ``[B, H, L, D]``: the keys in position order, unit length (float32); ``stop`` ``[B, H, L]``: the first token
    after each one that is not mergeable (``L`` if none); ``eps`` ``[E, B]``: thresholds. Returns ``[E, B, H, L]``
    (int64): for anchor ``i``, the least ``j`` in ``i + 1 .. i + window`` with ``cos(k_i, k_j) <= eps``, else
    ``min(stop[i], i + 1 + window)``, whichever comes first. An end of ``i + 1 + window`` below ``stop[i]`` is a set
    the window did not end (``merging_chain`` measures it on). The similarities are computed a tile at a time and never
    stored; float32 products use three TF32 passes (``tf32x3``) on a GPU: near-float32 at tensor-core speed."""
    if window < 0:
        raise ValueError(f"merging_set_ends: the window is a number of tokens, at least 0 (got {window})")
    b, h, n, d = kn.shape
    e = eps.shape[0]
    out = torch.empty((e, b, h, n), dtype=torch.int64, device=kn.device)
    if not (e and b and h and n):
        return out
    block_e = _pow2(e, 1)
    thresholds = torch.nn.functional.pad(eps.T.float(), (0, block_e - e), value=_NO_THRESHOLD).contiguous()
    block = 64
    _merging_set_ends[(_cdiv(n, block), b * h)](
        kn.float().contiguous(), stop.contiguous(), thresholds, out, h, n, d, e, min(window, n),
        BLOCK_I=block, BLOCK_J=block, BLOCK_D=_pow2(d), BLOCK_E=block_e, PREC="tf32x3",
    )
    return out


@triton.jit
def _merging_chain(
    KN, STOP, FIRST, NEXT, EPS, CAP, MARK, B, H, N, D, W, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One row (threshold, sequence, head): follow the anchors from the first one, marking each, until the end or past
    the row's cap. After a set the window ended, the next anchor is ``NEXT``'s: one read an anchor, the walk's only
    dependent one. A set the window did not end (-1 there) is measured on from the window's end, a block of tokens at
    a time, up to the first token not mergeable after it (``STOP``), and the next anchor read from ``FIRST``."""
    r = tl.program_id(0).to(tl.int64)
    bh = r % (B * H)
    b = bh // H
    eps = tl.load(EPS + (r // (B * H)) * B + b)
    cap = tl.load(CAP + r)
    d = tl.arange(0, BLOCK_D)
    rows = KN + bh * N * D
    at = tl.load(FIRST + bh * (N + 1))
    count = 0
    while (at < N) & (count <= cap):
        tl.store(MARK + r * N + at, 1)
        count += 1
        nxt = tl.load(NEXT + r * N + at)
        if nxt < 0:
            limit = tl.load(STOP + bh * N + at)
            anchor = tl.load(rows + at * D + d, mask=d < D, other=0.0)
            j0 = at + 1 + W
            while j0 < limit:
                j = j0 + tl.arange(0, BLOCK_J)
                keys = tl.load(rows + j[:, None] * D + d[None, :], mask=(j[:, None] < limit) & (d[None, :] < D), other=0.0)
                sim = tl.sum(keys * anchor[None, :], 1)
                limit = tl.minimum(limit, tl.min(tl.where((j < limit) & (sim <= eps), j, N), 0))
                j0 += BLOCK_J
            nxt = tl.load(FIRST + bh * (N + 1) + limit)
        at = nxt


def merging_chain(
    kn: torch.Tensor, stop: torch.Tensor, first_from: torch.Tensor, ends: torch.Tensor, eps: torch.Tensor,
    cap: torch.Tensor, window: int,
) -> torch.Tensor:
    """Which tokens open a merging set, ``[E, B, H, L]`` (bool): the chain of anchors from each head's first mergeable
    token, ``first_from[end(anchor)]`` after each (``first_from`` ``[B, H, L + 1]``: the first mergeable token at or
    after each position, ``L`` if none), where ``end`` is ``merging_set_ends(kn, stop, eps, window)`` (``ends``) or,
    for a set that window did not end, measured on here. One program a row follows its chain and marks it up to its
    ``cap + 1``-th anchor (``cap`` ``[E, B, H]``, the most sets of a row that matter: a longer chain is marked ``cap + 1``
    times), so each token of a long set is compared once, with its own set's anchor. The next anchor after every set
    the window ended is gathered for all tokens at once first: the walk then waits on one read an anchor, not on two
    in a row (an end, then the anchor after it: 1.0 ms a layer at 8K on an H200, stop 59's profile, before)."""
    if window < 0:
        raise ValueError(f"merging_chain: the window is a number of tokens, at least 0 (got {window})")
    e, b, h, n = ends.shape
    mark = torch.zeros((e, b, h, n), dtype=torch.int8, device=ends.device)
    if mark.numel():
        w = min(window, n)
        ends = ends.long()
        unended = (ends == torch.arange(1 + w, n + 1 + w, device=ends.device)) & (ends < stop)
        nxt = torch.where(unended, -1, first_from.expand(e, -1, -1, -1).gather(-1, ends))
        _merging_chain[(e * b * h,)](
            kn.float().contiguous(), stop.contiguous(), first_from.contiguous(), nxt.contiguous(), eps.float().contiguous(),
            cap.to(torch.int64).contiguous(), mark, b, h, n, kn.shape[-1], w, BLOCK_J=64, BLOCK_D=_pow2(kn.shape[-1]),
        )
    return mark.view(torch.bool)


# ---------------------------------------------------------------------------------------------- KVMerger's merges
@triton.jit
def _merge_sets(
    K, V, STARTS, MERGEABLE, SCORE, KOUT, VOUT, PIVOT, N, D, DV, SIGMA,
    FIXED_SIGMA: tl.constexpr, SCALE: tl.constexpr, ANCHORS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One block of anchors of one (sequence, KV head): each set opening there is walked three times, a block of tokens
    at a time: for its end and pivot, for its mean distance to the pivot (``sigma``), and for the weighted sums written
    to the pivot's key and value."""
    bh = tl.program_id(1).to(tl.int64)
    keys, values, flags = K + bh * N * D, V + bh * N * DV, bh * N
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    for a in range(ANCHORS):
        i = tl.program_id(0) * ANCHORS + a
        opens = tl.load(STARTS + flags + i, mask=i < N, other=0) & tl.load(MERGEABLE + flags + i, mask=i < N, other=0)
        if opens != 0:
            end = N + tl.zeros((), tl.int32)  # (a tensor even where Triton passes N == 1 as a constant)
            best = tl.full((), float("-inf"), tl.float32)
            pivot = i
            j0 = i
            while j0 < end:  # the set's end (the next start or unmergeable token) and its first token of largest score
                j = j0 + tl.arange(0, BLOCK_N)
                later = tl.load(STARTS + flags + j, mask=j < N, other=0) != 0
                free = tl.load(MERGEABLE + flags + j, mask=j < N, other=0) != 0
                end = tl.minimum(end, tl.min(tl.where((later & (j > i)) | ~free, j, N), 0))
                score = tl.load(SCORE + flags + j, mask=j < end, other=float("-inf"))
                top, at = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
                pivot = tl.where(top > best, j0 + at, pivot)  # (strictly: the first of equal scores stays)
                best = tl.maximum(top, best)
                j0 += BLOCK_N
            anchor = tl.load(keys + pivot * D + d, mask=d < D, other=0.0).to(tl.float32)
            if FIXED_SIGMA:
                sigma = SIGMA
            else:
                spread = tl.zeros((), tl.float32)
                for s0 in range(i, end, BLOCK_N):
                    j = s0 + tl.arange(0, BLOCK_N)
                    k = tl.load(keys + j[:, None] * D + d[None, :], mask=(j[:, None] < end) & (d[None, :] < D), other=0.0)
                    diff = k.to(tl.float32) - anchor[None, :]
                    spread += tl.sum(tl.where(j < end, tl.sqrt(tl.sum(diff * diff, 1)), 0.0), 0)
                sigma = tl.maximum(spread / tl.maximum(end - i - 1, 1), 1e-6)
            total = tl.zeros((), tl.float32)
            acc_k = tl.zeros((BLOCK_D,), tl.float32)
            acc_v = tl.zeros((BLOCK_DV,), tl.float32)
            for s0 in range(i, end, BLOCK_N):
                j = s0 + tl.arange(0, BLOCK_N)
                k = tl.load(keys + j[:, None] * D + d[None, :], mask=(j[:, None] < end) & (d[None, :] < D), other=0.0)
                v = tl.load(values + j[:, None] * DV + dv[None, :], mask=(j[:, None] < end) & (dv[None, :] < DV), other=0.0)
                k = k.to(tl.float32)
                diff = k - anchor[None, :]
                g = tl.where(j < end, tl.exp(-tl.sum(diff * diff, 1) / (2 * sigma * sigma)), 0.0)
                total += tl.sum(g, 0)
                acc_k += tl.sum(g[:, None] * k, 0)
                acc_v += tl.sum(g[:, None] * v.to(tl.float32), 0)
            scale = 1.0 / tl.maximum(total, 1e-30)
            tl.store(KOUT + bh * N * D + pivot * D + d, (acc_k * scale).to(KOUT.dtype.element_ty), mask=d < D)
            if SCALE:
                scale = scale * (end - i)
            tl.store(VOUT + bh * N * DV + pivot * DV + dv, (acc_v * scale).to(VOUT.dtype.element_ty), mask=dv < DV)
            tl.store(PIVOT + flags + pivot, 1)


def merge_sets(
    keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, mergeable: torch.Tensor, score: torch.Tensor,
    sigma: float | None = None, scale_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, n, d = keys.shape
    merged_k, merged_v = keys.clone(memory_format=torch.contiguous_format), values.clone(memory_format=torch.contiguous_format)
    pivot = torch.zeros((b, h, n), dtype=torch.int8, device=keys.device)
    if pivot.numel():
        anchors = 16
        _merge_sets[(_cdiv(n, anchors), b * h)](
            keys.contiguous(), values.contiguous(), starts.to(torch.int8).contiguous(), mergeable.to(torch.int8).contiguous(),
            score.float().contiguous(), merged_k, merged_v, pivot, n, d, values.shape[-1], 0.0 if sigma is None else float(sigma),
            FIXED_SIGMA=sigma is not None, SCALE=scale_values, ANCHORS=anchors, BLOCK_N=64, BLOCK_D=_pow2(d),
            BLOCK_DV=_pow2(values.shape[-1]),
        )
    return merged_k, merged_v, pivot.view(torch.bool)


# ---------------------------------------------------------------------------------------------- D2O's matches
@triton.jit
def _max_similarity(
    ROWS, COLS, VALID, BEST, TARGET, E, K, D,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """One block of rows of one (sequence, head): the running largest product over blocks of columns, and where."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    r = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.arange(0, BLOCK_D)
    rows = tl.load(ROWS + bh * E * D + r[:, None] * D + d[None, :], mask=(r[:, None] < E) & (d[None, :] < D), other=0.0)
    best = tl.full((BLOCK_E,), float("-inf"), tl.float32)
    target = tl.zeros((BLOCK_E,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        cols = tl.load(COLS + bh * K * D + k[:, None] * D + d[None, :], mask=(k[:, None] < K) & (d[None, :] < D), other=0.0)
        ok = tl.load(VALID + bh * K + k, mask=k < K, other=0) != 0
        sim = tl.dot(rows, tl.trans(cols), input_precision=PREC)
        sim = tl.where(ok[None, :] & (sim == sim), sim, float("-inf"))  # a NaN product matches nothing
        top, at = tl.max(sim, 1, return_indices=True, return_indices_tie_break_left=True)
        better = top > best  # (strictly: the first column of equal maxima stays)
        target = tl.where(better, k0 + at, target)
        best = tl.where(better, top, best)
    tl.store(BEST + bh * E + r, best, mask=r < E)
    tl.store(TARGET + bh * E + r, target.to(tl.int64), mask=r < E)


def max_similarity(rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, e, d = rows.shape
    k = cols.shape[2]
    best = torch.empty((b, h, e), dtype=torch.float32, device=rows.device)
    target = torch.empty((b, h, e), dtype=torch.long, device=rows.device)
    if not (b and h and e):
        return best, target
    if k == 0:
        return best.fill_(float("-inf")), target.zero_()
    block = 64
    _max_similarity[(_cdiv(e, block), b * h)](
        rows.float().contiguous(), cols.float().contiguous(), valid.to(torch.int8).contiguous(), best, target, e, k, d,
        BLOCK_E=block, BLOCK_K=block // 2, BLOCK_D=_pow2(d), PREC="tf32x3", num_stages=2,
    )
    return best, target


# ---------------------------------------------------------------------------------------------- retention
@triton.jit
def _retention_scores(LB, POS, T, OUT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    lb = tl.load(LB + row * N + i, mask=m, other=0.0)
    p = tl.load(POS + row * N + i, mask=m, other=-1)
    t = tl.load(T + row)
    age = (t - p).to(tl.float32)
    tl.store(OUT + row * N + i, tl.where(p >= 0, age * lb, float("-inf")), mask=m)


def retention_scores(log_beta: torch.Tensor, slot_pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    b = log_beta.shape[0]
    n = log_beta[0].numel() if b else 0
    out = torch.empty(log_beta.shape, dtype=torch.float32, device=log_beta.device)
    if n == 0:
        return out
    block = 256
    _retention_scores[(b, _cdiv(n, block))](
        log_beta.float().contiguous(), slot_pos.contiguous(), t.to(torch.int64).contiguous(), out, n, BLOCK=block
    )
    return out


@triton.jit
def _retention_sum_fwd(LB, S, T, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    acc = tl.zeros([BLOCK_T], tl.float32)
    hi = tl.minimum((tb + 1) * BLOCK_T, T)
    for i0 in range(0, hi, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        im = i < T
        lb = tl.load(LB + row * T + i, mask=im, other=0.0)
        age = (t[:, None] - i[None, :]).to(tl.float32)
        live = (age >= 0) & im[None, :] & tm[:, None]
        acc += tl.sum(tl.where(live, tl.exp(tl.where(live, age, 0.0) * lb[None, :]), 0.0), 1)
    tl.store(S + row * T + t, acc, mask=tm)


@triton.jit
def _retention_sum_bwd(LB, GRAD, GLB, T, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ib = tl.program_id(1)
    i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < T
    lb = tl.load(LB + row * T + i, mask=im, other=0.0)
    acc = tl.zeros([BLOCK_I], tl.float32)
    for t0 in range(ib * BLOCK_I, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        g = tl.load(GRAD + row * T + t, mask=tm, other=0.0)
        age = (t[:, None] - i[None, :]).to(tl.float32)
        live = (age >= 0) & im[None, :] & tm[:, None]
        safe = tl.where(live, age, 0.0)
        acc += tl.sum(tl.where(live, g[:, None] * safe * tl.exp(safe * lb[None, :]), 0.0), 0)
    tl.store(GLB + row * T + i, acc, mask=im)


class _RetentionSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_beta: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        shape = log_beta.shape
        flat = log_beta.float().reshape(-1, shape[-1]).contiguous()
        out = torch.empty_like(flat)
        n, t = flat.shape
        if n and t:
            _retention_sum_fwd[(n, _cdiv(t, 64))](flat, out, t, BLOCK_T=64, BLOCK_I=64)
        ctx.save_for_backward(flat)
        ctx.shape, ctx.dtype = shape, log_beta.dtype
        return out.reshape(shape).to(log_beta.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (flat,) = ctx.saved_tensors
        g = grad.float().reshape(flat.shape).contiguous()
        out = torch.empty_like(flat)
        n, t = flat.shape
        if n and t:
            _retention_sum_bwd[(n, _cdiv(t, 64))](flat, g, out, t, BLOCK_T=64, BLOCK_I=64)
        return out.reshape(ctx.shape).to(ctx.dtype)


def retention_sum(log_beta: torch.Tensor) -> torch.Tensor:
    return _RetentionSum.apply(log_beta)


__all__ = [
    "causal_attention_stats",
    "compact_slots",
    "decode_attention_flat",
    "max_similarity",
    "merging_chain",
    "merging_set_ends",
    "pool_by_position",
    "retention_scores",
    "retention_sum",
    "window_scores_flat",
]
