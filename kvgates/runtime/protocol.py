"""What the runtime asks of a policy (``CachePolicy``, ``Schedule``) and the registry that builds policies by name.

The runtime depends on no policy: ``kvgates.policies`` registers its classes here (``register_policy``), and
``BudgetCache(config, "snapkv", budget=256)`` builds one through ``make_policy``. A policy class is any dataclass
with a ``name`` that implements ``CachePolicy``; ``kvgates.policies.base.Policy`` is the base they share.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kvgates.typecheck import as_int, field_problems, plain_scalar, scalar_fields

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvgates.runtime.layer import BudgetLayer
    from kvgates.runtime.state import SlotState
    from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


@dataclass(frozen=True)
class Schedule:
    """When a policy evicts.

    Attributes:
        prefill: at the end of every prompt chunk.
        decode_every: every this many decode steps, and at every decode call of several tokens (a new turn of a
            conversation), as at a prompt chunk (0: decode appends).
        tolerance: a sequence is evicted only once one of its heads holds more than its quota plus this many
            tokens, and then back to the quota (amortised eviction: TRIM-KV's buffer).
    """

    prefill: bool = True
    decode_every: int = 0
    tolerance: int = 0

    def __post_init__(self) -> None:
        """``ValueError`` for a schedule no runtime path reads alike: ``decode_every`` -1 counted as evicting while
        decoding in some places and never evicted in others, and a negative ``tolerance`` left a static layer fewer
        slots than its quota."""
        if not isinstance(self.prefill, bool):
            raise ValueError(f"Schedule: prefill must be True or False, got {self.prefill!r}")
        for name in ("decode_every", "tolerance"):
            given = getattr(self, name)
            value = as_int(given)
            if value is None or value < 0:
                raise ValueError(f"Schedule: {name} must be a whole number >= 0, got {given!r}")
            if value is not given:  # a numpy integer or a 0-d tensor (a policy's field), as the int it holds
                object.__setattr__(self, name, value)

    @property
    def slack(self) -> int:
        """Free slots a head keeps after an eviction: the tokens that arrive before the next one."""
        return max(self.decode_every, 1) + self.tolerance


NEVER = Schedule(prefill=False)
PROMPT = Schedule(prefill=True)
EVERY_STEP = Schedule(prefill=True, decode_every=1)


@runtime_checkable
class CachePolicy(Protocol):
    """The hooks ``BudgetLayer`` calls (documented on ``kvgates.policies.base.Policy``)."""

    name: ClassVar[str]
    ragged_heads: ClassVar[bool]
    decode_stats_for_eviction_only: ClassVar[bool]
    state_type: ClassVar[type | None]
    sync_free_decode: bool
    exact_quota: bool
    cross_layer: bool
    prompt_only: bool
    schedule: Schedule

    def stats_request(self, phase: Phase) -> StatsRequest: ...

    def slot_state(self) -> dict[str, SlotState]: ...

    def colmax_weights(self, layer: BudgetLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...

    def observe(self, layer: BudgetLayer, stats: AttnStats) -> None: ...

    def quota(self, layer: BudgetLayer, stats: AttnStats | None) -> int | torch.Tensor: ...

    def quota_range(self, layer: BudgetLayer, quota: torch.Tensor) -> tuple[list[int], list[int]] | None: ...

    def select(self, layer: BudgetLayer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor: ...

    def select_layers(self, layers: list[BudgetLayer]) -> list[torch.Tensor]: ...

    def after_layer(self, layer: BudgetLayer, stats: AttnStats) -> None: ...

    def position_shift(self, layer: BudgetLayer, q_pos: torch.Tensor) -> Any: ...

    def cache_copied(self, cache: Any, twin: Any) -> None: ...

    def cache_batch_selected(self, cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


POLICIES: dict[str, type] = {}

#: The package whose import registers the built-in policies. ``import kvgates`` imports nothing eagerly, so
#: ``make_policy`` imports it, by name, when a name is not registered yet: ``BudgetCache(config, "snapkv", ...)``
#: then works however the runtime was imported, while no runtime module imports a policy module.
BUILTIN_POLICIES = "kvgates.policies"


def register_policy(cls: type) -> type:
    """Class decorator: make a policy constructible by its ``name`` (configs, CLI, ``make_policy``)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered")
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered by {POLICIES[cls.name].__name__}")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, /, **params: Any) -> CachePolicy:
    """Build a registered policy by name, e.g. ``make_policy("snapkv", budget=256, window=16)``; an unknown
    parameter or a value of the wrong type for its field (``window="eight"``) is a ``ValueError``. A numpy scalar, or
    a 0-d array or tensor, given for a number or a flag is the Python value it holds (``budget=np.int64(64)``)."""
    if name not in POLICIES:
        importlib.import_module(BUILTIN_POLICIES)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available policies: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"policy {name!r} is registered by {cls.__name__}, which is no dataclass; decorate it with @dataclass")
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter {', '.join(unknown)}; its parameters are: {', '.join(sorted(allowed))}"
        )
    scalars = scalar_fields(cls)
    params = {key: plain_scalar(value) if key in scalars else value for key, value in params.items()}
    wrong = field_problems(cls, params)
    if wrong:
        raise ValueError(f"policy {name!r}: {'; '.join(wrong)}")
    return cls(**params)
