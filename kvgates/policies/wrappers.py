"""The base of policies that wrap another one (Ada-KV's head-wise quotas, merging of evicted tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from kvgates.policies.base import POLICIES, Policy, Schedule, make_policy
from kvgates.policies.learned import LearnedPolicy
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


def parse_params(params: dict[str, Any] | str, what: str = "base parameter") -> dict[str, Any]:
    """Policy parameters from a dict or a ``"key=value,key=value"`` string. Each value is read as YAML (``8``,
    ``true``, ``[1, 2]``, ``'a, quoted: text'``): a value that starts with a quote runs to its closing quote and one
    that starts with a bracket to its closing bracket, commas inside them included; any other value runs to the next
    comma (an apostrophe or bracket inside it is text), and stays the text it is where YAML would read a mapping
    (``Say it again:``). An empty value (``window=``) is refused (``window=null`` is None). Errors call the
    parameters ``what``: a wrapper's ``base_params`` by default, a bench's ``--policies`` entry its policy's own."""
    if isinstance(params, dict):
        return dict(params)
    out = {}
    for item in filter(None, (p.strip() for p in _items(params, what))):
        if "=" not in item:
            raise ValueError(f"expected key=value in {what}s, got {item!r}")
        key, value = (part.strip() for part in item.split("=", 1))
        if not value:  # YAML reads None, which the policy refused as "window must be an integer, got None"
            raise ValueError(f"{key}= has no value; give one, or leave {key} out for its default")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = " ".join(str(getattr(err, "problem", None) or err).split())
            raise ValueError(f"{what} {key}: cannot read {value!r} as YAML ({problem}); quote text that holds ': ' or commas") from err
        out[key] = value if isinstance(parsed, dict) and not value.startswith("{") else parsed
    return out


def _items(text: str, what: str) -> list[str]:
    """``text`` split into ``key=value`` items at the commas between values (``parse_params``)."""
    items, start = [], 0
    while start <= len(text):
        equals, comma = text.find("=", start), text.find(",", start)
        if equals < 0 or 0 <= comma < equals:  # no value (parse_params says so) or the last item
            stop = len(text) if comma < 0 else comma
        else:
            value = equals + 1 + len(text[equals + 1 :]) - len(text[equals + 1 :].lstrip())
            stop = text.find(",", _value_end(text, value, f"{what} {text[start:equals].strip()}"))
            stop = len(text) if stop < 0 else stop
        items.append(text[start:stop])
        start = stop + 1
    return items


def _value_end(text: str, at: int, name: str) -> int:
    """Where the value starting at ``at`` ends: after its closing quote or bracket where it opens with one (``name``:
    the parameter's, for the error where it never closes)."""
    closing = {"'": "'", '"': '"', "[": "]", "{": "}"}
    if at >= len(text) or text[at] not in closing:
        return at
    stack, quote = [closing[text[at]]], text[at] if text[at] in "'\"" else None
    for i in range(at + 1, len(text)):
        char = text[i]
        if quote is not None:
            if char == quote:
                quote = None
                if stack[-1] == char:
                    stack.pop()
        elif char in "'\"":
            quote = char
        elif char in "[{":
            stack.append(closing[char])
        elif char == stack[-1]:
            stack.pop()
        if not stack:
            return i + 1
    what = "quote" if text[at] in "'\"" else "bracket"
    raise ValueError(f"{name}: {text[at:]!r} opens a {what} it never closes")


def learned_policy(name: str, params: dict[str, Any]) -> type[LearnedPolicy] | None:
    """The learned policy that policy ``name`` built with ``params`` runs: itself, or the base a wrapper wraps
    (``adakv`` with ``base: trimkv-snap``); None when no learned policy runs (or the base is unknown)."""
    cls = POLICIES.get(name)
    if cls is not None and issubclass(cls, Wrapper):
        cls = POLICIES.get(params.get("base", cls.base))
    return cls if cls is not None and issubclass(cls, LearnedPolicy) else None


