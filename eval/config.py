"""A/B run configs (YAML): the specs of a run (its model, arms, budgets, tasks and comparisons), validated as a whole.

    base: reference.yaml         # optional: start from another config (relative to this one), merged key by key
    model: smollm2-135m
    seed: 0
    split: test                  # the essays the tasks are built from; `validation` while developing a recipe
    device: cpu                  # where the model runs: cpu, cuda or cuda:N; a GPU run wants device: cuda, dtype: bfloat16
    dtype: float32               # the model's weights and cache: float32, bfloat16 or float16
    budgets: [128, 256, 512]
    arms:
      - snapkv                                              # a registered policy with its defaults
      - {policy: adakv, params: {base: snapkv}}             # parameters
      - {policy: trimkv, gates: untrained}                  # freshly initialised gates, labelled "(untrained)"
      - {policy: trimkv, gates: checkpoints/run/adapter, label: trimkv}    # an adapter folder or a Hub id
      - {policy: trimkv, gates: smollm2-135m-trimkv}        # or the name of an adapter shipped in the package
      - {policy: h2o, budgets: [512], label: h2o-512}       # some of the run's budgets only
    tasks:
      - {task: needle, context_tokens: [2000, 4000], examples: 10}       # lengths x evenly spaced depths
      - {task: multikey, context_tokens: 2000, examples: 10, keys: 4}
      - {task: fidelity, context_tokens: 2000, examples: 8, new_tokens: 512, budgets: [128, 256]}   # some budgets only
    comparisons: auto            # each learned arm vs each heuristic at the same budget; or [[a, b], ...] labels
    reuse: [docs/reference-core/results.jsonl]   # other runs' journals: results with this run's keys are not recomputed
    quick: {budgets: [128], arms: [snapkv], tasks: {needle: {examples: 3}}}    # what --quick changes
    output_dir: outputs/ab

The file is read by the shared loader (``kvgates.config``: ``base:`` chains, ``key=value`` overrides such as
``budgets=[128]`` on the command line, unknown keys refused). ``quick:`` is merged over the config with
``--quick``: its keys replace the config's, except ``arms`` (the labels of the arms kept) and ``tasks`` (the names
of the tasks kept, or a mapping of names to the settings changed); its output folder is the config's with
``-quick`` unless it names one.

The full cache is always an arm (label ``full``): it is the reference of every task. ``ABConfig.load`` checks
everything that can be checked without the model (keys, policy names and parameters, budgets, tasks and their
options, adapters: present, readable and of the policy's kind) and raises ``kvgates.ConfigError`` with one
sentence; ``eval.arms.prepare_arms`` checks the rest once the model is loaded (adapters made for another model)
before any example runs. Loading adapters and building the arms' policies is ``eval.arms``'s: a run reads each
adapter once, while validating, and keeps it in ``ABConfig.adapters`` for ``prepare_arms``; the weights it read enter
the journal keys (``ArmSpec.identity``), so an adapter retrained in place or pushed again to its Hub repository gets
results of its own.

Results depend on the device and dtype the model runs in, so a run's journal keys name them, except on the defaults
(``cpu`` and ``float32``, whose keys are those of the runs made before they could be set, such as the reports
committed under ``docs/``): a run on a GPU or in another dtype never takes, resumes or reuses the results of one on
another. The device is checked against this machine only when the model loads: a report is re-rendered anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvgates
from data.tasks import OPTIONS, check_options, template_by_name, templates
from eval.arms import UNTRAINED, UNTRAINED_GATES, check_budgets, load_adapter
from kvgates.config import ConfigError, build, merge, read_yaml, refuse_unknown
from kvgates.models import device_and_dtype
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.wrappers import learned_params, learned_policy

#: Essay splits an A/B run may use; the training essays are never evaluated on.
EVAL_SPLITS = ("test", "validation")


#: Options each task kind accepts besides the common keys (``data.tasks.OPTIONS``, each task's option names).
ANSWER_OPTIONS = {task: tuple(options) for task, options in OPTIONS.items()}
ANSWER_KINDS = tuple(ANSWER_OPTIONS)  # data.tasks.TASKS and multikey (a test keeps them in step)
#: Tasks scored against the full cache's own output rather than a known answer.
REFERENCE_OPTIONS = {"fidelity": ("new_tokens",), "generation": ("new_tokens",), "perplexity": ("chunk",)}
TASK_KINDS = ANSWER_KINDS + tuple(REFERENCE_OPTIONS)
COMMON_TASK_KEYS = ("name", "task", "context_tokens", "examples", "budgets")
ANSWER_KEYS = ("templates", "max_new_tokens")
TASK_DEFAULTS = {"new_tokens": 128, "chunk": 64}


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ArmSpec:
    """One arm: a policy with fixed parameters and, for learned policies, its gates.

    Attributes:
        label: unique name in the report.
        policy: registered policy name.
        params: policy parameters (the budget comes from the run's budgets).
        gates: learned arms only: an adapter folder (a leading ``~`` is the home folder), a Hub id, or ``"untrained"``. An arm is learned when its
            policy is, or wraps one (``{policy: adakv, params: {base: trimkv-snap}}``: the gates go to the base).
        budgets: the run's budgets this arm runs at (empty: all of them); e.g. an evicting arm at the budget a
            prompt-only arm ends up holding, for a comparison at matched memory, without running every arm there.
    """

    label: str
    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    gates: str | None = None
    budgets: tuple[int, ...] = ()

    @property
    def budgeted(self) -> bool:
        return self.policy != "full"

    @property
    def learned_policy(self) -> type[LearnedPolicy] | None:
        """The learned policy the arm runs (its policy, or the base a wrapper wraps); None for a heuristic arm."""
        return learned_policy(self.policy, self.params)

    @property
    def learned(self) -> bool:
        return self.learned_policy is not None

    def identity(self, adapters: dict[str, kvgates.GateSet]) -> str:
        """What changes this arm's results (journal keys). An adapter enters by the digest of the weights it was
        loaded from (``GateSet.loaded_digest``: a folder, a shipped adapter and a Hub id alike), read once into
        ``adapters`` (the run's ``ABConfig.adapters``, ``eval.arms.load_adapter``): the weights the arm runs."""
        gates = self.gates
        if gates and gates != UNTRAINED:
            gates = load_adapter(self, adapters).loaded_digest
        extra = UNTRAINED_GATES if gates == UNTRAINED else {}
        return _digest([self.policy, self.params, gates, extra])


@dataclass(frozen=True)
class TaskSpec:
    """One task of the run.

    Attributes:
        name: unique name in the report (defaults to the task).
        task: the kind: one of ``data.tasks.TASKS`` plus ``multikey`` (scored by the answer), or ``fidelity``
            (teacher-forced through the full cache's ``new_tokens``), ``generation`` (free-generation agreement
            with the full cache over ``new_tokens``), ``perplexity`` (test-essay tokens streamed in ``chunk``s).
        context_tokens: prompt lengths; each gets ``examples`` examples (haystack tasks: at evenly spaced depths).
        templates: answer tasks: template names (of either set) cycled over the examples; default: the eval set.
        max_new_tokens: answer tasks: greedy tokens generated for the answer.
        options: the kind's options (``keys``, ``hops``, ``new_tokens``, ``chunk`` ...).
        budgets: the run's budgets this task runs at (empty: all of them).
    """

    name: str
    task: str
    context_tokens: tuple[int, ...]
    examples: int
    templates: tuple[str, ...] = ()
    max_new_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    budgets: tuple[int, ...] = ()

    @property
    def answer(self) -> bool:
        return self.task in ANSWER_KINDS

    def option(self, name: str) -> Any:
        return self.options.get(name, TASK_DEFAULTS.get(name))

    @property
    def training_templates(self) -> tuple[str, ...]:
        """The task's templates from the set gate training draws on (``data.tasks``' ``train`` set), where it names
        any: its examples are then phrased as some training rows were."""
        return tuple(t for t in self.templates if template_by_name(template_task(self.task), t).set == "train")

    def identity(
        self, model: str, seed: int, prefill_chunk: int | None, split: str = "test", device: str = "cpu", dtype: str = "float32"
    ) -> str:
        """What changes this task's examples or results (journal keys): not the budgets it runs at, nor, for text
        tasks of one prompt length (whose example ``i`` is seeded by ``i`` alone), how many examples it has, so adding
        examples keeps the results of the first ones. With several lengths it does: example ``i`` of the second
        length is number ``examples + i``, so their count moves every later length's examples to other numbers. The
        split, and the device's kind (``cuda``, whichever GPU) with the dtype, enter the key only when they are not the
        defaults, so journals of test runs on the CPU in float32 keep their keys."""
        ignored = {"budgets"} if self.answer or len(self.context_tokens) > 1 else {"budgets", "examples"}
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}
        kind = torch.device(device).type
        placed = [{"device": kind, "dtype": dtype}] if (kind, dtype) != ("cpu", "float32") else []
        return _digest([model, seed, prefill_chunk, settings] + ([split] if split != "test" else []) + placed)


@dataclass(frozen=True)
class ABConfig:
    """A validated A/B run (see the module docstring for the YAML)."""

    model: str = "smollm2-135m"
    seed: int = 0
    #: The essay split the tasks are built from: ``test`` (reports) or ``validation`` (recipe development).
    split: str = "test"
    #: Where the model runs (``cpu``, ``cuda``, ``cuda:N``) and its parameter dtype (``kvgates.models.DTYPES``); both
    #: change results, and so the journal keys (``TaskSpec.identity``).
    device: str = "cpu"
    dtype: str = "float32"
    budgets: tuple[int, ...] = (128,)
    arms: tuple[ArmSpec, ...] = ()
    tasks: tuple[TaskSpec, ...] = ()
    #: Pairs of arm labels; ``None``: each learned arm against each heuristic (at every budget, on every task).
    comparisons: tuple[tuple[str, str], ...] | None = None
    output_dir: str = "outputs/ab"
    #: Prompt prefill in chunks of this many tokens (eviction after each), or whole.
    prefill_chunk: int | None = None
    #: Examples of exactly one prompt length (in tokens) run as a batch, never padded (``eval.runner.batches``), of at
    #: most ``max_batch`` rows and ``batch_tokens`` prompt tokens.
    batch_tokens: int = 16384
    max_batch: int = 8
    #: Bootstrap resamples per comparison.
    n_boot: int = 2000
    #: Journals (``results.jsonl``) of other runs: a result whose key this run has (same task settings, example,
    #: arm and adapter weights, budget, model, seed, device and dtype) is taken from there instead of being computed again.
    reuse: tuple[str, ...] = ()
    #: The adapters the arms name, by folder, shipped name or Hub id, as ``validate`` read them (not a config key):
    #: ``eval.arms.prepare_arms`` reuses them, so a run reads each adapter once.
    adapters: dict[str, kvgates.GateSet] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def all_arms(self) -> tuple[ArmSpec, ...]:
        """The full-cache reference first, then the configured arms."""
        return (ArmSpec("full", "full"),) + tuple(a for a in self.arms if a.label != "full")

    def task_budgets(self, task: TaskSpec) -> tuple[int, ...]:
        """The budgets ``task`` runs at: its own list, else the run's."""
        return task.budgets or self.budgets

    def arm_budgets(self, arm: ArmSpec, task: TaskSpec | None = None) -> tuple[int | None, ...]:
        """The budgets ``arm`` runs ``task`` at (any task's when None; ``(None,)`` for the full cache)."""
        if not arm.budgeted:
            return (None,)
        budgets = self.task_budgets(task) if task is not None else self.budgets
        return tuple(b for b in budgets if not arm.budgets or b in arm.budgets)

    def placement(self, here: bool = True) -> tuple[torch.device, torch.dtype]:
        """The device and dtype the model loads in; ``ConfigError`` in one sentence for ones that are not, or (``here``)
        a GPU this machine lacks."""
        try:
            return device_and_dtype(self.device, self.dtype, command="python -m eval ab", here=here)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def arm(self, label: str) -> ArmSpec:
        return next(a for a in self.all_arms if a.label == label)

    def pairs(self) -> list[tuple[str, str]]:
        """The compared ``(a, b)`` arm labels."""
        if self.comparisons is not None:
            return list(self.comparisons)
        learned = [a.label for a in self.arms if a.learned]
        heuristic = [a.label for a in self.arms if a.budgeted and not a.learned]
        return [(a, b) for a in learned for b in heuristic]

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, overrides: Sequence[str] = (), quick: bool = False, output_dir: str | None = None) -> ABConfig:
        """Read ``path`` (its ``base`` chain merged in, ``kvgates.config``), apply ``key=value`` ``overrides`` (values
        read as YAML) and validate it; ``quick`` applies its ``quick`` section, ``output_dir`` overrides last.

        With ``quick``, a key the quick section sets is overridden in that section (``quick.budgets=[64]``): an
        override of the key itself would be replaced by the section's, so it is refused; without ``quick``, an
        override of the quick section would be ignored, so it is refused too.
        """
        raw = read_yaml(path, overrides)
        try:
            for item in overrides:
                key = item.partition("=")[0].split(".")[0].strip()  # the top-level key the override sets
                if key == "quick" and not quick:
                    raise ConfigError(f"the override {item!r} changes the quick section, which only --quick applies; add --quick")
                if quick and isinstance(raw.get("quick"), dict) and key in raw["quick"]:
                    raise ConfigError(f"the quick section sets {key}, so --quick replaces the override {item!r}; override quick.{key} instead")
            return cls.from_dict(raw, quick=quick, output_dir=output_dir)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], quick: bool = False, output_dir: str | None = None) -> ABConfig:
        """The validated run ``raw`` describes (its ``quick`` section applied when ``quick``, then ``output_dir`` in place of
        its own; a leading ``~`` of either is the home folder); messages name no file."""
        raw = dict(raw)
        quick_section = raw.pop("quick", None)
        if quick:
            raw = _apply_quick(raw, quick_section)
        if output_dir is not None:
            raw["output_dir"] = output_dir
        if isinstance(raw.get("output_dir"), str):  # "~/runs/ab" is the home folder's (a shell leaves --out=~/ab as it is)
            raw["output_dir"] = os.path.expanduser(raw["output_dir"])
        comparisons = raw.get("comparisons", "auto")
        specs = {
            "arms": tuple(_arm(entry) for entry in _list(raw.get("arms", []), "arms")),
            "tasks": tuple(_task(entry) for entry in _list(raw.get("tasks", []), "tasks")),
            "budgets": tuple(_list(raw.get("budgets", list(cls.budgets)), "budgets")),
            "comparisons": None if comparisons == "auto" else tuple(_pair(p) for p in _list(comparisons, "comparisons")),
            "reuse": tuple(str(p) for p in _list(raw.get("reuse", []), "reuse")),
        }
        config = build(cls, {**raw, **specs}, "")
        config.validate()
        return config

    def validate(self) -> None:
        """Everything checkable without the model beyond the field types ``build`` checked; raises ``ConfigError``."""
        if not self.model:
            raise ConfigError("model must name a model (smollm2-135m, a Hub id or a local folder)")
        self.placement(here=False)  # (this machine's GPUs are checked when the model loads)
        for name in ("seed", "batch_tokens", "max_batch", "n_boot"):
            value = getattr(self, name)
            if value < (0 if name == "seed" else 1):
                raise ConfigError(f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} integer, got {value!r}")
        if self.split not in EVAL_SPLITS:
            raise ConfigError(f"split must be one of {', '.join(EVAL_SPLITS)} (never the training essays), got {self.split!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 2:
            raise ConfigError(
                f"prefill_chunk must be at least 2 tokens or null, got {self.prefill_chunk!r} (a one-token call after the "
                "prompt is a decode step, so the prompt would never be compressed)"
            )
        if not self.budgets:
            raise ConfigError("budgets is empty; list at least one budget in tokens per KV head")
        for budget in self.budgets:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise ConfigError(f"budget {budget!r} is not a whole number of tokens of at least 1; budgets count tokens per KV head")
        twice = _repeated(self.budgets)
        if twice is not None:
            raise ConfigError(f"budgets lists {twice} twice; list each budget once")
        if not self.tasks:
            raise ConfigError("the config lists no tasks")
        labels = [a.label for a in self.all_arms]
        label = _repeated(labels)
        if label is not None:
            raise ConfigError(f"two arms are labelled {label!r}; give one of them another label")
        name = _repeated([t.name for t in self.tasks])
        if name is not None:
            raise ConfigError(f"two tasks are named {name!r}; give one of them another name")
        for pair in self.pairs():
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ConfigError(f"comparison {list(pair)} must name two different arms")
            for label in pair:
                if label not in labels:
                    raise ConfigError(f"comparison {list(pair)} names arm {label!r}, which the config does not define; arms: {', '.join(labels)}")
        pair = _repeated(self.pairs())
        if pair is not None:  # each of its comparisons would be reported, and counted, twice
            raise ConfigError(f"comparisons lists {list(pair)} twice; list each pair once")
        restricted = [(f"task {t.name!r}", t.budgets) for t in self.tasks] + [(f"arm {a.label!r}", a.budgets) for a in self.arms]
        for what, budgets in restricted:
            twice = _repeated(budgets)
            if twice is not None:  # a task's: each of its arms ran, reported and was compared there twice
                raise ConfigError(f"{what} lists budget {twice} twice; list each budget once")
            extra = sorted(set(budgets) - set(self.budgets))
            if extra:
                raise ConfigError(f"{what} runs at budget {extra[0]!r}, which is not among the run's budgets {list(self.budgets)}")
        for arm in self.arms:
            _check_arm(arm, self.arm_budgets(arm), self.adapters)
        for journal in self.reuse:
            if not Path(journal).is_file():
                raise ConfigError(f"reuse names {journal}, which is not a file; list the results.jsonl of an earlier run")
            if not _journal_like(Path(journal)):
                raise ConfigError(
                    f"reuse names {journal}, whose first line is not a result (a JSON object with a 'key'); list the "
                    "results.jsonl of an earlier run"
                )


def template_task(kind: str) -> str:
    """The ``data.tasks`` task whose templates answer task ``kind`` draws on (multi-key: the needle's)."""
    return "needle" if kind == "multikey" else kind


def journal_row(line: str) -> dict | None:
    """The result a results-journal line holds (a JSON object with a ``key``), else None (a torn line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("key"), str) else None


def _journal_like(path: Path, lines: int = 5) -> bool:
    """Whether ``path`` starts as a results journal does: empty, or a JSON object with a ``key`` among its first
    ``lines`` lines (a torn line a killed run left may come first; ``results.json``, the report's record, is one
    object over many lines)."""
    try:
        with path.open() as f:
            head = [line for _, line in zip(range(lines), f) if line.strip()]
    except (OSError, UnicodeDecodeError):
        return False
    return not head or any(journal_row(line) is not None for line in head)


# ---------------------------------------------------------------------- parsing helpers
def _list(value: Any, what: str) -> list:
    if isinstance(value, (str, int, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what} must be a list, got {value!r}")
    return list(value)


def _repeated(items: Sequence[Any]) -> Any | None:
    """The first item of ``items`` listed again later, or None where each is listed once."""
    return next((x for i, x in enumerate(items) if x in items[i + 1:]), None)


def _whole(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool: YAML's ``true`` is no count) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _pair(entry: Any) -> tuple[str, ...]:
    """A comparison: a list of two arm labels (``validate`` checks that they name two different arms)."""
    if not isinstance(entry, (list, tuple)):
        raise ConfigError(f"comparison {entry!r} must be a pair of arm labels such as [trimkv, snapkv] (or comparisons: auto)")
    return tuple(str(label) for label in entry)


def _apply_quick(raw: dict, quick: Any) -> dict:
    """``raw`` with the ``quick`` section merged over it (``kvgates.config.merge``): its keys replace the config's
    (``output_dir`` by default the config's with ``-quick``), except ``arms``, which keeps the arms it labels (and
    the comparisons between them, unless the section sets ``comparisons``), and ``tasks``, which keeps the tasks it
    names (a list) or changes each one it names (a mapping of names to settings; a name the config lacks adds a
    task when its settings give a ``task``)."""
    if not isinstance(quick, dict):
        raise ConfigError("--quick needs a 'quick' section in the config (the keys it changes: budgets, arms, tasks, output_dir ...)")
    refuse_unknown(quick, [f.name for f in dataclasses.fields(ABConfig) if f.init], "the quick section")
    changes = {"output_dir": f"{raw.get('output_dir', ABConfig.output_dir)}-quick", **quick}
    if "arms" in quick:
        keep = set(_list(quick["arms"], "quick.arms"))
        entries = _list(raw.get("arms", []), "arms")
        arms = [_arm(e) for e in entries]
        missing = keep - {a.label for a in arms} - {"full"}
        if missing:
            raise ConfigError(f"the quick section keeps arm {sorted(missing)[0]!r}, which the config does not define")
        changes["arms"] = [e for e, a in zip(entries, arms) if a.label in keep]
        if isinstance(raw.get("comparisons"), list) and "comparisons" not in quick:  # pairs naming a dropped arm go with it
            changes["comparisons"] = [p for p in raw["comparisons"] if set(_list(p, "comparison")) <= keep | {"full"}]
    if "tasks" in quick:
        tasks = {_task(e).name: e if isinstance(e, dict) else {"task": e} for e in _list(raw.get("tasks", []), "tasks")}
        wanted = quick["tasks"] if isinstance(quick["tasks"], dict) else dict.fromkeys(_list(quick["tasks"], "quick.tasks"), {})
        for name, settings in wanted.items():
            if name not in tasks and "task" not in (settings or {}):
                raise ConfigError(f"the quick section names task {name!r}, which the config does not define; tasks: {', '.join(tasks)}")
        changes["tasks"] = [merge(tasks.get(name, {"name": name}), settings or {}) for name, settings in wanted.items()]
    return merge(raw, changes)


def _arm(entry: Any) -> ArmSpec:
    if isinstance(entry, str):
        entry = {"policy": entry}
    if not isinstance(entry, dict) or "policy" not in entry:
        raise ConfigError(f"arm {entry!r} must be a policy name or a mapping with a 'policy' key")
    refuse_unknown(entry, ["policy", "params", "gates", "label", "budgets"], f"arm {entry['policy']!r}")
    policy, params, gates = entry["policy"], entry.get("params") or {}, entry.get("gates")
    if not isinstance(params, dict):
        raise ConfigError(f"arm {policy!r}: params must be a mapping of the policy's parameters such as {{window: 16}}, got {params!r}")
    params = dict(params)
    if policy not in kvgates.POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; available policies: {', '.join(sorted(kvgates.POLICIES))}")
    if "budget" in params:
        raise ConfigError(f"arm {policy!r} sets a budget in its params; budgets come from the run's 'budgets' list")
    try:
        inner = learned_params(policy, params)  # a wrapper's base_params
    except ValueError:
        inner = {}  # malformed base_params: the policy says so when the arm is built (``_check_arm``)
    if "gates" in inner:  # the arm's own 'gates' would replace them
        raise ConfigError(f"arm {policy!r} names gates in its params; name the adapter in the arm's 'gates' key instead")
    label = entry.get("label")
    if label is None:
        extra = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        label = policy + (f"[{extra}]" if extra else "") + (" (untrained)" if gates == UNTRAINED else "")
    if not str(label).strip():
        raise ConfigError(f"arm {policy!r}: label must name the arm in the report, got {label!r}")
    if str(label) == "full" and policy != "full":
        raise ConfigError(f"arm {policy!r} is labelled 'full', the full cache's label (every run's reference arm); give it another label")
    if policy == "full" and str(label) != "full":  # it would run the reference's every example a second time
        raise ConfigError(f"arm {str(label)!r} is the full cache, which every run has as its reference arm 'full'; remove it")
    budgets = tuple(_list(entry.get("budgets", []), f"arm {label!r}: budgets"))
    if gates is not None:  # "~/g" is the home folder's, as kvgates.load_gates reads it (a shipped name or Hub id never begins with "~")
        gates = os.path.expanduser(str(gates))
    return ArmSpec(str(label), policy, params, gates, budgets)


def _task(entry: Any) -> TaskSpec:
    if isinstance(entry, str):
        entry = {"task": entry}
    if not isinstance(entry, dict) or "task" not in entry:
        raise ConfigError(f"task {entry!r} must be a task name or a mapping with a 'task' key")
    kind = entry["task"]
    if kind not in TASK_KINDS:
        raise ConfigError(f"unknown task {kind!r}; tasks: {', '.join(TASK_KINDS)}")
    options = ANSWER_OPTIONS.get(kind) or REFERENCE_OPTIONS[kind]
    answer = kind in ANSWER_KINDS
    refuse_unknown(entry, list(COMMON_TASK_KEYS) + (list(ANSWER_KEYS) if answer else []) + list(options), f"task {entry.get('name', kind)!r}")
    name = str(entry.get("name", kind))
    if not name.strip() or any(c in name for c in "/\\\0"):  # it names plot files (heatmap_<name>.png)
        raise ConfigError(f"task name {name!r} must be non-empty and hold no '/' or '\\': it names the report's plot files")
    lengths = tuple(_list(entry.get("context_tokens", 2000), f"task {name!r}: context_tokens"))
    if not lengths:
        raise ConfigError(f"task {name!r}: context_tokens is empty; list at least one prompt length")
    for n in lengths:
        if not _whole(n, 64):
            raise ConfigError(f"task {name!r}: context_tokens must be whole numbers of at least 64 tokens, got {n!r}")
    twice = _repeated(lengths)
    if twice is not None:  # its examples would be built twice and paired twice, as if they were independent
        raise ConfigError(f"task {name!r}: context_tokens lists {twice} twice; list each prompt length once")
    examples = entry.get("examples", 10)
    if not _whole(examples, 1):
        raise ConfigError(f"task {name!r}: examples must be a positive integer, got {examples!r}")
    opts = {k: entry[k] for k in options if k in entry}
    for k, v in opts.items():
        if not _whole(v, 1):
            raise ConfigError(f"task {name!r}: {k} must be a positive integer, got {v!r}")
    names: tuple[str, ...] = ()
    if answer:
        base = template_task(kind)
        usable = [t for s in ("train", "eval") for t in templates(base, s) if kind != "multikey" or "{key}" in t.statement]
        default = [t.name for t in usable if t.set == "eval"]
        names = tuple(_list(entry.get("templates", default), f"task {name!r}: templates"))
        if not names:
            raise ConfigError(f"task {name!r}: templates is empty; list template names or leave it out for the eval set's")
        for t in names:
            if t not in {u.name for u in usable}:
                raise ConfigError(f"task {name!r} has no template {t!r}; its templates: {', '.join(sorted(u.name for u in usable))}")
        try:  # what its examples draw (multikey's keys, common words' top and distinct), by the templates' sets
            check_options(kind, opts, tuple(sorted({u.set for u in usable if u.name in names})))
        except ValueError as err:
            raise ConfigError(f"task {name!r}: {err}") from None
    max_new = entry.get("max_new_tokens", 24 if kind in ("multivalue", "variable_tracking", "common_words") else 12) if answer else 0
    if answer and not _whole(max_new, 1):
        raise ConfigError(f"task {name!r}: max_new_tokens must be a positive integer, got {max_new!r}")
    budgets = tuple(_list(entry.get("budgets", []), f"task {name!r}: budgets"))
    return TaskSpec(name, kind, lengths, examples, names, max_new, opts, budgets)


def _check_arm(arm: ArmSpec, budgets: tuple[int | None, ...], adapters: dict[str, kvgates.GateSet]) -> None:
    """Build the arm's policy at every budget (learned arms with their adapter, read into ``adapters``) to surface
    bad parameters."""
    if arm.learned and arm.gates is None:
        raise ConfigError(
            f"arm {arm.label!r}: {arm.learned_policy.name} is learned and needs 'gates' (an adapter folder, a Hub id or 'untrained')"
        )
    if not arm.learned and arm.gates is not None:
        raise ConfigError(f"arm {arm.label!r}: {arm.policy} is not a learned policy and takes no gates")
    if arm.gates == UNTRAINED:
        return  # built for the model in eval.arms.prepare_arms, where its parameters are checked too
    check_budgets(arm, budgets, load_adapter(arm, adapters) if arm.learned else None)
