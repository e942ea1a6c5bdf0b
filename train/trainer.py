"""``GateTrainer``: transformers' ``Trainer`` for gate sets on a frozen LLM.

The Trainer brings devices, DDP/DeepSpeed/FSDP through accelerate, mixed precision, gradient accumulation and
checkpointing, the optimizer and schedule, checkpoint/resume (optimizer, scheduler, RNG, data order), best-checkpoint
tracking, wandb logging and progress bars. This subclass changes only what is specific to gates:

* ``compute_loss``: teacher forward (plain attention, no grad), student forward (gated attention), and the losses
  of ``train.losses``; Locret trains its heads from one labelling forward instead;
* ``evaluate``: validation with *hard* eviction through ``kvgates.BudgetCache`` (``train.validation``), never the
  soft training proxy; the best checkpoint is chosen by its KL;
* checkpoints hold the gate adapter (and the Trainer's optimizer/scheduler/RNG state), never the LLM.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import kvgates
from kvgates.gates.training import GateTraining, HardEviction
from train.config import TrainConfig
from train.losses import capacity_loss, distillation_loss, locret_loss, teacher_ranking_loss
from train.validation import Validator


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Run the block with ``model`` in eval mode (the frozen teacher), restoring its mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def keep_sets(cache: kvgates.BudgetCache, length: int) -> torch.Tensor:
    """``[L, B, H_kv, T]`` bool: the positions each budgeted layer's heads still hold."""
    out = []
    for layer in cache.budget_layers:
        pos = layer.pos
        keep = torch.zeros((*pos.shape[:2], length + 1), dtype=torch.bool, device=pos.device)
        keep.scatter_(2, torch.where(pos >= 0, pos, length).clamp(max=length), True)
        out.append(keep[..., :length])
    return torch.stack(out)


def decode_start(labels: torch.Tensor) -> torch.Tensor:
    """``[B]`` the first position of each row's completion (``labels != -100``), where inference starts decoding
    (the row's length when it has none)."""
    answer = labels != -100
    return torch.where(answer.any(-1), answer.int().argmax(-1), labels.shape[1])


