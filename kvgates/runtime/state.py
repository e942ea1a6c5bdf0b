"""Per-layer state types: what a policy keeps per slot (``SlotState``) and per layer (``LayerState``), and the
named views a layer gives of its packed per-slot state (``StateViews``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class SlotState:
    """A per-slot float32 tensor a policy keeps on each layer (cumulative attention, attention-row history, ...).

    Attributes:
        shape: trailing shape per slot (``()`` for a scalar).
        init: value a freshly written slot starts with.
    """

    shape: tuple[int, ...] = ()
    init: float = 0.0

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class KnownRange:
    """A quota tensor a policy made, with its least and largest entry over the batch per head, which the policy
    knows on the host: ``Policy.quota_range`` answers from it without a read back. Kept in a ``LayerState`` it is
    not a tensor field, so a batch selection leaves it behind with the old tensor, and ``of`` then answers None (the
    layer reads the new quota's range)."""

    quota: torch.Tensor
    least: list[int]
    most: list[int]

    def of(self, quota: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """``quota_range``'s answer for ``quota``: the range per head if ``quota`` is this one, else None."""
        return (self.least, self.most) if quota is self.quota else None


@dataclass
class LayerState:
    """Base of a policy's own values on one layer (thresholds, per-sequence budgets, ring pointers ...).

    Subclass it as a dataclass with defaults and name it in the policy's ``state_type``; the layer creates one per
    policy on first use (``Policy.layer_state``). Tensor fields of at least one dimension are per sequence (dim 0)
    and follow beam reordering and batch selection; other fields (0-d tensors among them) are per layer.
    ``known_quota``: the range of a quota tensor the policy made, where it knows it (``Policy.quota_range``).
    """

    known_quota: KnownRange | None = None

    def select_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim():
                setattr(self, f.name, fn(value))


class StateViews(dict):
    """Named views into a layer's packed per-slot state. Assigning to a name writes into the storage
    (so ``layer.state["score"] += x`` updates the layer, as with a plain tensor attribute)."""

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name not in self:
            raise KeyError(f"no per-slot state {name!r}; the policy declares {sorted(self)}")
        target = dict.__getitem__(self, name)
        if value is not target:
            target.copy_(value)

