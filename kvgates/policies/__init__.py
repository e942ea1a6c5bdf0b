"""Eviction policies, one per file, registered by name (``make_policy("snapkv", budget=256)``)."""

from kvgates.policies.base import POLICIES, Policy, make_policy, register_policy
from kvgates.policies.full import Full
from kvgates.policies.h2o import H2O
from kvgates.policies.pyramidkv import PyramidKV
from kvgates.policies.snapkv import SnapKV
from kvgates.policies.streaming import StreamingLLM
from kvgates.policies.tova import TOVA

__all__ = [
    "POLICIES",
    "Policy",
    "make_policy",
    "register_policy",
    "Full",
    "H2O",
    "PyramidKV",
    "SnapKV",
    "StreamingLLM",
    "TOVA",
]
