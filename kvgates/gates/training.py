"""Training-time attention of a model carrying a gate set: one model, three kinds of forward.

The frozen LLM is both teacher and student, with one copy of its weights. ``GateTraining(model, gates)``
registers the gates on that model instance (``model.kvgates_gates``, so accelerate, DDP and DeepSpeed see and
synchronise them), hooks the inputs the gates read, and marks each gated attention module so that the
``"kvgates"`` attention function hands its call to this object. What the call does depends on ``mode``:

* ``None`` (teacher): plain attention, exactly transformers' sdpa;
* ``"gated"`` (TRIM-KV student): attention with the retention bias ``(t - i) * log_beta_i`` from each layer's gate
  (``kvgates.kernels.gated.gated_attention``, exact gradients into the gates); ``log_beta`` of every layer is
  kept in ``self.log_beta`` for the capacity loss. With a ``HardEviction`` the student evicts as inference does
  instead (``kvgates.kernels.gated.evicted_attention``: straight-through, or relaxed at the keep-set's boundary);
* ``"labels"`` (Locret): plain attention, plus each layer's causal-importance labels (``self.labels``, no
  gradient) and the retaining heads' predictions (``self.scores``, with gradient into the heads only). The LLM's
  own activations need no gradient, so this forward stores none.

The gated student's attention (``attention``): ``"exact"`` (``gated_attention``, float32 with two extra
channels; what the CPU runs), ``"fused"`` / ``"fused-split"`` (``gated_attention_fused`` in float32 / with
bfloat16 operands and a split bias: padded for CUDA's fused kernels, memory linear in ``T``) or ``"flex"``
(``gated_attention_flex``, compiled FlexAttention; CUDA only, it has no CPU backward). ``"auto"`` is
``CUDA_ATTENTION`` on CUDA and ``"exact"`` elsewhere. On CUDA every training attention call (teacher, student,
labels) runs with sdpa's math kernel excluded, so nothing falls back silently to ``T x T`` memory.

Everything lives on the model instance and is undone by ``close()``; no library code is replaced. The mode
stays set until changed, so a backward that recomputes checkpointed layers sees the same attention as the
forward did.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvgates.gates.adapter import GateSet
from kvgates.gates.capture import GateCapture, attention_modules
from kvgates.kernels.gated import (
    causal_importance,
    evicted_attention,
    fused_only,
    gated_attention,
    gated_attention_flex,
    gated_attention_fused,
)
from kvgates.runtime.attention import TRAINING_ATTR

GATES_ATTR = "kvgates_gates"
MODES = (None, "gated", "labels")
#: The gated student's attention implementations (see the module docstring).
ATTENTIONS = {
    "exact": gated_attention,
    "fused": gated_attention_fused,
    "fused-split": functools.partial(gated_attention_fused, precision="split"),
    "flex": gated_attention_flex,
}
#: What ``attention="auto"`` runs on CUDA: the one switch between the padded fused kernels and FlexAttention
#: (their speed on a GPU is not measured; both are linear in memory).
CUDA_ATTENTION = "fused"


@dataclass
class HardEviction:
    """The student's ``"gated"`` forward evicts as inference does: ``budget`` tokens per KV head kept after each
    decoded position, decoding from ``decode_from`` (``[B]``, the first position after each row's prompt).
    ``temperature``: ``evicted_attention``'s (0: hard eviction with the soft decay's gradient; above 0: eviction
    relaxed at the keep-set's boundary)."""

    budget: int
    decode_from: torch.Tensor
    temperature: float = 0.0


class GateTraining:
    """Gated / label-producing attention for ``gates`` on ``model`` (see the module docstring).

    Args:
        model: the (frozen) model; its attention must be ``"kvgates"`` (``kvgates.prepare_model``).
        gates: a ``GateSet`` of the model's shapes (``RetentionGates``, ``GlobalRetentionGates`` for ``"gated"``;
            ``RetainingHeads`` for ``"labels"``).
        attention: the gated student's attention, ``"auto"`` or one of ``ATTENTIONS``.
    """

    def __init__(self, model: PreTrainedModel, gates: GateSet, attention: str = "auto"):
        if attention != "auto" and attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'auto' or one of {', '.join(ATTENTIONS)}, got {attention!r}")
        if getattr(model, GATES_ATTR, None) is not None:
            raise RuntimeError("this model already carries training gates; close() the other GateTraining first")
        if model.config._attn_implementation != "kvgates":
            raise ValueError("GateTraining needs the model's attention set to 'kvgates' (kvgates.prepare_model(model))")
        gates.check_model(model, strict=False)
        self.model, self.gates = model, gates
        self.attention = attention
        self.mode: str | None = None
        self.hard: HardEviction | None = None
        self.log_beta: dict[int, torch.Tensor] = {}
        self.labels: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor] = {}
        model.add_module(GATES_ATTR, gates)
        self._capture = GateCapture(model, gates.captures, gates.config.layer_ids)
        modules = attention_modules(model)
        self._marked: list[nn.Module] = [modules[i] for i in gates.config.layer_ids]
        for module in self._marked:
            setattr(module, TRAINING_ATTR, self)

    def set_mode(self, mode: str | None, hard: HardEviction | None = None) -> GateTraining:
        """Switch what the next forwards (and the backward's recomputations) do; clears the recorded tensors.

        ``hard`` (mode ``"gated"`` only): the student evicts as inference does (see ``HardEviction``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if hard is not None and mode != "gated":
            raise ValueError("hard eviction applies to the gated student (mode 'gated')")
        if hard is not None and self.gates.kind == "retention-global":
            raise ValueError("hard eviction is per head; global gates rank across layers, which one layer cannot see")
        if mode == "gated" and self.gates.captures != "hidden":
            raise ValueError(f"{self.gates.kind} gates do not produce retention; use mode 'labels'")
        if mode == "labels" and self.gates.captures != "qkv":
            raise ValueError(f"{self.gates.kind} gates are trained with mode 'gated', not 'labels'")
        self.mode, self.hard = mode, hard
        self.log_beta, self.labels, self.scores = {}, {}, {}
        return self

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The attention call of a gated layer (from the ``"kvgates"`` attention function)."""
        with fused_only(query.device, f"training attention of layer {module.layer_idx}", query, key, value):
            return self._attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def _attend(self, module, query, key, value, attention_mask, dropout, scaling, **kwargs):
        layer = module.layer_idx
        captured = self._capture.pop(layer)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.mode == "gated":
            if query.shape[2] != key.shape[2]:
                raise RuntimeError("gated training attention runs on whole sequences without a cache (use_cache=False)")
            log_beta = self.gates(layer, captured).transpose(1, 2)  # [B, H_kv, T]
            self.log_beta[layer] = log_beta
            hard, soft = self.hard, self.student_attention(query.device)
            if hard is None:
                out = soft(query, key, value, log_beta, scale, attention_mask)
            else:
                out = evicted_attention(
                    query, key, value, log_beta, scale, hard.budget, hard.decode_from, attention_mask, hard.temperature, soft
                )
            return out.transpose(1, 2).contiguous(), None
        if self.mode == "labels":
            q_valid = None if attention_mask is None else _real_queries(attention_mask)
            with torch.no_grad():
                self.labels[layer] = causal_importance(query, key, scale, q_valid)
            self.scores[layer] = self.gates(layer, captured).float().transpose(1, 2)  # [B, H_kv, T]
        half = query.dtype in (torch.float16, torch.bfloat16)
        if self.attention_name(query.device) != "exact" and not half and attention_mask is None:
            # float32 on CUDA is the memory-efficient kernel's, which takes no grouped query heads: repeat them here
            # (transformers does so itself when there is a mask).
            key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], 1) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def attention_name(self, device: torch.device) -> str:
        """The ``ATTENTIONS`` entry the student runs on ``device`` (``attention``, ``"auto"`` resolved)."""
        return self.attention if self.attention != "auto" else CUDA_ATTENTION if device.type == "cuda" else "exact"

    def student_attention(self, device: torch.device):
        """The gated attention function the student runs on ``device``."""
        return ATTENTIONS[self.attention_name(device)]

    def close(self) -> None:
        """Remove the hooks, the marks and the gates from the model."""
        self._capture.remove()
        for module in self._marked:
            if getattr(module, TRAINING_ATTR, None) is self:
                delattr(module, TRAINING_ATTR)
        self._marked = []
        if getattr(self.model, GATES_ATTR, None) is self.gates:
            delattr(self.model, GATES_ATTR)

    def __enter__(self) -> GateTraining:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _real_queries(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` non-padding tokens of a 4-D attention mask: the columns the last row may attend to (padding
    columns are masked in every row)."""
    last = mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
