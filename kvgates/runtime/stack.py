"""Several alike layers seen as one: a policy's selection for all of them at once, in one set of launches.

A decision across layers (D2O's prompt eviction after the last layer, DynamicKV's truncations after a reallocation)
selects for every layer in turn: on a GPU each layer's selection is its own ~60-130 launches, which the device waits
for one after another. Where the layers are alike (the same device, batch, dtype and heads, each with as many slots
in every head), ``LayerStack`` stacks their sequences along the batch axis (each layer's slots padded with empty ones
to the most any has) and answers what a selection reads of a layer (positions, held slots, per-slot state, the quota
and what the host knows of it, keys and values, the policy's values on the layer), so that one call of the policy's
``select`` selects for all; ``split`` gives each layer its keep mask, and ``finish`` returns what the selection
changed (merged keys and values, the policy's values) to each layer. A selection reads each sequence's rows alone,
so every layer gets what it would get alone.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch

from kvgates.runtime.state import StateViews
from kvgates.runtime.storage import KeptCounts

if TYPE_CHECKING:
    from kvgates.runtime.layer import BudgetLayer
    from kvgates.runtime.state import LayerState

#: Key (and value) elements a ``LayerStack`` holds at most (``stack_groups``): its keys and values are copies, and a
#: merge's similarities work on float32 copies of them.
STACK_ELEMENTS = 1 << 27


def stack_groups(layers: list[BudgetLayer]) -> list[list[BudgetLayer]] | None:
    """``layers`` in consecutive groups of at most ``STACK_ELEMENTS`` key elements each (a layer alone at least), or
    None where they are not alike (``LayerStack``)."""
    first = layers[0]
    if any(
        layer.device != first.device or layer.batch_size != first.batch_size or layer.keys.dtype != first.keys.dtype
        or layer.num_kv_heads != first.num_kv_heads or not layer.uniform or layer.static
        or layer.keys.shape[-1] != first.keys.shape[-1] or layer.values.shape[-1] != first.values.shape[-1]
        for layer in layers
    ):
        return None
    per_layer = max(layer.keys.numel() for layer in layers)
    size = max(1, STACK_ELEMENTS // max(per_layer, 1))
    return [layers[i : i + size] for i in range(0, len(layers), size)]


class LayerStack:
    """Alike ``layers`` (``stack_groups``) as one layer whose sequences are theirs, stacked in order: what a
    selection reads of a ``BudgetLayer``, with copies of the keys and values that ``finish`` writes back."""

    static = False
    held_over_quota = None

    def __init__(self, layers: list[BudgetLayer]):
        self.layers = layers
        first = layers[0]
        self.num_kv_heads, self.device = first.num_kv_heads, first.device
        self.max_slots = max(layer.max_slots for layer in layers)  # a layer with fewer gets empty slots after its own
        self.batch_size = first.batch_size * len(layers)
        self.pos = self._cat([layer.pos for layer in layers], -1)
        self.quota = torch.cat([layer.quota for layer in layers])
        views = [layer.head_views()[0] for layer in layers]
        self.keys, self.values = self._cat([k for _, k, _, _ in views]), self._cat([v for _, _, v, _ in views])
        self.state = StateViews()
        for name in first.state:
            dict.__setitem__(self.state, name, self._cat([layer.state[name] for layer in layers]))
        self._policy_states: dict[int, tuple[LayerState, dict[str, torch.Tensor]]] = {}

    def _cat(self, tensors: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """``[B, H_kv, slots, ...]`` tensors of the layers, each padded to ``max_slots`` with ``fill``, stacked."""
        padded = []
        for t in tensors:
            extra = self.max_slots - t.shape[2]
            padded.append(torch.nn.functional.pad(t, (0, 0) * (t.dim() - 3) + (0, extra), value=fill) if extra else t)
        return torch.cat(padded)

    def split(self, keep: torch.Tensor) -> list[torch.Tensor]:
        """A keep mask of the stack, as each layer's."""
        return [part[..., : layer.max_slots] for part, layer in zip(keep.chunk(len(self.layers)), self.layers)]

    @property
    def valid(self) -> torch.Tensor:
        return self.pos >= 0

    def held(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def head_views(self) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(slice(0, self.num_kv_heads), self.keys, self.values, self.pos)]

    @property
    def most_held(self) -> int | None:
        held = [layer.most_held for layer in self.layers]
        return None if None in held else max(held)

    @property
    def over_quota_bound(self) -> int | None:
        bounds = [layer.over_quota_bound for layer in self.layers]
        return None if None in bounds else max(bounds)

    def exact_counts(self) -> KeptCounts | None:
        """Per head, the least kept, the most kept and the most evicted of any layer's sequences."""
        counts = [layer.exact_counts() for layer in self.layers]
        if None in counts:
            return None
        return KeptCounts(*([f(values) for values in zip(*parts)] for f, parts in zip((min, max, max), zip(*counts))))

    def policy_state(self, policy: Any) -> LayerState:
        """``policy``'s values on the layers: stacked where each layer has a tensor of its sequences (what ``finish``
        returns to the layers where the selection replaced it), the layers' own where every layer has the same number
        or string, else left at their defaults."""
        key = id(policy)
        if key not in self._policy_states:
            states = [layer.policy_state(policy) for layer in self.layers]
            stacked, shared = {}, {}
            for field in fields(states[0]):
                values = [getattr(state, field.name) for state in states]
                if all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == layer.batch_size for v, layer in zip(values, self.layers)):
                    stacked[field.name] = torch.cat(values)
                elif all(isinstance(v, (int, float, str)) for v in values) and len(set(values)) == 1:
                    shared[field.name] = values[0]
            self._policy_states[key] = (type(states[0])(**stacked, **shared), stacked)
        return self._policy_states[key][0]

    def finish(self) -> None:
        """Write the stacked keys and values back to each layer, and each policy value the selection replaced."""
        b = self.layers[0].batch_size
        for i, layer in enumerate(self.layers):
            rows = slice(i * b, (i + 1) * b)
            _, k, v, _ = layer.head_views()[0]
            k.copy_(self.keys[rows, :, : layer.max_slots])
            v.copy_(self.values[rows, :, : layer.max_slots])
        for key, (state, stacked) in self._policy_states.items():
            for name, before in stacked.items():
                after = getattr(state, name)
                if after is not before:
                    for i, layer in enumerate(self.layers):
                        setattr(layer._policy_states[key], name, after[i * b : (i + 1) * b])
