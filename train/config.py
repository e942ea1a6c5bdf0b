"""Training run configs: YAML files in ``configs/train/``, single keys overridable on the command line.

    accelerate launch train.py --config configs/train/quickstart.yaml training.max_steps=50 budget=128

Every key is known and checked before anything runs: an unknown key, a value of the wrong type or out of range,
an unknown learned method (``kind``) or teacher policy, or a bad data source each stop the run with one sentence, before any file
is written or the model loads. The ``training`` section is passed to ``transformers.TrainingArguments`` (its keys
are checked against it, its values against the fields' types and the ranges in ``_TRAINING_RANGES``). Reading,
``base:`` chains, overrides and building the sections are ``kvgates.config``'s, shared with the A/B configs; ``kind``
names a learned method (``kvgates.methods``) and ``method:`` holds that method's own options.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.build import FORMATS, check_mix
from kvgates import POLICIES
from kvgates.config import ConfigError, build, read_yaml, yaml_hint
from kvgates.methods import METHODS, LearnedMethod
from kvgates.policies.learned import LearnedPolicy
from kvgates.typecheck import field_problems

#: Policies no heuristic teacher or report row may be: the learned ones and the full cache.
NOT_HEURISTIC = ("full",)
#: ``model_dtype``: the frozen model's weights (``auto``: bfloat16 on CUDA, float32 elsewhere); gates stay float32.
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class GateSpec:
    """Shape of the gates: ``hidden`` units (None = the kind's default), ``init_bias`` (None = the kind's default:
    TRIM-KV's retention bias 18, DMS's decision bias -2, ``GateSet.default_init_bias``); or
    ``init_from``: a trained adapter (folder, shipped name or Hub id) of the run's kind for this model, to continue
    from (e.g. a budget curriculum: gates trained at 256 tightened to 128); its shape replaces ``hidden``."""

    hidden: int | None = None
    init_bias: float | None = None
    init_from: str | None = None


@dataclass
class DataSpec:
    """Training and validation data (``data.build``): a mix of sources at ``seq_len`` tokens."""

    seq_len: int = 512
    format: str = "raw"
    train_examples: int = 400
    validation_examples: int = 8
    seed: int = 0
    mix: list[dict[str, Any]] = field(default_factory=lambda: [{"task": "essays"}])


#: How ``loss.budget_ramp_steps`` lowers the budget (see ``LossSpec``).
BUDGET_RAMPS = ("budget", "compression")


@dataclass
class LossSpec:
    """Loss weights. ``budget_ramp_steps``: the capacity budget falls from ``seq_len`` to ``budget`` over these
    optimizer steps (0: the target from the start), ``budget_ramp`` saying how (``BUDGET_RAMPS``): ``"budget"``
    linearly in the budget, ``"compression"`` linearly in the compression ratio ``seq_len / budget`` (DMS's ramp:
    the budget falls fast at first, then slowly). ``hard_eviction``
    (``trimkv`` only): the student's forward evicts as inference does (top-``budget`` after the prompt and after
    each completion token) and the gates learn through the soft decay's gradient (straight-through;
    ``kvgates.kernels.gated.evicted_attention``); with ``eviction_temperature > 0`` the eviction is instead relaxed
    at the keep-set's boundary, gradients through every boundary token (same function)."""

    lambda_cap: float = 1.0
    capacity_stride: int = 4
    budget_ramp_steps: int = 0
    budget_ramp: str = "budget"
    hard_eviction: bool = False
    eviction_temperature: float = 0.0
    distill_chunk: int = 256
    locret_smoothness: float = 0.0025


@dataclass
class TeacherSpec:
    """A heuristic policy whose keep-set at ``budget`` supervises the gates (``kvgates.methods.losses.teacher_ranking_loss``)
    with ``weight``, annealed linearly to 0 over ``anneal_steps`` optimizer steps (0: constant)."""

    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    anneal_steps: int = 0
    pairs: int = 256


@dataclass
class ValidationSpec:
    """Hard-eviction validation every ``training.eval_steps`` steps and at the end, on validation essays."""

    needles: int = 4
    needle_tokens: int | None = None  # default: data.seq_len


@dataclass
class ReportSpec:
    """The final held-out table (test essays, eval templates) at the training budget."""

    examples: int = 8
    needles: int = 10
    policies: list[str] = field(default_factory=lambda: ["streaming_llm", "h2o", "snapkv", "tova"])
    max_new_tokens: int = 8


