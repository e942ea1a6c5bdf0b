"""MorphKV, D2O, DynamicKV, KVMerger and Ada-KV against literal re-implementations of the spec."""

import os

import brute
import pytest
import torch
from helpers import make_layer, random_positions, teacher_forced_logits, tiny_model

from kvgates import BudgetCache, kernels
from kvgates.policies import D2O, AdaKV, DynamicKV, KVMerger, Merge, MorphKV
from kvgates.policies.adakv import adakv_head_budgets
from kvgates.policies.d2o import d2o_layer_ratios, layer_variance
from kvgates.policies.dynamickv import dynamickv_allocation
from kvgates.policies.h2o import CUMULATIVE
from kvgates.policies.history import push_rows
from kvgates.policies.kvmerger import merging_set_starts
from kvgates.policies.merging import MergeState, merge_evicted
from kvgates.runtime.launches import Launches
from kvgates.runtime.stats import AttnStats, Phase
from kvgates.runtime.storage import KeptCounts

B, HKV, C = 2, 3, 24


def stats(phase=Phase.PREFILL, rows=None, colsum=None):
    return AttnStats(phase=phase, new_slots=torch.zeros(B, HKV, 1, dtype=torch.long), rows=rows, colsum=colsum)


def kept(layer, keep, b, h):
    return {int(p) for p in layer.pos[b, h][keep[b, h]].tolist()}