def learned_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters the learned policy of ``name`` gets: ``params`` itself, or a wrapper's ``base_params``
    (parsed; a ValueError when they are malformed)."""
    return parse_params(params.get("base_params", {})) if issubclass(POLICIES[name], Wrapper) else params


def with_gates(name: str, params: dict[str, Any], gates: Any) -> dict[str, Any]:
    """``params`` of policy ``name`` with ``gates`` given to the learned policy it runs (a wrapper's base)."""
    if issubclass(POLICIES[name], Wrapper):
        return {**params, "base_params": {**learned_params(name, params), "gates": gates}}
    return {**params, "gates": gates}


@dataclass
class Wrapper(Policy):
    """A policy that delegates every hook to an inner policy built from ``base`` and ``base_params``."""

    base: str = "snapkv"
    base_params: dict[str, Any] | str = field(default_factory=dict)
    inner: Policy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base not in POLICIES:
            raise ValueError(f"{self.name}: unknown base policy {self.base!r}; available: {', '.join(sorted(POLICIES))}")
        if self.base == "full":
            raise ValueError(f"{self.name}: base 'full' evicts nothing, so there is nothing to wrap; pick a policy that evicts")
        params = parse_params(self.base_params)
        if "budget" in params:  # the base runs at the wrapper's budget, which would replace this one
            raise ValueError(f"{self.name}: base_params sets a budget; the base policy runs at {self.name}'s budget, so pass it as budget")
        if self.budget is not None:
            params["budget"] = self.budget
        try:
            self.inner = make_policy(self.base, **params)
        except ValueError as err:  # the base's own sentence, said to be the base's (its parameters are base_params)
            advice = " (the base's parameters go in base_params)"
            said = str(err).removesuffix(advice)  # a wrapped wrapper's sentence says it already
            raise ValueError(f"{self.name}'s base {said}{advice}") from None
        self.ragged_heads = type(self).ragged_heads or self.inner.ragged_heads

    @property
    def schedule(self) -> Schedule:
        return self.inner.schedule

    def attach(self, model: Any) -> Wrapper:
        self.inner.attach(model)
        return self

    def detach(self) -> None:
        self.inner.detach()

    def cache_copied(self, cache: Any, twin: Any) -> None:
        self.inner.cache_copied(cache, twin)

    def cache_batch_selected(self, cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner.cache_batch_selected(cache, fn)

    def stats_request(self, phase: Phase) -> StatsRequest:
        return self.inner.stats_request(phase)

    def slot_state(self) -> dict[str, SlotState]:
        return self.inner.slot_state()

    def colmax_weights(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.inner.colmax_weights(layer)

    def observe(self, layer, stats: AttnStats) -> None:
        self.inner.observe(layer, stats)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.score(layer, stats)

    def quota(self, layer, stats: AttnStats | None) -> int | torch.Tensor:
        return self.inner.quota(layer, stats)

    def quota_range(self, layer, quota: torch.Tensor) -> tuple[list[int], list[int]] | None:
        return self.inner.quota_range(layer, quota)  # (None for a quota of the wrapper's own: ``KnownRange.of``)

    def select(self, layer, stats: AttnStats | None, quota: torch.Tensor) -> torch.Tensor:
        return self.inner.select(layer, stats, quota)

    def after_layer(self, layer, stats: AttnStats) -> None:
        self.inner.after_layer(layer, stats)

    @property
    def cross_layer(self) -> bool:
        """The wrapped policy's, unless the wrapper has an ``after_layer`` of its own."""
        return self.inner.cross_layer or type(self).after_layer is not Wrapper.after_layer

    @property
    def prompt_only(self) -> bool:
        return self.inner.prompt_only

    @property
    def position_window(self) -> int | None:
        return self.inner.position_window

    def scoring_reach(self, model: Any, prompt_tokens: int) -> int:
        return self.inner.scoring_reach(model, prompt_tokens)

    def position_shift(self, layer, q_pos: torch.Tensor):
        return self.inner.position_shift(layer, q_pos)
