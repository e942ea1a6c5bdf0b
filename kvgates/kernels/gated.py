"""Training-time kernels: TRIM-KV gated attention, and Locret's causal-importance labels.

Gated attention (TRIM-KV, "Cache What Lasts"). A student attends with

    logits[t, i] = scale * q_t . k_i + (t - i) * log_beta_i          for i <= t

where ``log_beta_i`` (<= 0) belongs to token ``i``'s KV head and is broadcast over that head's query heads: a
token with ``beta < 1`` fades with its age, which is the soft counterpart of evicting it. ``log_beta = 0`` is the
frozen model exactly.

``gated_attention_reference`` builds the ``T x T`` bias literally (the definition, for tests).
``gated_attention`` never builds it: the bias is separable, ``(t - i) lb_i = t lb_i - i lb_i``, so two extra query
channels ``[t - c, 1]`` and two extra key channels ``[lb_i, -(i - c) lb_i] / scale`` carry it exactly through
any fused attention kernel (here ``scaled_dot_product_attention``: the CPU flash kernel, FlashAttention or the
memory-efficient kernel on GPU), with exact gradients into ``log_beta``. Precision: ``(t - c) lb`` and
``(i - c) lb`` are subtracted inside the kernel's dot product, so their rounding error grows with the length;
centring on ``c = (T - 1) / 2`` halves the magnitudes, and the whole product runs in float32 (half-precision
inputs are upcast for this call: in bf16, ``t`` itself would be rounded by up to 8 positions at T = 2048).
On CUDA no fused kernel (flash, memory-efficient, cuDNN) takes that head dim (``D + 2``), so sdpa would fall back
to its math kernel and hold the ``T x T`` scores: ``gated_attention_fused`` is the CUDA route. It pads the extra
channels with zeros to a width the fused kernels take (a multiple of 8; zero channels add nothing to ``q . k``, and
the scale is passed explicitly, so padding changes nothing) and carries the bias in one of two precisions
(``FUSED_PRECISIONS``):

* ``"float32"``: everything in float32 (the memory-efficient kernel): the bias and its gradient as exact as the
  CPU path's;
* ``"split"``: ``q``, ``k``, ``v`` in bfloat16 (FlashAttention), the bias channels split into bfloat16 parts
  (``x = x_1 + x_2 + x_3``) whose products the kernel accumulates in float32, so the forward's bias keeps about
  float32's precision. The gradient into ``log_beta`` comes out of the kernel's bfloat16 key gradient, where the
  two halves of the separable bias cancel: its relative error grows with ``T`` (measured in docs/training-gpu.md).

On CUDA both run with sdpa's math kernel excluded (``fused_only``): a shape no fused kernel takes is an error
naming it, never a silent ``O(T^2)`` fallback. ``gated_attention_flex`` is the other GPU route: FlexAttention
under ``torch.compile`` with a ``score_mod`` that adds the bias in float32 inside the kernel (FlexAttention has no
CPU backward, so on the CPU it serves forwards only). Which of the two a CUDA run takes is
``kvgates.gates.training.CUDA_ATTENTION`` (their speed on a GPU is not measured: no GPU was lent).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "causal_importance",
    "causal_visibility",
    "evicted_attention",
    "FUSED_PRECISIONS",
    "fused_kernel_violations",
    "fused_only",
    "fused_operands",
    "fused_width",
    "gated_attention",
    "gated_attention_flex",
    "gated_attention_fused",
    "gated_attention_reference",
    "grouped_masked_attention",
    "hard_eviction_mask",
]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (gradient checks); everything else runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_visibility(n: int, t: int, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[B or 1, 1, n, T]`` bool: ``n`` query rows, the last ``n`` of ``T`` positions, under causality, and ``mask``
    (``[.., n, T]``, bool, True = attend; or additive float) when given."""
    idx = torch.arange(t, device=device)
    causal = (idx[t - n :, None] >= idx[None, :])[None, None]
    if mask is None:
        return causal
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return causal & allowed


