"""A/B run configs (YAML): the model, the arms, the budgets, the tasks and the comparisons, validated as a whole.

    model: smollm2-135m
    seed: 0
    split: test                  # the essays the tasks are built from; `validation` while developing a recipe
    budgets: [128, 256, 512]
    arms:
      - snapkv                                              # a registered policy with its defaults
      - {policy: adakv, params: {base: snapkv}}             # parameters
      - {policy: trimkv, gates: untrained}                  # freshly initialised gates, labelled "(untrained)"
      - {policy: trimkv, gates: checkpoints/run/adapter, label: trimkv}    # an adapter folder or a Hub id
      - {policy: trimkv, gates: smollm2-135m-trimkv}        # or the name of an adapter shipped in the package
      - {policy: h2o, budgets: [128, 640], label: h2o-640}  # some of the run's budgets only
    tasks:
      - {task: needle, context_tokens: [2000, 4000], examples: 10}       # lengths x evenly spaced depths
      - {task: multikey, context_tokens: 2000, examples: 10, keys: 4}
      - {task: fidelity, context_tokens: 2000, examples: 8, new_tokens: 512, budgets: [128, 256]}   # some budgets only
    comparisons: auto            # each learned arm vs each heuristic at the same budget; or [[a, b], ...] labels
    reuse: [docs/reference-core/results.jsonl]   # other runs' journals: results with this run's keys are not recomputed
    quick: {budgets: [128], arms: [snapkv], tasks: {needle: {examples: 3}}}    # what --quick changes
    output_dir: outputs/ab

The full cache is always an arm (label ``full``): it is the reference of every task. ``ABConfig.load`` checks
everything that can be checked without the model (keys, policy names and parameters, budgets, tasks and their
options, adapters: present, readable and of the policy's kind) and raises ``ConfigError`` with one sentence;
``eval.runner.prepare_arms`` checks the rest once the model is loaded (adapters made for another model) before
any example runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open

import kvgates
from data.tasks import templates
from kvgates.errors import AdapterError
from kvgates.gates.embedded import embedded_adapter_dir, embedded_adapters
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.wrappers import learned_policy, with_gates

#: Gates of an arm built fresh for the model (``gates: untrained``), as the training issue initialises them.
UNTRAINED = "untrained"
UNTRAINED_GATES = {"gate_hidden": 64, "init_bias": 8.0}
#: Essay splits an A/B run may use; the training essays are never evaluated on.
EVAL_SPLITS = ("test", "validation")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ConfigError(ValueError):
    """A config that cannot run; the message is one sentence saying what is wrong."""


#: Options each task kind accepts besides the common keys (see ``data.tasks.make_example``).
ANSWER_OPTIONS = {
    "needle": ("digits",),
    "multikey": ("digits", "keys"),
    "multivalue": ("digits", "values"),
    "kv": ("pairs",),
    "variable_tracking": ("digits", "hops"),
    "passkey": ("digits",),
    "common_words": ("top", "distinct"),
}
ANSWER_KINDS = tuple(ANSWER_OPTIONS)  # data.tasks.TASKS and multikey (a test keeps them in step)
#: Tasks scored against the full cache's own output rather than a known answer.
REFERENCE_OPTIONS = {"fidelity": ("new_tokens",), "generation": ("new_tokens",), "perplexity": ("chunk",)}
TASK_KINDS = ANSWER_KINDS + tuple(REFERENCE_OPTIONS)
COMMON_TASK_KEYS = ("name", "task", "context_tokens", "examples", "budgets")
ANSWER_KEYS = ("templates", "max_new_tokens")
TASK_DEFAULTS = {"new_tokens": 128, "chunk": 64}


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


@lru_cache(maxsize=32)
def _weights_digest(path: str, mtime_ns: int, inode: int) -> str:
    """Digest of the tensors of a safetensors file: names, dtypes, shapes and values, not the file's bytes, so an
    adapter saved again with another card or header order (``train.ship --ab``, a safetensors upgrade) keeps its
    journal keys. Cached per path, modification time and inode: journal keys ask for it often."""
    h = hashlib.sha256()
    with safe_open(path, framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous().reshape(-1)
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ArmSpec:
    """One arm: a policy with fixed parameters and, for learned policies, its gates.

    Attributes:
        label: unique name in the report.
        policy: registered policy name.
        params: policy parameters (the budget comes from the run's budgets).
        gates: learned arms only: an adapter folder, a Hub id, or ``"untrained"``. An arm is learned when its
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

    def identity(self) -> str:
        """What changes this arm's results (journal keys); adapters by the digest of their weights file."""
        gates = self.gates
        shipped = embedded_adapter_dir(gates) if gates and gates != UNTRAINED else None
        gates = str(shipped) if shipped is not None else gates
        if gates and gates != UNTRAINED and Path(gates).is_dir():
            weights = Path(gates) / "model.safetensors"
            gates = _weights_digest(str(weights), weights.stat().st_mtime_ns, weights.stat().st_ino) if weights.is_file() else gates
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

    def identity(self, model: str, seed: int, prefill_chunk: int | None, split: str = "test") -> str:
        """What changes this task's examples or results (journal keys): not the budgets it runs at, nor, for text
        tasks (whose example ``i`` is seeded by ``i`` alone), how many examples it has, so adding examples keeps
        the results of the first ones. The split enters the key only when it is not the default, so journals of
        test runs keep their keys."""
        ignored = {"budgets"} if self.answer else {"budgets", "examples"}
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}
        return _digest([model, seed, prefill_chunk, settings] + ([split] if split != "test" else []))