def scores_of(layer, scores, b, h):
    return {int(p): float(s) for p, s in zip(layer.pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}


# ------------------------------------------------------------------------------------------------ MorphKV
@pytest.mark.parametrize("fusion", ["sum", "max"])
@pytest.mark.parametrize("seed", range(3))
def test_morphkv_selection(fusion, seed):
    policy = MorphKV(budget=10, recent=4, fusion=fusion)
    layer = make_layer(policy, random_positions(B, HKV, C, held=18, seed=seed))
    g = torch.Generator().manual_seed(seed)
    history = [torch.rand(B, HKV, C, generator=g) for _ in range(4)]
    current = torch.rand(B, HKV, C, generator=g)  # recorded before the decision, left out of it
    push_rows(layer, "morph_rows", policy.layer_state(layer), torch.stack(history + [current], dim=2))
    keep = policy.select(layer, stats(Phase.DECODE), 10)
    for b in range(B):
        for h in range(HKV):
            rows = [scores_of(layer, r, b, h) for r in history]
            positions = [p for p in layer.pos[b, h].tolist() if p >= 0]
            assert kept(layer, keep, b, h) == brute.morphkv(rows, positions, 10, 4, fusion)


@pytest.mark.parametrize("start", [-1, 2])
@pytest.mark.parametrize("r", [1, 3, 5, 8])
def test_push_rows_records_a_prompt_chunks_rows_as_one_at_a_time_would_in_one_write(start, r):
    """Rows pushed together land where pushing them one by one puts them (the ring's last ``size`` rows, newest last,
    from an empty ring or one mid-way), with a fixed number of launches: a prompt chunk's rows were pushed one at a
    time, three launches a row (MorphKV's 30 rows: 90 a layer)."""
    from types import SimpleNamespace

    from kvgates.policies.history import History

    size = 5
    rows = torch.rand(B, HKV, r, C, generator=torch.Generator().manual_seed(r))
    rings = []
    for one_by_one in (True, False):
        layer = SimpleNamespace(state={"rows": torch.rand(B, HKV, C, size, generator=torch.Generator().manual_seed(0))})
        history = History(newest=torch.tensor(start))
        with Launches() as counted:
            for chunk in rows.split(1, dim=2) if one_by_one else [rows]:
                push_rows(layer, "rows", history, chunk)
        rings.append((layer.state["rows"], int(history.newest)))
    assert torch.equal(rings[0][0], rings[1][0]) and rings[0][1] == rings[1][1] == (start + r) % size
    assert counted.launches <= 6  # (the ring index advanced, the rows' indices made, one copy)


def test_morphkv_ring_buffer_keeps_last_rows_and_new_slots_start_at_zero(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, MorphKV(budget=12, recent=3))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        layer = cache.budget_layers[0]
        assert layer.state["morph_rows"].shape[-1] == 3 + 1  # the R recent rows and the current one
        for t in range(20, 40):
            model(ids[:, t : t + 1], past_key_values=cache)
            assert int(layer.held().max()) == 12 and int(layer.held().min()) == 12
            # the newest token was written after every recorded row but the current one: zero in all older rows
            newest = layer.pos == t
            rows = layer.state["morph_rows"][newest]  # [H_kv, R + 1]
            current = cache.policy.layer_state(layer).newest
            others = [r for r in range(4) if r != current]
            assert torch.all(rows[:, others] == 0) and torch.all(rows[:, current] > 0)


def test_morphkv_records_every_row_of_a_multi_token_decode_step(tiny):
    """A decode step verifying several tokens (speculative decoding) records all their rows, not just the last."""
    _, model = tiny
    cache = BudgetCache(model.config, MorphKV(budget=12, recent=3))
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        model(ids[:, 20:21], past_key_values=cache)
        history = [cache.policy.layer_state(layer) for layer in cache.budget_layers]
        before = [h.newest for h in history]
        model(ids[:, 21:24], past_key_values=cache)
    assert [h.newest for h in history] == [(n + 3) % 4 for n in before]
    assert cache.held_tokens().unique().tolist() == [12]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_morphkv_holds_exactly_capacity_on_gqa_models(family):
    _, model = tiny_model(family)
    cache = BudgetCache(model.config, "morphkv", budget=16, recent=4)
    ids = torch.randint(1, 128, (2, 80), generator=torch.Generator().manual_seed(1))
    teacher_forced_logits(model, cache, ids, 30)
    assert cache.held_tokens().unique().tolist() == [16]


# ------------------------------------------------------------------------------------------------ D2O
@pytest.mark.parametrize("hkv", [1, 2, HKV])
def test_d2o_layer_variance_and_ratios(hkv):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(B, hkv, C, generator=g) * torch.arange(1, hkv + 1)[None, :, None]
    valid = torch.rand(B, hkv, C, generator=g) > 0.3
    v = layer_variance(scores, valid)
    for b in range(B):
        per_head = [[float(x) for x, ok in zip(scores[b, h], valid[b, h]) if ok] for h in range(hkv)]
        assert v[b].item() == pytest.approx(brute.d2o_layer_variance(per_head), abs=1e-6)
    if hkv < 3:  # min-max over one head is 0, over two heads 0 and 1: every layer alike (the docstring's caveat)
        assert v.tolist() == [0.5 * (hkv - 1)] * B
    variances = torch.rand(5, B, generator=g)
    rho = torch.tensor([0.2, 0.05])
    ratios = d2o_layer_ratios(variances, rho)
    for b in range(B):
        assert ratios[:, b].tolist() == pytest.approx(brute.d2o_ratios(variances[:, b].tolist(), rho[b].item()), abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_d2o_keep_mask(seed):
    policy = D2O(budget=12, sinks=2, merge=False)
    layer = make_layer(policy, random_positions(B, HKV, C, held=20, seed=seed))
    layer.state[CUMULATIVE] = torch.rand(B, HKV, C, generator=torch.Generator().manual_seed(seed))
    budget = torch.tensor([[12], [9]])
    keep = policy.select(layer, None, budget)
    for b in range(B):
        for h in range(HKV):
            expected = brute.d2o_keep(scores_of(layer, layer.state[CUMULATIVE], b, h), int(budget[b]), 2, 3, 1)
            assert kept(layer, keep, b, h) == expected


@pytest.mark.parametrize("rule", ["paper", "official"])
def test_d2o_merge_matches_brute_force(rule):
    policy = D2O(budget=8)
    pos = random_positions(1, 1, 12, held=12, seed=3)
    layer = make_layer(policy, pos, head_dim=4, seed=3)
    keys = {int(p): layer.keys[0, s].tolist() for s, p in enumerate(pos[0, 0].tolist())}
    values = {int(p): layer.values[0, s].tolist() for s, p in enumerate(pos[0, 0].tolist())}
    keep = torch.zeros(1, 1, 12, dtype=torch.bool)
    keep[0, 0, :6] = True
    kept_pos = {int(p) for p in pos[0, 0, :6].tolist()}
    evicted_pos = set(keys) - kept_pos
    state = MergeState()
    merge_evicted(layer, keep, state, beta=0.7, rule=rule)
    new_k, new_v, tau = brute.d2o_merge(keys, values, kept_pos, evicted_pos, None, 0.7, rule)
    assert state.tau.item() == pytest.approx(tau, abs=1e-6)
    for s in range(6):
        p = int(pos[0, 0, s])
        assert layer.keys[0, s].tolist() == pytest.approx(new_k[p], abs=1e-5)
        assert layer.values[0, s].tolist() == pytest.approx(new_v[p], abs=1e-5)
    # A second eviction updates the threshold as an EMA.
    keep2 = keep.clone()
    keep2[0, 0, :3] = False
    layer.pos[0, 0, 6:] = -1
    keys2 = {p: (layer.keys[0, s].tolist()) for s, p in enumerate(pos[0, 0, :6].tolist())}
    values2 = {p: (layer.values[0, s].tolist()) for s, p in enumerate(pos[0, 0, :6].tolist())}
    merge_evicted(layer, keep2, state, beta=0.7, rule=rule)
    _, _, tau2 = brute.d2o_merge(keys2, values2, set(pos[0, 0, 3:6].tolist()), set(pos[0, 0, :3].tolist()), tau, 0.7, rule)
    assert state.tau.item() == pytest.approx(tau2, abs=1e-6)


def test_d2o_layer_budgets_follow_variance():
    _, model = tiny_model("llama", num_key_value_heads=4)  # (the shared tiny model's two KV heads give every layer one v_l)
    cache = BudgetCache(model.config, "d2o", budget=10, sinks=2)
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    variances = [cache.policy.layer_state(layer).variance.item() for layer in cache.budget_layers]
    ratios = brute.d2o_ratios(variances, 10 / 50)
    expected = [max(round(r * 50), 3) for r in ratios]
    assert [int(layer.quota.max()) for layer in cache.budget_layers] == expected and len(set(expected)) > 1
    assert cache.held_tokens()[:, 0, 0].tolist() == expected


def test_d2o_protected_edge_layers_hold_at_least_the_budget_while_decoding():
    """``protect_edge_layers`` gave layers 0, 1 and the last a budget of the prompt's length: after a prompt shorter
    than ``budget`` they evicted down to it at every decode step (5 tokens, where the unprotected layer held 10), and a
    batch's 1-token row held its 2 sinks over a quota of 1. They keep their whole prompt and at least the budget."""
    _, model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for prompt, expected in ((5, [10, 10, 10, 10]), (30, [30, 30, 10, 30])):
        cache = BudgetCache(model.config, "d2o", budget=10, sinks=2, protect_edge_layers=True)
        with torch.no_grad():
            model(ids[:1, :prompt], past_key_values=cache)
            for t in range(prompt, 40):
                model(ids[:1, t : t + 1], past_key_values=cache)
        assert cache.held_tokens()[:, 0, 0].tolist() == expected, prompt
    cache = BudgetCache(model.config, "d2o", budget=10, sinks=2, protect_edge_layers=True)
    with torch.no_grad():
        model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache)  # (row 1: one real token)
        for t in range(5, 20):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)
    assert all(bool((layer.held() <= layer.quota).all()) for layer in cache.budget_layers)
    assert cache.held_tokens()[:, :, 0].tolist() == [[10, 10]] * 4


