"""KVzap (kvgates.methods.kvzap): its regressors, adapters, training loss and the ``kvzap`` policy, on tiny models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from brute import recent, sinks, top_by_score
from helpers import gate_batch, tiny_model

import kvgates
from kvgates.gates.capture import attention_modules
from kvgates.gates.training import GateTraining
from kvgates.methods import METHODS
from kvgates.methods.kvzap import KVzap, KVzapGates, KVzapLinearGates, KVzapOptions, kvzap_targets
from kvgates.policies.kvzip import kvzip_scores
from kvgates.runtime.cache import BudgetCache
from train.config import ConfigError, TrainConfig
from train.trainer import gate_loss

REPO = Path(__file__).resolve().parents[1]
REPEAT = [5, 6, 7]  # the tiny models have no tokenizer: KVzip's repeat prompt as ids


@pytest.fixture(scope="module")
def tiny():
    _, model = tiny_model()
    return model.requires_grad_(False)


@pytest.mark.parametrize("cls", [KVzapGates, KVzapLinearGates])
def test_regressor_shapes(tiny, cls):
    gates = cls.for_model(tiny, gate_hidden=8)
    assert gates.config.layer_ids == [0, 1, 2] and gates.captures == "hidden"
    out = gates(1, torch.randn(2, 5, tiny.config.hidden_size))
    assert out.shape == (2, 5, tiny.config.num_key_value_heads) and out.dtype == torch.float32
    per_layer = sum(p.numel() for p in gates.gates[0].parameters())
    d, h = tiny.config.hidden_size, tiny.config.num_key_value_heads
    assert per_layer == ((d + 1) * 8 + (8 + 1) * h if cls is KVzapGates else (d + 1) * h)


@pytest.mark.parametrize("cls", [KVzapGates, KVzapLinearGates])
def test_adapter_round_trip(tiny, tmp_path, cls):
    gates = cls.for_model(tiny, gate_hidden=8, training_budget=16)
    gates.save_pretrained(tmp_path / "a")
    loaded = kvgates.load_gates(tmp_path / "a")
    assert type(loaded) is cls and loaded.config == gates.config
    for name, tensor in gates.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    x = torch.randn(1, 4, tiny.config.hidden_size)
    assert torch.equal(loaded(2, x), gates(2, x))


def test_an_adapter_loads_in_a_process_that_imported_no_method(tiny, tmp_path):
    # The kvzap kinds are registered by kvgates.methods, which loading an adapter must import itself.
    KVzapGates.for_model(tiny, gate_hidden=8).save_pretrained(tmp_path / "a")
    code = f"from kvgates.gates.adapter import GateSet; print(GateSet.from_pretrained({str(tmp_path / 'a')!r}).kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "kvzap-mlp"


def _config(kind: str = "kvzap", **method) -> TrainConfig:
    return TrainConfig.from_dict({
        "kind": kind, "budget": 8, "data": {"seq_len": 64}, "policy": {"window": 2},
        "method": {"repeat_ids": REPEAT, "chunk_size": 16, **method},
    })


@pytest.mark.parametrize("kind", ["kvzap", "kvzap-linear"])
def test_training_loss_is_the_mse_of_log_kvzip_scores_and_trains_the_regressors_only(tiny, kind):
    config = _config(kind)
    gates = METHODS[kind].gate_set.for_model(tiny, gate_hidden=8)
    batch = gate_batch(padded=True, length=40, completion=8)
    mask = batch["attention_mask"]
    with GateTraining(tiny, gates) as run:
        loss, parts = gate_loss(tiny, tiny.lm_head, run, config, batch, 8.0, 0.0)
        loss.backward()
        # By hand: the regressors on the hidden states entering attention, against log KVzip+ scores.
        seen = {}
        hooks = [m.register_forward_pre_hook(lambda m, a, k: seen.__setitem__(m.layer_idx, a[0] if a else k["hidden_states"]), with_kwargs=True)
                 for m in attention_modules(tiny).values()]
        with torch.no_grad():
            run.teach()
            tiny(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)
            predicted = torch.stack([gates(i, seen[i]).transpose(1, 2) for i in range(3)])
            targets = kvzip_scores(tiny, batch["input_ids"], mask, repeat_ids=REPEAT, chunk_size=16, normalize=True)
        for hook in hooks:
            hook.remove()
        assert set(run._capture.inputs) == {0, 1, 2}  # captured by kvzip's forwards through its cache, never popped
        run.teach()
        assert not run._capture.inputs  # teach() (and learn()) drop them
    real = mask.bool()[None, :, None, :].expand_as(targets)
    expected = (predicted - targets.clamp(min=1e-6).log())[real].pow(2).mean()
    assert torch.isfinite(loss) and set(parts) == {"mse", "r2"}
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.parameters())
    assert all(p.grad is None for name, p in tiny.named_parameters() if not name.startswith("kvgates_gates."))


def test_targets_are_floored_logs_and_plain_kvzip_on_request(tiny):
    ids = gate_batch(padded=True, length=40, completion=8)["input_ids"]
    mask = torch.ones_like(ids)
    plain = kvzap_targets(tiny, ids, mask, KVzapOptions(repeat_ids=REPEAT, chunk_size=16, normalize=False, floor=1e-3))
    scores = kvzip_scores(tiny, ids, mask, repeat_ids=REPEAT, chunk_size=16)
    torch.testing.assert_close(plain, scores.clamp(min=1e-3).log())
    assert float(plain.min()) >= torch.tensor(1e-3).log() - 1e-6


@pytest.mark.parametrize("method, message", [
    ({"floor": 0.0}, "method: floor must be a number above 0"),
    ({"chunk_size": 0}, "method: kvzip: chunk_size must be >= 1"),
    ({"repeat_ids": []}, "method: kvzip: repeat_ids must be a non-empty list"),
    ({"rank": 4}, "method: unknown key 'rank'; known keys: normalize, chunk_size"),
])
def test_bad_method_options(method, message):
    with pytest.raises(ConfigError, match=message):
        _config(**method)


def _scores_by_hooks(model, gates) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Each layer's regressor outputs ``[B, q, H_kv]`` for every forward, from hooks of our own."""
    seen: dict[int, list[torch.Tensor]] = {}

    def hook(module, args, kwargs):
        with torch.no_grad():
            hidden = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(module.layer_idx, []).append(gates(module.layer_idx, hidden))

    return seen, [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention_modules(model).values()]