@dataclass(frozen=True)
class ABConfig:
    """A validated A/B run (see the module docstring for the YAML)."""

    model: str = "smollm2-135m"
    seed: int = 0
    #: The essay split the tasks are built from: ``test`` (reports) or ``validation`` (recipe development).
    split: str = "test"
    budgets: tuple[int, ...] = (128,)
    arms: tuple[ArmSpec, ...] = ()
    tasks: tuple[TaskSpec, ...] = ()
    #: Pairs of arm labels; ``None``: each learned arm against each heuristic (at every budget, on every task).
    comparisons: tuple[tuple[str, str], ...] | None = None
    output_dir: str = "outputs/ab"
    #: Prompt prefill in chunks of this many tokens (eviction after each), or whole.
    prefill_chunk: int | None = None
    #: Examples of one prompt length run as a padded batch of at most ``max_batch`` rows and ``batch_tokens`` tokens.
    batch_tokens: int = 16384
    max_batch: int = 8
    #: Bootstrap resamples per comparison.
    n_boot: int = 2000
    #: Journals (``results.jsonl``) of other runs: a result whose key this run has (same task settings, example,
    #: arm and adapter weights, budget, model, seed) is taken from there instead of being computed again.
    reuse: tuple[str, ...] = ()

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
    def load(cls, path: str | Path, quick: bool = False, output_dir: str | None = None) -> ABConfig:
        """Read and validate ``path``; ``quick`` applies its ``quick`` section, ``output_dir`` overrides."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML ({str(err).splitlines()[0]})") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of settings at the top level")
        try:
            return cls.from_dict(raw, quick=quick, output_dir=output_dir)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], quick: bool = False, output_dir: str | None = None) -> ABConfig:
        raw = dict(raw)
        quick_section = raw.pop("quick", None)
        _known(raw, [f.name for f in dataclasses.fields(cls)], "the config")
        if quick:
            raw = _apply_quick(raw, quick_section)
        if output_dir:
            raw["output_dir"] = output_dir
        arms = tuple(_arm(entry) for entry in _list(raw.get("arms", []), "arms"))
        tasks = tuple(_task(entry) for entry in _list(raw.get("tasks", []), "tasks"))
        budgets = tuple(_list(raw.get("budgets", list(cls.budgets)), "budgets"))
        comparisons = raw.get("comparisons", "auto")
        config = cls(
            **{k: v for k, v in raw.items() if k not in ("arms", "tasks", "budgets", "comparisons", "reuse")},
            reuse=tuple(str(p) for p in _list(raw.get("reuse", []), "reuse")),
            arms=arms,
            tasks=tasks,
            budgets=budgets,
            comparisons=None if comparisons == "auto" else tuple(tuple(p) for p in _list(comparisons, "comparisons")),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Everything checkable without the model; raises ``ConfigError``."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must name a model (smollm2-135m, a Hub id or a local folder)")
        for name in ("seed", "batch_tokens", "max_batch", "n_boot"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "seed" else 1):
                raise ConfigError(f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} integer, got {value!r}")
        if self.split not in EVAL_SPLITS:
            raise ConfigError(f"split must be one of {', '.join(EVAL_SPLITS)} (never the training essays), got {self.split!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ConfigError(f"prefill_chunk must be a positive number of tokens or null, got {self.prefill_chunk!r}")
        if not self.budgets:
            raise ConfigError("budgets is empty; list at least one budget in tokens per KV head")
        for budget in self.budgets:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise ConfigError(f"budget {budget!r} is not a whole number of tokens of at least 1; budgets count tokens per KV head")
        if not self.tasks:
            raise ConfigError("the config lists no tasks")
        labels = [a.label for a in self.all_arms]
        for label in {x for x in labels if labels.count(x) > 1}:
            raise ConfigError(f"two arms are labelled {label!r}; give one of them another label")
        names = [t.name for t in self.tasks]
        for name in {x for x in names if names.count(x) > 1}:
            raise ConfigError(f"two tasks are named {name!r}; give one of them another name")
        for pair in self.pairs():
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ConfigError(f"comparison {list(pair)} must name two different arms")
            for label in pair:
                if label not in labels:
                    raise ConfigError(f"comparison {list(pair)} names arm {label!r}, which the config does not define; arms: {', '.join(labels)}")
        restricted = [(f"task {t.name!r}", t.budgets) for t in self.tasks] + [(f"arm {a.label!r}", a.budgets) for a in self.arms]
        for what, budgets in restricted:
            extra = sorted(set(budgets) - set(self.budgets))
            if extra:
                raise ConfigError(f"{what} runs at budget {extra[0]!r}, which is not among the run's budgets {list(self.budgets)}")
        for arm in self.arms:
            _check_arm(arm, self.arm_budgets(arm))
        for journal in self.reuse:
            if not Path(journal).is_file():
                raise ConfigError(f"reuse names {journal}, which is not a file; list the results.jsonl of an earlier run")


# ---------------------------------------------------------------------- parsing helpers
def _known(raw: dict, allowed, where: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        keys = f"key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        raise ConfigError(f"{where} has unknown {keys}; known keys: {', '.join(allowed)}")


def _list(value: Any, what: str) -> list:
    if isinstance(value, (str, int, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what} must be a list, got {value!r}")
    return list(value)


def _apply_quick(raw: dict, quick: Any) -> dict:
    """``raw`` with the ``quick`` section applied: budgets/output_dir replaced, arms kept by label (with the
    comparisons between kept arms), tasks kept by name (when ``tasks`` lists names) or overridden per name (when
    it maps names to settings; a name the config lacks adds a task when its settings give a ``task``)."""
    if not isinstance(quick, dict):
        raise ConfigError("--quick needs a 'quick' section in the config (budgets, arms, tasks, output_dir to change)")
    _known(quick, ["budgets", "arms", "tasks", "output_dir"], "the quick section")
    raw = dict(raw)
    raw["output_dir"] = quick.get("output_dir", f"{raw.get('output_dir', ABConfig.output_dir)}-quick")
    if "budgets" in quick:
        raw["budgets"] = quick["budgets"]
    if "arms" in quick:
        keep = set(_list(quick["arms"], "quick.arms"))
        arms = [_arm(e) for e in _list(raw.get("arms", []), "arms")]
        missing = keep - {a.label for a in arms} - {"full"}
        if missing:
            raise ConfigError(f"the quick section keeps arm {sorted(missing)[0]!r}, which the config does not define")
        raw["arms"] = [e for e, a in zip(raw["arms"], arms) if a.label in keep]
        if isinstance(raw.get("comparisons"), list):  # pairs naming a dropped arm go with it
            raw["comparisons"] = [p for p in raw["comparisons"] if set(_list(p, "comparison")) <= keep | {"full"}]
    if "tasks" in quick:
        tasks = {_task(e).name: e for e in _list(raw.get("tasks", []), "tasks")}
        wanted = quick["tasks"] if isinstance(quick["tasks"], dict) else dict.fromkeys(_list(quick["tasks"], "quick.tasks"), {})
        for name, settings in wanted.items():
            if name not in tasks and "task" not in (settings or {}):
                raise ConfigError(f"the quick section names task {name!r}, which the config does not define; tasks: {', '.join(tasks)}")
            tasks.setdefault(name, {"name": name})
        raw["tasks"] = [{**(tasks[n] if isinstance(tasks[n], dict) else {"task": tasks[n]}), **(o or {})} for n, o in wanted.items()]
    return raw


def _arm(entry: Any) -> ArmSpec:
    if isinstance(entry, str):
        entry = {"policy": entry}
    if not isinstance(entry, dict) or "policy" not in entry:
        raise ConfigError(f"arm {entry!r} must be a policy name or a mapping with a 'policy' key")
    _known(entry, ["policy", "params", "gates", "label", "budgets"], f"arm {entry['policy']!r}")
    policy, params, gates = entry["policy"], dict(entry.get("params") or {}), entry.get("gates")
    if policy not in kvgates.POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; available policies: {', '.join(sorted(kvgates.POLICIES))}")
    if "budget" in params:
        raise ConfigError(f"arm {policy!r} sets a budget in its params; budgets come from the run's 'budgets' list")
    label = entry.get("label")
    if label is None:
        extra = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        label = policy + (f"[{extra}]" if extra else "") + (" (untrained)" if gates == UNTRAINED else "")
    budgets = tuple(_list(entry.get("budgets", []), f"arm {label!r}: budgets"))
    return ArmSpec(str(label), policy, params, None if gates is None else str(gates), budgets)


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
    _known(entry, list(COMMON_TASK_KEYS) + (list(ANSWER_KEYS) if answer else []) + list(options), f"task {entry.get('name', kind)!r}")
    name = str(entry.get("name", kind))
    lengths = tuple(_list(entry.get("context_tokens", 2000), f"task {name!r}: context_tokens"))
    for n in lengths:
        if not isinstance(n, int) or n < 64:
            raise ConfigError(f"task {name!r}: context_tokens must be whole numbers of at least 64 tokens, got {n!r}")
    examples = entry.get("examples", 10)
    if not isinstance(examples, int) or examples < 1:
        raise ConfigError(f"task {name!r}: examples must be a positive integer, got {examples!r}")
    opts = {k: entry[k] for k in options if k in entry}
    for k, v in opts.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"task {name!r}: {k} must be a positive integer, got {v!r}")
    names: tuple[str, ...] = ()
    if answer:
        base = "needle" if kind == "multikey" else kind
        usable = [t for s in ("train", "eval") for t in templates(base, s) if kind != "multikey" or "{key}" in t.statement]
        default = [t.name for t in usable if t.set == "eval"]
        names = tuple(_list(entry.get("templates", default), f"task {name!r}: templates"))
        for t in names:
            if t not in {u.name for u in usable}:
                raise ConfigError(f"task {name!r} has no template {t!r}; its templates: {', '.join(sorted(u.name for u in usable))}")
    max_new = entry.get("max_new_tokens", 24 if kind in ("multivalue", "variable_tracking", "common_words") else 12) if answer else 0
    if answer and (not isinstance(max_new, int) or max_new < 1):
        raise ConfigError(f"task {name!r}: max_new_tokens must be a positive integer, got {max_new!r}")
    budgets = tuple(_list(entry.get("budgets", []), f"task {name!r}: budgets"))
    return TaskSpec(name, kind, lengths, examples, names, max_new, opts, budgets)


def _check_arm(arm: ArmSpec, budgets: tuple[int | None, ...]) -> None:
    """Build the arm's policy at every budget (learned arms with their adapter) to surface bad parameters."""
    if arm.learned and arm.gates is None:
        raise ConfigError(
            f"arm {arm.label!r}: {arm.learned_policy.name} is learned and needs 'gates' (an adapter folder, a Hub id or 'untrained')"
        )
    if not arm.learned and arm.gates is not None:
        raise ConfigError(f"arm {arm.label!r}: {arm.policy} is not a learned policy and takes no gates")
    gates = None
    if arm.learned:
        if arm.gates == UNTRAINED:
            return  # built for the model in eval.runner.prepare_arms, where its parameters are checked too
        gates = load_adapter(arm.gates, arm.label)
    for budget in budgets:
        try:
            build_policy(arm, budget, gates)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"arm {arm.label!r} at budget {budget}: {err}") from None


def load_adapter(path_or_id: str, label: str) -> kvgates.GateSet:
    """The adapter an arm names (a folder, a shipped adapter's name, else a Hub id), or ``ConfigError`` saying why
    it cannot be read."""
    if not Path(path_or_id).is_dir() and embedded_adapter_dir(path_or_id) is None and not HUB_ID.fullmatch(path_or_id):
        raise ConfigError(
            f"arm {label!r}: the adapter {path_or_id} is neither an existing folder, a shipped adapter "
            f"({', '.join(embedded_adapters()) or 'none ship'}) nor a Hub id (owner/name)"
        )
    try:
        return kvgates.load_gates(path_or_id)
    except AdapterError as err:
        raise ConfigError(f"arm {label!r}: {' '.join(str(err).split())}") from None


def build_policy(arm: ArmSpec, budget: int | None, gates: kvgates.GateSet | None = None) -> kvgates.Policy:
    """The arm's policy at ``budget`` (learned arms: with ``gates``, given to the base when the policy wraps one)."""
    params = with_gates(arm.policy, arm.params, gates) if arm.learned else dict(arm.params)
    return kvgates.make_policy(arm.policy, **params) if not arm.budgeted else kvgates.make_policy(arm.policy, budget=budget, **params)
