"""Run configs in YAML: the one loader of training (``train/config.py``) and evaluation (``eval/config.py``) configs.

    raw = read_yaml("configs/train/trimkv-128.yaml", ["training.max_steps=50"])  # base: chain, then key=value
    config = build(TrainConfig, raw, "configs/train/trimkv-128.yaml")

* ``base: other.yaml`` (a path relative to the file) is read first and the file's own keys are merged over it,
  section by section: a mapping merges key by key, anything else (lists included) is replaced. A chain may be of
  any length; a cycle is refused. A mapping that gives a key twice is refused too (PyYAML would keep the last).
* An override ``a.b=value`` sets key ``b`` of section ``a`` (made when absent); ``value`` is read as YAML, so
  ``budgets=[128]`` is a list and ``seed=3`` a number.
* ``build`` makes a dataclass of a mapping, refusing an unknown key, a value of the wrong type
  (``kvgates.typecheck``) and a missing required key. A field whose type is a dataclass (or an optional one) is a
  section: a mapping built the same way, to any depth. A section whose class depends on other keys (a method's
  settings by ``kind``) is a mapping field, built by the caller with the class it picks:
  ``build(cls_of_kind, raw["method"], f"{where}: method")``.

Each problem is a ``ConfigError`` (``kvgates.errors``) with one sentence naming the file or section.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

from kvgates.errors import ConfigError
from kvgates.typecheck import field_problems

__all__ = [
    "ConfigError", "apply_override", "build", "check_output_file", "check_output_folder", "merge", "output_path", "read_yaml", "refuse_unknown",
    "yaml_hint",
]

T = TypeVar("T")


class _DuplicateKey(yaml.YAMLError):
    """A mapping of a config gives one key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice: PyYAML keeps the last one silently, so a
    copied line (``budget: 128`` below an earlier ``budget: 256``) would change a run unseen. Keys a ``<<`` merge
    brings in may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        marks: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue
            if key in marks:
                first, again = marks[key], key_node.start_mark
                where = (
                    f"line {first.line + 1}, columns {first.column + 1} and {again.column + 1}"
                    if first.line == again.line else f"lines {first.line + 1} and {again.line + 1}"
                )
                raise _DuplicateKey(f"key {key!r} is given twice ({where}); keep one")
            marks[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _load(text: str) -> Any:
    """``text`` read as YAML by ``_UniqueKeyLoader``."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_yaml(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The mapping a YAML config holds, its ``base`` chain merged in (the ``base`` key itself removed), then the
    command-line ``overrides`` (``apply_override``) in order."""
    raw = _read(Path(path), ())
    for item in overrides:
        apply_override(raw, item)
    return raw


def _read(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; name a YAML file in it")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' configs form a cycle")
    try:
        raw = _load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a YAML file (not UTF-8 text)") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML ({_one_line(err)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings at the top level")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must name another YAML config (a path relative to this one), got {base!r}")
    target = path.parent / base
    if not target.exists():
        raise ConfigError(f"{path}: base {base!r} names {target}, which does not exist (a path relative to this config)")
    return merge(_read(target, (*seen, path.resolve())), raw)


def output_path(path: str | Path) -> Path:
    """The path an output option names, a leading ``~`` read as the home folder (``~user``: that user's; left as it is
    where there is none), as ``load_model`` and ``save_pretrained`` read theirs: a shell leaves ``--out=~/runs`` as
    it is, so ``Path`` alone made a folder named ``~`` in the current folder. ``check_output_folder`` and
    ``check_output_file`` check this path and return it: write there."""
    return Path(os.path.expanduser(path))  # (Path.expanduser raises RuntimeError for an unknown ~user)


def text_lines(path: str | Path) -> list[str]:
    """The lines of a file a run appends to (a journal, a metrics log), leaving out any of bytes that are no UTF-8
    text (garbled by a disk or another program): one such line made the whole file a ``UnicodeDecodeError``."""
    lines = []
    for raw in Path(path).read_bytes().splitlines():
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return lines


def check_output_folder(path: str | Path, option: str) -> Path:
    """The folder to write in (``output_path(path)``: a leading ``~`` is the home folder), or
    ``ConfigError`` when ``path``, the output folder ``option`` names, cannot be a folder the run writes in: it, or
    a folder it would be made in, is a file; the nearest of them that exists takes no new entries (read-only, not
    yours, or a place such as ``/proc``: an empty folder is made there and removed again to find out); or it is
    empty (``""``, which a run would take for the current folder, strewing its outputs there). Run before any model
    work, so that the run is not refused only when it writes."""
    if not str(path).strip():
        raise ConfigError(f"{option} is empty; name a folder for the run's outputs (an empty one would be the current folder)")
    path = output_path(path)
    for node in (path, *path.parents):
        if node.exists():
            if not node.is_dir():
                where = "" if node == path else f" cannot be made: {node}"
                raise ConfigError(f"{option} {path}{where} is a file, not a folder; name a folder for the run's outputs")
            try:
                tempfile.TemporaryDirectory(dir=node).cleanup()
            except OSError as err:
                where = "" if node == path else f" cannot be made: {node}"
                raise ConfigError(f"{option} {path}{where} takes no new files ({err.strerror}); name a folder you can write in") from None
            break
    return path


