"""Each policy's keep decision equals a literal re-implementation of the spec, on random small layers."""

import brute
import pytest
import torch
from helpers import make_layer, random_positions

from kvgates.policies import H2O, TOVA, PyramidKV, SnapKV, StreamingLLM
from kvgates.policies.h2o import CUMULATIVE
from kvgates.policies.pyramidkv import pyramid_budgets
from kvgates.runtime.stats import AttnStats, Phase

B, HKV, C = 2, 3, 24


def kept_positions(layer, keep, b, h):
    return {int(p) for p in layer.pos[b, h][keep[b, h]].tolist()}


def head_scores(layer, scores, b, h):
    return {int(p): float(s) for p, s in zip(layer.pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}


def stats_with(rows=None, colsum=None, phase=Phase.PREFILL, window=None):
    return AttnStats(
        phase=phase, new_slots=torch.zeros(B, HKV, 1, dtype=torch.long), rows=rows, colsum=colsum,
        window=None if window is None else window.sum(2), window_rows=0 if window is None else window.shape[2],
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,sinks", [(8, 4), (10, 0), (5, 2)])
def test_streaming_llm(seed, budget, sinks):
    policy = StreamingLLM(budget=budget, sinks=sinks)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    keep = policy.select(layer, stats_with(), budget)
    for b in range(B):
        for h in range(HKV):
            positions = [p for p in layer.pos[b, h].tolist() if p >= 0]
            assert kept_positions(layer, keep, b, h) == brute.streaming_llm(positions, budget, sinks)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,recent", [(8, None), (10, 3), (6, 0)])
def test_h2o(seed, budget, recent):
    policy = H2O(budget=budget, recent=recent)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    layer.state[CUMULATIVE] = torch.rand(B, HKV, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(), budget)
    for b in range(B):
        for h in range(HKV):
            scores = head_scores(layer, layer.state[CUMULATIVE], b, h)
            assert kept_positions(layer, keep, b, h) == brute.h2o(scores, budget, policy.recent)


def test_h2o_accumulates_prefill_and_decode_scores():
    policy = H2O(budget=8)
    layer = make_layer(policy, random_positions(B, HKV, C, held=10, seed=0))
    first, second = torch.rand(B, HKV, C), torch.rand(B, HKV, C)
    policy.observe(layer, stats_with(colsum=first))
    policy.observe(layer, stats_with(colsum=second, phase=Phase.DECODE))
    torch.testing.assert_close(layer.state[CUMULATIVE], first + second)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,kernel,pooling", [(4, 7, "max"), (3, 3, "avg"), (2, 1, "max")])
def test_snapkv(seed, window, kernel, pooling):
    budget = 9
    policy = SnapKV(budget=budget, window=window, kernel=kernel, pooling=pooling)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    rows = torch.rand(B, HKV, window, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(window=rows), budget)
    for b in range(B):
        for h in range(HKV):
            scores = head_scores(layer, rows.sum(2), b, h)
            assert kept_positions(layer, keep, b, h) == brute.snapkv(scores, budget, window, kernel, pooling)


@pytest.mark.parametrize("policy", [SnapKV(budget=9, window=4, kernel=7), PyramidKV(budget=9, window=4, kernel=7)])
def test_snapkv_pooling_stays_outside_the_observation_window(policy):
    """The window's large self-attention must not leak into its neighbours through the pooling: with a heavy
    token 1 and a window (13-16) attending mostly to itself, the 5 kept outside tokens are token 1's
    neighbourhood, not tokens 10-12 next to the window."""
    pos = torch.arange(17).expand(1, 1, 17).contiguous()
    layer = make_layer(policy, pos)
    scores = torch.full((1, 1, 17), 0.01)
    scores[..., 1] = 0.5
    scores[..., 13:] = 1.0
    keep = policy.select(layer, stats_with(window=scores[:, :, None].expand(1, 1, 4, 17) / 4), 9)
    assert kept_positions(layer, keep, 0, 0) == {0, 1, 2, 3, 4, 13, 14, 15, 16}
    assert kept_positions(layer, keep, 0, 0) == brute.snapkv(head_scores(layer, scores, 0, 0), 9, 4, 7, "max")


@pytest.mark.parametrize("budget,window,prompt,layers", [(64, 8, 500, 30), (32, 4, 40, 5), (20, 4, 21, 3), (16, 2, 300, 7)])
def test_pyramid_budgets(budget, window, prompt, layers):
    got = pyramid_budgets(budget, window, prompt, layers, 20)
    assert got == brute.pyramid_budgets(budget, window, prompt, layers, 20)
    assert got == sorted(got, reverse=True)


def test_pyramidkv_uses_layer_budget(tiny):
    _, model = tiny
    from kvgates import BudgetCache

    cache = BudgetCache(model.config, PyramidKV(budget=16, window=4, kernel=3))
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    expected = pyramid_budgets(16, 4, 60, 3, 20)
    assert [int(layer.quota.max()) for layer in cache.budget_layers] == expected
    assert cache.held_tokens()[:, 0, 0].tolist() == expected


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_head", [False, True])
def test_tova(seed, per_head):
    budget = 7
    policy = TOVA(budget=budget, per_head=per_head)
    pos = random_positions(B, 1, C, held=15, seed=seed).expand(B, HKV, C).contiguous()
    layer = make_layer(policy, pos)
    rows = torch.rand(B, HKV, 1, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(rows=rows), budget)
    for b in range(B):
        shared = head_scores(layer, rows[:, :, 0].mean(1, keepdim=True).expand(B, HKV, C), b, 0)
        for h in range(HKV):
            scores = head_scores(layer, rows[:, :, 0], b, h) if per_head else shared
            assert kept_positions(layer, keep, b, h) == brute.tova(scores, budget)


@pytest.mark.parametrize("seed", range(6))
def test_single_drop_fast_path_matches_full_ranking(seed):
    """With at most one slot too many per row (every decode step), topk_mask skips sorting; same decisions."""
    from kvgates.policies.selection import topk_mask

    g = torch.Generator().manual_seed(seed)
    pos = random_positions(B, HKV, C, held=12, seed=seed)
    valid = pos >= 0
    scores = torch.randint(0, 4, (B, HKV, C), generator=g).float()  # many ties
    k = torch.tensor([[11, 12, 13], [11, 11, 12]])  # drop one, none, none / one, one, none
    keep = topk_mask(scores, k, valid, pos)
    for b in range(B):
        for h in range(HKV):
            s = {int(p): float(x) for p, x in zip(pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}
            assert {int(p) for p in pos[b, h][keep[b, h]].tolist()} == brute.top_by_score(s, int(k[b, h]), set())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bound", [1, 3, 24])
def test_a_host_bound_on_the_excess_gives_the_same_decisions(seed, bound):
    """``excess`` (what a packed layer's host knows of how many slots a row holds over budget) replaces the
    read-backs of topk_mask: the single-drop shortcut when it is <= 1, a ranking of every slot otherwise."""
    from kvgates.policies.selection import topk_mask

    g = torch.Generator().manual_seed(seed)
    pos = random_positions(B, HKV, C, held=12, seed=seed)
    valid = pos >= 0
    scores = torch.randint(0, 4, (B, HKV, C), generator=g).float()
    k = torch.randint(max(12 - bound, 0), 14, (B, HKV), generator=g)  # rows hold 12 candidates: at most `bound` over k
    keep = topk_mask(scores, k, valid, pos, excess=bound)
    for b in range(B):
        for h in range(HKV):
            s = {int(p): float(x) for p, x in zip(pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}
            assert {int(p) for p in pos[b, h][keep[b, h]].tolist()} == brute.top_by_score(s, int(k[b, h]), set())