def gated_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The definition, with an explicit ``[B, H, n, T]`` bias.

    Args:
        q: ``[B, H, n, D]``, the queries of the last ``n`` positions (``n = T``: every position; fewer when only the
            last rows' outputs are read, e.g. a model's last layer in distillation); k, v: ``[B, H_kv, T, D]`` (one
            sequence, no cache: key ``i`` sits at position ``i``).
        log_beta: ``[B, H_kv, T]`` per-token log retention (<= 0) of each KV head.
        scale: softmax scale.
        mask: optional ``[B, 1, n, T]`` bool (True = may attend) or additive float mask, on top of causality.

    Returns:
        ``[B, H, n, D]`` in ``q``'s dtype; a row that may attend to nothing is zero.
    """
    n, t = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    work = _work_dtype(q)
    kk, vv = k.repeat_interleave(g, 1).to(work), v.repeat_interleave(g, 1).to(work)
    lb = log_beta.repeat_interleave(g, 1).to(work)
    idx = torch.arange(t, device=q.device, dtype=work)
    logits = torch.matmul(q.to(work), kk.transpose(-1, -2)) * scale + (idx[t - n :, None] - idx[None, :]) * lb[:, :, None, :]
    logits = logits.masked_fill(~causal_visibility(n, t, mask, q.device), float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.matmul(probs, vv).to(q.dtype)


def gated_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``gated_attention_reference`` through ``scaled_dot_product_attention`` with two extra channels (no ``T x T``
    bias; see the module docstring). Same arguments and result."""
    with torch.autocast(q.device.type, enabled=False):  # bf16 autocast would round the position channels
        return _gated_sdpa(q, k, v, log_beta, scale, mask)