@dataclass
class TrainConfig:
    """One training run. See ``configs/train/quickstart.yaml`` for a commented example."""

    run_name: str = "run"
    output_dir: str = "checkpoints/run"
    model: str = "smollm2-135m"
    #: The frozen model's weight dtype (``MODEL_DTYPES``); the gates and their optimizer state stay float32.
    model_dtype: str = "auto"
    #: The gated student's attention (``kvgates.gates.training.ATTENTIONS`` or ``auto``: the padded fused kernels
    #: on CUDA, the exact float32 path on the CPU; ``flex`` trains on CUDA only; DMS students take
    #: ``kvgates.methods.dms.ATTENTIONS``, ``auto`` being ``dms_attention_fused`` on every device).
    attention: str = "auto"
    #: The learned method (``kvgates.methods.METHODS``): ``trimkv``, ``trimkv-global``, ``locret``, ...
    kind: str = "trimkv"
    budget: int = 256
    #: The learned method's own training options (``kvgates.methods``: its ``options`` dataclass), e.g. KVzap's
    #: label settings; a method without options takes none.
    method: dict[str, Any] = field(default_factory=dict)
    #: Parameters of the gates' inference policy (validation and the final table), e.g. ``{window: 16}`` for
    #: trimkv or ``{stabilizers: 32, local: 32}`` for locret; the budget is ``budget``.
    policy: dict[str, Any] = field(default_factory=dict)
    gates: GateSpec = field(default_factory=GateSpec)
    data: DataSpec = field(default_factory=DataSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    teacher: TeacherSpec | None = None
    validation: ValidationSpec = field(default_factory=ValidationSpec)
    report: ReportSpec = field(default_factory=ReportSpec)
    training: dict[str, Any] = field(default_factory=dict)
    push_to_hub: str | None = None

    def __post_init__(self) -> None:
        if not self.run_name.strip():  # its type was checked when the config was built
            raise ConfigError("run_name is empty; name the run (wandb and report.md show the name)")
        if self.kind not in METHODS:
            raise ConfigError(f"unknown kind {self.kind!r}; kinds (learned methods): {', '.join(METHODS)}")
        if self.budget < 1:  # its type was checked when the config was built (``kvgates.config.build``)
            raise ConfigError(f"budget must be a whole number of tokens per KV head, at least 1; got {self.budget!r}")
        _check_learned_policy(self.kind, self.budget, self.policy)
        method = self.learned_method
        #: Settings the kind's training never reads (``train.py`` notes them: a value set where it does nothing): loss
        #: keys and gate shapes the kind does not read (every gate shape when ``gates.init_from``'s adapter brings its
        #: own), and ``attention`` where the kind's student attends plainly.
        self.unread = [
            f"loss.{f.name}" for f in dataclasses.fields(LossSpec)
            if method.loss_keys is not None and f.name not in method.loss_keys | {"hard_eviction"} and getattr(self.loss, f.name) != f.default
        ] + [
            f"gates.{key}" for key in ("hidden", "init_bias")
            if (key not in method.gate_keys or self.gates.init_from is not None) and getattr(self.gates, key) is not None
        ] + (["attention"] if not method.reads_attention and self.attention != "auto" else [])
        if self.gates.init_bias is None:  # the kind's default, recorded as the value the run used (run_config.json)
            self.gates.init_bias = self.learned_method.gate_set.default_init_bias
        if self.model_dtype not in MODEL_DTYPES:
            raise ConfigError(f"model_dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.model_dtype!r}")
        if self.data.format not in FORMATS:
            raise ConfigError(f"data.format must be one of {FORMATS}, got {self.data.format!r}")
        if self.data.seq_len < 64 or self.data.seq_len <= self.budget:
            raise ConfigError(f"data.seq_len ({self.data.seq_len}) must be at least 64 and larger than the budget ({self.budget})")
        if self.data.train_examples < 1 or self.data.validation_examples < 1:
            raise ConfigError("data.train_examples and data.validation_examples must be at least 1")
        try:
            check_mix(self.data.mix, self.data.seq_len)
        except ValueError as err:
            raise ConfigError(f"data.mix: {err}") from None
        if self.loss.budget_ramp not in BUDGET_RAMPS:
            raise ConfigError(f"loss.budget_ramp must be one of {', '.join(BUDGET_RAMPS)}, got {self.loss.budget_ramp!r}")
        if self.loss.capacity_stride < 1 or self.loss.budget_ramp_steps < 0 or self.loss.lambda_cap < 0:
            raise ConfigError("loss.capacity_stride must be >= 1, loss.budget_ramp_steps and loss.lambda_cap >= 0")
        _check_ranges(self)
        if self.loss.eviction_temperature < 0:
            raise ConfigError(f"loss.eviction_temperature must be >= 0 (0: straight-through), got {self.loss.eviction_temperature}")
        if self.loss.eviction_temperature > 0 and not self.loss.hard_eviction:  # (read by the hard eviction only)
            raise ConfigError(
                f"loss.eviction_temperature {self.loss.eviction_temperature} relaxes the hard eviction, which is off; add "
                "loss.hard_eviction: true, or leave the temperature out"
            )
        options = self.learned_method.options
        if options is None and self.method:
            raise ConfigError(f"method: {self.kind} takes no method options, got {sorted(self.method)}")
        try:
            self.method_options = None if options is None else build(options, self.method, "method")
        except ConfigError:
            raise
        except ValueError as err:  # the options' own range checks
            raise ConfigError(f"method: {err}") from None
        _check_finite("method", self.method_options)  # (dms's temperature: .inf passed its > 0, and the heads never trained)
        try:
            self.learned_method.check_attention(self.attention)
            self.learned_method.check(self)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.teacher is not None:
            if not self.learned_method.takes_teacher:
                raise ConfigError(f"a heuristic teacher supervises retention gates; {self.kind} trains on its own labels")
            if not is_heuristic(self.teacher.policy):
                heuristics = sorted(name for name in POLICIES if is_heuristic(name))
                raise ConfigError(f"unknown teacher policy {self.teacher.policy!r}; heuristic policies: {', '.join(heuristics)}")
            from kvgates import make_policy

            if "budget" in self.teacher.params:
                raise ConfigError("teacher.params: budget is set by the run (its top-level budget); remove it from teacher.params")
            try:
                make_policy(self.teacher.policy, budget=self.budget, **self.teacher.params)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"teacher: {err}") from None
        for name in self.report.policies:
            if not is_heuristic(name):
                heuristics = sorted(p for p in POLICIES if is_heuristic(p))
                raise ConfigError(f"report.policies: {name!r} is not a heuristic policy; heuristic policies: {', '.join(heuristics)}")
        if self.push_to_hub is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.push_to_hub)
            except HFValidationError:
                raise ConfigError(f"push_to_hub must be a Hub repository id (user/name), got {self.push_to_hub!r}") from None
        _check_training_args(self.training)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> TrainConfig:
        """The run ``raw`` describes (``kvgates.config.build``: every key known, every section a dataclass);
        ``source`` names it in messages."""
        return build(cls, raw, source)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] = ()) -> TrainConfig:
        """Read a YAML config and apply ``key.sub=value`` overrides (values parsed as YAML).

        A config may start from another: ``base: other.yaml`` (relative to the file) is read first and the file's
        own keys are merged over it, section by section.
        """
        return cls.from_dict(read_yaml(path, overrides), str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @property
    def learned_method(self) -> LearnedMethod:
        """The method ``kind`` names (``kvgates.methods``)."""
        return METHODS[self.kind]

    @property
    def gate_kind(self) -> str:
        return self.learned_method.gate_set.kind

    def torch_dtype(self, cuda: bool) -> torch.dtype:
        """The frozen model's weight dtype on a machine with (``cuda``) or without CUDA."""
        name = self.model_dtype if self.model_dtype != "auto" else "bfloat16" if cuda else "float32"
        return getattr(torch, name)


#: TrainingArguments the run sets itself (from other keys), so a config must not.
_RESERVED_ARGS = {"output_dir", "run_name", "remove_unused_columns", "metric_for_best_model", "greater_is_better"}


#: The largest seed a run takes: transformers' ``set_seed`` seeds numpy's global generator, which takes no more.
MAX_SEED = 2**32 - 1
#: Lower bounds of section values not checked elsewhere: (section, key) -> smallest allowed value.
_AT_LEAST = {
    ("gates", "hidden"): 1,
    ("data", "seed"): 0,
    ("loss", "distill_chunk"): 1,
    ("loss", "locret_smoothness"): 0,
    ("teacher", "weight"): 0,
    ("teacher", "anneal_steps"): 0,
    ("teacher", "pairs"): 1,
    ("validation", "needles"): 0,
    ("validation", "needle_tokens"): 64,
    ("report", "examples"): 1,
    ("report", "needles"): 0,
    ("report", "max_new_tokens"): 1,
}


def _check_finite(section: str, values: Any) -> None:
    """``ConfigError`` for a number of the section ``values`` (a dataclass, or None) that is NaN or infinite: NaN
    passes every comparison, infinity every lower bound."""
    for f in dataclasses.fields(values) if values is not None else ():
        value = getattr(values, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name} must be a finite number, got {value!r}")


def _check_ranges(config: TrainConfig) -> None:
    for section in ("gates", "loss", "teacher"):
        _check_finite(section, getattr(config, section))
    for (section, key), least in _AT_LEAST.items():
        value = getattr(getattr(config, section) or object(), key, None)
        if value is not None and value < least:
            raise ConfigError(f"{section}.{key} must be at least {least}, got {value!r}")
    if config.data.seed > MAX_SEED:  # the run's training.seed unless that is set
        raise ConfigError(f"data.seed must be at most {MAX_SEED} (2**32 - 1, what numpy's generator takes), got {config.data.seed}")


def is_heuristic(policy: str) -> bool:
    """Whether ``policy`` is a registered policy that runs without gates and evicts (not ``full``)."""
    return policy in POLICIES and policy not in NOT_HEURISTIC and not issubclass(POLICIES[policy], LearnedPolicy)


def _check_learned_policy(kind: str, budget: int, params: dict[str, Any]) -> None:
    """Build the inference policy once on placeholder gates, so bad parameters fail before training, not after."""
    from kvgates import make_policy

    for key, what in (("budget", "its top-level budget"), ("gates", "the gates it trains")):
        if key in params:
            raise ConfigError(f"policy: {key} is set by the run ({what}); remove it from policy")
    method = METHODS[kind]
    try:
        make_policy(method.policy, budget=budget, gates=method.gate_set.placeholder(), **params)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"policy: {err}") from None


