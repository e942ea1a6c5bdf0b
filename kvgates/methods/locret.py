"""Locret as a learned method: retaining heads regress each token's causal importance (the largest pre-softmax
logit later queries give it) from the raw q/k/v projections, in one labelling forward with no backward through
the model (``spec/learned.md``)."""

from __future__ import annotations

import torch
from torch import nn

from kvgates.gates.adapter import RetainingHeads
from kvgates.gates.training import real_queries
from kvgates.kernels.gated import causal_importance
from kvgates.methods.base import LearnedMethod, TrainingStep, register_method
from kvgates.methods.losses import locret_loss

LABELS, SCORES = "labels", "scores"


@register_method
class LocretMethod(LearnedMethod):
    """Locret: the student forward is plain attention that records each layer's causal-importance labels (no
    gradient) and the retaining heads' predictions; loss: SmoothL1 + ``loss.locret_smoothness`` x smoothness."""

    name = "locret"
    loss_keys = frozenset({"locret_smoothness"})
    gate_keys = frozenset({"hidden"})
    gate_set = RetainingHeads
    reads_attention = False  # plain attention
    policies = ("locret",)

    def attend(self, training, module: nn.Module, query, key, value, attention_mask, scale, captured, **kwargs) -> torch.Tensor:
        layer = module.layer_idx
        q_valid = None if attention_mask is None else real_queries(attention_mask)
        with torch.no_grad():
            training.records[LABELS][layer] = causal_importance(query, key, scale, q_valid)
        training.records[SCORES][layer] = training.gates(layer, captured).float().transpose(1, 2)  # [B, H_kv, T]
        return training.plain(module, query, key, value, attention_mask, scaling=scale, **kwargs)

    def loss(self, step: TrainingStep) -> tuple[torch.Tensor, dict[str, float]]:
        step.record()
        loss, regression, smooth = locret_loss(step.stacked(SCORES), step.stacked(LABELS), step.config.loss.locret_smoothness)
        return loss, {"regression": regression.item(), "smoothness": smooth.item()}
