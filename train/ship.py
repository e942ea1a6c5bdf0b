"""Ship a trained adapter inside the package (``kvgates/gates/embedded/NAME``), in fp16, with its A/B report.

    python -m train.ship checkpoints/smollm2-135m-trimkv/adapter smollm2-135m-trimkv --ab docs/reference --arm trimkv
    python -m train.ship smollm2-135m-trimkv smollm2-135m-trimkv --ab docs/reference --ab docs/reference-needles --arm trimkv

The weights are those ``train.py`` exported (no edit beyond the cast to float16, which halves the size; the policies
run gates in the model's own dtype by default, ``gate_dtype="auto"``, whatever dtype they were shipped in).
``--ab DIR --arm LABEL`` adds to the card's results the adapter's A/B table from the ``python -m eval ab`` run in DIR (its arm
LABEL beside the best heuristic and the full cache at each task and budget, and its verdicts), after the held-out
table ``train.py`` wrote, in place of any A/B sections the card had (re-shipping an adapter by its name with newer
runs replaces its tables); ``--ab`` may be given once per run, each run's table in the order given, the arm labelled
LABEL in each. The training record (recipe, command, time, data split) stays as ``train.py`` wrote it. The folder is
exactly what one would push to the Hub. Every error (a name that is not a plain folder name, or names an adapter shipped
for another model, an unreadable adapter, one without the training record or held-out table a finished run writes, an
A/B folder without that arm) is one sentence and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import kvgates
from eval.arms import UNTRAINED, load_adapter
from eval.report import AB_SECTION, arm_section, read_record
from kvgates.cli import OneLineParser, plain, quiet_exits, usage_error
from kvgates.gates.adapter import CONFIG_FILE
from kvgates.gates.embedded import EMBEDDED_DIR

#: What a shipped adapter's name may be: lower-case letters, digits, '.', '_' and '-' (a folder name, never a path).
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def check_name(name: str) -> None:
    """``ValueError`` unless ``name`` can name a shipped adapter (one folder inside ``kvgates/gates/embedded``)."""
    if not NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"{name!r} cannot name a shipped adapter; a name is lower-case letters, digits, '.', '_' and '-' "
            "(e.g. smollm2-135m-trimkv), never a path: it ships as kvgates/gates/embedded/NAME"
        )


def ship(source: str | Path, name: str, ab: str | Path | Sequence[str | Path] = (), arm: str | None = None) -> Path:
    """Copy the adapter at ``source`` to ``kvgates/gates/embedded/name`` in float16, its card extended with its arm
    ``arm`` (default: ``name``) of the A/B run folder ``ab`` (or of each folder, in order); returns the folder.
    ``ValueError`` (an ``AdapterError`` for the adapter) before anything is written when any input is wrong."""
    check_name(name)
    gates = kvgates.load_gates(source)
    held_out = gates.config.report.split(AB_SECTION)[0].strip()  # earlier A/B sections are replaced
    check_finished(gates, source, held_out)
    runs = [ab] if isinstance(ab, (str, Path)) else list(ab)
    if runs:
        sections = [arm_section(run, arm or name) for run in runs]  # every run checked before the card changes
        for run in runs:
            check_arm_ran(gates, run, arm or name)
        gates.config.report = "\n\n".join([held_out, *sections]).strip()
    check_same_model(gates, EMBEDDED_DIR / name)
    return gates.to(torch.float16).save_pretrained(EMBEDDED_DIR / name)


def check_finished(gates: kvgates.GateSet, source: str | Path, held_out: str) -> None:
    """``ValueError`` unless ``gates`` (read from ``source``) hold what a finished ``train.py`` run writes into its
    adapter: the training record and the held-out table (``held_out``: the card's report before any A/B section), which
    every shipped card states. A checkpoint folder has neither; a run stopped during its table, no table."""
    if not gates.config.training:
        raise ValueError(
            f"{source} holds no training record (recipe, command, data split): it is no adapter a finished train.py run exported; "
            "ship the run's adapter folder (checkpoints/RUN/adapter), not a checkpoint"
        )
    if not held_out:
        raise ValueError(
            f"{source} holds no held-out table: its run stopped before making it; add --resume to the run's command to make it "
            "(nothing is trained again), then ship its adapter"
        )


def check_same_model(gates: kvgates.GateSet, folder: Path) -> None:
    """``ValueError`` when ``folder``, where ``gates`` ship, holds a shipped adapter for another model (neither its id
    nor its weights' fingerprint are theirs): the policies loading it by name (``default_gates``) would get gates that do
    not fit the model they run on. Re-shipping newer gates for the same model replaces it."""
    try:
        there = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):  # nothing shipped there (save_pretrained refuses a file, and an adapter of another kind)
        return
    base, fingerprint = (there.get("base_model"), there.get("fingerprint")) if isinstance(there, dict) else (None, None)
    mine = gates.config
    if base is not None and base != mine.base_model and fingerprint != mine.fingerprint:
        raise ValueError(
            f"{folder} holds the shipped adapter {folder.name} for {base} (fingerprint {fingerprint}); these gates are for "
            f"{mine.base_model} (fingerprint {mine.fingerprint}): ship them under another name, or remove that folder first"
        )


def check_arm_ran(gates: kvgates.GateSet, run: str | Path, label: str) -> None:
    """``ValueError`` unless arm ``label`` of the A/B run folder ``run`` ran ``gates`` (their weights, in float16 as
    they ship): the adapter the run recorded for the arm, unchanged since (the weights' digest in its results'
    journal keys), holds them. Without it a card took the results of whatever adapter that arm had run."""
    results, config = read_record(run)
    arm = config.arm(label)
    if not arm.learned or arm.gates in (None, UNTRAINED):
        raise ValueError(f"arm {label!r} of {run} ran no trained adapter (policy {arm.policy}); pass the arm that ran this one as --arm")
    ran = {json.loads(row["key"])[4] for row in results["rows"] if row["arm"] == label and "key" in row}
    adapters: dict[str, kvgates.GateSet] = {}  # (the arm's adapter, read once)
    if ran != {arm.identity(adapters)}:
        raise ValueError(
            f"the adapter arm {label!r} of {run} ran ({arm.gates}) is not there as it ran (its weights changed or it is gone), "
            "so its results cannot be matched to this adapter; run the A/B again"
        )
    theirs, mine = load_adapter(arm, adapters).state_dict(), gates.state_dict()
    if theirs.keys() != mine.keys() or any(not torch.equal(theirs[k].half(), mine[k].half()) for k in mine):
        raise ValueError(f"arm {label!r} of {run} ran another adapter ({arm.gates}) than this one; pass the adapter it ran, or its arm")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m train.ship", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a trained adapter folder (checkpoints/RUN/adapter)")
    parser.add_argument("name", help="the name it ships under (e.g. smollm2-135m-trimkv)")
    parser.add_argument(
        "--ab", type=Path, action="append", default=[],
        help="an A/B run's output folder (python -m eval ab) to take a card table from; repeat for several runs",
    )
    parser.add_argument("--arm", help="the adapter's arm label in that run (default: the name)")
    args = parser.parse_args(argv)
    if args.arm is not None and not args.ab:
        parser.error("--arm labels the adapter's arm in an --ab run, and no --ab is given; add --ab DIR (the run's output folder)")
    try:
        folder = ship(args.source, args.name, args.ab, args.arm)
    except (ValueError, OSError) as err:  # a bad name, AdapterError, an A/B folder without results or that arm
        return usage_error(parser.prog, err)
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    print(f"shipped {args.source} as {args.name}: {folder} ({size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(quiet_exits(main, "python -m train.ship"))  # Ctrl-C, a closed or full stdout: no traceback
