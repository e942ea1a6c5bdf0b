"""Training-time attention of a model carrying a gate set: one model, a teacher forward and a student forward.

The frozen LLM is both teacher and student, with one copy of its weights. ``GateTraining(model, gates)``
registers the gates on that model instance (``model.kvgates_gates``, so accelerate, DDP and DeepSpeed see and
synchronise them), hooks the inputs the gates read, and marks each gated attention module so that the
``"kvgates"`` attention function hands its call to this object. What the call does:

* after ``teach()``: plain attention, exactly transformers' sdpa (the teacher);
* after ``learn(**context)``: the student attention of the gates' learned method (``kvgates.methods``:
  ``method.attend``), e.g. TRIM-KV's retention-biased attention or Locret's labelling pass; what the method's loss
  needs is recorded in ``records[name][layer]``, and ``context`` carries per-batch settings (TRIM-KV's
  ``hard=HardEviction(...)``).

The gated student's attention (``attention``, for methods whose student biases attention by the gates):
``"exact"`` (``gated_attention``, float32 with two extra channels; what the CPU runs), ``"fused"`` /
``"fused-split"`` (``gated_attention_fused`` in float32 / with bfloat16 operands and a split bias: padded for
CUDA's fused kernels, memory linear in ``T``) or ``"flex"`` (``gated_attention_flex``, compiled FlexAttention;
CUDA only, it has no CPU backward). ``"auto"`` is ``CUDA_ATTENTION`` on CUDA and ``"exact"`` elsewhere. On CUDA
every training attention call (teacher and student) runs with sdpa's math kernel excluded, so nothing falls back
silently to ``T x T`` memory.

Distillation reads the model's final hidden states at a sequence's last rows only (its completion), so both modes
take ``rows_from``: with ``rows_from = s > 0`` the model's last decoder layer computes its rows ``s ..`` alone. Its
keys and values still come from every row (they are what those rows attend to), but its queries, attention, output
projection and MLP run on rows ``s ..`` (the attention of methods that take it, ``LearnedMethod.partial_queries``,
and the teacher's; the output projection and MLP through hooks on that layer), and its rows before ``s`` come out
as zeros plus the residual: not the model's output, so only rows ``s ..`` of the last hidden states may be read.
Exact for those rows; it takes nearly the last of a model's ``L`` layers off a step.

Everything lives on the model instance and is undone by ``close()``; no library code is replaced. The mode (and
``rows_from``) stays set until changed, so a backward that recomputes checkpointed layers sees the same attention
as the forward did.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvgates.gates.adapter import GateSet
from kvgates.gates.capture import GateCapture, attention_modules
from kvgates.kernels.gated import causal_visibility, fused_only, gated_attention, gated_attention_flex, gated_attention_fused
from kvgates.runtime.attention import TRAINING_ATTR

GATES_ATTR = "kvgates_gates"
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


class GateTraining:
    """Teacher and student attention for ``gates`` on ``model`` (see the module docstring).

    Args:
        model: the (frozen) model; its attention must be ``"kvgates"`` (``kvgates.prepare_model``).
        gates: a ``GateSet`` of the model's shapes, of a registered learned method (``kvgates.methods.METHODS``).
        attention: the student's attention, ``"auto"`` or one of ``ATTENTIONS`` (what the gates' method takes:
            ``LearnedMethod.check_attention``).
    """

    def __init__(self, model: PreTrainedModel, gates: GateSet, attention: str = "auto"):
        from kvgates.methods import method_of

        method_of(gates).check_attention(attention)
        if getattr(model, GATES_ATTR, None) is not None:
            raise RuntimeError("this model already carries training gates; close() the other GateTraining first")
        if model.config._attn_implementation != "kvgates":
            raise ValueError("GateTraining needs the model's attention set to 'kvgates' (kvgates.prepare_model(model))")
        gates.check_model(model, strict=False)
        self.model, self.gates, self.method = model, gates, method_of(gates)
        self.attention = attention
        self.student = False
        self.context: dict[str, Any] = {}
        self.rows_from = 0
        #: Whether the model's logits were found to be ``lm_head`` of its hidden states (``check_output_head``, once).
        self.output_head_checked = False
        self.records: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        model.add_module(GATES_ATTR, gates)
        self._capture = GateCapture(model, gates.captures, gates.config.layer_ids)
        modules = attention_modules(model)
        self._marked: list[nn.Module] = [modules[i] for i in gates.config.layer_ids]
        for module in self._marked:
            setattr(module, TRAINING_ATTR, self)
        self._last = max(modules)
        self._row_hooks = self._hook_last_rows(model, modules[self._last])

    def teach(self, rows_from: int = 0) -> GateTraining:
        """The next forwards (and the backward's recomputations) run plain attention, the last layer on rows
        ``rows_from ..`` (see the module docstring); clears the records and the captured gate inputs."""
        self.student, self.context, self.rows_from = False, {}, self._rows(rows_from)
        self._reset()
        return self

    def learn(self, rows_from: int = 0, **context: Any) -> GateTraining:
        """The next forwards run the method's student attention with ``context``, the last layer on rows
        ``rows_from ..``; clears the records and the captured gate inputs."""
        self.method.check_context(self.gates, context)
        self.student, self.context, self.rows_from = True, context, self._rows(rows_from)
        self._reset()
        return self

    def _rows(self, rows_from: int) -> int:
        if rows_from < 0:
            raise ValueError(f"rows_from is a row index, got {rows_from}")
        return rows_from if self._row_hooks else 0

    def _hook_last_rows(self, model: nn.Module, attention: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks running the last layer's output projection (``o_proj``, when it has one) and MLP (``mlp``) on rows
        ``rows_from ..`` (inputs ``[B, T, ..]``; outputs padded back to ``T`` rows with zeros). No hooks when the
        layer holding ``attention`` has no ``mlp``, and ``rows_from`` is then ignored. A forward of no more than
        ``rows_from`` rows (a decoding step through a cache) is refused: padded, it would broadcast silently."""
        layer = next((m for m in model.modules() if any(c is attention for c in m.children())), None)
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            return []

        def rows(module: nn.Module, args: tuple) -> tuple | None:
            if not self.rows_from:
                return None
            if args[0].shape[1] <= self.rows_from:
                raise RuntimeError(
                    f"the model's last layer runs on rows {self.rows_from} .. (GateTraining's rows_from) but this forward "
                    f"has {args[0].shape[1]}; call teach() or learn() without rows_from before a forward through a cache"
                )
            return (args[0][:, self.rows_from :], *args[1:])

        def pad(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            return torch.nn.functional.pad(output, (0, 0, self.rows_from, 0)) if self.rows_from else None

        modules = [m for m in (getattr(attention, "o_proj", None), mlp) if isinstance(m, nn.Module)]
        return [h for m in modules for h in (m.register_forward_pre_hook(rows), m.register_forward_hook(pad))]

    def _reset(self) -> None:
        """Forget the records and the captured inputs. A forward through a kvgates cache (a KVzip teacher's or
        KVzap's scoring forwards) captures the gates' inputs but attends in the cache, never here, so nothing pops
        them: they would stay on the model, as large as that forward, until the next forward of each layer."""
        self.records = defaultdict(dict)
        self._capture.inputs.clear()

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
        if query.shape[2] != key.shape[2]:
            raise RuntimeError("training attention runs on whole sequences without a cache (use_cache=False)")
        skip = self.rows_from if module.layer_idx == self._last else 0
        if skip and (not self.student or self.method.partial_queries(self.context)):
            query = query[:, :, skip:]  # the last layer's rows before ``skip`` are not read (``rows_from``)
            attention_mask = None if attention_mask is None else attention_mask[:, :, skip:]
        else:
            skip = 0
        with fused_only(query.device, f"training attention of layer {module.layer_idx}", query, key, value):
            captured = self._capture.pop(module.layer_idx)
            if not self.student:
                out = self.plain(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
            else:
                scale = scaling if scaling is not None else query.shape[-1] ** -0.5
                out = self.method.attend(self, module, query, key, value, attention_mask, scale, captured, dropout=dropout, **kwargs)
        return (torch.nn.functional.pad(out, (0, 0, 0, 0, skip, 0)) if skip else out), None

    def plain(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Plain attention ``[B, n, H, D]``: transformers' sdpa, as the teacher runs it; the queries may be those of
        the last ``n`` of the keys' ``T`` positions."""
        n, t = query.shape[2], key.shape[2]
        if n != t and attention_mask is None:  # sdpa's own causal mask would align the queries with the first keys
            attention_mask = causal_visibility(n, t, None, query.device)
        half = query.dtype in (torch.float16, torch.bfloat16)
        if self.attention_name(query.device) != "exact" and not half and attention_mask is None:
            # float32 on CUDA is the memory-efficient kernel's, which takes no grouped query heads: repeat them here
            # (transformers does so itself when there is a mask).
            key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], 1) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0]

    def attention_name(self, device: torch.device) -> str:
        """The ``ATTENTIONS`` entry the student runs on ``device`` (``attention``, ``"auto"`` resolved)."""
        return self.attention if self.attention != "auto" else CUDA_ATTENTION if device.type == "cuda" else "exact"

    def student_attention(self, device: torch.device):
        """The gated attention function the student runs on ``device``."""
        return ATTENTIONS[self.attention_name(device)]

    def close(self) -> None:
        """Remove the hooks, the marks and the gates from the model."""
        self._capture.remove()
        for handle in self._row_hooks:
            handle.remove()
        self._row_hooks, self.rows_from = [], 0
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


def real_queries(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` non-padding tokens of a 4-D attention mask: the columns the last row may attend to (padding
    columns are masked in every row)."""
    last = mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
