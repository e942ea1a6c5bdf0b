"""Training-time kernels and losses against literal brute-force definitions."""

import functools
import math

import pytest
import torch

from kvgates.kernels import gated
from kvgates.kernels.gated import (
    causal_importance,
    evicted_attention,
    gated_attention,
    gated_attention_flex,
    gated_attention_fused,
    gated_attention_reference,
    hard_eviction_mask,
)
from kvgates.kernels.reference import retention_sum
from kvgates.methods.losses import capacity_loss, distillation_loss, locret_loss, teacher_ranking_loss


def _inputs(b=2, h=4, hkv=2, t=9, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=dtype)
    lb = -torch.rand(b, hkv, t, generator=g, dtype=dtype)
    return q, k, v, lb


@pytest.mark.parametrize("masked", [False, True])
def test_gated_attention_equals_the_t_by_t_reference_in_values_and_gradients(masked):
    q, k, v, lb = _inputs()
    mask = None
    if masked:
        mask = torch.ones(2, 1, 9, 9, dtype=torch.bool)
        mask[1, ..., 6:] = False  # right padding of the second sequence
    args = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    refs = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    out, ref = gated_attention(*args, 0.3, mask), gated_attention_reference(*refs, 0.3, mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, r in zip(args, refs):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-10, rtol=1e-8)
    assert torch.autograd.gradcheck(lambda *x: gated_attention(*x, 0.3, mask), [x.clone().requires_grad_() for x in (q, k, v, lb)])


def test_gated_attention_reference_is_the_formula():
    q, k, v, lb = _inputs(b=1, h=2, hkv=1, t=5, d=4)
    out = gated_attention_reference(q, k, v, lb, 0.5)
    for head in range(2):
        for t in range(5):
            logits = [0.5 * float(q[0, head, t] @ k[0, 0, i]) + (t - i) * float(lb[0, 0, i]) for i in range(t + 1)]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            expected = sum(wi * v[0, 0, i] for i, wi in enumerate(w)) / sum(w)
            torch.testing.assert_close(out[0, head, t], expected)


def test_gated_attention_float32_at_long_length_and_zero_log_beta_is_plain_attention():
    q, k, v, lb = _inputs(b=1, h=3, hkv=1, t=700, d=16, dtype=torch.float32)
    lb = lb * 0.01
    torch.testing.assert_close(gated_attention(q, k, v, lb, 0.25), gated_attention_reference(q, k, v, lb, 0.25), atol=2e-5, rtol=1e-4)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(gated_attention(q, k, v, torch.zeros_like(lb), 0.25), plain, atol=1e-5, rtol=1e-5)