def gate_loss(
    model: torch.nn.Module,
    lm_head: torch.nn.Linear,
    gated: GateTraining,
    config: TrainConfig,
    inputs: dict[str, torch.Tensor],
    budget: float,
    teacher_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of one batch and its parts (for logging), for ``config.kind``'s gates.

    Retention gates (TRIM-KV): a teacher forward (plain attention, no gradient; through a ``BudgetCache`` with the
    heuristic teacher when one is configured, which leaves the logits unchanged and yields its keep-set), a student
    forward with gated attention (evicting as inference does under ``loss.hard_eviction``), then
    ``(KL + CE) / 2 + lambda_cap * capacity (+ teacher_weight * ranking)``.
    Retaining heads (Locret): one labelling forward, then the regression loss. ``model`` may be wrapped (DDP,
    DeepSpeed); ``lm_head`` is its output projection.
    """
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    lengths = mask.sum(-1)
    attention_mask = None if bool(mask.all()) else mask  # no padding: the fused causal kernels
    layers = gated.gates.config.layer_ids
    if config.kind == "locret":
        gated.set_mode("labels")
        model(input_ids=ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
        scores = torch.stack([gated.scores[i] for i in layers])
        targets = torch.stack([gated.labels[i] for i in layers])
        loss, regression, smooth = locret_loss(scores, targets, config.loss.locret_smoothness)
        return loss, {"regression": regression.item(), "smoothness": smooth.item()}

    gated.set_mode(None)
    with torch.no_grad(), eval_mode(model):
        cache = None
        policy = None
        if config.teacher is not None and teacher_weight > 0:
            # Attached like any policy at inference: KVzip's scoring pass runs the same model again.
            policy = kvgates.make_policy(config.teacher.policy, budget=config.budget, **config.teacher.params).attach(gated.model)
            cache = kvgates.BudgetCache(gated.model.config, policy)
        try:
            teacher = model(
                input_ids=ids, attention_mask=attention_mask, past_key_values=cache, use_cache=cache is not None,
                output_hidden_states=True, logits_to_keep=1,
            )
        finally:
            if policy is not None:
                policy.detach()
    targets = labels[:, 1:]
    completion = targets != -100
    teacher_hidden = teacher.hidden_states[-1][:, :-1][completion]
    del teacher  # its other layers' hidden states (layers x T x d) are not needed during the student's pass
    hard = None
    if config.loss.hard_eviction:
        hard = HardEviction(max(1, round(budget)), decode_start(labels), config.loss.eviction_temperature)
    gated.set_mode("gated", hard)
    student = model(input_ids=ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    student_hidden = student.hidden_states[-1][:, :-1][completion]
    kl, ce = distillation_loss(student_hidden, teacher_hidden, targets[completion], lm_head, config.loss.distill_chunk)
    log_beta = torch.stack([gated.log_beta[i] for i in layers])  # [L, B, H_kv, T]
    cap = capacity_loss(log_beta, budget, lengths, config.kind == "trimkv-global", config.loss.capacity_stride)
    loss = (kl + ce) / 2 + config.loss.lambda_cap * cap
    parts = {"kl": kl.item(), "ce": ce.item(), "capacity": cap.item(), "budget": budget}
    if cache is not None:
        keep = keep_sets(cache, ids.shape[1]).to(log_beta.device)
        rank = teacher_ranking_loss(log_beta, keep, lengths, config.teacher.pairs)  # global RNG: resumed with the run
        loss = loss + teacher_weight * rank
        parts.update(teacher_rank=rank.item(), teacher_weight=teacher_weight)
    parts["log_beta_mean"] = log_beta.detach().mean().item()
    return loss, parts


class GateTrainer(Trainer):
    """Trains the gates of ``training`` (a ``GateTraining`` on the model) according to ``config``.

    Args:
        config: the run config.
        training: the gated-attention set-up of the model (its gates are the only trainable parameters).
        validator: hard-eviction validation on held-out rows.
        **kwargs: ``transformers.Trainer`` arguments (model, args, datasets, collator, callbacks).
    """

    loss_is_scaled_for_ga = False  # compute_loss returns a per-batch mean

    def __init__(self, *, config: TrainConfig, training: GateTraining, validator: Validator, **kwargs: Any):
        super().__init__(**kwargs)
        self.config = config
        self.gated = training
        self.gates = training.gates
        self.validator = validator
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ------------------------------------------------------------------ what trains
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        gates = {id(p) for p in self.gates.parameters()}
        if held != gates:
            raise RuntimeError(
                f"the optimizer holds {len(held)} tensors but the gates have {len(gates)}: only gate parameters may train"
            )
        return optimizer

    # ------------------------------------------------------------------ schedules
    def current_budget(self) -> float:
        """The capacity budget at this step: ramps linearly from ``seq_len`` to ``budget`` (``loss.budget_ramp_steps``)."""
        ramp = self.config.loss.budget_ramp_steps
        target, start = float(self.config.budget), float(self.config.data.seq_len)
        if ramp == 0:
            return target
        done = min(1.0, self.state.global_step / ramp)
        return start + (target - start) * done

    def teacher_weight(self) -> float:
        teacher = self.config.teacher
        if teacher is None:
            return 0.0
        if teacher.anneal_steps == 0:
            return teacher.weight
        return teacher.weight * max(0.0, 1.0 - self.state.global_step / teacher.anneal_steps)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        lm_head = self.accelerator.unwrap_model(model).get_output_embeddings()
        loss, parts = gate_loss(model, lm_head, self.gated, self.config, inputs, self.current_budget(), self.teacher_weight())
        for name, value in parts.items():
            self._metrics[name].append(float(value))
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the means of the loss parts since the last training log (KL, CE, capacity, ...)."""
        if "loss" in logs and self._metrics:
            logs.update({name: sum(v) / len(v) for name, v in self._metrics.items()})
            self._metrics.clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ validation with hard eviction
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        self.gated.set_mode(None)
        model = self.accelerator.unwrap_model(self.model)
        with eval_mode(model):
            metrics = self.validator.run(model, self.gates)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints hold the gates, not the LLM
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if self.args.should_save:
            self.gates.save_pretrained(output_dir or self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        # DeepSpeed's own checkpoint holds the optimizer partitions (and the LR scheduler it manages) beside the
        # module's parameters: only the trainable ones (the gates), never a copy of the frozen LLM.
        from accelerate.utils import DeepSpeedSchedulerWrapper

        self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=True)
        if self.args.should_save and not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if not self.is_deepspeed_enabled or resume_from_checkpoint is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # The Trainer resumes DeepSpeed strictly, which a checkpoint without the frozen LLM cannot satisfy: load the
        # gates (checked against this model) and DeepSpeed's optimizer state ourselves, non-strictly.
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        self._load_gates(resume_from_checkpoint)
        self.model_wrapped.load_checkpoint(
            resume_from_checkpoint, load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        return model, train_dataloader

    def _load_gates(self, folder: str) -> None:
        loaded = kvgates.load_gates(folder)
        if loaded.config.fingerprint != self.gates.config.fingerprint or loaded.kind != self.gates.kind:
            raise kvgates.AdapterError(
                f"{folder} holds {loaded.kind} gates for {loaded.config.base_model} (fingerprint "
                f"{loaded.config.fingerprint}); this run trains {self.gates.kind} gates for fingerprint {self.gates.config.fingerprint}"
            )
        with torch.no_grad():
            self.gates.load_state_dict(loaded.state_dict())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._load_gates(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._load_gates(self.state.best_model_checkpoint)


class MetricsJsonl(TrainerCallback):
    """Appends every log (training losses, validation metrics) as one JSON line to ``path`` (main process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
