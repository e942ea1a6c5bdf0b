"""What a user installs and copies: the lean core import and the README's runtime snippet."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
#: What the `train` extra brings (pyproject.toml): the library must work without any of it.
TRAIN_EXTRA = ("accelerate", "deepspeed", "trl", "wandb", "datasets", "matplotlib")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def readme_snippet(heading: str) -> str:
    """The first Python block of the README after ``heading``."""
    text = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_the_library_works_without_the_train_extra(checkpoint):
    """The core install (no accelerate, deepspeed, trl, wandb, datasets, matplotlib): a subprocess where those
    cannot be imported (as if not installed; transformers then treats them as absent) loads a model, generates
    through a BudgetCache with a heuristic and a learned policy, saves and loads gates, and runs the CLI."""
    code = f"""
import sys
for name in {TRAIN_EXTRA!r}:
    sys.modules[name] = None  # import fails, importlib.util.find_spec says absent
import torch
import kvgates
from kvgates.cli import main
model, tok = kvgates.load_model({str(checkpoint)!r})
ids = tok("the quick brown fox jumps over the lazy dog " * 3, return_tensors="pt")
model.generate(**ids, past_key_values=kvgates.BudgetCache(model.config, "snapkv", budget=16, window=4), max_new_tokens=3)
gates = kvgates.RetentionGates.for_model(model)
gates.save_pretrained(sys.argv[1])
policy = kvgates.make_policy("trimkv", budget=16, gates=kvgates.load_gates(sys.argv[1])).attach(model)
model.generate(**ids, past_key_values=kvgates.BudgetCache(model.config, policy), max_new_tokens=3)
kvgates.load_gates("smollm2-135m-trimkv")
assert main(["generate", "--model", {str(checkpoint)!r}, "--policy", "h2o", "--budget", "8", "--prompt", "hello"]) == 0
imported = sorted(n for n in {TRAIN_EXTRA!r} if sys.modules.get(n) is not None)
assert not imported, imported
"""
    done = subprocess.run([sys.executable, "-c", code, str(checkpoint.parent / "gates")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_import_kvgates_imports_no_heavy_library():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, kvgates; print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_the_readme_runtime_snippet_runs(checkpoint):
    """README "Using the runtime", verbatim but for the model (a tiny local checkpoint instead of the embedded one)."""
    snippet = readme_snippet("## Using the runtime")
    assert 'kvgates.load_model("smollm2-135m")' in snippet
    code = snippet.replace('"smollm2-135m"', repr(str(checkpoint)))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    held, allocated = (int(x) for x in done.stdout.splitlines()[0].split())
    assert 0 < held <= allocated


@pytest.mark.slow
def test_the_readme_runtime_snippet_runs_verbatim_on_the_embedded_model():
    done = subprocess.run([sys.executable, "-c", readme_snippet("## Using the runtime")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_older_transformers_is_refused_in_one_sentence():
    """A transformers older than pyproject.toml's lower bound is named with the fix (a GPU machine's own 5.17
    imported kvgates and failed later, in BudgetCache, with 'no full-attention layer')."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 (pyproject.toml's dev extra brings tomli there)
        import tomli as tomllib

    from kvgates.runtime import MIN_TRANSFORMERS, check_transformers

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers>={MIN_TRANSFORMERS},<5.24" in dependencies
    with pytest.raises(ImportError, match=r"needs transformers 5\.23 or newer.*imports transformers 5\.17\.0 from .*pip install"):
        check_transformers("5.17.0")
    check_transformers("5.23.0")
    check_transformers("5.24.1")