@pytest.mark.parametrize("hkv", [1, 2])
def test_d2o_with_one_or_two_kv_heads_gives_every_layer_the_budget(hkv):
    """With one KV head (MQA) or two every layer's ``v_l`` is the same, so every layer gets the budget; the layer
    budgets, merges and decode-time evictions hold it on a batch with a left-padded row, with finite logits."""
    _, model = tiny_model("llama", num_key_value_heads=hkv)
    cache = BudgetCache(model.config, "d2o", budget=9, sinks=2)
    ids = torch.randint(1, 128, (2, 44), generator=torch.Generator().manual_seed(hkv))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        logits = [model(ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache).logits]
        assert [cache.policy.layer_state(layer).variance.tolist() for layer in cache.budget_layers] == [[0.5 * (hkv - 1)] * 2] * 3
        for t in range(30, 44):
            logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
            assert cache.held_tokens().unique().tolist() == [9]
    assert all(layer.quota.unique().tolist() == [9] for layer in cache.budget_layers)
    assert torch.isfinite(torch.cat(logits, 1)).all()


def test_d2o_layer_variances_are_computed_at_each_layers_end_of_prompt(tiny, monkeypatch):
    # D2O's prompt evictions wait for the last layer (the allocation needs every layer's variance), and on a GPU what
    # runs then is not hidden behind any layer's work: each layer's variance is computed when that layer is done.
    _, model = tiny
    cache = BudgetCache(model.config, "d2o", budget=10, sinks=2)
    allocate, seen = type(cache.policy)._allocate, []

    def checked(policy, layers, stats):
        states = [policy.layer_state(layer) for layer in layers]
        seen.append([state.variance is not None for state in states])
        for layer, state in zip(layers, states):
            assert torch.equal(state.variance, layer_variance(layer.state[CUMULATIVE], layer.valid))
        with Launches() as counted:
            allocate(policy, layers, stats)
        assert counted.ops["pow"] == 0  # (layer_variance's square)

    monkeypatch.setattr(type(cache.policy), "_allocate", checked)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(2)), past_key_values=cache)
    assert seen == [[True] * len(cache.budget_layers)]


def test_d2o_later_prompt_chunks_use_the_prompt_length_seen_so_far():
    """The layer variances come from the first chunk; each later chunk's layer budgets are ``r_l`` times the
    prompt length seen so far, not the tokens held after the previous compression. The length shows through
    the clamp ``r_l >= 0.01``: a layer whose share is below 1% of the prompt seen keeps that 1%."""
    _, model = tiny_model("llama", num_key_value_heads=4)  # four KV heads: the layers' variances differ
    cache = BudgetCache(model.config, "d2o", budget=4, sinks=2)
    ids = torch.randint(1, 128, (1, 600), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids[:, :500], past_key_values=cache)
        model(ids[:, 500:], past_key_values=cache)
    variances = [cache.policy.layer_state(layer).variance.item() for layer in cache.budget_layers]
    expected = [max(round(r * 600), 3) for r in brute.d2o_ratios(variances, 4 / 600)]
    assert [int(layer.quota.max()) for layer in cache.budget_layers] == expected
    assert min(expected) == 6  # the 1% floor of the 600 tokens seen


@pytest.mark.parametrize("chunk", [None, 8])
def test_d2o_gives_a_padded_row_the_layer_budgets_it_gets_alone(chunk):
    """A left-padded row of a batch given without position_ids (the model numbers every column, padding included) took
    the padded length as its prompt length: the 10-token row, alone within its budget of 12 and given 12 at every
    layer, got the padded 30 tokens' budgets, 11 at the first layer, which evicts from the second decode step on where
    alone it does not. (In chunks of 8 the first chunk is all padding, and the padded row's length still comes from its
    first real token.)"""
    _, model = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=4)  # four KV heads: the layers' variances differ
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0

    def budgets(rows: torch.Tensor, rows_mask: torch.Tensor) -> list[list[int]]:
        cache = BudgetCache(model.config, "d2o", budget=12, sinks=2)
        step = chunk or rows.shape[1]
        with torch.no_grad():
            for start in range(0, rows.shape[1], step):
                model(rows[:, start : start + step], attention_mask=rows_mask[:, : start + step], past_key_values=cache)
        return torch.cat([layer.quota[:, :1] for layer in cache.budget_layers], 1).tolist()  # [row][layer]

    both = budgets(ids, mask)
    assert both[1] == budgets(ids[1:, 20:], mask[1:, 20:])[0] == [12] * 4
    assert both[0] == budgets(ids[:1], mask[:1])[0]


