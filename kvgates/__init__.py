"""kvgates: learned and heuristic KV-cache eviction in one shared, budgeted cache runtime.

    import kvgates
    model, tok = kvgates.load_model("smollm2-135m")
    cache = kvgates.BudgetCache(model.config, "snapkv", budget=256)
    out = model.generate(**tok("...", return_tensors="pt"), past_key_values=cache, max_new_tokens=32)
"""

from kvgates.runtime import attention as _attention

_attention.register()

from kvgates.errors import AdapterError, UnsupportedModelError  # noqa: E402
from kvgates.gates import GateSet, GlobalRetentionGates, RetainingHeads, RetentionGates, load_gates  # noqa: E402
from kvgates.models import EMBEDDED_MODELS, check_supported, load_model, model_fingerprint, prepare_model  # noqa: E402
from kvgates.policies import POLICIES, Policy, Schedule, make_policy, register_policy  # noqa: E402
from kvgates.runtime.cache import BudgetCache, dynamic_cache_bytes  # noqa: E402
from kvgates.runtime.layer import BudgetLayer, LayerState, SlotState  # noqa: E402
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "AttnStats",
    "BudgetCache",
    "BudgetLayer",
    "EMBEDDED_MODELS",
    "GateSet",
    "GlobalRetentionGates",
    "LayerState",
    "POLICIES",
    "Phase",
    "Policy",
    "RetainingHeads",
    "RetentionGates",
    "Schedule",
    "SlotState",
    "StatsRequest",
    "UnsupportedModelError",
    "check_supported",
    "dynamic_cache_bytes",
    "load_gates",
    "load_model",
    "make_policy",
    "model_fingerprint",
    "prepare_model",
    "register_policy",
]
