"""A ring buffer of recent attention rows, kept as per-slot state (SnapKV decode mode, MorphKV).

Row ``r`` of the buffer is one query's attention probabilities over the slots, stored in the slot's state
vector at index ``r``. A slot written after a row was recorded starts at 0 for it (that query never saw the
token), and evicting a slot drops its column with it, so the buffer needs no bookkeeping beyond ``History``:
the ring index of the newest row, a 0-d tensor on the layer's device (a compiled decode step advances it without
reading it back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgates.runtime.layer import BudgetLayer
from kvgates.runtime.state import LayerState, SlotState

FUSIONS = ("sum", "max")


@dataclass
class History(LayerState):
    """Where the newest recorded row of a layer's ring buffer is (-1: none yet), a 0-d int64 tensor."""

    newest: torch.Tensor = field(default_factory=lambda: torch.tensor(-1))


def history_state(size: int) -> SlotState:
    """Slot state holding ``size`` attention rows."""
    return SlotState(shape=(size,))


def push_rows(layer: BudgetLayer, name: str, history: History, rows: torch.Tensor) -> None:
    """Record the rows ``[B, H_kv, r, C]`` (oldest first), each overwriting the oldest recorded row: in one write
    whatever ``r`` (a prompt chunk's rows one at a time were three launches a row)."""
    buf = layer.state[name]
    size, pushed = buf.shape[-1], rows.shape[2]
    rows = rows[:, :, -size:]  # (older rows would be overwritten by newer ones of the same call)
    r = rows.shape[2]
    if not r:
        return
    history.newest = (history.newest.to(buf.device) + pushed) % size
    at = history.newest.view(1) if r == 1 else (history.newest + torch.arange(1 - r, 1, device=buf.device)) % size
    buf.index_copy_(-1, at, rows.transpose(-1, -2))


def fuse(layer: BudgetLayer, name: str, mode: str, leave_out: torch.Tensor | None = None) -> torch.Tensor:
    """Combine the recorded rows per slot, ``sum`` or ``max`` (rows not yet recorded are 0); with ``leave_out`` (a
    0-d ring index, ``History.newest`` or the oldest row after it), leave out that row."""
    buf = layer.state[name]
    if leave_out is not None:  # the row (if any: -1 matches no row) reads 0, neutral for both fusions
        buf = buf * (torch.arange(buf.shape[-1], device=buf.device) != leave_out.to(buf.device))
    if mode == "sum":
        return buf.sum(-1)
    if mode == "max":
        return buf.amax(-1)
    raise ValueError(f"fusion must be one of {FUSIONS}, got {mode!r}")
