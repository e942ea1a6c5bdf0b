"""The policy base class. The name registry (``POLICIES``, ``register_policy``, ``make_policy``) and ``Schedule``
belong to the runtime (``kvgates.runtime.protocol``, which depends on no policy) and are re-exported here.

A policy is a small dataclass of validated parameters. The runtime (``BudgetLayer.step``) asks it, per layer:

* ``stats_request(phase)``: which attention statistics the layer's attention call must produce;
* ``slot_state()``: per-slot tensors it keeps on each layer (initial value for new tokens);
* ``colmax_weights(layer)``: weights of the query rows and slots for a ``colmax`` statistic (default none);
* ``observe(layer, stats)``: update that state after each attention call;
* ``schedule``: when it evicts (prompt chunks, every k decode steps, with what tolerance);
* ``quota(layer, stats)``: how many tokens each head of each sequence may keep (default: ``budget``), and
  ``quota_range(layer, quota)`` its range per head where the policy knows it on the host (default: the layer reads it);
* ``select(layer, stats, quota)``: the keep mask of a sequence over its quota; by default the ``forced`` slots
  plus the best ``scores`` from ``score(layer, stats)``, which is all a scoring policy implements;
* ``after_layer(layer, stats)``: after each layer's own step, for decisions across layers (D2O, DynamicKV,
  global TRIM-KV), which enforce other layers through the same path;
* ``position_shift(layer, q_pos)``: attention at shifted positions (StreamingLLM's re-rotation);
* ``attach(model)`` / ``detach()``: for policies that read the model (learned gates, rotary frequencies).

Policies never see the model, only layers (positions, state, keys/values) and statistics, and never evict
themselves: the runtime applies every keep mask (``BudgetLayer.enforce``). A policy's own per-layer values live
in a typed ``LayerState`` (``state_type``, ``layer_state(layer)``). Selections are built from
``kvgates.policies.selection``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvgates.kernels.host import launch_bound
from kvgates.policies.selection import keep_forced_and_top
from kvgates.runtime.protocol import EVERY_STEP, NEVER, POLICIES, PROMPT, Schedule, make_policy, register_policy
from kvgates.runtime.stack import LayerStack, stack_groups
from kvgates.runtime.state import LayerState, SlotState
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase, StatsRequest
from kvgates.typecheck import as_int, plain_scalar, scalar_fields

if TYPE_CHECKING:
    from kvgates.runtime.layer import BudgetLayer
    from kvgates.runtime.rope import Rotary

__all__ = [
    "EVERY_STEP", "NEVER", "POLICIES", "PROMPT", "PerStepEviction", "Policy", "Schedule", "make_policy", "register_policy",
]


@dataclass
class Policy:
    """Base of eviction policies. ``budget`` is the number of tokens each KV head of a layer may hold."""

    name: ClassVar[str] = ""
    #: When the policy evicts (a property where it depends on parameters).
    schedule: ClassVar[Schedule] = PROMPT
    #: Whether KV heads of one layer may get different storage (head-wise quotas).
    ragged_heads: ClassVar[bool] = False
    #: The policy's own values on each layer, if it keeps any (``layer_state``).
    state_type: ClassVar[type[LayerState] | None] = None
    #: Whether a decode step's statistics are read only by an eviction in that step (``select``; ``observe`` and
    #: ``after_layer`` ignore them): a layer then skips them on the steps it knows evict nothing (amortised
    #: eviction between evictions), and such a step attends with sdpa.
    decode_stats_for_eviction_only: ClassVar[bool] = False
    #: Whether a single-token decode step (``observe``, ``quota``, ``select``, ``after_layer``) runs on a static
    #: layer (``layer.static``) without host syncs, data-dependent Python branches or changes of storage shapes, so
    #: that ``BudgetCache(..., static=True)`` can compile it (a property where it depends on parameters).
    sync_free_decode: ClassVar[bool] = False
    #: Whether ``select`` with ``stats=None`` reads of a layer only what a ``runtime.stack.LayerStack`` answers, and of
    #: its ``layer_state`` only tensors of its sequences and numbers every layer shares (``select_layers``).
    stackable: ClassVar[bool] = False

    budget: int | None = None

    @property
    def exact_quota(self) -> bool:
        """Whether ``select`` keeps exactly ``min(held, quota)`` tokens in every head: the base selection (forced
        slots within the quota plus the best others), which no subclass or wrapper replaces. An eviction then
        knows on the host what it leaves, and checks it on the device instead of reading it back."""
        return type(self).select is Policy.select

    def __post_init__(self) -> None:
        self._check_scalars()
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"{self.name}: budget must be at least 1 token per head, got {self.budget}")

    # -- helpers for subclasses' validation
    def _check_scalars(self) -> None:
        """Each parameter typed ``int``, ``float`` or ``bool`` (or either or None) must be one: a whole number (not a
        bool) for ``int``; any real number for ``float``; True or False for ``bool``. A numpy scalar, or a 0-d tensor or
        array, is the Python number or bool it holds. A string, a float where a whole number goes, or None failed as a
        ``TypeError`` in a comparison below, or was taken (``window=2.5``, and ``decode="no"`` as true) and failed
        later or ran otherwise than asked."""
        for field_name, (kind, takes_none) in scalar_fields(type(self)).items():
            given = getattr(self, field_name)
            if given is None and takes_none:
                continue
            value = plain_scalar(given)
            if kind is bool:
                if isinstance(value, bool):
                    setattr(self, field_name, value)
                    continue
            elif (whole := as_int(value)) is not None:
                if whole is not given:
                    setattr(self, field_name, whole)
                continue
            elif kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
                setattr(self, field_name, float(value))
                continue
            wanted = {int: "an integer", float: "a number", bool: "True or False"}[kind]
            raise ValueError(f"{self.name}: {field_name} must be {wanted}{' or None' * takes_none}, got {given!r}")

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
        """Each named parameter must be at least ``minimum`` (and finite: NaN compares as neither)."""
        for field_name in names:
            value = getattr(self, field_name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{self.name}: {field_name} must be a finite number, got {value!r}")
            if value < minimum:
                raise ValueError(f"{self.name}: {field_name} must be >= {minimum}, got {value!r}")

    def _one_of(self, field_name: str, choices: tuple[str, ...]) -> None:
        """The named parameter must be one of ``choices``."""
        value = getattr(self, field_name)
        if value not in choices:
            raise ValueError(f"{self.name}: {field_name} must be one of {choices}, got {value!r}")

    def layer_state(self, layer: BudgetLayer) -> Any:
        """This policy's own values on ``layer`` (an instance of its ``state_type``)."""
        return layer.policy_state(self)

    # -- lifecycle
    def attach(self, model: Any) -> Policy:
        """Prepare to run on ``model`` (learned policies hook their gate inputs here); most policies need nothing."""
        return self

    def detach(self) -> None:
        """Undo ``attach`` (remove hooks from the model)."""

    def cache_copied(self, cache: Any, twin: Any) -> None:
        """``twin`` is a copy of ``cache`` (``BudgetCache.__deepcopy__``), both running this policy: give it what the
        policy keeps per cache outside the cache (KVzip: the prompt seen); most policies keep nothing."""

    def cache_batch_selected(self, cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``cache``'s sequences were reordered, repeated or selected (``BudgetCache.reorder_cache``,
        ``batch_repeat_interleave``, ``batch_select_indices``): ``fn`` does it to a ``[B, ...]`` tensor; do it to what
        the policy keeps per sequence of ``cache`` outside the cache (KVzip: the prompt seen); most policies keep nothing."""

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- what the runtime asks
    def stats_request(self, phase: Phase) -> StatsRequest:
        """Statistics this policy needs from the attention call in ``phase``."""
        return NO_STATS

    def slot_state(self) -> dict[str, SlotState]:
        """Per-slot state tensors to keep on every layer."""
        return {}

    def colmax_weights(self, layer: BudgetLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For a ``colmax`` request on ``layer``'s current call: ``(rows [B, q], cols [B, H, max_slots])``, weights of
        each query row and of each slot per query head that multiply the probabilities before the maxima (KVzip+'s
        normalisation; KVzip's zeros outside the chunk it reconstructs, slots the attention then need not score:
        ``kernels.masked_attention_colmax``); ``None`` leaves them as they are."""
        return None, None

    def observe(self, layer: BudgetLayer, stats: AttnStats) -> None:
        """Update state from this call's statistics (before any eviction)."""

    def score(self, layer: BudgetLayer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [B, H_kv, C], forced [B, H_kv, C])``: higher scores are kept first; forced slots always are.

        Scoring policies implement this; wrappers (head-wise quotas, merging) build on it.
        """
        raise NotImplementedError(f"{self.name} does not expose per-slot scores")

    def quota(self, layer: BudgetLayer, stats: AttnStats | None) -> int | torch.Tensor:
        """Tokens each head may keep: an int, or a tensor broadcastable to ``[B, H_kv]`` (per sequence, per head).

        The layer reads a returned tensor once and reuses what it read while the same tensor comes back: give a
        new tensor for new quotas, never modify a returned one in place."""
        assert self.budget is not None
        return self.budget

    def quota_range(self, layer: BudgetLayer, quota: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """Per head, the least and the largest entry over the batch of the tensor ``quota`` just returned for
        ``layer``, when the policy knows them on the host: by default the ``KnownRange`` its layer state holds for
        that tensor (``LayerState.known_quota``, set where the policy made it: no read back, or one for several
        layers); None: the layer reads them back once."""
        known = None if self.state_type is None else self.layer_state(layer).known_quota
        return None if known is None else known.of(quota)

    def select(self, layer: BudgetLayer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        """Keep mask ``[B, H_kv, C]``: the forced slots plus the best-scoring others, ``quota`` per head."""
        scores, forced = self.score(layer, stats)
        return keep_forced_and_top(layer, scores, quota, forced)

    def select_layers(self, layers: list[BudgetLayer]) -> list[torch.Tensor]:
        """``select(layer, None, layer.quota)`` for each of ``layers`` (``runtime.layer.enforce_layers``: a decision
        across layers, every sequence of each over its quota). A ``stackable`` policy's on a GPU (``launch_bound``),
        where the layers are alike, a few layers at once (``runtime.stack.LayerStack``), each group in one set of
        launches; else one layer at a time."""
        groups = stack_groups(layers) if self.stackable and launch_bound(layers[0].device) else None
        keeps = []
        for group in groups or [[layer] for layer in layers]:
            if len(group) == 1:  # (a stack of one would only copy the layer)
                keeps.append(self.select(group[0], None, group[0].quota))
                continue
            stack = LayerStack(group)
            keeps.extend(stack.split(self.select(stack, None, stack.quota)))
            stack.finish()
        return keeps

    def after_layer(self, layer: BudgetLayer, stats: AttnStats) -> None:
        """Called after each budgeted layer's own step (cross-layer decisions; ``layer.is_last`` ends a forward)."""

    @property
    def cross_layer(self) -> bool:
        """Whether the policy decides across layers (it has an ``after_layer``): otherwise a prompt forward's layer
        whose new quota has a range the host does not know is evicted at the end of the next layer's step, its range
        read back by then (``BudgetLayer._defer``)."""
        return type(self).after_layer is not Policy.after_layer

    @property
    def prompt_only(self) -> bool:
        """Whether the policy compresses only its prompt and appends decode steps whole: a call of several tokens
        after decoding began (a new turn of a conversation) is then kept whole, past the budget, which the cache
        warns of (``BudgetCache.several_after_decoding``). By default, a schedule that evicts prompt chunks and not
        while decoding (a policy whose prompt is evicted by other means, KVzip's scoring pass, says so itself)."""
        return self.schedule.prefill and not self.schedule.decode_every

    @property
    def position_window(self) -> int | None:
        """Where attention runs at positions within the cache (``position_shift``, StreamingLLM's ``rerotate``): the
        most tokens a head holds before a forward, so that a forward of n tokens attends below position
        ``position_window + n`` however long the stream; None (the default) where positions keep counting."""
        return None

    def scoring_reach(self, model: Any, prompt_tokens: int) -> int:
        """How many positions past a prompt of ``prompt_tokens`` tokens the policy's own scoring forwards on ``model``
        run at (KVzip reconstructs the prompt after it); 0, the default, where a prompt is scored within its own
        forward. The commands that warn about or refuse lengths past the model's context count them."""
        return 0

    def position_shift(self, layer: BudgetLayer, q_pos: torch.Tensor) -> tuple[Rotary, torch.Tensor, torch.Tensor] | None:
        """For policies that attend at shifted positions (StreamingLLM's re-rotation):
        ``(rotary, key_delta [B, H_kv, C], query_delta [B, q])``; ``None`` keeps the original positions."""
        return None


@dataclass
class PerStepEviction(Policy):
    """Base of policies that evict at the end of every prompt chunk and on every decode step, with optional
    amortised eviction.

    With ``slack`` = s > 0 a head may fill to ``budget + s`` tokens during decode; the step that brings it one
    past that evicts the ``s + 1`` lowest-ranked tokens at once, with the policy's own rule applied to what is
    held then, back to ``budget``. This departs from per-step eviction in three ways: a token per-step eviction
    would have dropped stays for up to s more steps (the queries in between attend to it, and it competes again
    at the next eviction, where it may now win); the decision is made on the scores of the step that evicts,
    not of each step; and a layer holds up to ``budget + s`` tokens between evictions (memory and attention cost
    ``s`` more slots). With s = 0 (the default) it is per-step eviction. Each eviction costs one ranking of the
    held tokens and one host sync, so s spreads that cost over s + 1 steps.
    """

    slack: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "slack")

    @property
    def schedule(self) -> Schedule:
        return Schedule(prefill=True, decode_every=1, tolerance=self.slack)
