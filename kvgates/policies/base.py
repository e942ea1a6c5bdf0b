"""The policy protocol, the name registry, and the selection helpers every policy is built from.

A policy is a small dataclass of validated parameters plus a few hooks the runtime calls per layer:

* ``stats_request(phase)``: which attention statistics the layer's attention call must produce;
* ``slot_state()``: per-slot tensors the policy keeps on each layer (initial value for new tokens);
* ``step(layer, stats)``: called after every attention call; returns a keep mask ``[B, H_kv, C]`` (or ``None``
  for no eviction). It runs ``observe`` (update state), ``decide`` (evict only in the policy's phases, every
  ``decode_interval`` decode steps, when the layer is over ``layer_budget``: then ``select``), and
  ``after_step``. Scoring policies only implement ``score`` -> ``(scores, forced)``; ``select`` keeps the
  forced slots plus the best-scoring others, which is also what wrappers (Ada-KV, merging) build on;
* ``on_forward_end(cache, phase)``: after the last layer of a forward, for policies that decide across
  layers (D2O, DynamicKV).

Policies never see the model, only layers (positions, state, keys/values) and statistics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvgates.runtime.layer import SlotState
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase, StatsRequest

if TYPE_CHECKING:
    from kvgates.runtime.cache import BudgetCache
    from kvgates.runtime.layer import BudgetLayer
    from kvgates.runtime.rope import Rotary

POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy constructible by its ``name`` (configs, CLI, ``make_policy``)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered")
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered by {POLICIES[cls.name].__name__}")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, **params: Any) -> Policy:
    """Build a registered policy by name, e.g. ``make_policy("snapkv", budget=256, window=16)``."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available policies: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter {', '.join(unknown)}; its parameters are: {', '.join(sorted(allowed))}"
        )
    return cls(**params)


