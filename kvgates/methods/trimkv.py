"""TRIM-KV as a learned method: retention gates (per layer, and DBTrimKV's global variant) trained by distilling
the frozen model into a student whose attention decays each token by its retention, under a capacity hinge,
optionally ranked by a heuristic teacher's keep-set (``spec/learned.md``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import kvgates
from kvgates.gates.adapter import GateSet, GlobalRetentionGates, RetentionGates
from kvgates.kernels.gated import evicted_attention
from kvgates.methods.base import LearnedMethod, TrainingStep, decode_start, register_method
from kvgates.methods.losses import capacity_loss, teacher_ranking_loss

LOG_BETA = "log_beta"


@dataclass
class HardEviction:
    """The student forward evicts as inference does: ``budget`` tokens per KV head kept after each decoded
    position, decoding from ``decode_from`` (``[B]``, the first position after each row's prompt).
    ``temperature``: ``evicted_attention``'s (0: hard eviction with the soft decay's gradient; above 0: eviction
    relaxed at the keep-set's boundary)."""

    budget: int
    decode_from: torch.Tensor
    temperature: float = 0.0

    @functools.cached_property
    def prefilled(self) -> int:
        """The rows every sequence prefills (``decode_from``'s least value; a host read, once per batch): the steps
        before them are not ranked (``evicted_attention``)."""
        return int(self.decode_from.min())


def keep_sets(cache: kvgates.BudgetCache, length: int) -> torch.Tensor:
    """``[L, B, H_kv, T]`` bool: the positions each budgeted layer's heads still hold."""
    out = []
    for layer in cache.budget_layers:
        pos = layer.pos
        keep = torch.zeros((*pos.shape[:2], length + 1), dtype=torch.bool, device=pos.device)
        keep.scatter_(2, torch.where(pos >= 0, pos, length).clamp(max=length), True)
        out.append(keep[..., :length])
    return torch.stack(out)


@register_method
class TrimKVMethod(LearnedMethod):
    """TRIM-KV: per-layer retention gates. The student attends with the retention bias ``(t - i) * log_beta_i``
    (``GateTraining.student_attention``; with ``hard=HardEviction(...)`` it evicts as inference does instead);
    loss ``(KL + CE) / 2 + lambda_cap * capacity (+ teacher_weight * ranking)``."""

    name = "trimkv"
    loss_keys = frozenset(
        {"lambda_cap", "capacity_stride", "budget_ramp_steps", "budget_ramp", "hard_eviction", "eviction_temperature", "distill_chunk"}
    )
    gate_set = RetentionGates
    policies = ("trimkv", "trimkv-morph", "trimkv-snap")
    takes_teacher = True
    #: Whether the capacity hinge sums over layers and heads against one global budget.
    global_budget = False

    def check(self, config: Any) -> None:
        if config.loss.hard_eviction and (config.policy.get("window", 0) or config.policy.get("buffer", 0)):
            raise ValueError("loss.hard_eviction evicts as TrimKV does with no window or buffer; drop them from policy")

    def check_context(self, gates: GateSet, context: dict[str, Any]) -> None:
        unknown = sorted(set(context) - {"hard"})
        if unknown:
            raise ValueError(f"{self.name} student forwards take hard=HardEviction(...) only, got {', '.join(unknown)}")
        if context.get("hard") is not None and self.global_budget:
            raise ValueError("hard eviction is per head; global gates rank across layers, which one layer cannot see")

    def partial_queries(self, context: dict[str, Any]) -> bool:
        return True  # the gated attentions and evicted_attention (hard or relaxed) take the last rows' queries

    def attend(self, training, module: nn.Module, query, key, value, attention_mask, scale, captured, **kwargs) -> torch.Tensor:
        log_beta = training.gates(module.layer_idx, captured).transpose(1, 2)  # [B, H_kv, T]
        training.records[LOG_BETA][module.layer_idx] = log_beta
        hard, soft = training.context.get("hard"), training.student_attention(query.device)
        if hard is None:
            out = soft(query, key, value, log_beta, scale, attention_mask)
        else:
            out = evicted_attention(
                query, key, value, log_beta, scale, hard.budget, hard.decode_from, attention_mask, hard.temperature, soft,
                hard.prefilled,
            )
        return out.transpose(1, 2).contiguous()

    def loss(self, step: TrainingStep) -> tuple[torch.Tensor, dict[str, float]]:
        config = step.config
        keep = None
        if config.teacher is not None and step.teacher_weight > 0:
            teacher, keep = self.taught(step)
        else:
            teacher = step.teacher_hidden()
        hard = None
        if config.loss.hard_eviction:
            hard = HardEviction(max(1, round(step.budget)), decode_start(step.labels), config.loss.eviction_temperature)
        kl, ce = step.distill(step.student_hidden(hard=hard), teacher)
        log_beta = step.stacked(LOG_BETA)  # [L, B, H_kv, T]
        cap = capacity_loss(log_beta, step.budget, step.lengths, self.global_budget, config.loss.capacity_stride)
        loss = (kl + ce) / 2 + config.loss.lambda_cap * cap
        parts = {"kl": kl.item(), "ce": ce.item(), "capacity": cap.item(), "budget": step.budget}
        if keep is not None:
            keep = keep.to(log_beta.device)
            rank = teacher_ranking_loss(log_beta, keep, step.lengths, config.teacher.pairs)  # global RNG: resumed with the run
            loss = loss + step.teacher_weight * rank
            parts.update(teacher_rank=rank.item(), teacher_weight=step.teacher_weight)
        parts["log_beta_mean"] = log_beta.detach().mean().item()
        return loss, parts

    @staticmethod
    def taught(step: TrainingStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's hidden states (``TrainingStep.teacher_hidden``) and the heuristic teacher's keep-sets
        ``[L, B, H_kv, T]`` (``keep_sets``), each padded row run alone (``TrainingStep.rows``: the policy would
        score its pads as its last queries) and its keep-set padded with False."""
        config, model = step.config, step.training.model
        hidden, keeps = [], []
        for row in step.rows():
            # Attached like any policy at inference: KVzip's scoring pass runs the same model again.
            policy = kvgates.make_policy(config.teacher.policy, budget=config.budget, **config.teacher.params)
            policy.attach(model)
            cache = kvgates.BudgetCache(model.config, policy)
            try:
                hidden.append(row.teacher_hidden(cache))
            finally:
                policy.detach()
            keep = keep_sets(cache, row.ids.shape[1])
            keeps.append(torch.nn.functional.pad(keep, (0, step.ids.shape[1] - keep.shape[-1])))
        return torch.cat(hidden), torch.cat(keeps, dim=1)


@register_method
class TrimKVGlobalMethod(TrimKVMethod):
    """DBTrimKV: one retention scale across layers and heads (shared final projection), one global capacity."""

    name = "trimkv-global"
    gate_set = GlobalRetentionGates
    policies = ("trimkv-global",)
    global_budget = True

    check = LearnedMethod.check  # no hard eviction: global gates rank across layers
