"""Amortised eviction (``PerStepEviction.slack``): a layer fills to budget + slack and evicts the slack at once;
with slack 0 it is per-step eviction, token for token."""

import pytest
import torch
from helpers import policy_on

from kvgates import BudgetCache, make_policy
from kvgates.policies.base import PerStepEviction
from kvgates.policies.tova import TOVA
from kvgates.runtime.layer import BudgetLayer

PER_STEP = ["streaming_llm", "h2o", "tova", "d2o"]
BUDGET, SLACK, PROMPT, DECODE = 10, 4, 24, 30


def decode_trace(model, policy, ids):
    """Logits and the positions each layer and head holds, after the prompt and after every decode step."""
    cache = BudgetCache(model.config, policy)
    logits, held = [], []
    with torch.no_grad():
        for a, z in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
            logits.append(model(ids[:, a:z], past_key_values=cache).logits[:, -1])
            held.append([[sorted(p[p >= 0].tolist()) for p in layer.pos.flatten(0, 1)] for layer in cache.budget_layers])
    return torch.stack(logits), held


@pytest.mark.parametrize("name", PER_STEP)
def test_the_per_step_policies_take_a_slack(name):
    policy = make_policy(name, budget=BUDGET, slack=SLACK)
    assert isinstance(policy, PerStepEviction) and policy.schedule.tolerance == SLACK
    with pytest.raises(ValueError, match="slack"):
        make_policy(name, budget=BUDGET, slack=-1)


@pytest.mark.parametrize("name", PER_STEP)
def test_slack_zero_keeps_what_per_step_eviction_keeps(tiny, name):
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + DECODE), generator=torch.Generator().manual_seed(0))
    with policy_on(model, name, BUDGET) as per_step:
        expected_logits, expected_held = decode_trace(model, per_step, ids)
    with policy_on(model, name, BUDGET, slack=0) as amortised:
        got_logits, got_held = decode_trace(model, amortised, ids)
    assert got_held == expected_held
    torch.testing.assert_close(got_logits, expected_logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", PER_STEP)
def test_a_layer_fills_to_budget_plus_slack_then_evicts_the_slack_at_once(tiny, name):
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + DECODE), generator=torch.Generator().manual_seed(1))
    with policy_on(model, name, BUDGET, slack=SLACK) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            sizes = []
            for t in range(PROMPT, ids.shape[1]):
                model(ids[:, t : t + 1], past_key_values=cache)
                held = torch.stack([layer.held() for layer in cache.budget_layers])
                quota = torch.stack([layer.quota for layer in cache.budget_layers])
                assert bool((held <= quota + SLACK).all())
                sizes.append(held - quota)
    # After the prompt each head holds its quota; it then grows by one token a step up to quota + slack, and the
    # next step evicts slack + 1 tokens at once: a saw-tooth of period slack + 1.
    expected = [(step % (SLACK + 1) + 1) % (SLACK + 1) for step in range(DECODE)]
    assert [int(s.max()) for s in sizes] == expected
    assert all(bool((s == s.flatten()[0]).all()) for s in sizes)


def test_streaming_llm_with_slack_keeps_its_sinks_and_every_newer_token_until_it_evicts(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(2))
    cache = BudgetCache(model.config, "streaming_llm", budget=BUDGET, sinks=2, slack=SLACK)
    with torch.no_grad():
        model(ids[:, :PROMPT], past_key_values=cache)
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache)
            held = BUDGET + (t - PROMPT + 1) % (SLACK + 1)
            for layer in cache.budget_layers:
                for p in layer.pos[0]:
                    assert sorted(p[p >= 0].tolist()) == [0, 1] + list(range(t + 1 - (held - 2), t + 1))


def test_h2o_with_slack_evicts_to_its_budget_keeping_the_window_and_heavy_hitters(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + SLACK + 1), generator=torch.Generator().manual_seed(3))
    cache = BudgetCache(model.config, "h2o", budget=BUDGET, slack=SLACK)
    with torch.no_grad():
        model(ids[:, :PROMPT], past_key_values=cache)
        for t in range(PROMPT, PROMPT + SLACK):
            model(ids[:, t : t + 1], past_key_values=cache)
        before = [layer.pos.clone() for layer in cache.budget_layers]
        assert all(bool((layer.held() == BUDGET + SLACK).all()) for layer in cache.budget_layers)
        model(ids[:, -1:], past_key_values=cache)  # the step that brings each head past budget + slack
    newest = ids.shape[1] - 1
    recent = set(range(newest + 1 - BUDGET // 2, newest + 1))
    for layer, pos in zip(cache.budget_layers, before):
        assert bool((layer.held() == BUDGET).all())
        for kept, held in zip(layer.pos[0], pos[0]):
            kept, held = set(kept[kept >= 0].tolist()), set(held[held >= 0].tolist())
            assert recent <= kept  # the window, the new token included
            assert kept - recent <= held  # the heavy hitters come from what the head held


def test_tova_with_slack_attends_without_statistics_between_evictions(tiny, monkeypatch):
    """TOVA ranks by the evicting step's query alone, so the steps between evictions skip the statistics (sdpa
    over the held slice); what it keeps and its logits are those of a run computing them on every step."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + DECODE), generator=torch.Generator().manual_seed(4))
    with_stats = []
    decode = BudgetLayer._decode

    def counted(self, *args):
        with_stats.append(self.layer_idx)
        return decode(self, *args)

    monkeypatch.setattr(BudgetLayer, "_decode", counted)
    with policy_on(model, "tova", BUDGET, slack=SLACK) as policy:
        got_logits, got_held = decode_trace(model, policy, ids)
    evictions = DECODE // (SLACK + 1)  # the saw-tooth: every slack + 1 steps, from the first step past budget + slack
    assert len(with_stats) == evictions * len(model.model.layers)
    monkeypatch.setattr(TOVA, "decode_stats_for_eviction_only", False)
    with policy_on(model, "tova", BUDGET, slack=SLACK) as policy:
        expected_logits, expected_held = decode_trace(model, policy, ids)
    assert got_held == expected_held
    torch.testing.assert_close(got_logits, expected_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "params"), [("morphkv", {"recent": 4, "evict_every": 4}),
                                              ("snapkv", {"window": 4, "decode": True, "decode_every": 4})])
def test_a_new_turn_is_due_for_eviction_every_k_steps(tiny, name, params):
    """A call of several tokens after decoding began (a new turn of a chat) counted as one decode step: a 30-token
    turn on a step not due for eviction was held whole (49 tokens a head where MorphKV promises at most budget +
    evict_every - 1 = 19), and a static cache, which settles at budget + evict_every slots, refused it. Such a call
    is due now, whatever the count (a sequence alone and in a batch whose turns are padded still count alike), in an
    eager and a static cache alike."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 40 + 2 + 30 + 1), generator=torch.Generator().manual_seed(2))
    with policy_on(model, name, 16, **params) as policy, torch.no_grad():
        runs = []
        for static in (False, True):
            cache = BudgetCache(model.config, policy, static=static)
            logits = [model(ids[:, :40], past_key_values=cache).logits[:, -1]]
            for a, z in ((40, 41), (41, 42), (42, 72), (72, 73)):
                logits.append(model(ids[:, a:z], past_key_values=cache).logits[:, -1])
                assert cache.held_tokens().max() <= 16 + 4 - 1, (static, z)
            runs.append(torch.stack(logits))
    torch.testing.assert_close(runs[1], runs[0], atol=1e-5, rtol=1e-5)
