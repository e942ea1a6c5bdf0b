"""Gate adapters shipped inside the package, like the embedded model: usable offline by name.

``kvgates.load_gates("smollm2-135m-trimkv")`` (or ``--gates smollm2-135m-trimkv`` on the command line) loads the
folder ``kvgates/gates/embedded/smollm2-135m-trimkv/``; ``default_gates(model_name, policy)`` names the adapter a
learned policy uses on an embedded model when no gates are given. Each folder is an ordinary adapter (what one
would push to the Hub): ``config.json`` (with the recipe, command, training time and data split), fp16
``model.safetensors`` and a model card with its A/B tables. They are trained by ``train.py`` from the recipes in
``configs/train/`` and copied here by ``python -m train.ship``.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).with_name("embedded")

#: Adapter used by a learned policy on an embedded model when no gates are named: (model, policy) -> adapter name.
DEFAULTS = {
    ("smollm2-135m", "trimkv"): "smollm2-135m-trimkv",
    ("smollm2-135m", "trimkv-global"): "smollm2-135m-trimkv-global",
    ("smollm2-135m", "locret"): "smollm2-135m-locret",
}


def embedded_adapters() -> list[str]:
    """Names of the adapters shipped in the package."""
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file()) if EMBEDDED_DIR.is_dir() else []


def embedded_adapter_dir(name: str) -> Path | None:
    """The folder of the shipped adapter ``name``, or None when no adapter of that name ships."""
    folder = EMBEDDED_DIR / str(name)
    return folder if "/" not in str(name) and (folder / "config.json").is_file() else None


def default_gates(model: str, policy: str) -> str | None:
    """The shipped adapter a learned ``policy`` uses on the embedded ``model`` when none is named (None if none)."""
    name = DEFAULTS.get((model, policy))
    return name if name is not None and embedded_adapter_dir(name) is not None else None