def test_d2o_takes_a_padded_row_s_layer_variances_from_its_first_real_tokens():
    """A prompt in chunks of 8 whose first two hold only padding for the left-padded row: that row took its layer
    variances from them, 0 at every layer (the variance of nothing), and with them the same budget at every layer,
    [12, 12, 12, 12] where alone, its first chunk then the first real tokens, it gets [12, 13, 10, 13]."""
    _, model = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=4)  # four KV heads: the layers' variances differ
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :16] = 0

    def run(rows: torch.Tensor, rows_mask: torch.Tensor) -> tuple[list, list]:
        cache = BudgetCache(model.config, "d2o", budget=12, sinks=2)
        positions = (rows_mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            for a in range(0, rows.shape[1], 8):
                model(
                    rows[:, a : a + 8], attention_mask=rows_mask[:, : a + 8], position_ids=positions[:, a : a + 8], past_key_values=cache
                )
        variances = torch.stack([cache.policy.layer_state(layer).variance for layer in cache.budget_layers], 1)
        return variances.tolist(), torch.cat([layer.quota[:, :1] for layer in cache.budget_layers], 1).tolist()

    (variances, budgets), (alone_variances, alone_budgets) = run(ids, mask), run(ids[1:, 16:], mask[1:, 16:])
    assert budgets[1] == alone_budgets[0] and len(set(budgets[1])) > 1
    assert variances[1] == pytest.approx(alone_variances[0], abs=1e-5)


def test_merge_wrapper_merges_what_the_base_evicts(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    plain, merged = BudgetCache(model.config, "h2o", budget=12), BudgetCache(model.config, Merge(budget=12, base="h2o"))
    with torch.no_grad():
        model(ids, past_key_values=plain)
        model(ids, past_key_values=merged)
    assert torch.equal(plain.layers[0].pos, merged.layers[0].pos)  # same tokens kept
    assert not torch.equal(plain.layers[0].keys, merged.layers[0].keys)  # but kept keys absorbed evicted ones


# ------------------------------------------------------------------------------------------------ DynamicKV
@pytest.mark.parametrize("counts", [[5, 9, 0, 2], [1, 1, 1, 1], [0, 0, 7, 0], [0, 0, 0, 0]])
def test_dynamickv_allocation(counts):
    got = dynamickv_allocation(torch.tensor(counts)[:, None], room=6, num_layers=8, r_max=10)
    assert got[:, 0].tolist() == brute.dynamickv_budgets(counts, 6, 8, 10)


def test_dynamickv_reallocation_matches_brute_force(tiny):
    _, model = tiny
    policy = DynamicKV(budget=12, window=4, kernel=3, update_every=2)
    cache = BudgetCache(model.config, policy)
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    # Record each layer's pooled scores and held set just before the final reallocation over all layers.
    snapshots = {}
    original = policy._reallocate

    def spy(layers, room, num_layers):
        snapshots["before"] = [(ly.pos.clone(), ly.state["dynamickv_score"].clone(), policy.layer_state(ly).window) for ly in layers]
        return original(layers, room, num_layers)

    policy._reallocate = spy
    with torch.no_grad():
        model(ids, past_key_values=cache)
    room, n = 8, 3
    flat = []
    per_layer = []
    for i, (pos, score, w) in enumerate(snapshots["before"]):
        heads = []
        for h in range(pos.shape[1]):
            positions = [p for p in pos[0, h].tolist() if p >= 0]
            window = brute.recent(positions, w)
            sc = {p: s for p, s in scores_of_pos(pos, score, h).items() if p not in window}
            flat += [(s, i) for s in sc.values()]
            heads.append((sc, window))
        per_layer.append(heads)
    flat.sort(key=lambda t: -t[0])
    counts = [0] * n
    for _, i in flat[: room * 2 * n]:
        counts[i] += 1
    budgets = brute.dynamickv_budgets(counts, room, n, 10)
    for i, layer in enumerate(cache.budget_layers):
        for h, (sc, window) in enumerate(per_layer[i]):
            f = min(budgets[i], len(sc))
            assert set(layer.pos[0, h][layer.pos[0, h] >= 0].tolist()) == window | brute.top_by_score(sc, f, set())


def test_dynamickv_truncates_at_the_next_layers_end_what_an_immediate_truncation_keeps():
    # A reallocation before the last layer is read back and applied at the end of the next layer (on a GPU the next
    # layer's work then runs while the host truncates); the layers end exactly as with the truncation right away.
    _, model = tiny_model("llama", num_hidden_layers=5)

    class Immediate(DynamicKV):
        def after_layer(self, layer, stats):
            if stats.phase is Phase.PREFILL and ((layer.rank + 1) % self.update_every == 0 or layer.is_last):
                self._truncate(self._reallocate(layer.cache.budget_layers[: layer.rank + 1], self.budget - self.window, 5))

    params = {"budget": 12, "window": 4, "kernel": 3, "update_every": 2}
    deferred, now = BudgetCache(model.config, DynamicKV(**params)), BudgetCache(model.config, Immediate(**params))
    events, after_layer, truncate = [], DynamicKV.after_layer, DynamicKV._truncate

    def logged_after_layer(policy, layer, stats):
        events.append(f"layer {layer.rank}")
        after_layer(policy, layer, stats)

    def logged_truncate(policy, done):
        events.append(f"truncate {len(done.layers)}")
        truncate(policy, done)

    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(ids, past_key_values=now)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DynamicKV, "after_layer", logged_after_layer)
            patch.setattr(DynamicKV, "_truncate", logged_truncate)
            model(ids, past_key_values=deferred)
    assert events == ["layer 0", "layer 1", "layer 2", "truncate 2", "layer 3", "layer 4", "truncate 4", "truncate 5"]
    for a, b in zip(deferred.budget_layers, now.budget_layers):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys)


def scores_of_pos(pos, score, h):
    return {int(p): float(s) for p, s in zip(pos[0, h].tolist(), score[0, h].tolist()) if p >= 0}


