"""kvgates.config, the one loader of training and evaluation configs: base chains, overrides, dataclasses built with
every key and type checked; each problem one sentence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

import kvgates
from kvgates.config import ConfigError, apply_override, build, merge, read_yaml


@dataclass
class Inner:
    depth: int = 1


@dataclass
class Section:
    rate: float = 0.5
    name: str = "s"
    inner: Inner = field(default_factory=Inner)


@dataclass
class Needy:
    policy: str
    weight: float = 1.0


@dataclass
class Top:
    budget: int = 8
    section: Section = field(default_factory=Section)
    needy: Needy | None = None
    params: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)


def one_sentence(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, ValueError), text
    return text


def test_the_config_error_is_one_class_everywhere():
    import eval.config
    import train.config

    assert kvgates.ConfigError is ConfigError is train.config.ConfigError is eval.config.ConfigError
    assert issubclass(ConfigError, ValueError)


def test_a_base_chain_merges_section_by_section(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "root.yaml").write_text("budget: 4\nsection: {rate: 0.1, name: root, inner: {depth: 3}}\nnames: [a, b]\n")
    (tmp_path / "shared" / "mid.yaml").write_text("base: root.yaml\nsection: {name: mid}\nparams: {window: 2}\n")
    (tmp_path / "top.yaml").write_text("base: shared/mid.yaml\nsection: {inner: {depth: 5}}\nnames: [c]\n")
    raw = read_yaml(tmp_path / "top.yaml")  # each base is relative to the file naming it
    assert raw == {"budget": 4, "section": {"rate": 0.1, "name": "mid", "inner": {"depth": 5}}, "params": {"window": 2}, "names": ["c"]}
    assert build(Top, raw, "top.yaml") == Top(4, Section(0.1, "mid", Inner(5)), None, {"window": 2}, ["c"])


def test_merge_changes_neither_side():
    base, top = {"a": {"x": 1, "y": 2}, "b": [1]}, {"a": {"y": 3}, "b": [2]}
    assert merge(base, top) == {"a": {"x": 1, "y": 3}, "b": [2]}
    assert base == {"a": {"x": 1, "y": 2}, "b": [1]} and top == {"a": {"y": 3}, "b": [2]}


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, "a.yaml: 'base' configs form a cycle"),
        ({"a.yaml": "base: a.yaml\n"}, "a.yaml: 'base' configs form a cycle"),
        # The config that names a missing base is named too.
        ({"a.yaml": "base: gone.yaml\n"}, "{tmp}/a.yaml: base 'gone.yaml' names {tmp}/gone.yaml, which does not exist"),
        ({"a.yaml": "base: [b.yaml]\n"}, "a.yaml: base must name another YAML config"),
        ({"a.yaml": "budget: [1,\n"}, "a.yaml is not valid YAML (while parsing"),
        ({"a.yaml": "- 1\n- 2\n"}, "a.yaml must hold a mapping of settings at the top level"),
        ({"a.yaml": b"\xff\xfebudget: 1\n"}, "a.yaml is not a YAML file (not UTF-8 text)"),
        ({"a.yaml": None}, "config file {tmp}/a.yaml is a folder; name a YAML file in it"),
        ({"a.yaml": "base: sub\n", "sub": None}, "config file {tmp}/sub is a folder"),
        # PyYAML keeps the last of a key given twice, silently: a copied line changed the run unseen.
        ({"a.yaml": "budget: 256\nseed: 1\nbudget: 128\n"}, "{tmp}/a.yaml: key 'budget' is given twice (lines 1 and 3); keep one"),
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "data:\n  seq_len: 64\n  seq_len: 96\n"}, "{tmp}/b.yaml: key 'seq_len' is given twice"),
    ],
)
def test_unreadable_configs_are_one_sentence(tmp_path, files, message):
    for name, text in files.items():
        if text is None:
            (tmp_path / name).mkdir()
        elif isinstance(text, bytes):
            (tmp_path / name).write_bytes(text)
        else:
            (tmp_path / name).write_text(text)
    message = message.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as err:
        read_yaml(tmp_path / "a.yaml")
    assert message in one_sentence(err)


def test_overrides_are_yaml_values_at_dotted_keys():
    raw: dict[str, Any] = {"section": {"rate": 0.1}, "needy": None}
    for item in ["budget=16", "section.inner.depth=7", "section.name=x=y", "names=[a, b]", "params={window: 4}",
                 "needy.policy=snapkv", "section.rate=1.0e-3"]:
        apply_override(raw, item)
    assert raw == {"budget": 16, "section": {"rate": 0.001, "inner": {"depth": 7}, "name": "x=y"}, "needy": {"policy": "snapkv"},
                   "names": ["a", "b"], "params": {"window": 4}}
    assert build(Top, raw, "c.yaml").needy == Needy("snapkv")


def test_a_key_a_yaml_merge_brings_in_may_be_overridden(tmp_path):
    """Refusing a key given twice leaves YAML's own ``<<`` merge alone: the mapping's key wins over the merged one."""
    (tmp_path / "a.yaml").write_text("shared: &s {window: 4, kernel: 3}\nparams:\n  <<: *s\n  window: 8\n")
    assert read_yaml(tmp_path / "a.yaml")["params"] == {"window": 8, "kernel": 3}


@pytest.mark.parametrize(
    "item, message",
    [
        ("budget", "overrides look like key=value or section.key=value, got 'budget'"),
        ("=3", "overrides look like key=value"),
        ("section..rate=1", "overrides look like key=value"),
        ("budget.x=1", "override 'budget.x=1': 'budget' is not a section"),
        ("names=[a,", "override 'names=[a,': the value is not valid YAML"),
        ("budget= ", "override 'budget= ' has no value; give one (budget=null for none), or leave it out to keep the config's"),
        ("section.rate=", "override 'section.rate=' has no value"),
        (
            "params={window: 4, window: 8}",
            "override 'params={window: 4, window: 8}': the value is not valid YAML (key 'window' is given twice (line 1, columns 2 and 13)",
        ),
    ],
)
def test_bad_overrides_are_one_sentence(item, message):
    with pytest.raises(ConfigError) as err:
        apply_override({"budget": 8}, item)
    assert message in one_sentence(err)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"colour": 1}, "c.yaml: unknown key 'colour'; known keys: budget, section, needy, params, names"),
        ({"colour": 1, "size": 2}, "c.yaml: unknown keys 'colour', 'size'"),
        ({"section": {"inner": {"deep": 1}}}, "c.yaml: section: inner: unknown key 'deep'; known keys: depth"),
        ({"budget": "8"}, "c.yaml: budget must be an integer, got '8'"),
        ({"section": {"rate": "1e-3"}}, "c.yaml: section: rate must be a number, got '1e-3' (YAML reads 1e-3 as a string; write 1.0e-3)"),
        ({"section": {"rate": "fast"}}, "c.yaml: section: rate must be a number, got 'fast'"),
        ({"section": {"inner": {"depth": 1.5}}}, "c.yaml: section: inner: depth must be an integer, got 1.5"),
        ({"section": 3}, "c.yaml: section must be a mapping, got 3"),
        ({"section": None}, "c.yaml: section must be a mapping, got None"),  # a required section set to null
        ({"needy": {"weight": 2.0}}, "c.yaml: needy: missing required key 'policy'"),
        ({"params": [1]}, "c.yaml: params must be a mapping, got [1]"),
        ({"section": {"name": False}}, "section: name must be a string, got False (YAML reads no, yes, off and on as false or true"),
    ],
)
def test_build_refuses_unknown_keys_and_wrong_types(raw, message):
    with pytest.raises(ConfigError) as err:
        build(Top, raw, "c.yaml")
    assert message in one_sentence(err)


class Strategy(str, enum.Enum):
    NO = "no"
    STEPS = "steps"


@dataclass
class Scheduled:
    strategy: Strategy | str = "steps"


def test_an_enum_field_takes_its_values_and_names_them():
    """A field typed as a string enum or a string (transformers' ``eval_strategy: IntervalStrategy | str``) takes the
    enum's values; YAML's ``no`` (False) is refused naming them, where it passed to fail later as "False is not a
    valid IntervalStrategy"."""
    assert build(Scheduled, {"strategy": "no"}, "c.yaml").strategy == "no"
    with pytest.raises(ConfigError) as err:
        build(Scheduled, {"strategy": False}, "c.yaml")
    assert one_sentence(err).startswith("c.yaml: strategy must be one of 'no', 'steps', got False (YAML reads no, yes, off and on")


def test_build_finds_sections_from_the_field_types():
    config = build(Top, {"section": {"inner": {}}, "needy": {"policy": "h2o"}}, "")
    assert config == Top(section=Section(inner=Inner()), needy=Needy("h2o"))
    assert build(Top, {"needy": None}, "").needy is None  # an optional section may be null
    with pytest.raises(ConfigError, match="^unknown key 'x'"):  # no where: the caller names the file
        build(Top, {"x": 1}, "")


@dataclass
class Checked:
    budget: int = 8

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ConfigError(f"budget must be at least 1, got {self.budget}")


def test_a_class_s_own_check_names_the_file_as_builds_checks_do():
    with pytest.raises(ConfigError) as err:
        build(Checked, {"budget": 0}, "c.yaml")
    assert one_sentence(err) == "c.yaml: budget must be at least 1, got 0"
    with pytest.raises(ConfigError, match="^budget must be at least 1"):  # no where: the caller names the file
        build(Checked, {"budget": 0}, "")


def test_a_training_config_s_checks_name_its_file(tmp_path):
    from train.config import TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text("kind: trimkv\nbudget: 64\ndata: {mix: [{task: needle, colour: 1}]}\n")
    with pytest.raises(ConfigError) as err:
        TrainConfig.load(path)
    assert one_sentence(err).startswith(f"{path}: data.mix: data source 0 (needle) has unknown keys ['colour']")
