"""Checking plain config values (YAML, JSON, command-line strings) against a dataclass field's type hint.

Policies, gate adapter configs and training configs are dataclasses built from values a user typed; a value of
the wrong type (``window: eight``) would otherwise surface later as a ``TypeError`` deep in the code.
``type_problem`` says, in words, what a value should have been; the caller raises its own error with it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import sys
import types
import typing
from typing import Any, Union

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a mapping"}


def as_int(value: Any) -> int | None:
    """``value`` as an ``int`` where it is a whole number of a type that says so (an ``int``, a numpy integer, a 0-d
    integer tensor: what ``operator.index`` takes), else None (a bool, a float, a string)."""
    if type(value) is int:  # (the common case, and all that torch.compile traces)
        return value
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def plain_scalar(value: Any) -> Any:
    """The Python number or bool a numpy scalar, or a 0-d array or tensor, holds (``np.int64(64)`` -> ``64``); any
    other value as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)) else value


def scalar_type(hint: Any) -> tuple[type, bool] | None:
    """``(kind, takes None)`` where ``hint`` is ``int``, ``float`` or ``bool`` (``kind``), alone or with None
    (``int | None``), else None."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    return (kinds[0], len(kinds) < len(args)) if len(kinds) == 1 and kinds[0] in (int, float, bool) else None


def _accepts(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` fits ``hint`` (None: the hint is not one this module checks, so anything goes)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        verdicts = [_accepts(value, arg) for arg in typing.get_args(hint)]
        return True if True in verdicts else None if None in verdicts else False
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    base = origin or hint
    if isinstance(base, type) and issubclass(base, enum.Enum):  # a member, or its value (YAML gives the value)
        return any(value is member or (value == member.value and type(value) is type(member.value)) for member in base)
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base in (str, list, dict):
        return isinstance(value, base)
    if base is tuple:
        return isinstance(value, (list, tuple))
    return None


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if any(_string_enum(a) for a in args):  # IntervalStrategy | str: the strings it takes are the enum's values
            args = [a for a in args if a is not str]
        words = " or ".join(_describe(a) for a in args)
        return f"{words} or null" if type(None) in typing.get_args(hint) else words
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    base = origin or hint
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in base)
    return _NAMES.get(base, getattr(base, "__name__", str(base)))


def _string_enum(hint: Any) -> bool:
    """Whether ``hint`` is an enum whose values are strings (transformers' ``IntervalStrategy``, ``SchedulerType``)."""
    return isinstance(hint, type) and issubclass(hint, enum.Enum) and all(isinstance(m.value, str) for m in hint)


def type_problem(value: Any, hint: Any) -> str | None:
    """``None`` when ``value`` fits the type ``hint`` (ints, floats, bools, strings, lists, mappings, Literal, enums
    (a member or its value), Optional and unions of them; other types are not checked), else what it should be, e.g.
    ``"an integer"``."""
    return None if _accepts(value, hint) is not False else _describe(hint)


def field_hints(cls: type) -> dict[str, Any]:
    """The type hints of class ``cls``'s fields, as ``typing.get_type_hints`` gives them; where one names what cannot be
    found at run time (a class imported only under ``TYPE_CHECKING``, or local to a function, in a module of ``from
    __future__ import annotations``), which made ``get_type_hints`` fail for every field, the others' alone (nothing
    here checks that one)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # (NameError for a name it cannot find; each hint alone below)
        pass
    hints: dict[str, Any] = {}
    for owner in reversed(cls.__mro__):
        module = sys.modules.get(owner.__module__)
        globalns, localns = (vars(module) if module else {}), dict(vars(owner))
        for name, hint in owner.__dict__.get("__annotations__", {}).items():
            try:
                hints[name] = typing.get_type_hints(types.SimpleNamespace(__annotations__={name: hint}), globalns, localns)[name]
            except Exception:
                hints.pop(name, None)  # (not a base's hint of the same name either)
    return hints


@functools.cache
def scalar_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """The init fields of dataclass ``cls`` typed ``int``, ``float`` or ``bool`` (``scalar_type``): name -> (that type,
    whether None fits). A field whose hint cannot be resolved (``field_hints``) is not one."""
    hints = field_hints(cls)
    kinds = {f.name: scalar_type(hints[f.name]) for f in dataclasses.fields(cls) if f.init and f.name in hints}
    return {name: kind for name, kind in kinds.items() if kind is not None}


def field_problems(cls: type, values: dict[str, Any]) -> list[str]:
    """For each of ``values`` naming a field of dataclass ``cls`` whose type it does not fit, one phrase:
    ``"window must be an integer, got 'eight'"`` (a field whose hint cannot be resolved, ``field_hints``, is not
    checked)."""
    hints = field_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    problems = []
    for name, value in values.items():
        if name in known:
            wanted = type_problem(value, hints.get(name, Any))
            if wanted is not None:
                problems.append(f"{name} must be {wanted}, got {value!r}")
    return problems