def test_dynamickv_total_budget(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, "dynamickv", budget=12, window=4, kernel=3)
    ids = torch.randint(1, 128, (2, 90), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    held = cache.held_tokens()  # [layers, B, H]
    assert int(held.sum(0).max()) <= 12 * 3


# ------------------------------------------------------------------------------------------------ KVMerger
@pytest.mark.parametrize("eps", [0.0, 0.3, -0.5])
def test_kvmerger_sets(eps):
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(1, 1, 20, 4, generator=g)
    mergeable = torch.rand(1, 1, 20, generator=g) > 0.2
    starts = merging_set_starts(keys, mergeable, torch.tensor([[eps]]))[0, 0, 0]
    sets = brute.kvmerger_sets(keys[0, 0].tolist(), mergeable[0, 0].tolist(), eps)
    assert starts.nonzero().flatten().tolist() == [s[0] for s in sets]


TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
#: Where the fused (Triton) scan's tests put their tensors: the GPU where there is one (not the interpreter's CPU).
FUSED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "launch_bound,fused",
    [(False, False), (True, False), pytest.param(True, True, marks=pytest.mark.skipif(not TRITON, reason="needs Triton"))],
)
@pytest.mark.parametrize("window", [1, 3, 8, 16])
def test_kvmerger_sets_longer_than_the_scan_window_match_brute_force(window, launch_bound, fused):
    # Correlated keys make sets far longer than the window, so the scan's walk measures them one at a time: several
    # thresholds, sequences and heads at once, each row as the token-by-token scan gives it; the GPU's way
    # (``launch_bound``: one block, every doubling, four walk steps a read) finds the same sets, and so does the
    # Triton kernels (``fused``: set ends within the window, the chain measuring on the longer sets, no walk).
    g = torch.Generator().manual_seed(window)
    keys = torch.randn(2, 3, 90, 4, generator=g).cumsum(2)
    mergeable = torch.rand(2, 3, 90, generator=g) > 0.05
    eps = torch.tensor([[0.99, 0.9], [0.7, 0.5], [0.0, -0.5]])  # [E, B]
    device = FUSED_DEVICE if fused else "cpu"
    keys, mergeable, eps = keys.to(device), mergeable.to(device), eps.to(device)
    starts = merging_set_starts(keys, mergeable, eps, window=window, launch_bound=launch_bound, fused=fused).cpu()
    keys, mergeable, eps = keys.cpu(), mergeable.cpu(), eps.cpu()
    longest = 0
    for e in range(3):
        for b in range(2):
            for h in range(3):
                sets = brute.kvmerger_sets(keys[b, h].tolist(), mergeable[b, h].tolist(), float(eps[e, b]))
                assert starts[e, b, h].nonzero().flatten().tolist() == [s[0] for s in sets]
                longest = max(longest, *map(len, sets))
    assert longest > window + 1


def counted_scan(launch_bound: bool, fused: bool) -> Launches:
    """The launches and reads of one scan over correlated keys (sets far longer than its window of 8), after checking
    that it finds the CPU band path's sets (on the GPU where the scan is ``fused`` and there is one)."""
    from kvgates.policies.kvmerger import SCAN_BLOCK, MergingScan

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 5 * SCAN_BLOCK, 4, generator=g).cumsum(2)
    mergeable = torch.rand(1, 2, 5 * SCAN_BLOCK, generator=g) > 0.02
    eps = torch.tensor([[0.9], [0.5]])
    device = FUSED_DEVICE if fused else "cpu"
    inputs, thresholds = (keys.to(device), mergeable.to(device)), eps.to(device)
    with Launches() as counted:
        starts = MergingScan(*inputs, window=8, launch_bound=launch_bound, fused=fused).starts(thresholds)
    assert torch.equal(starts.cpu(), merging_set_starts(keys, mergeable, eps, window=8, fused=False))
    return counted


def test_kvmerger_launch_bound_scan_launches_and_reads_back_less():
    # On a GPU each of the scan's blocks costs launches and each read makes the host wait: the launch-bound scan
    # builds its band in one block, never reads to stop the doublings, and reads once per four walk steps.
    from kvgates.policies.kvmerger import GPU_WALK_STEPS

    cpu, gpu = counted_scan(launch_bound=False, fused=False), counted_scan(launch_bound=True, fused=False)
    walk = cpu.sync_ops["_local_scalar_dense"]
    assert cpu.sync_ops["equal"] > 0 and walk > 2 * GPU_WALK_STEPS  # long sets: a walk of several steps
    assert gpu.sync_ops == {"_local_scalar_dense": -(-walk // GPU_WALK_STEPS)}
    assert (cpu.ops["cummax"], gpu.ops["cummax"]) == (5, 1)


@pytest.mark.skipif(not TRITON, reason="needs Triton (a GPU or TRITON_INTERPRET=1)")
def test_kvmerger_fused_scan_reads_nothing_back_and_builds_no_band():
    # Where the kernels run Triton the sets are ended within a window by ``merging_set_ends`` and chained by
    # ``merging_chain``, which measures on the longer ones: no band (its matmuls and prefix maxima), no walk, no
    # doubling, and no host read at all; the sets are the band's and walk's.
    band, fused = counted_scan(launch_bound=True, fused=False), counted_scan(launch_bound=True, fused=True)
    assert band.sync_ops and band.ops["cummax"] == 1  # the band, and the walk's reads
    assert fused.sync_ops == {} and "cummax" not in fused.ops and "bmm" not in fused.ops
    assert "scatter_reduce" not in fused.ops  # no pointer doubling: the chain kernel follows each row


def test_kvmerger_launch_bound_scan_widens_its_window_as_memory_allows(monkeypatch):
    # Every set longer than the window is a step of the walk: on a GPU the window is as wide as the band's memory
    # allows, between SCAN_WINDOW and GPU_SCAN_WINDOW; on the CPU it is SCAN_WINDOW.
    import kvgates.policies.kvmerger as kvmerger

    keys, mergeable = torch.randn(2, 3, 2000, 4), torch.ones(2, 3, 2000, dtype=torch.bool)
    def width(launch_bound: bool) -> int:
        return kvmerger.MergingScan(keys, mergeable, launch_bound=launch_bound, fused=False).w

    assert width(False) == kvmerger.SCAN_WINDOW
    assert width(True) == kvmerger.GPU_SCAN_WINDOW
    monkeypatch.setattr(kvmerger, "GPU_BAND_ELEMENTS", 6 * 2000 * 300)
    assert width(True) == 300
    monkeypatch.setattr(kvmerger, "GPU_BAND_ELEMENTS", 6 * 2000 * 10)
    assert width(True) == kvmerger.SCAN_WINDOW


@pytest.mark.parametrize(
    "backend", ["reference", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="needs Triton"))]
)
@pytest.mark.parametrize("sigma,scale", [(None, False), (0.7, True)])
def test_kvmerger_merge_matches_brute_force(sigma, scale, backend, monkeypatch):
    # The scan and the merges: the torch reference's, or the kernels' (on the GPU where there is one: forced Triton on
    # CPU tensors is refused there, without the interpreter).
    monkeypatch.setenv("KVGATES_KERNELS", backend)
    device = FUSED_DEVICE if backend == "triton" else "cpu"
    policy = KVMerger(budget=14, window=3, heavy=2, epsilon=0.0, sigma=sigma, scale_values=scale)
    pos = random_positions(1, 1, C, held=20, seed=7)
    layer = make_layer(policy, pos, head_dim=4, seed=7, device=device)
    layer.state[CUMULATIVE] = torch.rand(1, 1, C, generator=torch.Generator().manual_seed(7)).to(device)
    slots = {int(p): s for s, p in enumerate(pos[0, 0].tolist()) if p >= 0}
    order = sorted(slots)
    keys = [layer.keys[0, slots[p]].tolist() for p in order]
    values = [layer.values[0, slots[p]].tolist() for p in order]
    score = [layer.state[CUMULATIVE][0, 0, slots[p]].item() for p in order]
    protected = brute.recent(order, 3) | brute.top_by_score(dict(zip(order, score)), 2, brute.recent(order, 3))
    mergeable = [p not in protected for p in order]
    keep = policy.select(layer, None, torch.tensor([[14]], device=device))
    eps = policy.layer_state(layer).epsilon.item()
    sets = brute.kvmerger_sets(keys, mergeable, eps)
    assert eps <= 0.0 and len(sets) + len(protected) <= 14  # calibrated down from the fixed epsilon to fit
    assert any(len(m) > 1 for m in sets)
    expected_keep = set(protected)
    for members in sets:
        pivot, k, v = brute.kvmerger_merge(keys, values, score, members, sigma, scale)
        expected_keep.add(order[pivot])
        s = slots[order[pivot]]
        assert layer.keys[0, s].tolist() == pytest.approx(k, abs=1e-5)
        assert layer.values[0, s].tolist() == pytest.approx(v, abs=1e-5)
    assert kept(layer, keep, 0, 0) == expected_keep