def test_gated_attention_flex_forward_matches():
    q, k, v, lb = _inputs(dtype=torch.float32)
    with torch.no_grad():  # FlexAttention has no CPU backward; the GPU path is unmeasured here
        torch.testing.assert_close(gated_attention_flex(q, k, v, lb, 0.3), gated_attention_reference(q, k, v, lb, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "attention, tolerance",
    [(gated_attention, 1e-10), (gated_attention_reference, 1e-10), (gated_attention_fused, 1e-10),
     (functools.partial(gated_attention_fused, precision="split"), 0.05)],
)
def test_queries_of_the_last_rows_are_those_rows_of_the_whole_attention_with_their_gradients(attention, tolerance, masked):
    """A model's last layer in distillation attends with the queries of its distilled rows only: each gated attention
    takes the last ``n`` positions' queries over all ``T`` keys, and gives those rows of the whole attention."""
    q, k, v, lb = _inputs(t=11)
    n = 4
    mask = None
    if masked:
        mask = torch.ones(2, 1, 11, 11, dtype=torch.bool)
        mask[1, ..., :3] = False  # left padding of the second sequence
    whole = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    part = [x.clone().requires_grad_() for x in (q[:, :, -n:], k, v, lb)]
    if tolerance > 1e-6:  # bfloat16 operands: compare with the definition in float64
        ref = gated_attention_reference(*whole, 0.3, mask)[:, :, -n:]
    else:
        ref = attention(*whole, 0.3, mask)[:, :, -n:]
    out = attention(*part, 0.3, None if mask is None else mask[:, :, -n:])
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(part[0].grad, whole[0].grad[:, :, -n:], atol=tolerance, rtol=tolerance)
    for a, r in zip(part[1:], whole[1:]):
        torch.testing.assert_close(a.grad, r.grad, atol=tolerance * 10, rtol=tolerance * 10)


def test_gated_attention_flex_takes_the_queries_of_the_last_rows():
    q, k, v, lb = _inputs(dtype=torch.float32, t=11)
    with torch.no_grad():
        out = gated_attention_flex(q[:, :, -4:], k, v, lb, 0.3)
        torch.testing.assert_close(out, gated_attention_reference(q, k, v, lb, 0.3)[:, :, -4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_evicted_attention_takes_the_queries_of_the_last_rows(temperature):
    """Hard (straight-through) and relaxed eviction take the queries of the last rows alone: those rows of the
    whole attention, with the gradients the whole one gives from them."""
    q, k, v, lb = _inputs(t=11)
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool)
    mask[1, ..., :2] = False  # left padding
    decode_from = torch.tensor([5, 7])
    whole = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    part = [x.clone().requires_grad_() for x in (q[:, :, -4:], k, v, lb)]
    want = evicted_attention(*whole, 0.3, 3, decode_from, mask, temperature)[:, :, -4:]
    got = evicted_attention(*part, 0.3, 3, decode_from, mask[:, :, -4:], temperature)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(want)
    (want * w).sum().backward()
    (got * w).sum().backward()
    torch.testing.assert_close(part[0].grad, whole[0].grad[:, :, -4:], atol=1e-12, rtol=1e-10)
    for a, r in zip(part[1:], whole[1:]):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-12, rtol=1e-10)


def _brute_visible(lb: torch.Tensor, budget: int, decode_from: int) -> torch.Tensor:
    """Row by row: the prompt sees every earlier token; a decoded row sees itself and the ``budget`` best of the
    tokens before it, ranked by ``(t - 1 - i) * lb_i`` when step ``t - 1`` evicted."""
    t = lb.numel()
    out = torch.zeros(t, t, dtype=torch.bool)
    for row in range(t):
        if row < decode_from:
            out[row, : row + 1] = True
            continue
        ranked = sorted(range(row), key=lambda i: -(row - 1 - i) * float(lb[i]))
        for i in ranked[:budget]:
            out[row, i] = True
        out[row, row] = True
    return out


@pytest.mark.parametrize("budget, decode_from", [(3, 4), (3, 12), (5, 0), (20, 2)])
def test_hard_eviction_mask_is_inference_eviction_row_by_row(budget, decode_from):
    _, _, _, lb = _inputs(b=2, hkv=2, t=12)
    starts = torch.tensor([decode_from, min(decode_from + 3, 12)])
    mask = hard_eviction_mask(lb, budget, starts)
    for b in range(2):
        for h in range(2):
            assert torch.equal(mask[b, h], _brute_visible(lb[b, h], budget, int(starts[b]))), (b, h)
    # The last rows alone, and with the steps before the rows every sequence prefills not ranked: the same rows.
    for rows_from in (0, 1, 6, 11):
        for prefilled in (0, int(starts.min())):
            assert torch.equal(hard_eviction_mask(lb, budget, starts, rows_from, prefilled), mask[:, :, rows_from:]), (rows_from, prefilled)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_evicted_attention_ranks_only_the_steps_after_the_prompt(temperature):
    """``prefilled`` (the rows every sequence prefills) skips ranking steps no row sees, and those rows take plain
    causal attention: the same values and gradients (to rounding), padded or not, whole or for the last rows."""
    q, k, v, lb = _inputs(t=11)
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool)
    mask[1, ..., :2] = False  # left padding
    decode_from = torch.tensor([5, 7])
    for rows in (11, 4):
        outs, grads = [], []
        for prefilled in (0, 5):
            args = [x.clone().requires_grad_() for x in (q[:, :, -rows:], k, v, lb)]
            out = evicted_attention(*args, 0.3, 3, decode_from, mask[:, :, -rows:], temperature, prefilled=prefilled)
            out.backward(torch.ones_like(out))
            outs.append(out)
            grads.append([a.grad for a in args])
        torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=1e-12)
        for a, r in zip(*grads):
            torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_evicted_attention_with_no_decoded_row_is_plain_attention(temperature):
    """``decode_from = T`` (``hard_eviction_mask``: no decoding), as ``decode_start`` gives a batch with no
    completion: every query row is a prompt row and sees every earlier key. The masked attention of the (no) rows
    after the prompt failed to reshape its empty output, so such a batch stopped a ``loss.hard_eviction`` step."""
    q, k, v, lb = _inputs(t=11)
    decode_from = torch.tensor([11, 11])
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    for rows in (11, 4):
        out = evicted_attention(q[:, :, -rows:], k, v, lb, 0.3, 3, decode_from, temperature=temperature, prefilled=11)
        torch.testing.assert_close(out, plain[:, :, -rows:], atol=1e-12, rtol=1e-12)

