"""TRIM-KV gates inside attention-scored policies (``GateKept``). Inside MorphKV: MorphKV at ``gate_keep = 0``,
TRIM-KV with a recent window at ``gate_keep = budget - recent``, the gates' choice kept in between. Inside SnapKV:
SnapKV at ``gate_keep = 0``, the gates' choice kept at the end of the prompt, and the gates idle while decoding."""

import pytest
import torch
from helpers import policy_on

import kvgates
from kvgates import BudgetCache
from kvgates.gates import RetentionGates
from kvgates.policies.trimkv import LOG_BETA

BUDGET, RECENT, PROMPT, DECODE = 12, 4, 40, 16


def held_positions(model, policy, ids) -> list[list[list[int]]]:
    """After a prompt and teacher-forced decode steps: the positions each layer's heads hold, after every step."""
    cache = BudgetCache(model.config, policy)
    seen = []
    with torch.no_grad():
        for a, z in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
            model(ids[:, a:z], past_key_values=cache)
            seen.append([sorted(p for p in layer.pos[0, h].tolist() if p >= 0)
                         for layer in cache.budget_layers for h in range(layer.num_kv_heads)])
    return seen


@pytest.fixture
def setup(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    gates = RetentionGates.for_model(model, init_bias=2.0)
    return model, ids, gates


def run(model, ids, name, gates=None, **params):
    if gates is not None:
        params["gates"] = gates
    policy = kvgates.make_policy(name, budget=BUDGET, **params).attach(model)
    try:
        return held_positions(model, policy, ids)
    finally:
        policy.detach()


def test_without_gate_tokens_it_is_morphkv(setup):
    model, ids, gates = setup
    assert run(model, ids, "trimkv-morph", gates, recent=RECENT, gate_keep=0) == run(model, ids, "morphkv", recent=RECENT)


def test_with_every_older_slot_to_the_gates_it_is_trimkv_with_a_recent_window(setup):
    model, ids, gates = setup
    got = run(model, ids, "trimkv-morph", gates, recent=RECENT, gate_keep=BUDGET - RECENT)
    assert got == run(model, ids, "trimkv", gates, window=RECENT)


def test_the_gates_best_older_tokens_survive_every_eviction(tiny):
    """After each decode eviction a head holds the budget, its recent window, and the ``gate_keep`` older tokens of
    highest decayed retention among those it held before."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + DECODE), generator=torch.Generator().manual_seed(4))
    with policy_on(model, "trimkv-morph", BUDGET, recent=RECENT, gate_keep=5) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            for t in range(PROMPT, ids.shape[1]):
                before = [(layer.pos.clone(), layer.state[LOG_BETA].clone()) for layer in cache.budget_layers]
                model(ids[:, t : t + 1], past_key_values=cache)
                for layer, (pos, log_beta) in zip(cache.budget_layers, before):
                    assert bool((layer.held() == BUDGET).all())
                    for b in range(2):
                        for h in range(layer.num_kv_heads):
                            held = set(layer.pos[b, h].tolist()) - {-1}
                            old = {p: lb for p, lb in zip(pos[b, h].tolist(), log_beta[b, h].tolist()) if p >= 0}
                            assert set(range(t - RECENT + 1, t + 1)) <= held
                            older = sorted((p for p in old if p <= t - RECENT), key=lambda p: (-(t - p) * old[p], -p))
                            assert set(older[:5]) <= held


def test_bad_parameters_fail_clearly(setup):
    model, _, gates = setup
    with pytest.raises(ValueError, match="must fit the budget"):
        kvgates.make_policy("trimkv-morph", budget=BUDGET, gates=gates, recent=RECENT, gate_keep=BUDGET)
    with pytest.raises(ValueError, match="gates are required"):
        kvgates.make_policy("trimkv-morph", budget=BUDGET, recent=RECENT)
    with pytest.raises(ValueError, match=r"window \(4\) \+ gate_keep \(9\) must fit the budget"):
        kvgates.make_policy("trimkv-snap", budget=BUDGET, gates=gates, window=RECENT, gate_keep=9)


def test_snap_without_gate_tokens_it_is_snapkv(setup):
    model, ids, gates = setup
    params = {"window": RECENT, "kernel": 3}
    assert run(model, ids, "trimkv-snap", gates, gate_keep=0, **params) == run(model, ids, "snapkv", **params)


def test_snap_with_every_slot_outside_the_window_to_the_gates_compresses_the_prompt_as_trimkv(setup):
    model, ids, gates = setup
    snap = run(model, ids, "trimkv-snap", gates, window=RECENT, kernel=3, gate_keep=BUDGET - RECENT)
    assert snap[0] == run(model, ids, "trimkv", gates, window=RECENT)[0]  # after the prompt


def test_snap_decode_appends_without_running_the_gates(tiny):
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + 3), generator=torch.Generator().manual_seed(5))
    with policy_on(model, "trimkv-snap", BUDGET, window=RECENT, gate_keep=5) as policy:
        cache = BudgetCache(model.config, policy)
        gate_calls = []
        policy._running.register_forward_pre_hook(lambda *args: gate_calls.append(1))
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            assert gate_calls and all(bool((layer.held() == BUDGET).all()) for layer in cache.budget_layers)
            gate_calls.clear()
            for t in range(PROMPT, ids.shape[1]):
                model(ids[:, t : t + 1], past_key_values=cache)
        assert gate_calls == []
        assert all(bool((layer.held() == BUDGET + 3).all()) for layer in cache.budget_layers)


def test_on_the_embedded_model_it_uses_the_shipped_128_trimkv_adapter():
    """The adapter chosen on the validation essays (configs/eval/dev.yaml) at both budgets."""
    from kvgates.gates.embedded import default_gates

    assert default_gates("smollm2-135m", "trimkv-morph", 128) == default_gates("smollm2-135m", "trimkv-morph", 512)
    assert default_gates("smollm2-135m", "trimkv-morph", 256) == "smollm2-135m-trimkv-128"
    # The Hub id the embedded model came from (its adapters' base model) gets the same adapters.
    assert default_gates("HuggingFaceTB/SmolLM2-135M-Instruct", "trimkv", 512) == default_gates("smollm2-135m", "trimkv", 512)
    assert default_gates("HuggingFaceTB/SmolLM2-135M-Instruct", "trimkv", 512) is not None