@pytest.mark.parametrize(
    "group,launch_bound,fused",
    [(4, False, False), (16, False, False), (4, True, False),
     pytest.param(4, True, True, marks=pytest.mark.skipif(not TRITON, reason="needs Triton"))],
)
@pytest.mark.parametrize("seed", range(4))
def test_kvmerger_calibration_takes_the_largest_feasible_grid_value(seed, group, launch_bound, fused, monkeypatch):
    check_calibration(seed, group, launch_bound, fused, monkeypatch)


def test_kvmerger_calibration_is_tested_over_budget(monkeypatch):
    # The seeds above include a sequence whose lowest threshold is chosen over its budget (the kernels' scan lists
    # that row whole, not to its budget).
    assert any(check_calibration(seed, 4, False, False, monkeypatch) for seed in range(4))


def check_calibration(seed: int, group: int, launch_bound: bool, fused: bool, monkeypatch) -> bool:
    """Whether some head ends over its budget (at the grid's lowest value) after checking the calibration."""
    # The calibration scans each grid from its largest thresholds down, a group at a time, and stops early (groups of
    # 4 on the CPU; the whole grid at once on a GPU, ``launch_bound``): it must choose what evaluating every grid
    # value does (per sequence, with long sets from correlated keys). The kernels' scan (``fused``) lists a head's
    # sets only up to its budget, except at the grid's lowest value, chosen even over budget (small budgets here).
    import kvgates.policies.kvmerger as kvmerger

    monkeypatch.setattr(kvmerger, "FEASIBLE_GROUP", group)
    monkeypatch.setattr(kvmerger, "FUSED_WINDOW", 8)  # the kernels' window: sets longer than it, measured on by the chain
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, 150, 6, generator=g).cumsum(2)
    mergeable = torch.rand(3, 2, 150, generator=g) > 0.1
    fixed = (~mergeable).sum(-1)
    budget = fixed + torch.randint(2, 60, (3, 2), generator=g)
    policy = KVMerger(budget=64)
    device = FUSED_DEVICE if fused else "cpu"
    eps, starts = policy.calibrate(*(t.to(device) for t in (keys, mergeable, fixed, budget)), launch_bound=launch_bound, fused=fused)
    eps, starts = eps.cpu(), starts.cpu()
    hi, lo, rows = torch.full((3,), 1.0001), torch.full((3,), -1.0001), torch.arange(3)
    for _ in range(2):
        grid = lo[None] + torch.linspace(0.0, 1.0, policy.grid)[:, None] * (hi - lo)[None]
        every = merging_set_starts(keys, mergeable, grid)
        feasible = (every.sum(-1) + fixed <= budget).all(-1)
        feasible[0] = True
        best = (feasible * torch.arange(policy.grid)[:, None]).amax(0)
        step = (hi - lo) / (policy.grid - 1)
        lo = grid[best, rows]
        hi = torch.where(best < policy.grid - 1, lo + step, lo)
    assert torch.equal(eps, lo)
    assert torch.equal(starts, every[best, rows])
    return bool((every[best, rows].sum(-1) + fixed > budget).any())


def test_kvmerger_calibrates_to_budget(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, "kvmerger", budget=12, window=4, heavy=2)
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert int(cache.held_tokens().max()) <= 12


