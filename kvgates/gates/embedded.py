"""Gate adapters shipped inside the package, like the embedded model: usable offline by name.

``kvgates.load_gates("smollm2-135m-trimkv")`` (or ``--gates smollm2-135m-trimkv`` on the command line) loads the
folder ``kvgates/gates/embedded/smollm2-135m-trimkv/``; ``default_gates(model_name, policy, budget)`` names the
adapter a learned policy uses on an embedded model when no gates are given. Each folder is an ordinary adapter (what one
would push to the Hub): ``config.json`` (with the recipe, command, training time and data split), fp16
``model.safetensors`` and a model card with its A/B tables. They are trained by ``train.py`` from the recipes in
``configs/train/`` and copied here by ``python -m train.ship``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

EMBEDDED_DIR = Path(__file__).with_name("embedded")

#: Adapters a learned policy may use on an embedded model when no gates are named: (model, policy) -> names; the
#: one trained at the budget nearest the requested one is used (``default_gates``).
DEFAULTS = {
    ("smollm2-135m", "trimkv"): ("smollm2-135m-trimkv", "smollm2-135m-trimkv-128"),
    ("smollm2-135m", "trimkv-morph"): ("smollm2-135m-trimkv-128",),  # best at 128 and 256 on validation
    ("smollm2-135m", "trimkv-snap"): ("smollm2-135m-trimkv-128",),
    ("smollm2-135m", "trimkv-global"): ("smollm2-135m-trimkv-global",),
    ("smollm2-135m", "locret"): ("smollm2-135m-locret",),
    ("smollm2-135m", "dms"): ("smollm2-135m-dms",),  # validation KL 0.021, against 0.029 for smollm2-135m-dms-lora
    ("smollm2-135m", "kvzap"): ("smollm2-135m-kvzap",),
}


def embedded_adapters() -> list[str]:
    """Names of the adapters shipped in the package."""
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file()) if EMBEDDED_DIR.is_dir() else []


def embedded_adapter_dir(name: str) -> Path | None:
    """The folder of the shipped adapter ``name``, or None when no adapter of that name ships."""
    folder = EMBEDDED_DIR / str(name)
    return folder if "/" not in str(name) and (folder / "config.json").is_file() else None


def default_gates(model: str, policy: str, budget: int | None = None) -> str | None:
    """The shipped adapter a learned ``policy`` uses on the embedded ``model`` (its short name, or the Hub id it came
    from, which the adapters name as their base model) when none is named (None if none): of those listed in
    ``DEFAULTS``, the one whose training budget is nearest ``budget`` by ratio (ties: the larger budget); without a
    budget (or with one below 1, which the policy itself refuses), the first listed."""
    from kvgates.models import EMBEDDED_MODELS

    model = next((name for name, spec in EMBEDDED_MODELS.items() if spec.hub_id == model), model)
    names = [n for n in DEFAULTS.get((model, policy), ()) if embedded_adapter_dir(n) is not None]
    if not names or budget is None or budget < 1:
        return names[0] if names else None

    def distance(name: str) -> tuple[float, int]:
        trained = json.loads((EMBEDDED_DIR / name / "config.json").read_text())["training_budget"]
        return abs(math.log(budget / trained)), -trained

    return min(names, key=distance)
