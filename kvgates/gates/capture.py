"""Hooks on one model instance that hand each gated layer's inputs to its gate during the normal forward.

The ``"kvgates"`` attention function receives post-RoPE q/k/v only. A retention gate reads the normed hidden
state entering attention, a retaining head the raw q/k/v projections; these hooks capture them as the model
runs (no second pass) and are removed with ``remove()``. Nothing outside the given model instance is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from kvgates.errors import UnsupportedModelError

CAPTURE_KINDS = ("hidden", "qkv")


def attention_modules(model: PreTrainedModel) -> dict[int, nn.Module]:
    """The model's attention modules by layer index."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
            found.setdefault(idx, module)
    if not found:
        raise UnsupportedModelError(f"{type(model).__name__} has no attention modules with q_proj/qkv_proj and layer_idx")
    return found


class GateCapture:
    """Captured gate inputs of the current forward, by layer index.

    Args:
        model: the model instance to hook.
        what: ``"hidden"`` (normed hidden state entering attention) or ``"qkv"`` (raw projections).
        layers: which layer indices to capture.
        when: captures only while this returns True (default: always); a forward it skips holds nothing here.
    """

    def __init__(self, model: PreTrainedModel, what: str, layers: list[int], when: Callable[[], bool] | None = None):
        if what not in CAPTURE_KINDS:
            raise ValueError(f"capture must be one of {CAPTURE_KINDS}, got {what!r}")
        self.what, self.when = what, when
        self.inputs: dict[int, Any] = {}
        self._handles = []
        modules = attention_modules(model)
        for layer in layers:
            if layer not in modules:
                raise UnsupportedModelError(f"layer {layer} has no attention module to hook")
            attn = modules[layer]
            if what == "hidden":
                self._handles.append(attn.register_forward_pre_hook(self._hidden_hook(layer), with_kwargs=True))
            elif hasattr(attn, "qkv_proj"):  # fused projection (Phi-3): its output is concat[q, k, v]
                self._handles.append(attn.qkv_proj.register_forward_hook(self._output_hook(layer, None)))
            else:
                for slot, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
                    self._handles.append(proj.register_forward_hook(self._output_hook(layer, slot)))

    def _hidden_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.when is None or self.when():
                self.inputs[layer] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _output_hook(self, layer: int, slot: int | None):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self.when is not None and not self.when():
                return
            if slot is None:
                self.inputs[layer] = output
            else:
                parts = self.inputs.get(layer)
                parts = list(parts) if isinstance(parts, tuple) and slot else [None, None, None]
                parts[slot] = output
                self.inputs[layer] = tuple(parts)

        return hook

    def pop(self, layer: int) -> Any:
        """The inputs captured for ``layer`` in this forward (consumed)."""
        if layer not in self.inputs:
            raise RuntimeError(f"no gate input was captured for layer {layer}; is the policy attached to this model?")
        return self.inputs.pop(layer)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.inputs.clear()