def _literal(scores: list[float], steps: list[int], rule) -> set[int]:
    """Positions one head holds after forwards of ``steps`` tokens each, evicting by ``rule(held scores)`` after every
    forward that leaves it over budget (``rule`` returns the kept positions)."""
    held: dict[int, float] = {}
    start = 0
    for n in steps:
        held.update({p: scores[p] for p in range(start, start + n)})
        start += n
        held = {p: held[p] for p in rule(held)}
    return set(held)


@pytest.mark.parametrize("threshold", [None, "median"])
def test_policy_keeps_what_its_rule_says_in_prefill_and_decode(tiny, threshold):
    budget, window, n_sinks, prompt, decode = 10, 3, 2, 30, 5
    gates = KVzapGates.for_model(tiny, gate_hidden=8)
    ids = torch.randint(3, 100, (2, prompt + decode), generator=torch.Generator().manual_seed(1))
    seen, hooks = _scores_by_hooks(tiny, gates)
    with torch.no_grad():
        tiny(ids[:, :prompt])  # the threshold: the median of the prompt's scores, so heads hold different numbers
    thr = None if threshold is None else float(torch.cat([v[0] for v in seen.values()]).median())
    seen.clear()
    policy = KVzap(budget=budget, gates=gates, window=window, sinks=n_sinks, threshold=thr).attach(tiny)
    cache = BudgetCache(tiny.config, policy)
    with torch.no_grad():
        tiny(ids[:, :prompt], past_key_values=cache)
        for t in range(prompt, prompt + decode):
            tiny(ids[:, t : t + 1], past_key_values=cache)
    policy.detach()
    for hook in hooks:
        hook.remove()

    def rule(held: dict[int, float]) -> set[int]:
        # The window and the sinks always; then the best scores (threshold mode: only those at or above it).
        forced = recent(list(held), window) | sinks(list(held), n_sinks)
        passing = {p for p, s in held.items() if p not in forced and (thr is None or s >= thr)}
        if len(forced | passing) <= budget:
            return forced | passing
        return forced | top_by_score(held, budget - len(forced), forced)

    sizes = set()
    for layer_idx, layer in enumerate(cache.layers):
        scores = torch.cat(seen[layer_idx], dim=1)  # [B, T, H_kv]
        for b in range(2):
            for h in range(tiny.config.num_key_value_heads):
                expected = _literal(scores[b, :, h].tolist(), [prompt] + [1] * decode, rule)
                held = layer.pos[b, h][layer.valid[b, h]].tolist()
                assert sorted(held) == sorted(expected), (layer_idx, b, h)
                sizes.add(len(held))
    assert sizes == {budget} if thr is None else len(sizes) > 1 and max(sizes) <= budget


def test_decode_appends_without_decode_eviction(tiny):
    gates = KVzapGates.for_model(tiny, gate_hidden=8)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(2))
    with KVzap(budget=8, gates=gates, window=2, decode_evict=False).attach(tiny) as policy, torch.no_grad():
        cache = BudgetCache(tiny.config, policy)
        tiny(ids[:, :20], past_key_values=cache)
        for t in range(20, 24):
            tiny(ids[:, t : t + 1], past_key_values=cache)
    assert int(cache.held_tokens().max()) == 8 + 4


@pytest.mark.parametrize("params, message", [
    ({"window": 6}, "budget 8 must be larger than the recent window and the sinks \\(6 \\+ 2\\)"),
    ({"sinks": -1}, "sinks must be >= 0"),
    ({"window": -1}, "window must be >= 0"),
    ({"threshold": float("nan")}, "threshold must be a finite number"),
    ({"threshold": "low"}, "^kvzap: threshold must be a number or None, got 'low'$"),
])
def test_bad_policy_parameters(tiny, params, message):
    with pytest.raises(ValueError, match=message):
        KVzap(budget=8, gates=KVzapGates.for_model(tiny, gate_hidden=4), **{"window": 2, "sinks": 2, **params})


def test_policy_refuses_other_gates(tiny):
    with pytest.raises(ValueError, match="kvzap needs kvzap-mlp or kvzap-linear gates, got 'retention'"):
        KVzap(budget=8, gates=kvgates.RetentionGates.for_model(tiny))
