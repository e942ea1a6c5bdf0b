"""A ring buffer of recent attention rows, kept as per-slot state (SnapKV decode mode, MorphKV).

Row ``r`` of the buffer is one query's attention probabilities over the slots, stored in the slot's state
vector at index ``r``. A slot written after a row was recorded starts at 0 for it (that query never saw the
token), and evicting a slot drops its column with it, so the buffer needs no separate bookkeeping.
"""

from __future__ import annotations

import torch

from kvgates.runtime.layer import BudgetLayer, SlotState


def history_state(size: int) -> SlotState:
    """Slot state holding ``size`` attention rows."""
    return SlotState(shape=(size,))


def load_rows(layer: BudgetLayer, name: str, rows: torch.Tensor) -> None:
    """Replace the buffer by ``rows`` (``[B, H_kv, r, C]``, oldest first), e.g. the last prompt queries."""
    buf = layer.state[name]
    size = buf.shape[-1]
    rows = rows[:, :, -size:]
    r = rows.shape[2]
    buf.zero_()
    buf[..., :r] = rows.transpose(-1, -2)
    layer.scratch[f"{name}.next"] = r % size


def push_row(layer: BudgetLayer, name: str, row: torch.Tensor) -> None:
    """Record one query's row ``[B, H_kv, C]``, overwriting the oldest."""
    buf = layer.state[name]
    nxt = layer.scratch.get(f"{name}.next", 0)
    buf[..., nxt] = row
    layer.scratch[f"{name}.next"] = (nxt + 1) % buf.shape[-1]


def fuse(layer: BudgetLayer, name: str, mode: str) -> torch.Tensor:
    """Combine the recorded rows per slot: ``sum`` or ``max`` (rows not yet recorded are 0)."""
    buf = layer.state[name]
    if mode == "sum":
        return buf.sum(-1)
    if mode == "max":
        return buf.amax(-1)
    raise ValueError(f"fusion must be 'sum' or 'max', got {mode!r}")