#: Ranges of the ``training`` values the run's Trainer needs (checked before the model loads): name -> (test, words).
_TRAINING_RANGES = {
    "learning_rate": (lambda v: v > 0, "greater than 0"),
    "max_steps": (lambda v: v == -1 or v >= 1, "at least 1 (or -1: num_train_epochs decides)"),
    "num_train_epochs": (lambda v: v > 0, "greater than 0"),
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "at least 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1"),
    "warmup_steps": (lambda v: v >= 0, "at least 0"),
    "weight_decay": (lambda v: v >= 0, "at least 0"),
    "max_grad_norm": (lambda v: v >= 0, "at least 0"),
    "logging_steps": (lambda v: v > 0, "greater than 0"),
    "eval_steps": (lambda v: v is None or v > 0, "greater than 0"),
    "save_steps": (lambda v: v > 0, "greater than 0"),
    "save_total_limit": (lambda v: v is None or v >= 1, "at least 1"),
    "seed": (lambda v: 0 <= v <= MAX_SEED, f"from 0 to {MAX_SEED} (2**32 - 1, what numpy's generator takes)"),
    "adam_epsilon": (lambda v: v > 0, "greater than 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "from 0 to below 1"),
    "adam_beta2": (lambda v: 0 <= v < 1, "from 0 to below 1"),
}