def check_output_file(path: str | Path, option: str, what: str) -> Path:
    """The file to write (``output_path(path)``: a leading ``~`` is the home folder), or
    ``ConfigError`` when ``path``, the file ``option`` names (``what``: ``"plot file"``), cannot be written: it is
    empty or a folder, its folder does not exist or is a file, or that folder takes no new files (read-only, not
    yours, or a place such as ``/proc``: a temporary file is made there, and goes, to find out). Run before any
    work, so that a run is not refused only when it writes its result."""
    if not str(path).strip():
        raise ConfigError(f"{option} is empty; name the {what} to write")
    path = output_path(path)
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; name the {what} to write")
    folder = path.parent
    if not folder.is_dir():
        there = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{option} {path}: its folder {folder} {there}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        where = f"{option} {path}: its folder {folder}"
        raise ConfigError(f"{where} takes no new files ({err.strerror}); name a {what} in a folder you can write in") from None
    return path


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base`` (neither is changed); sections (mappings) merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``raw[a][b] = value`` for an override ``a.b=value`` (``value`` read as YAML, not empty; sections made as needed)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"overrides look like key=value or section.key=value, got {item!r}")
    if not text.strip():  # YAML reads None, which the run refused as the config file's "seed must be an integer, got None"
        raise ConfigError(f"override {item!r} has no value; give one ({key.strip()}=null for none), or leave it out to keep the config's")
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = _load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_one_line(err)})") from None


def build(cls: type[T], raw: Any, where: str) -> T:
    """Dataclass ``cls`` made of mapping ``raw``, its sections built likewise. ``where`` opens each message (a
    file, ``"c.yaml: data"`` for its section; ``""`` when the caller prefixes them). Raises ``ConfigError`` for a
    value that is not a mapping, an unknown key, a missing required key or a value of the wrong type, and passes
    on the ``ConfigError`` of the class's own checks with ``where`` opening it."""
    prefix = f"{where}: " if where else ""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {raw!r}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    refuse_unknown(raw, [f.name for f in fields], where)
    hints = typing.get_type_hints(cls)
    kwargs, plain = {}, {}
    for name, value in raw.items():
        section = _section(hints[name])
        if section is not None and (value is not None or not _optional(hints[name])):
            kwargs[name] = build(section, value, prefix + name)
        else:
            kwargs[name] = plain[name] = value
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in raw]
    if missing:
        raise ConfigError(f"{prefix}missing required {_keys(missing)}")
    wrong = field_problems(cls, plain)
    if wrong:
        raise ConfigError(f"{prefix}{yaml_hint(wrong[0])}")
    try:
        return cls(**kwargs)
    except ConfigError as err:  # the class's own checks (``__post_init__``) name the file too
        raise ConfigError(f"{prefix}{err}") from None


def refuse_unknown(raw: dict[str, Any], known: Iterable[str], where: str) -> None:
    """``ConfigError`` naming the keys of ``raw`` not among ``known`` (and listing those), if there are any;
    ``where`` opens the message as in ``build``."""
    known = list(known)
    unknown = sorted(set(raw) - set(known), key=str)
    if unknown:
        raise ConfigError(f"{where + ': ' if where else ''}unknown {_keys(unknown)}; known keys: {', '.join(known)}")


def yaml_hint(problem: str) -> str:
    """``problem`` (a ``field_problems`` phrase) plus, for a value YAML read otherwise than it was meant, how to write
    it: a number read as a string (``1e-3`` without a dot), or a word read as a boolean (YAML 1.1's ``no``, ``yes``,
    ``on`` and ``off``) where a boolean is not what is asked."""
    value = problem.rsplit("got ", 1)[-1].strip("'")
    if value in ("True", "False") and "true or false" not in problem:
        return f"{problem} (YAML reads no, yes, off and on as false or true; quote the word: 'no')"
    try:
        float(value)
    except ValueError:
        return problem
    return f"{problem} (YAML reads 1e-3 as a string; write 1.0e-3)" if "must be a number" in problem else problem


def _section(hint: Any) -> type | None:
    """The dataclass a field of type ``hint`` holds (``Spec`` or ``Spec | None``), else None."""
    union = typing.get_origin(hint) in (Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    return args[0] if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]) else None


def _optional(hint: Any) -> bool:
    """Whether a field of type ``hint`` admits None."""
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)


def _keys(names: list[Any]) -> str:
    return f"key{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
