"""The ``"kvgates"`` attention implementation, registered with transformers' ``AttentionInterface``.

``model.set_attn_implementation("kvgates")`` makes every attention module call ``kvgates_attention``. For a
layer whose cache is a ``BudgetLayer`` it stores the new tokens, attends over the held slots with
position-based visibility, computes the statistics the policy asked for, and lets the policy evict. A layer whose
gates are being trained (``kvgates.gates.training.GateTraining``) gets that object's attention. For any
other layer (no cache, a ``DynamicCache``, a sliding-window layer) it is exactly transformers' ``sdpa``
attention, with the same masks: the ``"kvgates"`` mask function is transformers' ``sdpa_mask``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvgates.runtime.layer import ACTIVE_LAYER

#: Attribute of an attention module whose calls go to a ``kvgates.gates.training.GateTraining`` (set and removed
#: by it; read here without importing it, so the runtime does not depend on the training machinery).
TRAINING_ATTR = "_kvgates_training"

ATTN_IMPLEMENTATION = "kvgates"


def kvgates_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a budgeted cache layer, or plain sdpa when the layer is not budgeted."""
    layer = ACTIVE_LAYER.get()
    if layer is None or not layer.staged(getattr(module, "layer_idx", None), key):
        training = getattr(module, TRAINING_ATTR, None)
        if training is not None:  # a gate set is being trained on this model (kvgates.gates.training)
            return training.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    ACTIVE_LAYER.set(None)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("kvgates attention does not support logit soft-capping on budgeted layers")
    if dropout and module.training:
        raise NotImplementedError("kvgates budgeted attention is for inference; disable attention dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query, scale, attention_mask, kwargs.get("position_ids"))
    return out, None


def register() -> None:
    """Register the ``"kvgates"`` attention and mask functions (idempotent; done on ``import kvgates``)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvgates_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
