"""Evaluation run configs (YAML) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgates import make_policy


@dataclass(frozen=True)
class PolicySpec:
    """A policy by name with fixed parameters; the budget comes from the run's budget list."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def budgeted(self) -> bool:
        return self.name != "full"

    def build(self, budget: int | None):
        return make_policy(self.name, **self.params) if not self.budgeted else make_policy(self.name, budget=budget, **self.params)

    def label(self, budget: int | None) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        base = self.name + (f"[{extra}]" if extra else "")
        return base if budget is None else f"{base}@{budget}"


@dataclass(frozen=True)
class NeedleRunConfig:
    """A needle-in-a-haystack sweep."""

    model: str = "smollm2-135m"
    context_tokens: tuple[int, ...] = (2000,)
    depths: int = 10
    seed: int = 0
    budgets: tuple[int, ...] = (128, 512)
    policies: tuple[PolicySpec, ...] = (PolicySpec("full"),)
    max_new_tokens: int = 8
    prefill_chunk_size: int | None = None
    output_dir: str = "outputs/needle"

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("the config lists no policies")
        for spec in self.policies:
            for budget in self.budgets if spec.budgeted else [None]:
                spec.build(budget)  # validates names and parameters before any model is loaded

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> NeedleRunConfig:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        policies = []
        for entry in raw.get("policies", []):
            entry = {"name": entry} if isinstance(entry, str) else dict(entry)
            name = entry.pop("name")
            policies.append(PolicySpec(name, entry.pop("params", entry)))
        raw["policies"] = tuple(policies)
        for key in ("context_tokens", "budgets"):
            if key in raw:
                value = raw[key]
                raw[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        return cls(**raw)
