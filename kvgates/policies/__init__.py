"""Eviction policies, one per file, registered by name (``make_policy("snapkv", budget=256)``)."""

# The learned methods register their own policies (kvgates.methods: one module each); they import policy submodules,
# never names from this package, so the registry is complete whichever of the two is imported first.
import kvgates.methods  # noqa: F401
from kvgates.policies.adakv import AdaKV
from kvgates.policies.base import POLICIES, Policy, Schedule, make_policy, register_policy
from kvgates.policies.d2o import D2O
from kvgates.policies.dynamickv import DynamicKV
from kvgates.policies.full import Full
from kvgates.policies.h2o import H2O
from kvgates.policies.kvmerger import KVMerger
from kvgates.policies.kvzip import KVzip
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.locret import Locret
from kvgates.policies.merging import Merge
from kvgates.policies.morphkv import MorphKV
from kvgates.policies.pyramidkv import PyramidKV
from kvgates.policies.snapkv import SnapKV
from kvgates.policies.streaming import StreamingLLM
from kvgates.policies.tova import TOVA
from kvgates.policies.trimkv import TrimKV
from kvgates.policies.trimkv_global import TrimKVGlobal
from kvgates.policies.trimkv_morph import TrimKVMorph
from kvgates.policies.trimkv_snap import TrimKVSnap

__all__ = [
    "POLICIES",
    "Policy",
    "Schedule",
    "make_policy",
    "register_policy",
    "AdaKV",
    "D2O",
    "DynamicKV",
    "Full",
    "H2O",
    "KVMerger",
    "KVzip",
    "LearnedPolicy",
    "Locret",
    "Merge",
    "MorphKV",
    "PyramidKV",
    "SnapKV",
    "StreamingLLM",
    "TOVA",
    "TrimKV",
    "TrimKVGlobal",
    "TrimKVMorph",
    "TrimKVSnap",
]
