"""The learned-method registry: one object per method owns its gate kind, its policies and its training loss."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvgates
from kvgates.gates import GATE_KINDS
from kvgates.gates.embedded import embedded_adapters
from kvgates.methods import METHODS, LearnedMethod, method_of, register_method
from kvgates.policies.base import POLICIES
from kvgates.policies.learned import LearnedPolicy
from train.config import ConfigError, TrainConfig


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_names_a_gate_kind_and_policies_that_run_it(name):
    method = METHODS[name]
    assert GATE_KINDS[method.gate_set.kind] is method.gate_set
    assert method.policies and method.policy == method.policies[0]
    for policy in method.policies:
        assert issubclass(POLICIES[policy], LearnedPolicy)
        assert method.gate_set.kind in POLICIES[policy].gate_kinds, (name, policy)
    assert TrainConfig.from_dict({"kind": name}).gate_kind == method.gate_set.kind


@pytest.mark.parametrize("module", ["kvgates.gates", "kvgates.gates.adapter"])
def test_gate_kinds_names_every_kind_whatever_was_imported_first(module):
    # A fresh interpreter: importing the gates alone used to leave out the kinds the learned methods define (dms,
    # kvzap-*) until something imported kvgates.methods, so GATE_KINDS["dms"] was a KeyError.
    code = f"import {module}\nfrom kvgates.gates import GATE_KINDS\nprint(' '.join(sorted(GATE_KINDS)))"
    kinds = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(kinds) == {method.gate_set.kind for method in METHODS.values()} | set(GATE_KINDS)
    assert {"dms", "dms-lora", "kvzap-mlp", "kvzap-linear"} <= set(kinds)


def test_every_learned_policy_belongs_to_a_method():
    owned = {policy for method in METHODS.values() for policy in method.policies}
    learned = {name for name, cls in POLICIES.items() if issubclass(cls, LearnedPolicy)}
    assert learned <= owned, learned - owned


@pytest.mark.parametrize("name", embedded_adapters())
def test_each_shipped_adapter_is_found_by_its_method(name):
    gates = kvgates.load_gates(name)
    method = method_of(gates)
    assert method.gate_set is type(gates)
    assert f'make_policy("{method.policy}"' in gates.model_card()


def test_a_method_name_registers_once():
    class Again(LearnedMethod):
        name = "trimkv"

    with pytest.raises(ValueError, match="new name"):
        register_method(Again)


def test_method_options_are_refused_by_a_method_without_them():
    with pytest.raises(ConfigError, match="locret takes no method options"):
        TrainConfig.from_dict({"kind": "locret", "method": {"rank": 4}})


def test_an_unknown_kind_lists_the_methods():
    with pytest.raises(ConfigError, match="kinds \\(learned methods\\): .*trimkv-global"):
        TrainConfig.from_dict({"kind": "dmz"})


@pytest.mark.parametrize("teacher", ["tova", "snapkv", "h2o"])
def test_a_heuristic_teachers_keep_set_of_a_padded_row_is_that_of_the_row_alone(teacher):
    """TRL's collator pads rows on the right, and the teacher's cache read a padded row's pads as its last queries
    (TOVA's query, SnapKV's window): its keep-set differed from the row's own in 16 of 40 positions per head. Each
    padded row now runs alone; the teacher's hidden states are the batch's."""
    import torch
    from helpers import gate_batch, tiny_model

    from kvgates.gates.training import GateTraining
    from kvgates.methods.base import TrainingStep
    from kvgates.methods.trimkv import TrimKVMethod, keep_sets

    _, model = tiny_model()
    model.requires_grad_(False)
    params = {"window": 4} if teacher == "snapkv" else {}
    config = TrainConfig.from_dict({"budget": 16, "data": {"seq_len": 64}, "teacher": {"policy": teacher, "params": params}})
    gates = kvgates.RetentionGates.for_model(model)
    batch = gate_batch(padded=True)
    with GateTraining(model, gates) as run:
        step = TrainingStep(model, model.lm_head, run, config, batch, budget=16.0, teacher_weight=1.0)
        hidden, keep = TrimKVMethod.taught(step)
        plain = step.teacher_hidden()
    torch.testing.assert_close(hidden, plain, atol=1e-5, rtol=1e-4)
    assert keep.shape[1:] == (2, model.config.num_key_value_heads, 64) and not keep[..., 1, :, 54:].any()
    for row, length in [(0, 64), (1, 54)]:
        alone = kvgates.BudgetCache(model.config, teacher, budget=16, **params)
        with torch.no_grad():
            model(batch["input_ids"][row : row + 1, :length], past_key_values=alone)
        assert torch.equal(keep[:, row : row + 1, :, :length], keep_sets(alone, length)), row


@pytest.mark.parametrize("kind", ["trimkv", "dms"])
@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_a_model_that_transforms_its_logits_after_lm_head_is_refused_by_distillation(kind, family):
    """Distillation makes the completion's logits as ``lm_head(final hidden state)``. Granite divides its logits by
    ``logits_scaling`` (8 here), Cohere multiplies them by ``logit_scale``: both models load and prepare, and their
    gates were distilled, silently, at temperature 1/8 (1/16) and against a CE of those logits."""
    import torch
    from helpers import _COMMON, gate_batch
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    from kvgates.gates.training import GateTraining
    from kvgates.methods.base import TrainingStep

    config_cls, model_cls, extra = {
        "granite": (GraniteConfig, GraniteForCausalLM, {"logits_scaling": 8.0}),
        "cohere": (CohereConfig, CohereForCausalLM, {"logit_scale": 0.0625}),
    }[family]
    torch.manual_seed(0)
    model = kvgates.prepare_model(model_cls(config_cls(**_COMMON, **extra)).eval()).requires_grad_(False)
    window = {"method": {"window": 4}, "policy": {"window": 4}} if kind == "dms" else {}
    config = TrainConfig.from_dict({"kind": kind, "budget": 16, "data": {"seq_len": 64}, **window})
    method = config.learned_method
    with GateTraining(model, method.gate_set.for_model(model)) as run:
        step = TrainingStep(model, model.lm_head, run, config, gate_batch(padded=True), budget=16.0)
        said = rf"^{model_cls.__name__} transforms its logits after its output projection \(a scale or a soft cap\), "
        with pytest.raises(kvgates.UnsupportedModelError, match=said + r".* cannot be distilled at temperature 1$"):
            method.loss(step)


def test_the_output_head_is_checked_at_a_runs_first_teacher_forward_only(monkeypatch):
    """The check reads a norm back to the host: done at every step it was a sync a step, for a frozen model whose
    logits cannot change between steps."""
    from helpers import gate_batch, tiny_model

    import kvgates.methods.base as base
    from kvgates.gates.training import GateTraining

    calls = []
    check = base.check_output_head
    monkeypatch.setattr(base, "check_output_head", lambda *args: calls.append(1) or check(*args))
    _, model = tiny_model()
    model.requires_grad_(False)
    config = TrainConfig.from_dict({"kind": "trimkv", "budget": 16, "data": {"seq_len": 64}})
    method = config.learned_method
    with GateTraining(model, method.gate_set.for_model(model)) as run:
        for _ in range(2):
            method.loss(base.TrainingStep(model, model.lm_head, run, config, gate_batch(padded=True), budget=16.0))
    assert len(calls) == 1
