"""Plain-torch semantics of every kvgates kernel.

Each function here defines what its Triton counterpart (``kvgates.kernels.triton_ops``) must compute; the
dispatch in ``kvgates.kernels`` calls these on CPU and the Triton versions on CUDA. Layout conventions:

* a dense slot layout is ``[B, H_kv, C, D]`` for keys/values and ``[B, H_kv, C]`` for slot positions
  (int64, ``-1`` = empty slot);
* queries are ``[B, H, q, D]`` with ``H = G * H_kv``; query head ``i`` reads KV head ``i // G`` (the
  ``repeat_kv`` convention of transformers);
* slot ``s`` is visible to a query at position ``p`` iff ``pos[s] >= 0`` and ``pos[s] <= p``. Visibility
  never depends on slot order, so evicted slots can be reused by later tokens.

Probabilities and scores are returned in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "GROUP_REDUCTIONS",
    "group_reduce",
    "visibility",
    "attention_probs",
    "masked_attention",
    "decode_attention",
    "column_sums",
    "pool_by_position",
    "gather_slots",
    "gather_flat",
    "scatter_flat",
    "retention_scores",
    "retention_sum",
]

GROUP_REDUCTIONS = ("sum", "mean", "max")


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
    """Attention of ``q`` over the slots under position visibility, ``[B, H, q, D]`` in the input dtype."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    mask = visibility(slot_pos, q_pos)
    # A row that sees nothing would give NaN; such rows (padded queries) are discarded by the caller.
    mask = mask | ~mask.any(-1, keepdim=True)
    mask = mask[:, :, None].expand(b, hkv, h // hkv, n, mask.shape[-1]).reshape(b, h, n, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor,
    scale: float,
    reduce: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per sequence over the slots, plus each slot's attention probability.

    Args:
        q: ``[B, H, D]`` the current query (its own key is already in a slot).
        k, v: ``[B, H_kv, C, D]``.
        slot_pos: ``[B, H_kv, C]``; every valid slot is visible (it holds a past or the current token).
        scale: softmax scale.
        reduce: ``"sum"`` returns probabilities summed over each GQA group ``[B, H_kv, C]``;
            ``"none"`` returns them per query head ``[B, H, C]``.

    Returns:
        ``(out [B, H, D] in q's dtype, probs float32)``; empty slots get probability 0.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    scores = _grouped_scores(q[:, :, None], k, scale)[:, :, :, 0]  # [B, H_kv, G, C]
    scores = scores.masked_fill((slot_pos < 0)[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
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
    block: int = 256,
) -> torch.Tensor:
    """Sum over the (valid) query rows of their attention probabilities per slot, ``[B, H, C]`` float32.

    The rows are processed ``block`` at a time, so at most ``block x C`` probabilities per head exist at once.
    """
    b, h, n, _ = q.shape
    total = q.new_zeros((b, h, k.shape[2]), dtype=torch.float32)
    for start in range(0, n, block):
        stop = min(n, start + block)
        probs = attention_probs(q[:, :, start:stop], k, slot_pos, q_pos[:, start:stop], scale)
        weight = q_valid[:, None, start:stop, None].to(probs.dtype)
        total += (probs * weight).sum(2)
    return total


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


def gather_slots(tensors: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
    """Compaction: ``out[b, h, j] = t[b, h, index[b, h, j]]`` for each ``[B, H_kv, C, ...]`` tensor."""
    out = []
    for t in tensors:
        idx = index.reshape(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])
        out.append(torch.gather(t, 2, idx))
    return out


def gather_flat(tensors: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
    """Compaction of flat storage: ``out[b, j] = t[b, index[b, j]]`` for each ``[B, S, D]`` tensor."""
    return [torch.gather(t, 1, index[..., None].expand(*index.shape, t.shape[-1])) for t in tensors]


def scatter_flat(tensors: list[torch.Tensor], index: torch.Tensor, updates: list[torch.Tensor]) -> None:
    """In-place write ``t[b, index[b, j]] = u[b, j]``; ``updates`` are ``[B, H_kv, n, D]`` flattened to ``[B, H_kv*n, D]``."""
    for t, u in zip(tensors, updates):
        u = u.reshape(index.shape[0], index.shape[1], t.shape[-1]).to(t.dtype)
        t.scatter_(1, index[..., None].expand(*index.shape, t.shape[-1]), u)


def retention_scores(log_beta: torch.Tensor, slot_pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """TRIM-KV decayed retention ``(t - pos) * log_beta`` per slot; empty slots get ``-inf``.

    Args:
        log_beta: ``[B, H_kv, C]`` float (<= 0).
        slot_pos: ``[B, H_kv, C]``.
        t: ``[B]`` current position of each sequence.
    """
    age = (t[:, None, None] - slot_pos).to(log_beta.dtype)
    return torch.where(slot_pos >= 0, age * log_beta, torch.full_like(log_beta, float("-inf")))


def retention_sum(log_beta: torch.Tensor) -> torch.Tensor:
    """Training-time retention mass ``S_t = sum_{i <= t} beta_i^(t - i)`` for every t, ``[..., T]``.

    ``log_beta`` is ``[..., T]``. Computed by the recurrence ``S_t = beta_t^0 + sum_{i<t} beta_i^(t-i)``
    in the log domain over explicit ``(t, i)`` pairs, which is the definition; the Triton kernel computes the
    same thing without the ``T x T`` matrix.
    """
    n = log_beta.shape[-1]
    idx = torch.arange(n, device=log_beta.device)
    age = (idx[:, None] - idx[None, :]).to(log_beta.dtype)  # [t, i]
    logits = age * log_beta[..., None, :]
    logits = logits.masked_fill(age < 0, float("-inf"))
    return torch.logsumexp(logits, dim=-1).exp()
