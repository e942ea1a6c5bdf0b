"""KVzap as a learned method: a small per-layer regressor from the hidden state a layer sees to the log KVzip(+)
importance of each KV head's token, trained on KVzip scores of the training essays, and the ``kvzap`` policy that
keeps each head's best-predicted tokens (``spec/learned.md``; NVIDIA's KVzap, kvpress's ``KVzapPress``).

Two gate kinds, one method each: ``kvzap`` trains ``kvzap-mlp`` gates (``Linear(d_model, hidden) -> activation
-> Linear(hidden, H_kv)``) and ``kvzap-linear`` trains ``kvzap-linear`` gates (``Linear(d_model, H_kv)``); both
read the normed hidden state entering attention and both run under the one ``kvzap`` policy.

Training, per batch: the labels first, with the training attention in teacher mode: ``kvzip_scores`` (the frozen
model asked to repeat each essay; its own extra forwards, no gradient) gives every real token's score per layer and
KV head, and the target is ``log(max(score, floor))``. Then one student forward, plain attention (nothing the model
computes changes), in which each gated layer records its regressor's predictions; the loss is their mean squared
error against the targets over the real tokens of every gated layer and KV head. No backward runs through the LLM:
the gradient reaches the regressors only. MSE, not SmoothL1: it is the paper's fit (kvpress's MLP is trained with
``MSELoss`` and its linear model is a ridge regression), and the floor bounds the targets' lower tail, where the
outliers that would call for a robust loss would sit.

How this departs from the paper and kvpress (0.5.x):

* Labels: KVzip's scores as kvgates computes them (``kvgates.policies.kvzip``: reconstruction in chunks, the
  softmax over everything a reconstruction query sees, no chat template); KVzip+ normalisation (the paper's target)
  is ``method.normalize``, on by default. kvpress wraps the text in the chat template and extracts the scores from
  one eager forward of ``prompt + repeat prompt + prompt``.
* Data and fit: the project's training essays (``data.mix``; 64 windows of 512 tokens in the reference recipe), all
  real tokens of every row, trained by gradient steps with the run's optimizer; kvpress samples 500 tokens of each
  of ~4.5K Nemotron pretraining texts of 750-1,250 tokens (1.2M samples), fits the MLP with skorch (AdamW, lr 5e-3,
  15 epochs) and the linear model in closed form (sklearn ``Ridge``).
* The MLP's activation is the base model's (``GateConfig.activation``: SiLU for SmolLM2), kvpress's is GELU; its
  width is ``gates.hidden`` (kvpress: 512). Linear gates ignore ``gate_hidden``.
* Inference (``KVzap`` below): top-``budget`` per head by default, the threshold mode on request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from kvgates.gates.adapter import GateConfig, GateSet
from kvgates.methods.base import LearnedMethod, TrainingStep, eval_mode, register_method
from kvgates.policies.base import register_policy
from kvgates.policies.kvzip import REPEAT_PROMPT, KVzip, kvzip_scores
from kvgates.policies.learned import WriteScored
from kvgates.policies.selection import sink_mask, threshold_quota
from kvgates.runtime.stats import AttnStats

PREDICTED = "kvzap_predicted"
SCORE = "kvzap_score"


# ---------------------------------------------------------------------------------------------------- the gates
class KVzapMLP(nn.Module):
    """KVzap's MLP regressor of one layer: ``Linear(d_model, hidden) -> activation -> Linear(hidden, H_kv)``, both
    with biases, PyTorch's default initialisation (as kvpress's ``KVzapModel``)."""

    def __init__(self, hidden_size: int, num_kv_heads: int, gate_hidden: int = 512, activation: str = "silu"):
        super().__init__()
        self.up = nn.Linear(hidden_size, gate_hidden)
        self.act = ACT2FN[activation]
        self.down = nn.Linear(gate_hidden, num_kv_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> predicted log-importance ``[..., H_kv]``, float32."""
        return F.linear(self.act(F.linear(hidden, self.up.weight, self.up.bias)), self.down.weight, self.down.bias).float()


