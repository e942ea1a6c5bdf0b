"""Learned eviction methods, one module each (``kvgates.methods.base``: what a method is). Importing a method's
module registers it (and its gate kind and policies); this list is the one registration a new method needs."""

from kvgates.methods import dms, kvzap, locret, trimkv  # noqa: F401  (each registers its method)
from kvgates.methods.base import METHODS, LearnedMethod, TrainingStep, method_of, register_method

__all__ = ["METHODS", "LearnedMethod", "TrainingStep", "method_of", "register_method"]
