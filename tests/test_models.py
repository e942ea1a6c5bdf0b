"""Preparing and loading models for kvgates."""

import copy

from helpers import tiny_model

import kvgates


def test_prepare_model_keeps_training_mode_and_gradient_checkpointing():
    """Switching the attention implementation must not change the module's mode (a caller may be training)."""
    ref, _ = tiny_model("llama")
    model = copy.deepcopy(ref).train()
    model.gradient_checkpointing_enable()
    kvgates.prepare_model(model)
    assert model.config._attn_implementation == "kvgates"
    assert model.training and all(m.training for m in model.modules())
    assert model.is_gradient_checkpointing
    model.eval()
    kvgates.prepare_model(model)
    assert not any(m.training for m in model.modules())