class KVzapLinear(nn.Module):
    """KVzap's linear regressor of one layer: ``Linear(d_model, H_kv)`` with a bias."""

    def __init__(self, hidden_size: int, num_kv_heads: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_kv_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> predicted log-importance ``[..., H_kv]``, float32."""
        return F.linear(hidden, self.proj.weight, self.proj.bias).float()


class KVzapGates(GateSet):
    """KVzap MLP regressors, one per gated layer, over the normed hidden state entering attention; scores are
    predicted log KVzip(+) importances (higher: keep)."""

    kind = "kvzap-mlp"
    captures = "hidden"

    def __init__(self, config: GateConfig):
        super().__init__(config)
        self.gates = nn.ModuleList(self.regressor(config) for _ in config.layer_ids)

    def regressor(self, config: GateConfig) -> nn.Module:
        """One layer's regressor for ``config``."""
        return KVzapMLP(config.hidden_size, config.num_kv_heads, config.gate_hidden, config.activation)

    def forward(self, layer_idx: int, captured: torch.Tensor) -> torch.Tensor:
        gate = self.gates[self.layer_position(layer_idx)]
        return gate(captured.to(next(gate.parameters()).dtype))


class KVzapLinearGates(KVzapGates):
    """KVzap linear regressors, one per gated layer (``gate_hidden`` is unused)."""

    kind = "kvzap-linear"

    def regressor(self, config: GateConfig) -> nn.Module:
        return KVzapLinear(config.hidden_size, config.num_kv_heads)


# ---------------------------------------------------------------------------------------------------- the policy
@register_policy
@dataclass
class KVzap(WriteScored):
    """KVzap (NVIDIA, arXiv:2601.07891; kvpress's ``KVzapPress``): learned regressors predict each token's importance.

    Each new token gets a predicted log-importance per KV head from its layer's regressor (over the normed hidden
    state entering attention, computed inside the forward) when it is written; a head keeps its ``sinks`` first and
    ``window`` most recent tokens plus its best-predicted others, ``budget`` in all, after every prompt chunk and
    (``decode_evict``, the default) every decode step.

    Threshold mode (``threshold`` set): a token outside the window whose prediction is below ``threshold`` is
    dropped, so each head holds a variable number of tokens (its sinks and window plus the tokens at or above the threshold),
    at most ``budget`` (the best-predicted ones when more pass). Heads get their own storage (head-wise quotas, as
    Ada-KV's), so memory follows what they hold.

    Departures from kvpress: its ``ThresholdPress`` / ``DMSPress`` keep a 128-token sliding window and only have the
    threshold mode (which masks keys and frees no memory); here the fixed ``budget`` is the default mode, so that
    KVzap compares with every other policy at matched memory, and the window defaults to 32, because at the budgets
    kvgates compares (128, 256) a 128-token window would take all or half of the cache away from the regressor
    (Locret keeps 32 recent tokens by the same reasoning). The first ``sinks`` tokens are always kept, as KVzip (whose
    scores the regressors learn) keeps them (its default 4, as kvpress's ``KVzipPress``); kvpress's KVzap keeps none.
    A regressor that under-predicts a sink in one layer drops it, and that changes every later softmax: with the
    shipped MLP regressors on a 512-token validation essay (budget 256, window 32), the KL of the last 64 tokens to
    the full cache is 0.52 without sinks and 0.032 with 4. Decode-time eviction is on by default, as in KVzap's own
    usage (``ThresholdPress(..., decoding=True)``; the press's default is prefill only), so the cache stays within
    the budget while generating. The threshold applies to a token once it leaves the window, at the next eviction
    (the end of a prompt chunk or a decode step), as in kvpress.

    Args:
        budget: tokens kept per KV head (the most, in threshold mode).
        gates: a ``kvzap-mlp`` or ``kvzap-linear`` adapter; strict: require the training model.
        window: most recent tokens always kept.
        sinks: first tokens always kept.
        threshold: None (keep the top ``budget``) or the log-importance below which tokens are dropped.
        decode_evict: evict during decode too (False: decoded tokens are appended).
    """

    name = "kvzap"
    gate_kinds = ("kvzap-mlp", "kvzap-linear")
    score_state = SCORE

    window: int = 32
    sinks: int = 4
    threshold: float | None = None
    decode_evict: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "window", "sinks")
        self._require_budget(self.window + self.sinks, f"the recent window and the sinks ({self.window} + {self.sinks})")
        if self.threshold is not None:
            if not math.isfinite(self.threshold):  # (a number: ``Policy._check_scalars``)
                raise ValueError(f"{self.name}: threshold must be a finite number (a log-importance) or None, got {self.threshold!r}")
            self.ragged_heads = True  # each head holds what passes the threshold

    @property
    def protected(self) -> int:
        return self.window

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores, recent = super().score(layer, stats)
        return scores, recent | sink_mask(layer, self.sinks)

    def quota(self, layer, stats: AttnStats | None) -> int | torch.Tensor:
        """``budget``; in threshold mode, per sequence and head: its window plus its tokens at or above the
        threshold, at most ``budget``."""
        if self.threshold is None:
            return self.budget
        scores, forced = self.score(layer, stats)
        return threshold_quota(layer, forced, scores >= self.threshold, self.budget)


