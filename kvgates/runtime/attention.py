"""The ``"kvgates"`` attention implementation, registered with transformers' ``AttentionInterface``.

``model.set_attn_implementation("kvgates")`` makes every attention module call ``kvgates_attention``. For a
layer whose cache is a ``BudgetLayer`` it stores the new tokens, attends over the held slots with
position-based visibility, computes the statistics the policy asked for, and lets the policy evict. A layer whose
gates are being trained (``kvgates.gates.training.GateTraining``) gets that object's attention. For any
other layer (no cache, a ``DynamicCache``, a sliding-window layer) it is exactly transformers' ``sdpa``
attention, with the same masks: the ``"kvgates"`` mask function is transformers' ``sdpa_mask``.

Attention modules pass model-specific inputs as keyword arguments (GPT-OSS its attention sinks ``s_aux``,
Gemma-2 a logit ``softcap``). Only those in ``HONOURED_INPUTS`` are accepted; ``prepare_model`` refuses a model
whose attention passes anything else (``attention_inputs`` finds out with a one-token dry run), and every call
checks again, cheaply, so no input is ever dropped silently.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvgates.errors import UnsupportedModelError
from kvgates.runtime.cache import window_covers_context
from kvgates.runtime.layer import HANDOFF

#: Attribute of an attention module whose calls go to a ``kvgates.gates.training.GateTraining`` (set and removed
#: by it; read here without importing it, so the runtime does not depend on the training machinery).
TRAINING_ATTR = "_kvgates_training"

ATTN_IMPLEMENTATION = "kvgates"

#: Keyword inputs of an attention call that kvgates honours: ``position_ids`` (used for visibility: one per token, not
#: multimodal RoPE's several, ``[k, B, n]``, which GLM-4.5V and ERNIE-4.5-VL pass), flags that do
#: not change the attention output, ``sliding_window`` (sliding layers keep transformers' own cache and sdpa;
#: budgeted layers are full attention, or slide over a window that covers the whole context:
#: ``runtime.cache.window_covers_context``), and two inputs only at their default: ``softcap`` off (``None``) and
#: ``is_causal`` not ``False``. Anything else (attention sinks, packed-sequence offsets, biases) is refused.
HONOURED_INPUTS = frozenset(
    {
        "position_ids", "use_cache", "cache_position", "num_items_in_batch", "output_attentions",
        "output_hidden_states", "output_router_logits", "sliding_window", "softcap", "is_causal",
    }
)


#: Said (as a warning, once per place it is asked from) when a forward asks for ``output_attentions``.
NO_ATTENTION_WEIGHTS = (
    "kvgates attention returns no attention weights, so output_attentions=True gives none (an empty tuple); to read "
    "attention statistics, use a policy's stats (kvgates.runtime.stats) or a model with attn_implementation='eager'"
)


class _Probe(threading.local):
    """While a dry run is in progress in this thread (``attention_inputs``), the inputs each attention module class
    passed (thread-local, like ``HANDOFF``, so that compiled attention reads it without a graph break)."""

    inputs: dict[str, dict[str, Any]] | None = None


_PROBE = _Probe()


def unsupported_inputs(inputs: dict[str, Any]) -> list[str]:
    """The attention inputs in ``inputs`` that kvgates cannot honour (empty when it honours them all)."""
    softcap, causal, positions = inputs.get("softcap"), inputs.get("is_causal"), inputs.get("position_ids")
    rows = positions.shape[0] if positions is not None and positions.dim() == 3 else 1
    if inputs.keys() <= HONOURED_INPUTS and softcap is None and causal is not False and rows == 1:  # the per-call fast path
        return []
    return (
        sorted(inputs.keys() - HONOURED_INPUTS) + ["softcap"] * (softcap is not None) + ["is_causal=False"] * (causal is False)
        + [f"position_ids with {rows} positions per token (multimodal RoPE)"] * (rows > 1)
    )


def refusal(owner: str, names: list[str]) -> UnsupportedModelError:
    """The one-sentence error for an attention that passes inputs kvgates would drop."""
    return UnsupportedModelError(
        f"{owner} passes {', '.join(names)} to its attention function, which kvgates cannot honour (dropping or misreading it "
        f"would silently change the output); kvgates supports attention whose extra inputs are among "
        f"{', '.join(sorted(HONOURED_INPUTS))} (softcap only when off, is_causal not False, position_ids one per token)"
    )


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
    probe = _PROBE.inputs
    if probe is not None:  # prepare_model's dry run: record the inputs, compute nothing
        probe.setdefault(type(module).__name__, {}).update(kwargs)
        b, _, n, _ = query.shape
        return value.new_zeros((b, n, query.shape[1], value.shape[-1])), None
    if unsupported_inputs(kwargs):
        raise refusal(type(module).__name__, unsupported_inputs(kwargs))
    if kwargs.get("output_attentions"):
        warnings.warn(NO_ATTENTION_WEIGHTS, stacklevel=2)
    layer = HANDOFF.layer
    if layer is None or not layer.staged(getattr(module, "layer_idx", None), key):
        training = getattr(module, TRAINING_ATTR, None)
        if training is not None:  # a gate set is being trained on this model (kvgates.gates.training)
            return training.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    HANDOFF.layer = None
    if kwargs.get("sliding_window") is not None and not window_covers_context(kwargs["sliding_window"], getattr(module, "config", None)):
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {layer.layer_idx}) is a sliding-window attention on a layer the model's "
            "config declares full attention, so kvgates cannot budget it"
        )
    if dropout and module.training:
        raise NotImplementedError("kvgates budgeted attention is for inference; disable attention dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query, scale, attention_mask, kwargs.get("position_ids"))
    return out, None


@contextmanager
def _probing():
    inputs: dict[str, dict[str, Any]] = {}
    outer, _PROBE.inputs = _PROBE.inputs, inputs
    try:
        yield inputs
    finally:
        _PROBE.inputs = outer


def attention_inputs(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The keyword inputs each attention module class of ``model`` passes to its attention function.

    Found by a one-token forward with ``model``'s attention set to ``"kvgates"``, during which attention computes
    nothing (it returns zeros). The random number generators are left as they were, and so is the module's mode.
    """
    device = input_device(model)
    devices = [device] if device.type == "cuda" else []
    with _probing() as inputs, torch.no_grad(), torch.random.fork_rng(devices=devices):
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    return inputs


def input_device(model: torch.nn.Module) -> torch.device:
    """The device ``model``'s input embedding runs on: where its weights are, or, when accelerate offloads them
    (a ``device_map`` putting modules on ``"cpu"`` beside a GPU, or on ``"disk"``: the weights wait on ``meta``
    until a forward brings them in), the execution device of its hook (the CPU when no hook says: hooks move
    their inputs where they run)."""
    embeddings = model.get_input_embeddings()
    module = embeddings if embeddings is not None else model
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", [hook]):  # one hook, or accelerate's SequentialHook of several
        execution = getattr(part, "execution_device", None)
        if execution is not None:
            return torch.device(execution)
    device = next(module.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def register() -> None:
    """Register the ``"kvgates"`` attention and mask functions (idempotent; done when ``kvgates.runtime`` is imported)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvgates_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
