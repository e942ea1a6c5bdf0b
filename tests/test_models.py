"""Preparing and loading models for kvgates."""

import copy

import pytest
import torch
from helpers import tiny_model

import kvgates
from kvgates import BudgetCache, UnsupportedModelError


def test_prepare_model_keeps_training_mode_and_gradient_checkpointing():
    """Switching the attention implementation must not change the module's mode (a caller may be training)."""
    ref, _ = tiny_model("llama")
    model = copy.deepcopy(ref).train()
    model.activation_checkpointing_enable()
    kvgates.prepare_model(model)
    assert model.config._attn_implementation == "kvgates"
    assert model.training and all(m.training for m in model.modules())
    assert model.is_activation_checkpointing
    model.eval()
    kvgates.prepare_model(model)
    assert not any(m.training for m in model.modules())


def _tiny(config_cls, model_cls, **extra):
    from helpers import _COMMON

    torch.manual_seed(0)
    return model_cls(config_cls(**{**_COMMON, **extra})).eval()


@pytest.mark.parametrize(
    "family,inputs",
    [("gpt_oss", "s_aux"), ("gemma2", "softcap")],
)
def test_models_whose_attention_passes_inputs_kvgates_would_drop_are_refused(family, inputs):
    """GPT-OSS passes its attention sinks (``s_aux``), Gemma-2 a logit soft-cap: dropping either changes the output."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    if family == "gpt_oss":
        model = _tiny(GptOssConfig, GptOssForCausalLM, num_local_experts=2, num_experts_per_tok=1)
    else:
        model = _tiny(Gemma2Config, Gemma2ForCausalLM)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=f"passes {inputs} to its attention function, which kvgates cannot honour"):
        kvgates.prepare_model(model)
    assert model.config._attn_implementation == before  # left as it was


def test_an_unknown_input_at_call_time_is_refused(tiny):
    """Inputs a caller threads through the forward reach attention too; they are checked on every call."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 6))
    with pytest.raises(UnsupportedModelError, match="passes attention_bias_scale to its attention function"):
        model(ids, attention_bias_scale=2.0)
    with pytest.raises(UnsupportedModelError, match="passes attention_bias_scale"):
        model(ids, past_key_values=BudgetCache(model.config, "h2o", budget=4), attention_bias_scale=2.0)


def test_prepare_model_dry_run_keeps_the_random_state():
    ref, _ = tiny_model("llama")
    model = copy.deepcopy(ref).train()
    state = torch.random.get_rng_state()
    kvgates.prepare_model(model)
    assert torch.equal(torch.random.get_rng_state(), state)
