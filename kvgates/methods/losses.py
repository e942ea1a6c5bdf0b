"""Losses of gate training. Formulas are in each docstring; ``T`` is the sequence length, ``M`` the memory budget.

* ``distillation_loss``: quality of the gated student against the frozen teacher on completion tokens;
* ``capacity_loss``: the TRIM-KV hinge that keeps the soft retention mass within ``M``;
* ``teacher_ranking_loss``: a heuristic policy's keep-set as a ranking target for the gates' decayed scores;
* ``locret_loss``: regression of Locret's retaining heads onto causal-importance labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgates import kernels


def _kl_ce_chunk(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    gradients: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed KL and CE of one chunk of rows, and (``gradients``) their gradients with respect to ``student``.

    With ``q = softmax(student logits)`` and ``p = softmax(teacher logits)``, ``d KL / d logits = q - p`` and
    ``d CE / d logits = q - onehot(target)``, so both gradients come from one ``[2n, vocab] @ [vocab, d]`` product
    while the chunk's logits exist; nothing is recomputed in the backward."""
    n = student.shape[0]
    logp = torch.log_softmax(F.linear(torch.cat([student, teacher]), weight, bias).float(), -1)
    s, t = logp[:n], logp[n:]
    ce = -s.gather(-1, targets[:, None]).sum()
    diff = t - s
    p = t.exp_()  # in place: logp holds [log q; p] from here on (the softmax held four [n, vocab] buffers, now three)
    kl = diff.mul_(p).sum()
    del diff
    if not gradients:
        return kl, ce, None, None
    q = s.exp_()
    p.neg_().add_(q)  # logp: [q; q - p]
    q[torch.arange(n, device=q.device), targets] -= 1.0  # logp: [q - onehot; q - p]
    grads = logp.to(weight.dtype) @ weight
    return kl, ce, grads[n:], grads[:n]


class _DistillChunk(torch.autograd.Function):
    """``(KL sum, CE sum)`` of a chunk whose backward scales the gradients ``_kl_ce_chunk`` made in the forward."""

    @staticmethod
    def forward(ctx, student, teacher, targets, weight, bias):
        kl, ce, grad_kl, grad_ce = _kl_ce_chunk(student, teacher, targets, weight, bias, gradients=True)
        ctx.save_for_backward(grad_kl, grad_ce)
        ctx.dtype = student.dtype
        return kl, ce

    @staticmethod
    def backward(ctx, d_kl, d_ce):
        grad_kl, grad_ce = ctx.saved_tensors
        return (d_kl * grad_kl.float() + d_ce * grad_ce.float()).to(ctx.dtype), None, None, None, None


def distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Linear,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(KL, CE)`` averaged over completion tokens; the base loss is their mean, ``(KL + CE) / 2``.

    ``KL = mean_t sum_v p_teacher(v | <t) (log p_teacher(v | <t) - log p_student(v | <t))`` (forward KL at
    temperature 1) and ``CE = mean_t -log p_student(x_t | <t)`` over the ``n`` completion positions.

    Args:
        student_hidden, teacher_hidden: ``[n, d]`` final (normed) hidden states at the positions that predict the
            completion tokens.
        targets: ``[n]`` the completion tokens.
        lm_head: the frozen output projection (no gradient reaches it).
        chunk: rows per chunk. Each chunk's ``[2 chunk, vocab]`` logits (student's and teacher's) are made,
            reduced and dropped; when the student needs a gradient, the chunk's gradient (``[chunk, d]``, for KL and
            for CE) is made in the forward from the same logits, so neither side's ``[n, vocab]`` logits exist whole
            at any time and none are recomputed in the backward.
    """
    if lm_head.weight.requires_grad or (lm_head.bias is not None and lm_head.bias.requires_grad):
        raise ValueError("distillation_loss takes a frozen output projection: lm_head's parameters require gradients")
    n = targets.numel()
    if n == 0:
        zero = student_hidden.sum() * 0.0
        return zero, zero
    kl = ce = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        args = (student_hidden[sl], teacher_hidden[sl], targets[sl], lm_head.weight, lm_head.bias)
        if student_hidden.requires_grad and torch.is_grad_enabled():
            k, c = _DistillChunk.apply(*args)
        else:
            k, c = _kl_ce_chunk(*args, gradients=False)[:2]
        kl, ce = kl + k, ce + c
    return kl / n, ce / n


def capacity_loss(
    log_beta: torch.Tensor, budget: float, lengths: torch.Tensor, global_budget: bool = False, stride: int = 1
) -> torch.Tensor:
    """TRIM-KV capacity hinge.

    Per layer ``l`` and KV head ``h``: ``S_t = sum_{i <= t} beta_i^(t - i)`` (``kernels.retention_sum``) and
    ``L_t = max(0, (S_t - M) / max(t - M, 1))``; the loss is the mean of ``L_t`` over the positive hinges (as the
    TRIM-KV release does; zero when no hinge is positive). Global variant (``global_budget``): ``S_t`` is summed
    over layers and heads and compared with ``M_global = M * L * H_kv``, normalised by ``(t - M) * L * H_kv``.

    Only positions ``t >= M`` can violate (``S_t <= t + 1``), so rows ``t = M, M + stride, ...`` below each
    sequence's length are evaluated; ``stride > 1`` estimates the mean from a regular subset.

    Args:
        log_beta: ``[L, B, H_kv, T]`` (<= 0).
        budget: ``M`` (may be fractional while a schedule ramps it).
        lengths: ``[B]`` real (unpadded) length of each sequence; padding sits at the end.
    """
    n_layers, b, hkv, t = log_beta.shape
    start = int(budget)
    if start >= t:
        return log_beta.sum() * 0.0
    rows = torch.arange(start, t, stride, device=log_beta.device)
    s = kernels.retention_sum(log_beta, rows)  # [L, B, H_kv, R]
    excess_over = rows.to(s.dtype) - budget
    if global_budget:
        s = s.sum(dim=(0, 2))  # [B, R]
        hinge = (s - budget * n_layers * hkv) / (excess_over.clamp(min=1.0) * n_layers * hkv)
        valid = rows[None] < lengths[:, None]
    else:
        hinge = (s - budget) / excess_over.clamp(min=1.0)
        valid = (rows[None] < lengths[:, None])[None, :, None].expand_as(hinge)
    positive = (hinge > 0) & valid
    if not bool(positive.any()):
        return log_beta.sum() * 0.0
    return hinge[positive].mean()


def teacher_ranking_loss(
    log_beta: torch.Tensor, keep: torch.Tensor, lengths: torch.Tensor, pairs: int = 256, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pairwise logistic ranking of the gates' decayed scores against a heuristic teacher's keep-set.

    At the end of each sequence (``t = length - 1``) token ``i`` of a head scores ``r_i = (t - i) * log_beta_i``,
    the quantity TRIM-KV evicts by. For ``pairs`` random pairs ``(k, e)`` of a kept token ``k`` and an evicted
    token ``e`` of the same layer, sequence and head, the loss is ``mean softplus(r_e - r_k)``.

    What it pulls toward: the *order* the teacher implies at the end of the sequence, every kept token above
    every evicted one, so that the gates' own top-M at that moment approaches the teacher's keep-set. It does
    not ask for the teacher's scores, says nothing about earlier moments (the capacity and distillation terms
    shape those), and is zero once the order is learned with a margin.

    Args:
        log_beta: ``[L, B, H_kv, T]``.
        keep: ``[L, B, H_kv, T]`` bool, the teacher's keep-set (False beyond each length).
        lengths: ``[B]`` real length of each sequence.
    """
    n_layers, b, hkv, t = log_beta.shape
    idx = torch.arange(t, device=log_beta.device)
    real = idx[None] < lengths[:, None]  # [B, T]
    age = ((lengths[:, None] - 1 - idx[None]).clamp(min=0)).to(log_beta.dtype)  # [B, T]
    r = (age[None, :, None] * log_beta).reshape(-1, t)
    kept = (keep & real[None, :, None]).reshape(-1, t)
    evicted = (~keep & real[None, :, None]).reshape(-1, t)
    usable = kept.any(-1) & evicted.any(-1)
    if not bool(usable.any()):
        return log_beta.sum() * 0.0
    r, kept, evicted = r[usable], kept[usable], evicted[usable]
    # Sample uniformly among each row's kept and evicted tokens.
    k_idx = torch.multinomial(kept.float(), pairs, replacement=True, generator=generator)
    e_idx = torch.multinomial(evicted.float(), pairs, replacement=True, generator=generator)
    return F.softplus(r.gather(-1, e_idx) - r.gather(-1, k_idx)).mean()


def locret_loss(
    scores: torch.Tensor, labels: torch.Tensor, smoothness: float = 0.0025
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(total, regression, smoothness term)`` of Locret's retaining heads.

    ``regression = mean SmoothL1_beta=1(s, y)`` over tokens with a label (finite ``y``: a later query exists),
    heads and layers; ``smooth = sum_layers mean (s[:, :-1] - s[:, 1:])^2`` over neighbouring tokens that both have
    a label (Locret's term takes every neighbouring pair; here a pair with a padding token, or with a row's last
    token, which no later query labels, is left out); ``total = regression + smoothness * smooth``.

    Args:
        scores: ``[L, B, H_kv, T]`` the heads' predictions; labels: same shape, ``-inf`` where undefined.
    """
    known = torch.isfinite(labels)
    regression = F.smooth_l1_loss(scores[known], labels[known], beta=1.0) if bool(known.any()) else scores.sum() * 0.0
    pair = known[..., 1:] & known[..., :-1]
    diff = (scores[..., :-1] - scores[..., 1:]) ** 2
    per_layer = (diff * pair).sum(dim=(1, 2, 3)) / pair.sum(dim=(1, 2, 3)).clamp(min=1)
    smooth = per_layer.sum()
    return regression + smoothness * smooth, regression, smooth