def _gated_sdpa(q, k, v, log_beta, scale, mask):
    b, h, n, d = q.shape
    hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype, work = q.dtype, _work_dtype(q)
    q, k, v = q.to(work), k.to(work), v.to(work)
    pos = torch.arange(t, device=q.device, dtype=work) - (t - 1) / 2
    lb = log_beta.to(work) / scale
    q_aug = torch.cat([q, pos[t - n :].expand(b, h, n)[..., None], q.new_ones(b, h, n, 1)], dim=-1)
    k_aug = torch.cat([k, lb[..., None], (-pos * lb)[..., None]], dim=-1)
    # Equal q/k/v widths keep sdpa on its fused kernels; the padded value channels are dropped after.
    pad = d + 2 - dv
    v_aug = torch.cat([v, v.new_zeros(b, hkv, t, pad)], dim=-1) if pad > 0 else v
    if h != hkv and k_aug.requires_grad:
        # The CPU flash kernel's backward splits its work over key heads: with grouped heads it runs on as many
        # threads as there are key heads, repeated on as many as query heads (same forward cost).
        k_aug, v_aug = k_aug.repeat_interleave(h // hkv, 1), v_aug.repeat_interleave(h // hkv, 1)
    return _causal_sdpa(q_aug, k_aug, v_aug, scale, mask)[..., :dv].to(dtype)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """sdpa under the causal mask (and ``mask``, see ``causal_visibility``; a row that sees nothing is zero), grouped query
    heads when ``k`` has fewer heads than ``q``; the queries are the last ``q.shape[2]`` of ``k.shape[2]`` positions."""
    gqa = k.shape[1] != q.shape[1]
    n, t = q.shape[2], k.shape[2]
    if mask is None and n == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    visible = causal_visibility(n, t, mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa).nan_to_num(0.0)


#: Bias precisions of ``gated_attention_fused`` (see the module docstring).
FUSED_PRECISIONS = ("float32", "split")
#: sdpa's kernels that never hold the ``T x T`` scores: the only ones a CUDA training attention may run on.
FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_HALF = (torch.float16, torch.bfloat16)


@contextmanager
def fused_only(device: torch.device, what: str, *tensors: torch.Tensor) -> Iterator[None]:
    """On CUDA: sdpa calls in the block run on a fused kernel or fail with an error naming ``what`` and the shapes
    and dtypes of ``tensors`` (sdpa's math kernel, which holds the ``T x T`` scores, is excluded). Elsewhere:
    nothing changes (the CPU's flash kernel takes every head dim)."""
    if device.type != "cuda":
        yield
        return
    try:
        with sdpa_kernel(FUSED_BACKENDS):
            yield
    except RuntimeError as err:
        if "No available kernel" not in str(err):
            raise
        shapes = ", ".join(f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" for x in tensors)
        raise RuntimeError(
            f"{what}: no fused attention kernel (flash, memory-efficient, cuDNN) takes q, k, v of {shapes}, and the "
            f"math fallback (T x T scores) is excluded; see the warnings above for each kernel's reason"
        ) from err


def fused_kernel_violations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool = False) -> list[str]:
    """What keeps ``q``, ``k``, ``v`` (``[B, H, T, D]``) off CUDA's fused sdpa kernels (empty: one takes them).

    FlashAttention takes half precision, a head dim that is a multiple of 8 up to 256, equal widths and grouped
    query heads, but no mask; the memory-efficient kernel also takes float32 and masks, but needs as many key as
    query heads. Every kernel needs the last dim contiguous."""
    out = []
    dtypes = {x.dtype for x in (q, k, v)}
    if len(dtypes) > 1 or not dtypes <= {*_HALF, torch.float32}:
        out.append(f"dtypes {sorted(str(d) for d in dtypes)} (one of float16, bfloat16, float32)")
    widths = {x.shape[-1] for x in (q, k, v)}
    if len(widths) > 1 or any(w % 8 for w in widths):
        out.append(f"head dims {sorted(widths)} (one width, a multiple of 8)")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        out.append("a last dim that is not contiguous")
    flash = q.dtype in _HALF and not masked and max(widths) <= 256
    if not flash and k.shape[1] != q.shape[1]:
        out.append(f"{q.shape[1]} query heads over {k.shape[1]} key heads without FlashAttention (float32 or a mask)")
    return out


def fused_width(width: int) -> int:
    """The head dim, at least ``width``, that CUDA's fused sdpa kernels take: the next multiple of 8 (extra
    channels are zeros, which add nothing to ``q . k`` or to the output)."""
    return -(-width // 8) * 8


def _split(x: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``x`` (float32) as ``parts`` bfloat16 tensors whose sum is ``x`` to ``2^(-8 parts)`` relative."""
    out = []
    for _ in range(parts):
        out.append(x.to(torch.bfloat16))
        x = x - out[-1].float()
    return out


def fused_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float,
    precision: str = "float32", masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` as ``gated_attention_fused`` hands them to sdpa: the bias channels appended, all three padded
    with zero channels to one width that is a multiple of 8, in float32 (float64 stays float64) or, for
    ``"split"``, bfloat16; key and value heads repeated to the query heads where the kernel that will take them
    (memory-efficient: float32 or ``masked``) has no grouped-query support."""
    if precision not in FUSED_PRECISIONS:
        raise ValueError(f"precision must be one of {FUSED_PRECISIONS}, got {precision!r}")
    b, h, n, d = q.shape
    hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
    work = torch.bfloat16 if precision == "split" else _work_dtype(q)
    bias_dtype = torch.float32 if precision == "split" else work
    pos = torch.arange(t, device=q.device, dtype=bias_dtype) - (t - 1) // 2  # whole numbers: exact in the parts
    lb = log_beta.to(bias_dtype) / scale
    key_bias = -pos * lb
    pos = pos[t - n :]  # the queries' positions
    if precision == "split":
        p1, p2 = _split(pos, 2)
        a, c = _split(lb, 3), _split(key_bias, 3)
        ones = torch.ones_like(p1)
        q_extra = [p1, p1, p1, p2, p2, ones, ones, ones]
        k_extra = [a[0], a[1], a[2], a[0], a[1], *c]  # p1 a + p2 (a1 + a2) + c, to 2^-24 relative
    else:
        q_extra, k_extra = [pos, torch.ones_like(pos)], [lb, key_bias]
    width = fused_width(max(d + len(q_extra), dv))
    q_aug = torch.cat([q.to(work), torch.stack(q_extra, -1).expand(b, h, n, -1), q.new_zeros(b, h, n, width - d - len(q_extra), dtype=work)], -1)
    k_aug = torch.cat([k.to(work), torch.stack(k_extra, -1), k.new_zeros(b, hkv, t, width - d - len(k_extra), dtype=work)], -1)
    v_aug = torch.cat([v.to(work), v.new_zeros(b, hkv, t, width - dv, dtype=work)], -1)
    if h != hkv and (work not in _HALF or masked):
        k_aug, v_aug = k_aug.repeat_interleave(h // hkv, 1), v_aug.repeat_interleave(h // hkv, 1)
    return q_aug, k_aug, v_aug


def gated_attention_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float,
    mask: torch.Tensor | None = None, precision: str = "float32",
) -> torch.Tensor:
    """``gated_attention`` padded for CUDA's fused kernels (``fused_operands``; see the module docstring): memory
    linear in ``T``, never sdpa's math kernel on CUDA. Same arguments and result, plus ``precision``."""
    dv = v.shape[-1]
    with torch.autocast(q.device.type, enabled=False):
        # Queries of the last rows only are masked too (``causal_visibility``): sdpa's causal flag aligns the first.
        masked = mask is not None or q.shape[2] != k.shape[2]
        q_aug, k_aug, v_aug = fused_operands(q, k, v, log_beta, scale, precision, masked=masked)
        with fused_only(q.device, "gated training attention", q_aug, k_aug, v_aug):
            out = _causal_sdpa(q_aug, k_aug, v_aug, scale, mask)
    return out[..., :dv].to(q.dtype)


def hard_eviction_mask(
    log_beta: torch.Tensor, budget: int, decode_from: torch.Tensor, rows_from: int = 0, prefilled: int = 0
) -> torch.Tensor:
    """``[B, H_kv, T - rows_from, T]`` bool: the keys each query row (from ``rows_from`` on) sees when
    ``TrimKV(budget)`` evicts as inference does.

    Inference prefills a prompt with every token visible, then decodes one token at a time, and after each step
    keeps the ``budget`` tokens of highest ``(t - i) * log_beta_i`` (``t`` the step's position). So a query row
    ``t < decode_from[b]`` (the prompt) sees every ``i <= t``, and a row ``t >= decode_from[b]`` sees itself and
    the top ``budget`` of ``i <= t - 1`` ranked at ``t - 1``. One difference: inference never brings back an
    evicted token, while this mask ranks afresh at every row (a token can re-enter when its slower-decaying
    neighbours overtake it; identical when the order does not change, e.g. one ``beta`` per head).

    Args:
        log_beta: ``[B, H_kv, T]`` (<= 0).
        budget: tokens per KV head kept after each decode step.
        decode_from: ``[B]`` the first decoded position of each row (``T``: no decoding).
        rows_from: the first query row wanted (the queries of the last ``T - rows_from`` positions).
        prefilled: rows every sequence prefills (at most ``decode_from``'s least value): only the steps from
            there on are ranked (``T x T`` scores and a top-k over each become ``(T - prefilled) x T``).
    """
    with torch.no_grad():
        score, causal = _ranking_scores(log_beta, torch.float32, _first_step(rows_from, prefilled))
        kth = score.topk(min(budget, score.shape[-1]), dim=-1).values[..., -1:]  # -inf: fewer exist, keep all
        kept = (score >= kth) & causal  # kept after each step
        t = log_beta.shape[-1]
        everything = torch.arange(rows_from, t, device=log_beta.device)[:, None] >= torch.arange(t, device=log_beta.device)
        return _rows_after_step(kept, everything, decode_from, rows_from)


def _first_step(rows_from: int, prefilled: int) -> int:
    """The first step whose keep set a query row from ``rows_from`` on may see: the step before the first row that
    is not prefilled in every sequence (row 0 sees only itself either way)."""
    return max(rows_from, prefilled, 1) - 1


def _ranking_scores(log_beta: torch.Tensor, dtype: torch.dtype, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, H_kv, S, T] scores, [S, T] causal)`` for the steps ``s = first .. T - 2`` (``S`` of them; the last
    position's step keeps nothing a row sees): row ``s`` holds ``(s - i) * log_beta_i`` (``-inf`` for ``i > s``),
    the ranking an eviction after step ``s`` uses."""
    t = log_beta.shape[-1]
    idx = torch.arange(t, device=log_beta.device)
    steps = idx[first : t - 1]
    causal = steps[:, None] >= idx[None, :]
    score = (steps[:, None] - idx[None, :]).to(dtype) * log_beta.to(dtype)[:, :, None, :]
    return score.masked_fill(~causal, float("-inf")), causal


def _rows_after_step(kept: torch.Tensor, everything: torch.Tensor, decode_from: torch.Tensor, rows_from: int) -> torch.Tensor:
    """From what the steps ``T - 1 - S .. T - 2`` keep (``kept`` ``[B, H_kv, S, T]``) to what each query row from
    ``rows_from`` on sees: row ``t`` sees what step ``t - 1`` kept and itself (True for a bool mask, 0 for an
    additive one), and a prompt row (``t < decode_from[b]``) sees its row of ``everything`` (``[T - rows_from, T]``,
    or a scalar). Rows before ``T - S`` must be prompt rows of every sequence, or row 0 (which sees itself): they
    are ``everything``'s rows, and only the last ``S`` rows are assembled."""
    t, s = kept.shape[-1], kept.shape[2]
    n = t - rows_from
    seen = everything.to(kept.dtype).expand(*kept.shape[:2], n, t).clone()
    rows = torch.arange(t - s, t, device=kept.device)
    diagonal = rows[:, None] == torch.arange(t, device=kept.device)[None, :]
    decoded = kept | diagonal if kept.dtype == torch.bool else kept.masked_fill(diagonal, 0.0)
    prompt = rows[None, :] < decode_from[:, None]  # [B, S] ranked rows that are prefilled
    tail = everything[n - s :] if everything.dim() else everything
    seen[:, :, n - s :] = torch.where(prompt[:, None, :, None], tail.to(kept.dtype), decoded)
    return seen


def evicted_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float,
    budget: int,
    decode_from: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 0.0,
    soft_attention=gated_attention,
    prefilled: int = 0,
) -> torch.Tensor:
    """The TRIM-KV student attending as inference does: plain attention (no retention bias) over the tokens
    ``hard_eviction_mask`` leaves, with one of two gradients into the gates.

    * ``temperature == 0`` (straight-through): the value is exactly hard eviction's; the gradient into ``q``,
      ``k``, ``v`` and ``log_beta`` is ``gated_attention``'s (the soft decay's).
    * ``temperature > 0`` (relaxed): each decoded row's logit to token ``i`` gets
      ``logsigmoid((r_i - theta) / temperature)``, with ``r_i = (t - 1 - i) * log_beta_i`` and ``theta`` (no
      gradient, a rank statistic as soft top-k relaxations treat it) midway between the ``budget``-th and the next
      score: tokens well inside the keep set count fully, tokens well outside vanish, and those near the boundary
      are partly seen and carry the gradient of whether keeping them would help. ``temperature -> 0`` is the hard
      value. The gradient is this function's own.

    Args: as ``gated_attention`` (the queries may be those of the last ``n`` positions), plus ``budget`` and
    ``decode_from`` (``hard_eviction_mask``), ``temperature`` (in units of ``r``) and ``soft_attention``, the gated
    attention giving the straight-through gradient (``gated_attention`` or one of its GPU forms), and ``prefilled``
    (``hard_eviction_mask``: the rows every sequence prefills). Those rows see every earlier key: they take plain
    causal attention (sdpa's fused kernels, memory linear in ``T``), and only the rows after them are masked (an
    eviction mask or bias ``[B, H_kv, n - prefilled, T]``): memory ``(T - prefilled) x T``, quadratic in ``T`` only
    when the completion is as long as the sequence.
    """
    n, t = q.shape[2], k.shape[2]  # the queries of the last n positions
    p = min(n, max(0, prefilled - (t - n)))  # query rows every sequence prefills
    ranked_mask = None if mask is None else mask[..., p:, :]
    seen = causal_visibility(n - p, t, ranked_mask, q.device)
    if temperature > 0:
        work = _work_dtype(q)
        qw, kw, vw = q.to(work), k.to(work), v.to(work)
        bias = _relaxed_keep_bias(log_beta, budget, decode_from, temperature, work, t - n + p, prefilled).masked_fill(~seen, float("-inf"))
        ranked = grouped_masked_attention(qw[:, :, p:], kw, vw, bias, scale).nan_to_num(0.0)
        return _prompt_rows_then(qw, kw, vw, scale, mask, p, ranked).to(q.dtype)
    soft = soft_attention(q, k, v, log_beta, scale, mask)
    with torch.no_grad():
        seen = hard_eviction_mask(log_beta, budget, decode_from, t - n + p, prefilled) & seen
        hard = _prompt_rows_then(q, k, v, scale, mask, p, grouped_masked_attention(q[:, :, p:], k, v, seen, scale).nan_to_num(0.0))
    return soft + (hard - soft).detach()


def _prompt_rows_then(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None, p: int, ranked: torch.Tensor
) -> torch.Tensor:
    """``evicted_attention``'s output: the first ``p`` query rows (prompt rows of every sequence; ``q`` holds the
    last ``n`` positions of ``k``'s) by plain causal attention over the keys they see, then ``ranked``, the other
    rows' output. Key and value heads are repeated to the query heads (the CPU flash kernel's backward then uses
    every thread; CUDA's memory-efficient kernel, which takes float32 and masks, has no grouped heads), and on
    CUDA sdpa's math kernel is excluded (``fused_only``)."""
    if p == 0:
        return ranked
    n, t = q.shape[2], k.shape[2]
    keys = t - n + p  # the prompt rows see keys up to their last position
    g = q.shape[1] // k.shape[1]
    k, v = k[:, :, :keys].repeat_interleave(g, 1), v[:, :, :keys].repeat_interleave(g, 1)
    with fused_only(q.device, "eviction's prompt rows", q[:, :, :p], k, v):
        prompt = _causal_sdpa(q[:, :, :p], k, v, scale, None if mask is None else mask[..., :p, :keys])
    return torch.cat([prompt, ranked], dim=2)


def grouped_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """sdpa of ``q`` ``[B, H, n, D]`` over ``k``, ``v`` ``[B, H_kv, T, D]`` under ``mask`` ``[B, H_kv, n, T]`` (bool or
    additive), one mask per KV head: each KV head's group of query heads is a batch entry of its own, which the mask
    broadcasts over, so the mask (and its gradient) is never repeated per query head. The keys and values are
    repeated per query head (the memory-efficient kernel, which CUDA runs masked attention on, takes no grouped
    heads; and it gave wrong values for stride-0 keys and values before pytorch#191984): memory linear in ``T``,
    beside the mask's quadratic. A row that sees nothing is sdpa's (NaN)."""
    b, h, n, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = h // hkv
    if q.is_cuda and torch.is_grad_enabled() and mask.requires_grad and not (q.requires_grad or k.requires_grad or v.requires_grad):
        # CUDA's memory-efficient kernel keeps the log-sum-exp its backward needs only where q, k or v takes a
        # gradient: the gates' mask alone (a frozen model) failed every relaxed step on an H200 ("LSE is not correctly
        # aligned"). A query that asks for one, discarded, keeps it; the values and the mask's gradient are the same.
        q = q.detach().requires_grad_()
    out = F.scaled_dot_product_attention(
        q.reshape(b * hkv, g, n, d),
        k.reshape(b * hkv, 1, t, d).repeat(1, g, 1, 1),
        v.reshape(b * hkv, 1, t, -1).repeat(1, g, 1, 1),
        attn_mask=mask.reshape(b * hkv, 1, n, t),
        scale=scale,
    )
    return out.reshape(b, h, n, v.shape[-1])  # CUDA's kernels return [B, n, H, D] memory, which no view regroups


def _relaxed_keep_bias(
    log_beta: torch.Tensor,
    budget: int,
    decode_from: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    rows_from: int = 0,
    prefilled: int = 0,
) -> torch.Tensor:
    """``[B, H_kv, T - rows_from, T]`` additive bias of ``evicted_attention``'s relaxed form for the query rows from
    ``rows_from`` on (0 where a row sees a token fully; causality is the caller's; ``prefilled`` as
    ``hard_eviction_mask``'s)."""
    score, causal = _ranking_scores(log_beta, dtype, _first_step(rows_from, prefilled))
    t = score.shape[-1]
    top = score.detach().topk(min(budget + 1, t), dim=-1).values
    theta = (top[..., budget - 1 : budget] + top[..., -1:]) / 2 if budget < t else top[..., -1:]
    keep = F.logsigmoid((score - theta.nan_to_num(0.0, neginf=-1e30)) / temperature)
    keep = torch.where(torch.isfinite(top[..., -1:]), keep, torch.zeros_like(keep))  # fewer than budget + 1: all kept
    return _rows_after_step(keep.masked_fill(~causal, 0.0), keep.new_zeros(()), decode_from, rows_from)


def gated_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``gated_attention_reference`` with FlexAttention under ``torch.compile``: the bias is a ``score_mod``
    computed in float32 inside the kernel, causality (and ``mask``, bool only) a block mask, so memory is linear
    in ``T`` (the first call of a shape compiles). FlexAttention has no CPU backward: on the CPU it runs
    forwards only."""
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError("gated_attention_flex takes a boolean mask")
    b, h, n, _ = q.shape
    t, g = k.shape[2], h // k.shape[1]
    lb = log_beta.float()
    first = t - n  # the first query's position

    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + lb[batch, head // g, kv_idx] * (q_idx + first - kv_idx).to(torch.float32)

    if mask is None:
        block_mask = _causal_block_mask(n, t, str(q.device))
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(batch, head, q_idx, kv_idx):
            return (q_idx + first >= kv_idx) & mask[batch if mask.shape[0] > 1 else 0, 0, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, B=b, H=None, Q_LEN=n, KV_LEN=t, device=q.device)
    return _compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=g > 1)


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled once per process (uncompiled, it materialises the ``T x T`` scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=8)
def _causal_block_mask(n: int, t: int, device: str):
    """The causal block mask of the last ``n`` of ``t`` positions' queries (made once per shape and device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    first = t - n
    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + first >= kv_idx, B=None, H=None, Q_LEN=n, KV_LEN=t, device=device)


def causal_importance(
    q: torch.Tensor, k: torch.Tensor, scale: float, q_valid: torch.Tensor | None = None, block: int = 256
) -> torch.Tensor:
    """Locret's label: for each token ``i`` and KV head, the largest pre-softmax logit ``scale * q_p . k_i`` that any
    *later* query ``p > i`` of the head's query group gives it, ``[B, H_kv, T]`` float32.

    Tokens no later (valid) query sees get ``-inf`` (the last token always does): leave them out of the loss.
    Query rows are processed ``block`` at a time, so at most ``block x T`` logits per head exist at once; a block's
    queries meet only the keys before them (every one of those, with no mask, except the block's own diagonal),
    and the scale multiplies the maxima (exact: rounding ``scale * x`` is monotone in ``x``).

    Args:
        q: ``[B, H, T, D]`` post-RoPE queries; k: ``[B, H_kv, T, D]`` post-RoPE keys (what attention sees).
        scale: softmax scale (positive).
        q_valid: ``[B, T]`` bool, False for padding queries (they give no label).
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    kf = k.float().transpose(-1, -2)  # [B, H_kv, D, T]
    best = torch.full((b, hkv, t), float("-inf"), device=q.device)
    idx = torch.arange(t, device=q.device)
    for start in range(0, t, block):
        stop = min(t, start + block)
        r = stop - start
        rows = q[:, :, start:stop].float().reshape(b, hkv, g * r, d)  # a KV head's query rows, by query head
        hidden = None if q_valid is None else ~q_valid[:, None, None, start:stop, None]  # [B, 1, 1, r, 1]
        if start:  # keys before the block: every row is later than each of them
            past = torch.matmul(rows, kf[..., :start]).view(b, hkv, g, r, start)
            if hidden is not None:
                past.masked_fill_(hidden, float("-inf"))
            best[..., :start] = torch.maximum(best[..., :start], past.amax(dim=(2, 3)))
        own = torch.matmul(rows, kf[..., start:stop]).view(b, hkv, g, r, r)
        own.masked_fill_(idx[start:stop, None] <= idx[None, start:stop], float("-inf"))  # query p strictly after key i
        if hidden is not None:
            own.masked_fill_(hidden, float("-inf"))
        best[..., start:stop] = own.amax(dim=(2, 3))  # later blocks' queries raise these
    return best * scale