# ---------------------------------------------------------------------------------------------------- training
@dataclass
class KVzapOptions:
    """KVzap's label settings (the ``method:`` section of a training config).

    Attributes:
        normalize: KVzip+ scores (the paper's target; ``KVzip.normalize``), else plain KVzip.
        chunk_size: essay tokens reconstructed per scoring forward (``KVzip.chunk_size``).
        repeat_prompt: the reconstruction prompt (``KVzip.repeat_prompt``); ``repeat_ids``: its token ids instead.
        floor: scores below it count as it, so that the target ``log(score)`` stays finite.
    """

    normalize: bool = True
    chunk_size: int = 2048
    repeat_prompt: str = REPEAT_PROMPT
    repeat_ids: list[int] | None = None
    floor: float = 1e-6

    def __post_init__(self) -> None:
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not self.floor > 0:
            raise ValueError(f"floor must be a number above 0 (log(score) is the target), got {self.floor!r}")
        KVzip(budget=2, sinks=0, **self.scoring())  # KVzip's own checks of the scoring parameters

    def scoring(self) -> dict[str, Any]:
        """The parameters ``kvzip_scores`` takes."""
        return dict(normalize=self.normalize, chunk_size=self.chunk_size, repeat_prompt=self.repeat_prompt, repeat_ids=self.repeat_ids)


def kvzap_targets(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, options: KVzapOptions) -> torch.Tensor:
    """``[L, B, H_kv, T]`` the regression targets of ``ids`` (``mask``: 1 for real tokens): ``log`` of their KVzip(+)
    scores over the model's budgeted layers, floored at ``options.floor`` (padding holds ``log(floor)``; mask it)."""
    with eval_mode(model):  # kvzip_scores runs without gradients
        scores = kvzip_scores(model, ids, mask, **options.scoring())
    return scores.clamp(min=options.floor).log()


def regression_loss(predicted: torch.Tensor, targets: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(MSE, R^2)`` of ``predicted`` against ``targets`` (both ``[L, B, H_kv, T]``) over the real tokens (``real``
    ``[B, T]`` bool); R^2 (1 - MSE / the targets' variance there) is for logging."""
    keep = real[None, :, None, :].expand_as(targets)
    target = targets[keep]
    mse = (predicted[keep] - target).pow(2).mean()
    return mse, 1.0 - mse.item() / max(target.var(unbiased=False).item(), 1e-12)


@register_method
class KVzapMethod(LearnedMethod):
    """KVzap with MLP regressors (see the module docstring): labels from ``kvzip_scores`` in teacher mode, then a
    plain student forward recording the regressors' predictions; loss: MSE of the predicted log-importance."""

    name = "kvzap"
    loss_keys = frozenset()  # (its regression's own options are method:)
    gate_keys = frozenset({"hidden"})
    gate_set = KVzapGates
    reads_attention = False  # plain attention
    policies = ("kvzap",)
    options = KVzapOptions

    def scoring_reach(self, model: nn.Module, options: KVzapOptions, tokens: int) -> int:
        return KVzip(budget=2, sinks=0, **options.scoring()).scoring_reach(model, tokens)

    def partial_queries(self, context: dict[str, Any]) -> bool:
        return True  # plain attention; the predictions read the layer's input

    def attend(self, training, module: nn.Module, query, key, value, attention_mask, scale, captured, **kwargs) -> torch.Tensor:
        training.records[PREDICTED][module.layer_idx] = training.gates(module.layer_idx, captured).transpose(1, 2)  # [B, H_kv, T]
        return training.plain(module, query, key, value, attention_mask, scaling=scale, **kwargs)

    def loss(self, step: TrainingStep) -> tuple[torch.Tensor, dict[str, float]]:
        mask = step.inputs["attention_mask"]
        step.training.teach()  # kvzip's scoring forwards run the frozen model with plain attention
        targets = kvzap_targets(step.training.model, step.ids, mask, step.config.method_options)
        step.record()
        predicted = step.stacked(PREDICTED)
        if predicted.shape != targets.shape:
            raise RuntimeError(f"kvzap: {tuple(targets.shape)} KVzip scores for {tuple(predicted.shape)} predictions; "
                               "every budgeted layer must be gated")
        mse, r2 = regression_loss(predicted, targets.to(predicted.device), mask.bool().to(predicted.device))
        return mse, {"mse": mse.item(), "r2": r2}


@register_method
class KVzapLinearMethod(KVzapMethod):
    """KVzap with linear regressors."""

    name = "kvzap-linear"
    gate_keys = frozenset()  # (linear: no hidden width)
    gate_set = KVzapLinearGates