@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_evicted_attention_masks_only_the_rows_after_the_prompt(monkeypatch, temperature):
    """The rows every sequence prefills are plain causal attention; the eviction mask (or relaxed bias) covers only
    the rows after them, ``(T - prefilled) x T`` rather than ``T x T``: memory linear in ``T`` for a short completion."""
    q, k, v, lb = _inputs(t=11)
    decode_from = torch.tensor([8, 9])
    shapes = []
    masked = gated.grouped_masked_attention
    monkeypatch.setattr(gated, "grouped_masked_attention", lambda *a: shapes.append(tuple(a[3].shape)) or masked(*a))
    out = evicted_attention(q, k, v, lb, 0.3, 3, decode_from, temperature=temperature, prefilled=8)
    assert shapes == [(2, lb.shape[1], 3, 11)]
    plain = torch.nn.functional.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out[:, :, :8], plain, atol=1e-12, rtol=1e-12)


def test_grouped_masked_attention_takes_sdpas_output_in_any_memory_layout(monkeypatch):
    """CUDA's sdpa kernels return their output in ``[B, n, H, D]`` memory (a transposed view): regrouping the KV
    heads' batch entries into query heads must not assume the contiguous layout the CPU returns (on an H100, a
    ``view`` there failed every relaxed TRIM-KV step)."""
    q, k, v, _ = _inputs()
    mask = torch.rand(2, 2, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    expected = gated.grouped_masked_attention(q, k, v, mask, 0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # the same values in [B, n, H, D] memory

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_sdpa)
    torch.testing.assert_close(gated.grouped_masked_attention(q, k, v, mask, 0.5), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n", [5, 8])
def test_grouped_masked_attention_gives_the_gradient_of_a_mask_over_a_frozen_model(n):
    """Only the mask (the gates' bias) takes a gradient, as when training gates on a frozen model: on CUDA (run there
    when present) the memory-efficient kernel's backward failed for want of the log-sum-exp it keeps only for q, k or
    v; the gradient is the math formula's, and the frozen inputs get none."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, hh, tt, 8, generator=g).to(device) for hh, tt in ((4, n), (2, 11), (2, 11)))
    bias = (torch.randn(2, 2, n, 11, generator=g) * 0.5).to(device).requires_grad_()
    gated.grouped_masked_attention(q, k, v, bias, 0.3).pow(2).sum().backward()
    ref_bias = bias.detach().clone().requires_grad_()
    logits = torch.einsum("bkgnd,bktd->bkgnt", q.view(2, 2, 2, n, 8), k) * 0.3 + ref_bias[:, :, None]
    ref = torch.einsum("bkgnt,bktd->bkgnd", logits.softmax(-1), v).reshape(2, 4, n, 8)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(bias.grad, ref_bias.grad, atol=1e-5, rtol=1e-4)
    assert q.grad is None and k.grad is None and v.grad is None


def test_evicted_attention_has_the_hard_value_and_the_soft_gradient():
    q, k, v, lb = _inputs(dtype=torch.float32)
    starts = torch.tensor([3, 5])
    args = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    soft_args = [x.clone().requires_grad_() for x in (q, k, v, lb)]
    out = evicted_attention(*args, 0.3, 4, starts)
    seen = hard_eviction_mask(lb, 4, starts).repeat_interleave(2, 1)
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~seen, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v.repeat_interleave(2, 1), atol=1e-5, rtol=1e-5)
    soft = gated_attention(*soft_args, 0.3)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (soft * w).sum().backward()
    for a, r in zip(args, soft_args):
        torch.testing.assert_close(a.grad, r.grad)
    # A budget no smaller than the sequence evicts nothing: plain causal attention.
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(evicted_attention(q, k, v, lb, 0.3, 9, starts * 0), plain, atol=1e-5, rtol=1e-5)


def test_relaxed_eviction_tends_to_hard_eviction_and_has_exact_gradients():
    q, k, v, lb = _inputs()
    starts = torch.tensor([3, 5])
    hard = evicted_attention(q, k, v, lb, 0.3, 4, starts)
    torch.testing.assert_close(evicted_attention(q, k, v, lb, 0.3, 4, starts, temperature=1e-6), hard, atol=1e-6, rtol=1e-6)
    # Away from the limit the boundary tokens are partly seen, and the gradient is the function's own.
    assert float((evicted_attention(q, k, v, lb, 0.3, 4, starts, temperature=0.5) - hard).abs().max()) > 1e-3
    assert torch.autograd.gradcheck(
        lambda *x: evicted_attention(*x, lb, 0.3, 4, starts, temperature=0.5), [x.clone().requires_grad_() for x in (q, k, v)]
    )
    # Into log_beta: through every score, the threshold held where it is (it is a rank statistic).
    theta_moves = lb.clone().requires_grad_()
    evicted_attention(q, k, v, theta_moves, 0.3, 4, starts, temperature=0.5).sum().backward()
    assert float(theta_moves.grad.abs().sum()) > 0
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(evicted_attention(q, k, v, lb, 0.3, 9, starts, temperature=0.5), plain)


def _brute_s(lb: list[float]) -> list[float]:
    return [sum(math.exp((t - i) * lb[i]) for i in range(t + 1)) for t in range(len(lb))]


def test_retention_sum_is_the_definition_with_gradients_and_selected_rows():
    lb = -torch.rand(2, 3, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = retention_sum(lb, block=7)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(s[b, h], torch.tensor(_brute_s(lb[b, h].tolist()), dtype=torch.float64))
    rows = torch.tensor([3, 11, 19])
    torch.testing.assert_close(retention_sum(lb, rows, block=2), s[..., rows])
    assert torch.autograd.gradcheck(lambda x: retention_sum(x, rows, block=2), (lb.clone().requires_grad_(),))


def _brute_capacity(lb, budget, lengths, global_budget, stride):
    """Mean of the positive hinges, literally (lb: nested lists [L][B][H][T])."""
    n_layers, hkv = len(lb), len(lb[0][0])
    hinges = []
    for b, length in enumerate(lengths):
        for t in range(int(budget), length, stride):
            if global_budget:
                s = sum(_brute_s(lb[layer][b][h][:length])[t] for layer in range(n_layers) for h in range(hkv))
                hinges.append((s - budget * n_layers * hkv) / (max(t - budget, 1) * n_layers * hkv))
            else:
                for layer in range(n_layers):
                    for h in range(hkv):
                        s = _brute_s(lb[layer][b][h][:length])[t]
                        hinges.append((s - budget) / max(t - budget, 1))
    positive = [x for x in hinges if x > 0]
    return sum(positive) / len(positive) if positive else 0.0


@pytest.mark.parametrize("global_budget", [False, True])
@pytest.mark.parametrize("stride", [1, 3])
def test_capacity_loss_against_brute_force(global_budget, stride):
    g = torch.Generator().manual_seed(2)
    lb = -torch.rand(3, 2, 2, 24, dtype=torch.float64, generator=g) * 0.3
    lb[0, 0, 0] *= 0.01  # one head that keeps nearly everything
    lengths = torch.tensor([24, 17])
    got = capacity_loss(lb, 5, lengths, global_budget, stride)
    expected = _brute_capacity(lb.tolist(), 5, lengths.tolist(), global_budget, stride)
    assert abs(float(got) - expected) < 1e-10
    assert float(capacity_loss(lb, 30, lengths, global_budget, stride)) == 0.0  # the budget exceeds every length


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("block", [1, 3, 16])
def test_causal_importance_against_brute_force(block, padded):
    q, k, _, _ = _inputs(b=2, h=4, hkv=2, t=7, d=5)
    valid = torch.ones(2, 7, dtype=torch.bool)
    if padded:
        valid[1, 5:] = False
    got = causal_importance(q, k, 0.4, valid if padded else None, block=block)
    for b in range(2):
        for j in range(2):
            for i in range(7):
                logits = [0.4 * float(q[b, hq, p] @ k[b, j, i]) for hq in (2 * j, 2 * j + 1) for p in range(i + 1, 7) if valid[b, p]]
                assert float(got[b, j, i]) == pytest.approx(max(logits) if logits else float("-inf"))


def test_locret_loss_by_hand():
    scores = torch.tensor([[[[1.0, 3.0, 0.0]]]])
    labels = torch.tensor([[[[1.5, 1.0, float("-inf")]]]])
    total, regression, smooth = locret_loss(scores, labels, smoothness=0.5)
    assert float(regression) == pytest.approx((0.5 * 0.5**2 + (2.0 - 0.5)) / 2)  # SmoothL1, beta 1
    assert float(smooth) == pytest.approx((1.0 - 3.0) ** 2)  # only the pair with two labels
    assert float(total) == pytest.approx(float(regression) + 0.5 * float(smooth))


@pytest.mark.parametrize("bias", [False, True])
def test_distillation_loss_chunks_equal_whole_and_match_the_formula(bias):
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(6, 11, bias=bias).double().requires_grad_(False)
    s = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(9, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (9,), generator=g)
    kl, ce = distillation_loss(s, t, y, head, chunk=4)
    ps, pt = torch.log_softmax(head(s), -1), torch.log_softmax(head(t), -1)
    kl_ref, ce_ref = (pt.exp() * (pt - ps)).sum(-1).mean(), torch.nn.functional.cross_entropy(head(s), y)
    torch.testing.assert_close(kl, kl_ref.float())
    torch.testing.assert_close(ce, ce_ref.float())
    # The gradient made in the forward, scaled by the backward, is autograd's through the formula (any weights).
    grad = torch.autograd.grad(0.3 * kl + 1.7 * ce, s)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(0.3 * kl_ref + 1.7 * ce_ref, s)[0])
    whole = distillation_loss(s, t, y, head, chunk=100)
    torch.testing.assert_close(grad, torch.autograd.grad(0.3 * whole[0] + 1.7 * whole[1], s)[0])
    with torch.no_grad():
        torch.testing.assert_close(distillation_loss(s, t, y, head, chunk=4), (kl.detach(), ce.detach()))
    same = distillation_loss(t, t, y, head)[0].detach()
    assert float(same) == pytest.approx(0.0, abs=1e-6)


def test_distillation_loss_refuses_a_trainable_head():
    head = torch.nn.Linear(6, 11, bias=False)
    with pytest.raises(ValueError, match="frozen output projection"):
        distillation_loss(torch.randn(2, 6), torch.randn(2, 6), torch.tensor([1, 2]), head)


def test_teacher_ranking_loss_is_low_when_the_order_agrees():
    lengths = torch.tensor([8])
    keep = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    keep[..., [1, 6, 7]] = True
    agree = torch.full((1, 1, 1, 8), -3.0)
    agree[..., [1, 6, 7]] = 0.0  # kept tokens retain everything: top scores at the end
    disagree = torch.where(keep, torch.tensor(-3.0), torch.tensor(0.0))
    low = teacher_ranking_loss(agree, keep, lengths, generator=torch.Generator().manual_seed(0))
    high = teacher_ranking_loss(disagree, keep, lengths, generator=torch.Generator().manual_seed(0))
    assert float(low) < 0.05 < 1.0 < float(high)


def test_distillation_loss_in_bfloat16_follows_the_float64_formula():
    """bfloat16 hidden states and head (a GPU run's dtypes): the loss and the gradient made in the forward stay
    within bfloat16's rounding of the float64 formula's."""
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    s = torch.randn(12, 16, generator=g)
    t = torch.randn(12, 16, generator=g)
    y = torch.randint(0, 50, (12,), generator=g)
    s16 = s.bfloat16().requires_grad_(True)
    kl, ce = distillation_loss(s16, t.bfloat16(), y, head.bfloat16(), chunk=5)
    grad = torch.autograd.grad(kl + ce, s16)[0]
    assert grad.dtype == torch.bfloat16
    w = head.weight.bfloat16().double()
    s64 = s.bfloat16().double().requires_grad_(True)
    ps, pt = torch.log_softmax(s64 @ w.T, -1), torch.log_softmax(t.bfloat16().double() @ w.T, -1)
    ref = (pt.exp() * (pt - ps)).sum(-1).mean() + torch.nn.functional.nll_loss(ps, y)
    torch.testing.assert_close(kl + ce, ref.float(), atol=0, rtol=1e-2)
    expected = torch.autograd.grad(ref, s64)[0]
    assert (grad.double() - expected).norm() / expected.norm() < 1e-2
