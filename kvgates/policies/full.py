"""Full cache: keeps every token. The no-eviction baseline, run through the same runtime as every policy."""

from __future__ import annotations

from dataclasses import dataclass

from kvgates.policies.base import NEVER, Policy, register_policy


@register_policy
@dataclass
class Full(Policy):
    """Keep every token (no budget). Its outputs equal transformers' ``DynamicCache`` with sdpa attention."""

    name = "full"
    schedule = NEVER

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is not None:
            raise ValueError("full: the full cache keeps every token and takes no budget")
