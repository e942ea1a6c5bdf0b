"""``GateTrainer``: transformers' ``Trainer`` for gate sets on a frozen LLM.

The Trainer brings devices, DDP and DeepSpeed ZeRO-2 through accelerate (``train.run`` refuses FSDP and ZeRO-3),
gradient accumulation and checkpointing, the optimizer and schedule, checkpoint/resume (optimizer, scheduler, RNG,
data order), best-checkpoint tracking, wandb logging and progress bars. This subclass changes only what is specific to gates:

* ``compute_loss``: the loss of the gates' learned method (``kvgates.methods``: TRIM-KV's teacher forward, gated
  student forward and losses; Locret's one labelling forward; ...);
* ``evaluate``: validation with *hard* eviction through ``kvgates.BudgetCache`` (``train.validation``), never the
  soft training proxy; the best checkpoint is chosen by its KL;
* checkpoints hold the gate adapter (and the Trainer's optimizer/scheduler/RNG state), never the LLM.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import SaveStrategy

import kvgates
from kvgates.config import text_lines
from kvgates.gates.adapter import atomic_write
from kvgates.gates.training import GateTraining
from kvgates.methods.base import TrainingStep, eval_mode
from train.config import TrainConfig
from train.validation import Validator


def gate_loss(
    model: torch.nn.Module,
    lm_head: torch.nn.Linear,
    gated: GateTraining,
    config: TrainConfig,
    inputs: dict[str, torch.Tensor],
    budget: float,
    teacher_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of one batch and its parts (for logging): the loss of the gates' learned method
    (``kvgates.methods``). ``model`` may be wrapped (DDP, DeepSpeed); ``lm_head`` is its output projection."""
    step = TrainingStep(model, lm_head, gated, config, inputs, budget, teacher_weight)
    return gated.method.loss(step)


def ramped_budget(config: TrainConfig, step: int) -> float:
    """The capacity budget at optimizer step ``step``: from ``data.seq_len`` down to ``budget`` over
    ``loss.budget_ramp_steps`` steps, linearly in the budget or in the compression ratio (``loss.budget_ramp``)."""
    ramp, target, start = config.loss.budget_ramp_steps, float(config.budget), float(config.data.seq_len)
    done = 1.0 if ramp == 0 else min(1.0, step / ramp)
    if config.loss.budget_ramp == "compression":
        return start / (1 + (start / target - 1) * done)
    return start + (target - start) * done


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
        """The capacity budget at this step (``ramped_budget``)."""
        return ramped_budget(self.config, self.state.global_step)

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
        """Add the means of the loss parts since the last training log (KL, CE, capacity, ...), over the batches of
        every process, as the Trainer's ``loss`` is (each process computed the parts of its own batches only)."""
        if "loss" in logs:  # (every process logs the training loss at the same step: gathering is a collective)
            parts: dict[str, list[float]] = defaultdict(list)
            for each in gather_object([dict(self._metrics)]):
                for name, values in each.items():
                    parts[name] += values
            logs.update({name: sum(v) / len(v) for name, v in parts.items()})
            self._metrics.clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ validation with hard eviction
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        self.gated.teach()
        model = self.accelerator.unwrap_model(self.model)
        with eval_mode(model):
            # Each process validates its share of the held-out batches (the model and gates are whole on every one).
            shard = (self.accelerator.process_index, self.accelerator.num_processes)
            metrics = self.validator.run(model, self.gates, shard, gather_object)
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
        if self.args.should_save:
            self._drop_tied_frozen(Path(output_dir))
        if self.args.should_save and not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _drop_tied_frozen(self, folder: Path) -> None:
        """Remove frozen weights from the module states DeepSpeed just saved in ``folder``: its
        ``exclude_frozen_parameters`` looks names up in ``named_parameters()``, which lists a tied weight once, so the
        other name of a tied pair stayed (SmolLM2's ``lm_head.weight``, its 113 MB embedding, in every checkpoint)."""
        frozen = {name for name, p in self.model_wrapped.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        for path in folder.glob("*/mp_rank_*_model_states.pt"):
            states = torch.load(path, map_location="cpu", weights_only=False)
            tied = [name for name in states["module"] if name in frozen]
            if tied:
                for name in tied:
                    del states["module"][name]
                atomic_write(path, lambda p, states=states: torch.save(states, p))

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

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """The Trainer's best-metric tracking, over the validations of steps it saves only: one of a step it does not
        save (``eval_steps`` below ``save_steps``) became the best and named no checkpoint, a later save that did not
        beat it was no best either, and a run whose best validation was such a step exported its last step's gates
        (``best_checkpoint`` empty), not those of its best checkpoint."""
        if self.args.save_strategy != SaveStrategy.BEST and not self.control.should_save:
            return False
        return super()._determine_best_metric(metrics, trial)

    def _load_best_model(self) -> None:
        self._load_gates(self.state.best_model_checkpoint)


class DistinctNoise(TrainerCallback):
    """When training begins, a process other than the first reseeds torch's generators with the run's seed plus its
    index. Every process had drawn the same noise (DMS's Gumbel samples: the Trainer seeds them alike), so N processes
    trained as one process whose noise came N times over, not as one with N times the accumulation. The data's order
    is not drawn from them (its sampler has a seeded generator of its own, built before); a run of one process is
    unchanged; a resumed run's processes then restore their own saved states, as the Trainer does after this."""

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index:
            torch.manual_seed(args.seed + args.process_index)


class RecipeToWandb(TrainerCallback):
    """When training begins, adds the run's kvgates recipe (``TrainConfig.to_dict``: kind, budget, loss, data, gates)
    to the wandb run's config under ``kvgates``, beside what transformers' own callback records (the
    TrainingArguments and the LLM's config, neither of which says what was trained), so runs compare by recipe on the
    dashboard. Nothing where the run reports to no wandb (``training.report_to``)."""

    def __init__(self, recipe: dict[str, Any]):
        self.recipe = recipe

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or "wandb" not in args.report_to:
            return
        import wandb

        if wandb.run is not None:  # (transformers' WandbCallback, earlier in the list, has started it)
            wandb.run.config.update({"kvgates": self.recipe}, allow_val_change=True)


def _json_line(row: dict) -> str:
    """``row`` as one line of strict JSON: a float that is not finite as ``null``."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}) + "\n"


class MetricsJsonl(TrainerCallback):
    """Appends every log (training losses, validation metrics) as one JSON line to ``path`` (main process). When
    training begins, the file keeps only the logs of the steps the run starts from: none for a new run (a run stopped
    before its first checkpoint left its logs in a folder a new run may take), and for a resumed one those up to its
    checkpoint (the steps after it are trained, and logged, again). A torn last line (a run killed while it appended)
    goes with them; ``read`` skips one. A value that is not a finite number (a needle accuracy of a validation that
    held no needles, an overflowed ``grad_norm``) is written as ``null``: JSON has no NaN or infinity, and strict
    readers (``jq``, JavaScript) refuse Python's ``NaN``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @staticmethod
    def read(path: str | os.PathLike) -> list[dict]:
        """The logs ``path`` holds, in order, without a line torn by a killed run or of bytes that are no UTF-8 text."""
        rows = []
        for line in text_lines(path):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.path.is_file():
            rows = self.read(self.path) if state.global_step else []  # (a new run: none, an evaluation at step 0 neither)
            kept = [row for row in rows if isinstance(row, dict) and row.get("step", 0) <= state.global_step]
            text = "".join(_json_line(row) for row in kept)
            atomic_write(self.path, lambda p: Path(p).write_text(text))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with self.path.open("a") as f:
                f.write(_json_line({"step": state.global_step, **logs}))
