"""TRIM-KV gates inside MorphKV's selection: the gates keep what lasts, recent queries choose the rest."""

from __future__ import annotations

from dataclasses import dataclass

from kvgates.policies.base import register_policy
from kvgates.policies.morphkv import MorphKV
from kvgates.policies.trimkv import GateKept


@register_policy
@dataclass
class TrimKVMorph(GateKept, MorphKV):
    """A retention-gate adapter inside MorphKV's selection (``GateKept``), evicting at every decode step.

    Each KV head holds ``budget`` tokens: the ``recent`` most recent ones, the ``gate_keep`` older ones whose
    decayed retention is highest, and, for what is left, the older tokens the recent queries attended to most
    (MorphKV's fused attention rows). ``gate_keep = 0`` is MorphKV; ``gate_keep = budget - recent`` is TRIM-KV
    with an always-kept recent window of ``recent`` (both tested). Decode steps need MorphKV's attention rows,
    so it costs what MorphKV costs plus the gates.

    Args:
        budget: tokens per KV head.
        gates: a ``RetentionGates`` adapter (folder, Hub id or object); strict: require the training model.
        gate_keep: older tokens kept by gate retention (at most ``budget - recent``).
        recent, fusion, evict_every: as MorphKV.
    """

    name = "trimkv-morph"
    reserved = "recent"
