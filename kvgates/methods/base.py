"""A learned eviction method as one object: its gate adapter class, the policies that run it, what its student
attention does and its training loss.

Training (``train/``), adapters, the CLI and the A/B harness ask the method instead of branching on its name.
``register_method`` adds one to ``METHODS`` under ``name``, the run's ``kind:`` in a training config. A method
module holds everything specific to it (see ``kvgates/methods/kvzap.py``); ``kvgates/methods/__init__.py``
imports it, which is its one registration.

The pieces a method is made of:

* ``gate_set``: its ``GateSet`` subclass (the adapter kind, what its hooks capture: ``captures``);
* ``policies``: the inference policies that evict by these gates; the first runs the run's validation and its
  final held-out table;
* ``options``: a dataclass of the method's own training options, the ``method:`` section of a training config
  (None: it has none);
* ``attend``: the attention of one gated layer in the *student* forward (``GateTraining.learn``), which may
  record tensors for the loss in ``training.records``;
* ``loss``: the loss of one batch, from a ``TrainingStep`` (the teacher forward, the student forward and
  distillation are its helpers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kvgates.errors import UnsupportedModelError
from kvgates.gates.adapter import GateSet
from kvgates.methods.losses import distillation_loss

METHODS: dict[str, LearnedMethod] = {}


def register_method(cls: type[LearnedMethod]) -> type[LearnedMethod]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if not cls.name or cls.name in METHODS:
        raise ValueError(f"a learned method needs a new name, got {cls.name!r}")
    METHODS[cls.name] = cls()
    return cls


def method_of(gates: GateSet) -> LearnedMethod:
    """The method whose adapters ``gates`` are (by its gate kind)."""
    for method in METHODS.values():
        if method.gate_set.kind == gates.kind:
            return method
    raise ValueError(f"no learned method trains {gates.kind!r} gates; methods: {', '.join(METHODS)}")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run the block with ``model`` in eval mode (the frozen teacher), restoring its mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def decode_start(labels: torch.Tensor) -> torch.Tensor:
    """``[B]`` the first position of each row's completion (``labels != -100``), where inference starts decoding
    (the row's length when it has none)."""
    answer = labels != -100
    return torch.where(answer.any(-1), answer.int().argmax(-1), labels.shape[1])


def check_output_head(model: nn.Module, lm_head: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """``UnsupportedModelError`` (one sentence) unless the model's own ``logits`` (``[B, V]``) are ``lm_head(hidden)``
    (``hidden``: the final hidden states of the same rows). Distillation makes the completion's logits that way
    (``distillation_loss``), so a model that scales or caps its logits after the output projection (Granite's
    ``logits_scaling``, Cohere's ``logit_scale``, a ``final_logit_softcapping``) would be distilled at another
    temperature than 1, silently."""
    mine, theirs = lm_head(hidden.to(lm_head.weight.device)).float(), logits.float().to(lm_head.weight.device)
    if float((mine - theirs).norm()) > 1e-2 * float(theirs.norm()):
        raise UnsupportedModelError(
            f"{type(model).__name__} transforms its logits after its output projection (a scale or a soft cap), which "
            "distillation, computing the logits as lm_head(final hidden state), does not apply; its gates cannot be "
            "distilled at temperature 1"
        )


@dataclass
class TrainingStep:
    """One batch of a training run, as a method's ``loss`` sees it.

    Attributes:
        model: the model (possibly wrapped by DDP / DeepSpeed) carrying the gates.
        lm_head: its output projection.
        training: the ``GateTraining`` on the model (mode, records, the gates).
        config: the run config (``train.config.TrainConfig``: ``budget``, ``loss``, ``teacher``, ``method``, ...).
        inputs: the collated batch (``input_ids``, ``attention_mask``, ``labels``).
        budget: the capacity budget at this step (ramped from ``data.seq_len`` by ``loss.budget_ramp_steps``).
        teacher_weight: the heuristic teacher's weight at this step (0 without one).
    """

    model: nn.Module
    lm_head: nn.Linear
    training: Any
    config: Any
    inputs: dict[str, torch.Tensor]
    budget: float
    teacher_weight: float = 0.0

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs["input_ids"]

    @property
    def labels(self) -> torch.Tensor:
        return self.inputs["labels"]

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` real (unpadded) length of each row."""
        return self.inputs["attention_mask"].sum(-1)

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """The padding mask, or None when no row is padded (the fused causal kernels then run)."""
        mask = self.inputs["attention_mask"]
        return None if bool(mask.all()) else mask

    @property
    def completion(self) -> torch.Tensor:
        """``[B, T - 1]`` bool: the positions whose next token is a completion token (the distilled ones)."""
        return self.labels[:, 1:] != -100

    def forward(self, **kwargs: Any) -> Any:
        """The model on this batch (``use_cache=False`` unless a cache is given; logits of the last token only)."""
        kwargs.setdefault("use_cache", kwargs.get("past_key_values") is not None)
        return self.model(input_ids=self.ids, attention_mask=self.attention_mask, logits_to_keep=1, **kwargs)

    @functools.cached_property
    def distilled_from(self) -> int:
        """The first row any sequence of the batch distills (``completion``): the model's last layer computes only
        the rows from there on (``GateTraining``'s ``rows_from``; 0 when nothing is distilled). Read once per batch
        (a host sync) for the teacher's and the student's forward."""
        rows = self.completion.any(0)
        return int(rows.int().argmax()) if bool(rows.any()) else 0

    def rows(self) -> list[TrainingStep]:
        """Each sequence of the batch as a step of its own, its padding cut off (``[1, length]``). A heuristic
        teacher's cache reads a sequence's last queries (SnapKV's window, TOVA's last query), which a padded row's
        are pads: it runs on each row alone (``[self]`` when no row is padded)."""
        if self.attention_mask is None:
            return [self]
        return [
            dataclasses.replace(self, inputs={key: value[i : i + 1, : int(n)] for key, value in self.inputs.items()})
            for i, n in enumerate(self.lengths.tolist())
        ]

    def teacher_hidden(self, cache: Any = None) -> torch.Tensor:
        """``[n, d]`` the frozen model's final hidden states at the completion positions (plain attention, eval
        mode, no gradient, as the method's ``frozen`` context leaves the model; through ``cache`` when given: a
        policy's cache leaves the logits unchanged and records what it would keep, so every row is computed). A model
        whose logits are not ``lm_head`` of them is refused at the run's first teacher forward (``check_output_head``)."""
        self.training.teach(rows_from=0 if cache is not None else self.distilled_from)
        method = self.training.method
        with torch.no_grad(), eval_mode(self.model), method.frozen(self.training.model):
            out = self.forward(past_key_values=cache, output_hidden_states=True)
            if not self.training.output_head_checked:  # (the model is frozen: once a run, not a host read a step)
                check_output_head(self.training.model, self.lm_head, out.hidden_states[-1][:, -1], out.logits[:, -1])
                self.training.output_head_checked = True
        return out.hidden_states[-1][:, :-1][self.completion]

    def student_hidden(self, **context: Any) -> torch.Tensor:
        """``[n, d]`` the student's final hidden states at the completion positions (``GateTraining.learn``
        with ``context``)."""
        self.training.learn(rows_from=self.distilled_from, **context)
        out = self.forward(output_hidden_states=True)
        return out.hidden_states[-1][:, :-1][self.completion]

    def record(self, **context: Any) -> None:
        """The student forward of a method whose loss reads only what its attention records (``GateTraining.learn``
        with ``context``; Locret's labels, KVzap's predictions): no row of the last layer's output is read, so that
        layer computes its last row alone (``rows_from``; its attention every row unless ``partial_queries``)."""
        self.training.learn(rows_from=self.ids.shape[1] - 1, **context)
        self.forward()

    def distill(self, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(KL, CE)`` of the student against the teacher on the completion tokens (``distillation_loss``)."""
        targets = self.labels[:, 1:][self.completion]
        return distillation_loss(student, teacher, targets, self.lm_head, self.config.loss.distill_chunk)

    def stacked(self, name: str) -> torch.Tensor:
        """``[L, B, H_kv, T]``: what the student forward recorded under ``name``, over the gated layers."""
        records = self.training.records[name]
        return torch.stack([records[i] for i in self.training.gates.config.layer_ids])


class LearnedMethod:
    """Base of learned eviction methods (see the module docstring). Subclasses set the class attributes and
    implement ``attend`` and ``loss``; the other hooks have defaults."""

    #: The run's ``kind:`` in a training config.
    name: ClassVar[str] = ""
    #: The adapter class of its gates.
    gate_set: ClassVar[type[GateSet]]
    #: Inference policies that run these gates; the first validates the run and makes its final table.
    policies: ClassVar[tuple[str, ...]] = ()
    #: The method's own training options (the config's ``method:`` section); None: none.
    options: ClassVar[type | None] = None
    #: Whether a heuristic ``teacher:`` may supervise its gates.
    takes_teacher: ClassVar[bool] = False
    #: The ``loss:`` keys its training reads (None: every one); a run is told of the others it sets.
    loss_keys: ClassVar[frozenset[str] | None] = None
    #: The ``gates:`` shape keys (``hidden``, ``init_bias``) its fresh gates read.
    gate_keys: ClassVar[frozenset[str]] = frozenset({"hidden", "init_bias"})
    #: Whether its student reads the config's ``attention`` (a method whose student attends plainly does not).
    reads_attention: ClassVar[bool] = True

    @property
    def policy(self) -> str:
        """The policy that validates a run and makes its final table."""
        return self.policies[0]

    def check(self, config: Any) -> None:
        """Rules the run config must follow for this method beyond the common ones (``ValueError``, one sentence).
        Default: ``loss.hard_eviction`` is refused (it trains per-layer retention gates)."""
        if config.loss.hard_eviction:
            raise ValueError(f"loss.hard_eviction trains per-layer retention gates (kind trimkv), not {self.name}")

    def check_attention(self, attention: str) -> None:
        """Refuse (``ValueError``, one sentence) a training ``attention`` this method's student cannot run. Default:
        ``"auto"`` or one of ``kvgates.gates.training.ATTENTIONS`` (the gated attentions)."""
        from kvgates.gates.training import ATTENTIONS

        if attention != "auto" and attention not in ATTENTIONS:
            raise ValueError(f"attention must be auto or one of {', '.join(ATTENTIONS)}, got {attention!r}")

    def scoring_reach(self, model: nn.Module, options: Any, tokens: int) -> int:
        """How many positions past a training row of ``tokens`` tokens the forwards making its labels run at on
        ``model`` (``Policy.scoring_reach``; KVzap: KVzip's reconstruction), for the check of rows against the
        model's context. Default: 0 (labels come from the row's own forward)."""
        return 0

    def check_init(self, gates: GateSet, options: Any) -> None:
        """Refuse (``AdapterError``, one sentence) gates to continue from (``gates.init_from``) that this run's
        ``options`` cannot train, before the model loads. Default: nothing."""

    def check_model(self, model: nn.Module, options: Any) -> None:
        """Refuse (``UnsupportedModelError``, one sentence) a model this method cannot train with ``options``, from its
        skeleton (``kvgates.models.model_skeleton``: meta weights) before the weights load. Default: nothing."""

    def setup(self, model: nn.Module, gates: GateSet, options: Any) -> None:
        """Prepare ``model`` for training ``gates`` (before the Trainer is built). Default: nothing."""

    def teardown(self, model: nn.Module, gates: GateSet) -> None:
        """Undo ``setup`` once training is over (before the final evaluation runs other policies on ``model``).
        Default: nothing."""

    def partial_queries(self, context: dict[str, Any]) -> bool:
        """Whether ``attend`` with ``context`` takes the queries of a sequence's last rows only (``[B, H, n, D]``
        against keys and values of all ``T`` rows, the queries at positions ``T - n ..``; ``GateTraining``'s
        ``rows_from``). Default: no, the method's attention always gets every row's query."""
        return False

    def check_context(self, gates: GateSet, context: dict[str, Any]) -> None:
        """``ValueError`` for a student context (``GateTraining.learn(**context)``) this method does not take.
        Default: it takes none."""
        if context:
            raise ValueError(f"{self.name} student forwards take no settings, got {', '.join(context)}")

    def frozen(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which ``model`` is the frozen model as it was loaded (the teacher). Default: it always is."""
        return contextlib.nullcontext()

    def attend(
        self,
        training: Any,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scale: float,
        captured: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The student attention of gated layer ``module.layer_idx``: ``[B, T, H, D]``. ``captured`` holds the
        gate's inputs of this forward (``gate_set.captures``); ``training.plain(...)`` is the teacher's."""
        raise NotImplementedError

    def loss(self, step: TrainingStep) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one batch and its parts (floats, for logging)."""
        raise NotImplementedError
