"""kvgates: learned and heuristic KV-cache eviction in one shared, budgeted cache runtime.

    import kvgates
    model, tok = kvgates.load_model("smollm2-135m")
    cache = kvgates.BudgetCache(model.config, "snapkv", budget=256)
    out = model.generate(**tok("...", return_tensors="pt"), past_key_values=cache, max_new_tokens=32)

The names below are imported on first use (PEP 562), so ``import kvgates`` alone (and ``kvgates --version``) does
not import torch or transformers; importing any part of ``kvgates.runtime`` registers the ``"kvgates"`` attention.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module defining it.
_EXPORTS = {
    "AdapterError": "kvgates.errors",
    "ConfigError": "kvgates.errors",
    "HubPushError": "kvgates.errors",
    "UnsupportedModelError": "kvgates.errors",
    "GateSet": "kvgates.gates",
    "GlobalRetentionGates": "kvgates.gates",
    "RetainingHeads": "kvgates.gates",
    "RetentionGates": "kvgates.gates",
    "load_gates": "kvgates.gates",
    "EMBEDDED_MODELS": "kvgates.models",
    "check_supported": "kvgates.models",
    "load_model": "kvgates.models",
    "load_tokenizer": "kvgates.models",
    "model_fingerprint": "kvgates.models",
    "prepare_model": "kvgates.models",
    "POLICIES": "kvgates.policies",
    "Policy": "kvgates.policies",
    "Schedule": "kvgates.policies",
    "make_policy": "kvgates.policies",
    "register_policy": "kvgates.policies",
    "BudgetCache": "kvgates.runtime.cache",
    "dynamic_cache_bytes": "kvgates.runtime.cache",
    "BudgetLayer": "kvgates.runtime.layer",
    "LayerState": "kvgates.runtime.state",
    "SlotState": "kvgates.runtime.state",
    "AttnStats": "kvgates.runtime.stats",
    "Phase": "kvgates.runtime.stats",
    "StatsRequest": "kvgates.runtime.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgates' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from kvgates.errors import AdapterError, ConfigError, HubPushError, UnsupportedModelError  # noqa: F401
    from kvgates.gates import GateSet, GlobalRetentionGates, RetainingHeads, RetentionGates, load_gates  # noqa: F401
    from kvgates.models import EMBEDDED_MODELS, check_supported, load_model, load_tokenizer, model_fingerprint, prepare_model  # noqa: F401
    from kvgates.policies import POLICIES, Policy, Schedule, make_policy, register_policy  # noqa: F401
    from kvgates.runtime.cache import BudgetCache, dynamic_cache_bytes  # noqa: F401
    from kvgates.runtime.layer import BudgetLayer  # noqa: F401
    from kvgates.runtime.state import LayerState, SlotState  # noqa: F401
    from kvgates.runtime.stats import AttnStats, Phase, StatsRequest  # noqa: F401