def _check_training_args(training: dict[str, Any]) -> None:
    """The ``training`` section: known TrainingArguments fields, not set by the run itself, of the field's type
    and in range (``learning_rate: -1e-3`` is refused here, not by torch before step 1)."""
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    unknown = sorted(set(training) - known)
    if unknown:
        raise ConfigError(f"training: {unknown} are not transformers.TrainingArguments fields")
    if training.get("resume_from_checkpoint") is not None:  # a TrainingArguments field Trainer never reads: a fresh run
        raise ConfigError("training.resume_from_checkpoint is not read by the run; pass --resume to continue the run in output_dir")
    reserved = sorted(set(training) & _RESERVED_ARGS)
    if reserved:
        raise ConfigError(f"training: {reserved} are set by the run itself; remove them from the config")
    hub = sorted(key for key in training if key.startswith("hub_") and training[key] is not None)
    hub = (["push_to_hub"] if training.get("push_to_hub") else []) + hub
    if hub:  # the Trainer's push runs at its start, to a repository of the whole output folder (a traceback offline)
        raise ConfigError(
            f"training: {', '.join(hub)} would have the Trainer push its checkpoints; the run pushes its trained adapter "
            "itself: set the top-level push_to_hub: user/name instead"
        )
    wrong = field_problems(TrainingArguments, training)
    if wrong:
        raise ConfigError(f"training: {yaml_hint(wrong[0])}")
    for name, (ok, words) in _TRAINING_RANGES.items():
        if name in training and not ok(training[name]):
            raise ConfigError(f"training: {name} must be {words}, got {training[name]!r}")
        # Infinity passes every lower bound; only max_grad_norm takes it (no clipping).
        if name != "max_grad_norm" and isinstance(training.get(name), float) and math.isinf(training[name]):
            raise ConfigError(f"training: {name} must be a finite number, got {training[name]!r}")
