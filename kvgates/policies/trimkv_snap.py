"""TRIM-KV gates inside SnapKV's prompt compression: the gates keep what lasts, the prompt's last queries choose
the rest."""

from __future__ import annotations

from dataclasses import dataclass

from kvgates.policies.base import register_policy
from kvgates.policies.snapkv import SnapKV
from kvgates.policies.trimkv import GateKept


@register_policy
@dataclass
class TrimKVSnap(GateKept, SnapKV):
    """A retention-gate adapter inside SnapKV's selection (``GateKept``): prompt compression, like SnapKV.

    At the end of each prompt chunk each KV head keeps the observation ``window``, the ``gate_keep`` other
    tokens whose decayed retention is highest, and, for what is left, SnapKV's choice (the window's pooled
    attention). Decode appends without eviction (the gates then do not run), unless ``decode=True``, as SnapKV.
    ``gate_keep = 0`` is SnapKV (tested). It holds what SnapKV holds, so the two compare at matched memory.

    Args:
        budget: tokens per KV head.
        gates: a ``RetentionGates`` adapter (folder, Hub id or object); strict: require the training model.
        gate_keep: tokens outside the window kept by gate retention (at most ``budget - window``).
        window, kernel, pooling, group_reduce, decode, decode_every: as SnapKV.
    """

    name = "trimkv-snap"
    # Not for a static cache: its gates' capture keeps each decode step's input, which no step reads (SnapKV
    # evicts only the prompt), and a compiled step recompiles once on it.
    sync_free_decode = False