@dataclass
class Policy:
    """Base class of eviction policies. ``budget`` is the number of tokens each KV head of a layer may hold."""

    name: ClassVar[str] = ""
    #: Phases in which the default ``step`` evicts when a layer holds more than its budget.
    evicts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.PREFILL})
    #: Whether KV heads of one layer may get different storage capacities (head-wise budgets).
    ragged_heads: ClassVar[bool] = False

    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)):
            raise ValueError(f"{self.name}: budget must be an integer number of tokens, got {self.budget!r}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"{self.name}: budget must be at least 1 token per head, got {self.budget}")

    # -- helpers for subclasses' validation
    def _require_budget(self, reserved: int = 0, what: str = "") -> int:
        """The budget, checked to leave room beyond ``reserved`` always-kept tokens (sinks, windows)."""
        if self.budget is None:
            raise ValueError(f"{self.name}: a budget is required (tokens per KV head per layer)")
        if self.budget <= reserved:
            raise ValueError(
                f"{self.name}: budget {self.budget} must be larger than {what or f'the {reserved} always-kept tokens'}; "
                "raise the budget or shrink what is always kept"
            )
        return self.budget

    def _at_least(self, minimum: float, *names: str) -> None:
        """Each named parameter must be at least ``minimum``."""
        for field_name in names:
            value = getattr(self, field_name)
            if value < minimum:
                raise ValueError(f"{self.name}: {field_name} must be >= {minimum}, got {value!r}")

    def _one_of(self, field_name: str, choices: tuple[str, ...]) -> None:
        """The named parameter must be one of ``choices``."""
        value = getattr(self, field_name)
        if value not in choices:
            raise ValueError(f"{self.name}: {field_name} must be one of {choices}, got {value!r}")

    def _observation_window(self) -> None:
        """Checks shared by window-scored policies: ``window``, ``kernel`` (odd) and ``pooling``."""
        self._at_least(1, "window")
        self._require_budget(self.window, f"the observation window ({self.window})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: pooling kernel must be a positive odd number, got {self.kernel}")
        self._one_of("pooling", ("max", "avg"))

    # -- runtime hooks
    def attach(self, model: Any) -> Policy:
        """Prepare to run on ``model`` (learned policies hook their gate inputs here); heuristics need nothing."""
        return self

    def detach(self) -> None:
        """Undo ``attach`` (remove hooks from the model)."""

    def stats_request(self, phase: Phase) -> StatsRequest:
        """Statistics this policy needs from the attention call in ``phase``."""
        return NO_STATS

    def position_shift(self, layer: BudgetLayer, q_pos: torch.Tensor) -> tuple[Rotary, torch.Tensor, torch.Tensor] | None:
        """For policies that attend at shifted positions (StreamingLLM's re-rotation):
        ``(rotary, key_delta [B, H_kv, C], query_delta [B, q])``; ``None`` keeps the original positions."""
        return None

    def slot_state(self) -> dict[str, SlotState]:
        """Per-slot state tensors to keep on every layer."""
        return {}

    @property
    def decode_interval(self) -> int:
        """Decode steps between evictions (1 = every step)."""
        return 1

    @property
    def decode_slack(self) -> int:
        """Free slots a layer keeps after an eviction: tokens that arrive before the next one."""
        return self.decode_interval

    def layer_budget(self, layer: BudgetLayer, stats: AttnStats) -> int | torch.Tensor:
        """Tokens each KV head of ``layer`` may hold after this step: an int, or ``[B, 1]`` per sequence."""
        assert self.budget is not None
        return self.budget

    def observe(self, layer: BudgetLayer, stats: AttnStats) -> None:
        """Update per-slot state from this call's statistics (before any eviction)."""

    def score(self, layer: BudgetLayer, stats: AttnStats) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [B, H_kv, C], forced [B, H_kv, C])``: higher scores are kept first; forced slots always are.

        Scoring policies implement this; wrappers (head-wise budgets, merging) build on it.
        """
        raise NotImplementedError(f"{self.name} does not expose per-slot scores")

    def select(self, layer: BudgetLayer, stats: AttnStats, budget: int | torch.Tensor) -> torch.Tensor:
        """Keep mask ``[B, H_kv, C]``: the forced slots plus the best-scoring others, ``budget`` per head."""
        scores, forced = self.score(layer, stats)
        return keep_forced_and_top(layer, scores, budget, forced)

    def due(self, layer: BudgetLayer, stats: AttnStats) -> bool:
        """Whether this step may evict: a phase the policy evicts in, and every ``decode_interval`` decode steps."""
        if stats.phase not in self.evicts_in:
            return False
        if stats.phase is Phase.DECODE and self.decode_interval > 1:
            count = layer.scratch.get("decode_steps", 0) + 1
            layer.scratch["decode_steps"] = count
            return count % self.decode_interval == 0
        return True

    def decide(self, layer: BudgetLayer, stats: AttnStats) -> torch.Tensor | None:
        """Keep mask if this step evicts (``due`` and the layer is over budget), else ``None``."""
        if not self.due(layer, stats):
            return None
        budget = record_budget(layer, self.layer_budget(layer, stats))
        if bool((layer.held() <= budget).all()):
            return None
        return self.select(layer, stats, budget)

    def after_step(self, layer: BudgetLayer, stats: AttnStats, keep: torch.Tensor | None) -> None:
        """Bookkeeping after the decision, before the eviction is applied (e.g. recording this query's row)."""

    def step(self, layer: BudgetLayer, stats: AttnStats) -> torch.Tensor | None:
        """Runtime entry after each attention call: ``observe``, ``decide``, ``after_step``."""
        self.observe(layer, stats)
        keep = self.decide(layer, stats)
        self.after_step(layer, stats, keep)
        return keep

    def on_forward_end(self, cache: BudgetCache, phase: Phase) -> None:
        """Called after the last budgeted layer of every forward (cross-layer decisions)."""


# ---------------------------------------------------------------------------------------------- selection helpers
def record_budget(layer: BudgetLayer, budget: int | torch.Tensor) -> int | torch.Tensor:
    """Note on ``layer`` the budget this step applies (per-sequence budgets as ``head_budgets``); returns it."""
    if isinstance(budget, torch.Tensor):
        layer.head_budgets = budget.expand(layer.batch_size, layer.num_kv_heads).contiguous()
        layer.budget = int(budget.max())
    else:
        layer.budget = budget
    return budget


def topk_mask(
    scores: torch.Tensor, k: int | torch.Tensor, candidates: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Mark the ``k`` highest-scoring candidate slots of every ``[B, H_kv]`` row.

    ``k`` is an int or a tensor broadcastable to ``scores.shape[:-1]`` (per-row budgets); rows with fewer
    candidates keep all of them. With ``positions``, equal scores are broken in favour of the more recent
    token, which makes decisions deterministic (pooled scores tie often); without, ties are arbitrary.
    """
    n = scores.shape[-1]
    k_t = torch.as_tensor(k, device=scores.device).expand(scores.shape[:-1]).clamp(0, n)
    kmax = int(k_t.max()) if k_t.numel() else 0
    if kmax == 0:
        return torch.zeros_like(candidates)
    s = scores.double() if not scores.is_floating_point() else scores
    if positions is not None:
        excess = candidates.sum(-1) - k_t
        if int(excess.max()) <= 1:  # the decode case: drop at most one slot per row, no sort needed
            return candidates & ~_worst_slot(s, candidates, positions, excess > 0)
    s = s.masked_fill(~candidates, float("-inf"))
    if positions is None:
        idx = s.topk(kmax, dim=-1).indices
    else:
        by_recency = torch.argsort(positions, dim=-1, descending=True, stable=True)
        ranked = torch.argsort(s.gather(-1, by_recency), dim=-1, descending=True, stable=True)[..., :kmax]
        idx = by_recency.gather(-1, ranked)
    take = torch.arange(kmax, device=scores.device) < k_t[..., None]
    return torch.zeros_like(candidates).scatter(-1, idx, take) & candidates


def _worst_slot(scores: torch.Tensor, candidates: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One-hot mask of the lowest-scoring candidate of each selected row (ties: the oldest token), i.e. what the
    full ranking of ``topk_mask`` would leave out when it keeps all candidates but one."""
    s = scores.masked_fill(~candidates, float("inf"))
    tied = candidates & (s == s.amin(-1, keepdim=True))
    oldest = positions.masked_fill(~tied, torch.iinfo(positions.dtype).max).argmin(-1, keepdim=True)
    return torch.zeros_like(candidates).scatter(-1, oldest, rows[..., None])


def recent_mask(layer: BudgetLayer, n: int) -> torch.Tensor:
    """The ``n`` most recent tokens held per head."""
    return topk_mask(layer.pos, n, layer.valid)


def sink_mask(layer: BudgetLayer, n: int) -> torch.Tensor:
    """The ``n`` oldest tokens held per head (attention sinks)."""
    return topk_mask(-layer.pos, n, layer.valid)


def keep_forced_and_top(
    layer: BudgetLayer, scores: torch.Tensor, budget: int | torch.Tensor, forced: torch.Tensor
) -> torch.Tensor:
    """Keep ``forced`` slots plus the best-scoring other valid slots (ties: more recent), up to ``budget`` per head."""
    forced = forced & layer.valid
    room = torch.as_tensor(budget, device=scores.device) - forced.sum(-1)
    return forced | topk_mask(scores, room.clamp(min=0), layer.valid & ~forced, layer.pos)