# ------------------------------------------------------------------------------------------------ Ada-KV
@pytest.mark.parametrize("alpha", [0.2, 0.5])
@pytest.mark.parametrize("hkv", [1, 2, HKV, 5])
@pytest.mark.parametrize("seed", range(3))
def test_adakv_budgets_and_selection(seed, hkv, alpha):
    # One KV head (MQA), two, uneven counts; an int budget and one a sequence (the second row 7, not divisible by the
    # heads), the second row shorter (its slots past 14 empty, as a padded row's).
    policy = AdaKV(budget=9, base="h2o", base_params={"recent": 3})
    pos = random_positions(B, hkv, C, held=20, seed=seed)
    pos[1][pos[1] >= 14] = -1
    layer = make_layer(policy, pos)
    layer.state[CUMULATIVE] = torch.rand(B, hkv, C, generator=torch.Generator().manual_seed(seed)) ** 3
    scores, forced = policy.inner.score(layer, AttnStats(phase=Phase.PREFILL, new_slots=torch.zeros(B, hkv, 1, dtype=torch.long)))
    for budget in (9, torch.tensor([[9], [7]])):
        budgets = adakv_head_budgets(scores, forced, layer.valid, budget, alpha)
        for b in range(B):
            row = budget if isinstance(budget, int) else int(budget[b])
            per_head = [scores_of(layer, scores, b, h) for h in range(hkv)]
            forced_sets = [kept(layer, forced, b, h) for h in range(hkv)]
            assert budgets[b].tolist() == brute.adakv_budgets(per_head, forced_sets, row, alpha)
            # The spec's rounding moves the layer total off hkv * budget: over it by at most half a token a head, under
            # it by less than one and a half (the floor, then the rounding: one head, budget 7, alpha 0.2 gives 3 + 3).
            assert hkv * row - 3 * hkv / 2 <= int(budgets[b].sum()) <= hkv * row + hkv // 2


@pytest.mark.parametrize("alpha", [0.53, 0.34, 0.13])
def test_adakv_budgets_are_the_spec_arithmetic_for_any_alpha(alpha):
    """The budgets are those of the spec's formula in Python's (double) arithmetic: in float32 ``floor(0.53 * 100)``
    was 52 where the formula gives 53, each head's budget a token short."""
    for candidates, budget in ((120, 100), (40, 25), (30, 20)):
        scores = torch.rand(2, 3, candidates, generator=torch.Generator().manual_seed(candidates))
        forced, valid = torch.zeros_like(scores, dtype=torch.bool), torch.ones_like(scores, dtype=torch.bool)
        forced[1, :, -2:] = True  # the second row's heads each with 2 forced tokens
        budgets = adakv_head_budgets(scores, forced, valid, budget, alpha)
        for b in range(2):
            per_head = [dict(enumerate(scores[b, h].tolist())) for h in range(3)]
            forced_sets = [set(forced[b, h].nonzero()[:, 0].tolist()) for h in range(3)]
            assert budgets[b].tolist() == brute.adakv_budgets(per_head, forced_sets, budget, alpha)


def test_adakv_memory_follows_head_budgets(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(9))
    cache = BudgetCache(model.config, "adakv", budget=16, base="snapkv", base_params="window=4,kernel=3", alpha=0.2)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for layer in cache.budget_layers:
        slots = layer.head_slots
        held = layer.held()[0].tolist()
        assert slots == [h + 1 for h in held]  # each head's storage = its own budget + 1 slack slot
        assert layer.kv_bytes() == sum(slots) * 2 * layer.head_dim * 4
    assert any(len(set(layer.head_slots)) > 1 for layer in cache.budget_layers)  # ragged, not padded to the max


@pytest.mark.parametrize("base,params", [("snapkv", {"window": 4, "kernel": 3}), ("pyramidkv", {"window": 4, "kernel": 3}),
                                         ("h2o", {}), ("morphkv", {"recent": 4})])
def test_adakv_wraps_scoring_policies(tiny, base, params):
    _, model = tiny
    cache = BudgetCache(model.config, AdaKV(budget=12, base=base, base_params=params))
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(10))
    teacher_forced_logits(model, cache, ids, 40)
    for layer in cache.budget_layers:
        grown = 20 if cache.policy.inner.schedule.decode_every == 0 else 0
        assert bool((layer.held() <= layer.quota + grown).all())


