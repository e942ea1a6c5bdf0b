"""Learned eviction modules (TRIM-KV retention gates, Locret retaining heads) and their adapter format."""

from kvgates.gates.adapter import (
    GATE_KINDS,
    GateConfig,
    GateSet,
    GlobalRetentionGates,
    RetainingHeads,
    RetentionGates,
    load_gates,
)
from kvgates.gates.capture import GateCapture
from kvgates.gates.modules import GlobalRetentionTrunk, RetainingHead, RetentionGate, SharedRetentionHead

# isort: split
# Last: the learned methods' own gate kinds (DMS, KVzap) register on import, so GATE_KINDS names every kind.
import kvgates.methods  # noqa: F401

__all__ = [
    "GATE_KINDS",
    "GateCapture",
    "GateConfig",
    "GateSet",
    "GlobalRetentionGates",
    "GlobalRetentionTrunk",
    "RetainingHead",
    "RetainingHeads",
    "RetentionGate",
    "RetentionGates",
    "SharedRetentionHead",
    "load_gates",
]
