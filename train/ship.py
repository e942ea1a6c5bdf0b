"""Ship a trained adapter inside the package (``kvgates/gates/embedded/NAME``), in fp16, with its A/B report.

    python -m train.ship checkpoints/smollm2-135m-trimkv/adapter smollm2-135m-trimkv --report docs/reference/ab.md

The weights are those ``train.py`` exported (no edit beyond the cast to float16, which halves the size; the
policies run gates in float32 by default either way). ``--report`` replaces the card's results section with the
given Markdown (the A/B tables of the adapter against the heuristics); the training record (recipe, command,
time, data split) stays as ``train.py`` wrote it. The folder is exactly what one would push to the Hub.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kvgates
from kvgates.gates.embedded import EMBEDDED_DIR


def ship(source: str | Path, name: str, report: str | None = None) -> Path:
    """Copy the adapter at ``source`` to ``kvgates/gates/embedded/name`` in float16; returns the folder."""
    gates = kvgates.load_gates(source)
    if report is not None:
        gates.config.report = report
    return gates.to(torch.float16).save_pretrained(EMBEDDED_DIR / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a trained adapter folder (checkpoints/RUN/adapter)")
    parser.add_argument("name", help="the name it ships under (e.g. smollm2-135m-trimkv)")
    parser.add_argument("--report", type=Path, help="a Markdown file whose text becomes the card's results")
    args = parser.parse_args(argv)
    folder = ship(args.source, args.name, args.report.read_text() if args.report else None)
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    print(f"shipped {args.source} as {args.name}: {folder} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