@pytest.mark.parametrize("base", ["snapkv", "pyramidkv"])
def test_a_static_adakv_cache_takes_a_new_turn_that_outgrows_the_budget(tiny, base):
    """A static cache settles its layout again after a call of several tokens once decoding began (a new turn), asking
    the policy for its quota; Ada-KV gave a sequence that had outgrown the layer budget since its prompt fresh head
    budgets from the base's scores, which a prompt-only SnapKV has none of then (KeyError 'snapkv_rows'). Nothing is
    evicted while decoding: it holds what the dynamic cache holds, and the logits are the same."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 14), generator=torch.Generator().manual_seed(4))
    out, held = {}, {}
    for static in (False, True):
        policy = AdaKV(budget=8, base=base, base_params={"window": 4, "kernel": 3}, ragged=False)
        cache = BudgetCache(model.config, policy, static=static, decode_slots=9 if static else 0)  # (9 tokens after the prompt)
        with torch.no_grad(), pytest.warns(UserWarning, match="new turn"):
            calls = [(0, 5), (5, 6), (6, 7), (7, 10), (10, 11), (11, 14)]  # the prompt within budget; new turns to 11 tokens
            out[static] = torch.cat([model(ids[:, a:z], past_key_values=cache).logits for a, z in calls], 1)
        held[static] = cache.held_tokens().tolist()
    assert held[True] == held[False] == [[[14, 14]]] * 3
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=0)


def test_adakv_refuses_a_base_without_scores():
    with pytest.raises(ValueError, match="does not score tokens"):
        AdaKV(budget=12, base="kvmerger", base_params={"window": 4, "heavy": 1})


def _first_of(mask: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """One-hot mask of the first slot set in ``mask`` of every ``[B, H]`` row marked in ``where``."""
    return torch.zeros_like(mask).scatter(-1, mask.int().argmax(-1, keepdim=True), where[..., None]) & mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["paper", "official"])
@pytest.mark.parametrize("seed", range(4))
def test_merging_one_evicted_token_per_head_matches_the_general_merge(rule, seed, dtype):
    # Where the host knows that no head evicts more than one token (a per-step eviction's decode step), the merge
    # takes its own path (best_match_in_slots, no read-back, no listing of the kept slots): it must leave the keys,
    # values and threshold the general merge leaves, over two evictions (the first sets the threshold, the second
    # moves it). Rows: every head evicting, one head of three evicting (the others under budget), nothing held (a
    # padding row), every head evicting with one that keeps nothing; ties between kept keys and with the evicted key.
    b, hkv, c = 4, 3, 16
    pos = random_positions(b, hkv, c, held=12, seed=seed)
    pos[2] = -1
    pos[3, 1] = -1
    pos[3, 1, 5] = 7  # one token: evicting it keeps nothing
    held = pos >= 0
    where = torch.tensor([[True] * 3, [False, False, True], [True] * 3, [True] * 3])
    evicted = _first_of(held, where)
    keep = held & ~evicted
    evicted_again = _first_of(keep, where)

    def stored():
        made = make_layer(Merge(budget=8, base="h2o"), pos, head_dim=8, seed=seed)
        made.keys, made.values = made.keys.to(dtype), made.values.to(dtype)
        k = made.keys.view(b, hkv, c, -1)
        tied = keep[0, 0].nonzero().flatten()[[1, 3, 6]]
        k[0, 0, tied] = k[0, 0, tied[0]].clone()  # three equal kept keys and an evicted key along them: a tie
        k[0, 0, evicted[0, 0].int().argmax()] = 2 * k[0, 0, tied[0]]
        k[1, 2, keep[1, 2].nonzero().flatten()[[2, 5]]] = k[1, 2, evicted[1, 2].int().argmax()].clone()
        return made

    one, general, untouched = stored(), stored(), stored()
    one.exact_counts = lambda: KeptCounts([8] * hkv, [11] * hkv, [1] * hkv)  # what the host knows of a decode step
    states = MergeState(), MergeState()
    # Bit for bit, except where the general path's similarities come from the Triton kernel (``max_similarity``: its
    # own order of summation), which leaves last-bit differences.
    exact = {} if kernels.backend(one.keys) == "triton" else {"atol": 0, "rtol": 0}
    for keep_now, dropped in ((keep, evicted), (keep & ~evicted_again, evicted_again)):
        with Launches() as fast:
            merge_evicted(one, keep_now, states[0], rule=rule, exact=True)
        merge_evicted(general, keep_now, states[1], rule=rule)
        assert fast.syncs == 0 and "sort" not in fast.ops
        torch.testing.assert_close(states[0].tau, states[1].tau, equal_nan=True, **exact)
        torch.testing.assert_close(one.keys, general.keys, **exact)
        torch.testing.assert_close(one.values, general.values, **exact)
        for made in (one, general):  # the eviction that follows the merge
            made.pos.masked_fill_(dropped, -1)
    assert not torch.equal(one.keys, untouched.keys) and not torch.equal(one.values, untouched.values)


@pytest.mark.parametrize("rule", ["paper", "official"])
@pytest.mark.parametrize("seed", range(3))
def test_merging_on_a_static_layer_matches_the_general_merge(rule, seed):
    # A static layer's decode step (compiled: nothing read back, fixed shapes) matches the first
    # ``static_evictions`` evicted slots of each head against every slot and merges over every slot: it must leave
    # the keys, values and threshold the general merge leaves, with up to three tokens evicted per head, over two
    # evictions. Rows as above: every head evicting, one head of three, nothing held, a head that keeps nothing.
    b, hkv, c = 4, 3, 16
    pos = random_positions(b, hkv, c, held=12, seed=seed)
    pos[2] = -1
    pos[3, 1] = -1
    pos[3, 1, 5] = 7
    held = pos >= 0
    where = torch.tensor([[True] * 3, [False, False, True], [True] * 3, [True] * 3])[..., None]
    evicted = held & (held.cumsum(-1) <= 3) & where
    keep = held & ~evicted
    evicted_again = keep & (keep.cumsum(-1) <= 2) & where

    def stored():
        return make_layer(Merge(budget=8, base="h2o"), pos, head_dim=8, seed=seed)

    static, general = stored(), stored()
    static.decoded, static.static_evictions = torch.zeros((), dtype=torch.int64), 3  # as settle_static leaves it
    states = MergeState(tau=torch.full((b,), float("nan"))), MergeState()
    for keep_now, dropped in ((keep, evicted), (keep & ~evicted_again, evicted_again)):
        with Launches() as fast:
            merge_evicted(static, keep_now, states[0], rule=rule, exact=True, static_step=True)
        merge_evicted(general, keep_now, states[1], rule=rule)
        assert fast.syncs == 0 and "sort" not in fast.ops
        torch.testing.assert_close(states[0].tau, states[1].tau, atol=1e-6, rtol=0, equal_nan=True)
        torch.testing.assert_close(static.keys, general.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(static.values, general.values, atol=1e-6, rtol=0)
        for made in (static, general):
            made.pos.masked_fill_(dropped, -1)
    assert not torch.equal(static.keys, stored().keys)
