"""Base of learned policies: a policy that scores new tokens with a gate adapter while the model runs."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvgates.gates.adapter import GateSet
from kvgates.gates.capture import GateCapture
from kvgates.policies.base import EVERY_STEP, PROMPT, Policy, Schedule
from kvgates.policies.selection import recent_mask
from kvgates.runtime.attention import input_device
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats

GATE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: ``gate_dtype`` that runs the gates in the dtype of the model's input embedding (float32 where it is not a float).
AUTO = "auto"


def model_dtype(model: Any) -> torch.dtype:
    """The dtype ``model`` computes in, as its input embedding's weights hold it; float32 where they are not
    floating point (a quantised embedding)."""
    embeddings = model.get_input_embeddings()
    dtype = next((embeddings if embeddings is not None else model).parameters()).dtype
    return dtype if dtype.is_floating_point else torch.float32


@dataclass
class LearnedPolicy(Policy):
    """A policy driven by a gate adapter (``gates``: a ``GateSet``, an adapter folder or a Hub id).

    Before generating, ``policy.attach(model)`` checks that the gates were trained for ``model`` (its
    fingerprint; ``strict=False`` accepts any model of the same shapes) and hooks the model instance so each
    gated layer's inputs reach its gate during the normal forward; ``detach()`` (or leaving a ``with`` block)
    removes the hooks. ``gate_dtype`` is the precision gates run in at inference: ``"auto"`` (the default) the model's
    own (float32 for a float32 model; a bfloat16 model on a GPU runs bfloat16 gates, where float32 ones cost Locret's
    prefill 1.33x a plain one on an H200, bfloat16 ones 1.05x), or one of ``float32``, ``float16``, ``bfloat16``
    (``float16`` halves the weight traffic of every decode step of a float32 model). The final log-sigmoid always
    runs in float32.

    ``attach`` never changes the ``gates`` it was given (their dtype, device, mode and ``requires_grad`` stay as
    the caller left them, so an evaluation in the middle of training leaves the gates training): gates already in
    ``gate_dtype`` on the model's device are read as they are, under ``torch.no_grad``; otherwise the policy runs
    a cast copy, made at ``attach`` and dropped at ``detach``.

    Args:
        gates: the gate adapter (a ``GateSet``, an adapter folder, a Hub id or a shipped name).
        strict: require the model the gates were trained for (its fingerprint), else any of the same shapes.
        gate_dtype: the precision gates run in: auto (the model's own), float32, float16 or bfloat16.
    """

    gate_kinds: ClassVar[tuple[str, ...]] = ()

    gates: GateSet | str | None = field(default=None, repr=False)
    strict: bool = True
    gate_dtype: str = AUTO

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gates is None:
            raise ValueError(f"{self.name}: gates are required (a gate adapter folder, a Hub id, or a GateSet)")
        if isinstance(self.gates, (str, os.PathLike)):
            self.gates = GateSet.from_pretrained(self.gates)
        if not isinstance(self.gates, GateSet) or self.gates.kind not in self.gate_kinds:
            kind = getattr(self.gates, "kind", type(self.gates).__name__)
            raise ValueError(f"{self.name} needs {' or '.join(self.gate_kinds)} gates, got {kind!r}")
        if self.gate_dtype != AUTO and self.gate_dtype not in GATE_DTYPES:
            choices = [AUTO, *sorted(GATE_DTYPES)]
            raise ValueError(f"{self.name}: gate_dtype must be one of {choices}, got {self.gate_dtype!r}")
        self._capture: GateCapture | None = None
        self._running: GateSet | None = None  # what computes scores while attached: the gates or a cast copy

    def attach(self, model: Any) -> LearnedPolicy:
        self.gates.check_model(model, strict=self.strict)
        self.detach()
        dtype = model_dtype(model) if self.gate_dtype == AUTO else GATE_DTYPES[self.gate_dtype]
        self._running = self._gates_for(input_device(model), dtype)
        self._capture = GateCapture(model, self.gates.captures, self.gates.config.layer_ids)
        return self

    def _gates_for(self, device: torch.device, dtype: torch.dtype) -> GateSet:
        """The gates in ``dtype`` on ``device``: the caller's own when they already are, else a cast copy."""
        if all(p.dtype == dtype and p.device == device for p in self.gates.parameters()):
            return self.gates
        return copy.deepcopy(self.gates).to(device=device, dtype=dtype).eval().requires_grad_(False)

    def detach(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        self._running = None

    def new_token_scores(self, layer, stats: AttnStats) -> torch.Tensor:
        """Gate scores ``[B, H_kv, q_len]`` of the tokens this forward added to ``layer``."""
        if self._capture is None or self._running is None:
            raise RuntimeError(f"{self.name}: the gates are not attached to a model; call policy.attach(model) first")
        captured = self._capture.pop(layer.layer_idx)  # a tensor, or a tuple of them (raw q, k, v)
        gate_device = next(self._running.parameters()).device  # the gates run beside the input embedding
        if isinstance(captured, tuple):
            captured = tuple(t.to(gate_device) for t in captured)
        else:
            captured = captured.to(gate_device)
        with torch.no_grad():
            scores = self._running(layer.layer_idx, captured)  # [B, q_len, H_kv]
        return scores.float().transpose(1, 2).to(layer.device)  # a device_map may put this layer elsewhere

    def record(self, layer, stats: AttnStats, name: str) -> None:
        """Store the new tokens' gate scores in the per-slot state ``name``."""
        layer.state[name].scatter_(2, stats.new_slots, self.new_token_scores(layer, stats))


@dataclass
class WriteScored(LearnedPolicy):
    """A learned policy that ranks tokens by the score its gate gave each one when it was written (Locret, KVzap):
    each KV head keeps its ``protected`` most recent tokens plus its best-scored others, ``budget`` in all, after
    every prompt chunk and, with ``decode_evict``, after every decode step (otherwise decoded tokens are appended).
    Subclasses name the per-slot state of the scores (``score_state``) and say how many recent tokens are protected."""

    #: The per-slot state holding each token's gate score.
    score_state: ClassVar[str] = ""

    decode_evict: bool = False

    @property
    def protected(self) -> int:
        """The most recent tokens each head always keeps."""
        raise NotImplementedError

    @property
    def schedule(self) -> Schedule:
        return EVERY_STEP if self.decode_evict else PROMPT

    def slot_state(self) -> dict[str, SlotState]:
        return {self.score_state: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        self.record(layer, stats, self.score_state)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.state[self.score_state], recent_mask(layer, self.protected)
