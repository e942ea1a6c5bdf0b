"""Command line of the evaluation workbench (run from the repo root).

    python -m eval ab --config configs/eval/ab.yaml            # the full A/B report
    python -m eval ab --config configs/eval/ab.yaml --quick    # its smaller, complete version
    python -m eval ab --config configs/eval/ab.yaml 'budgets=[128]' output_dir=outputs/ab-128   # key=value overrides
    python -m eval ab --config configs/eval/demo.yaml --out outputs/demo --fresh
    python -m eval softhard --budget 128 --gates smollm2-135m-trimkv-128   # training's soft KL vs inference's hard KL

``ab`` reads the config (``base:`` and ``key=value`` overrides, as ``kvgates.config`` reads them; with ``--quick``,
a key its quick section sets is overridden there: ``quick.budgets=[64]``), validates the whole of it (arms, budgets,
tasks, adapters, the model's config) before any model work, runs every arm at every budget on the same examples,
journals each result to ``results.jsonl`` (an interrupted run resumes, and one with every result journalled reports
them without loading the model; ``--fresh`` starts over) and writes ``results.json``, ``report.md`` and PNG plots to
the output folder. ``--report-only`` writes them from the results journalled so far, without loading the model (the
progress of a long run); a folder with no results yet is an error, and so is one whose report holds results the
config does not have (another config's or other overrides': it is not rewritten from what the two share). ``seconds``
in ``results.json`` is the wall time of the invocations that computed, summed: a re-run adds its own,
``--report-only`` adds nothing, ``--fresh`` starts from zero. Every user error is one sentence on stderr and exit
status 2, leaving no empty output folder; Ctrl-C ends a run with status 130 and a line naming the journal the same
command resumes from, not a traceback. Configs write under ``outputs/`` (git-ignored); the committed reports under
``docs/`` are regenerated only on purpose, by naming them: ``--out docs/reference``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import kvgates
from eval.config import ABConfig, ConfigError
from kvgates.cli import OneLineParser, plain, quiet_exits, require_installed, usage_error
from kvgates.config import check_output_folder
from kvgates.models import check_model_source


def main(argv: list[str] | None = None) -> int:
    """The command's exit status: 0, 2 for a user error (one sentence on stderr), 130 for Ctrl-C, 141 for a reader
    that left early and 1 for a standard output that takes no more (``kvgates.cli.quiet_exits``: no traceback)."""
    return quiet_exits(lambda: _main(argv), "python -m eval")


def _main(argv: list[str] | None) -> int:
    parser = OneLineParser(prog="python -m eval", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ab = commands.add_parser("ab", help="A/B evaluation of policies and gate adapters at matched KV memory")
    ab.add_argument("--config", required=True, help="YAML run config (configs/eval/*.yaml)")
    ab.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, values as YAML (budgets=[128], tasks=[needle])")
    ab.add_argument("--quick", action="store_true", help="apply the config's quick section: a smaller, complete report")
    ab.add_argument("--out", help="output folder (default: the config's output_dir)")
    journal = ab.add_mutually_exclusive_group()  # --fresh discards the journal that --report-only reports
    journal.add_argument("--fresh", action="store_true", help="ignore results already journalled in results.jsonl")
    journal.add_argument("--report-only", action="store_true", help="compute nothing: report what results.jsonl holds so far")
    commands.add_parser("softhard", add_help=False, help="retention gates' KL to the full cache under soft and hard eviction (eval.soft_hard)")
    args, rest = parser.parse_known_args(argv)
    require_installed("python -m eval", ("matplotlib",) if args.command == "ab" else ())  # (the report's plots)
    if args.command == "softhard":
        from eval.soft_hard import main as soft_hard_main

        try:
            soft_hard_main(rest)
        except (ConfigError, kvgates.AdapterError, kvgates.UnsupportedModelError) as err:  # (a bad option or window: its parser's)
            return usage_error("python -m eval softhard", err)
        return 0
    args.overrides += [r for r in rest if not r.startswith("-")]  # overrides after an option (argparse leaves them)
    rest = [r for r in rest if r.startswith("-")]
    if rest:
        ab.error(f"unrecognized arguments: {' '.join(rest)}")  # (the subcommand's: "python -m eval ab: ...")

    out = None
    try:
        config = ABConfig.load(args.config, args.overrides, quick=args.quick, output_dir=args.out)
        check_output_folder(config.output_dir, "--out" if args.out is not None else "output_dir")
        out = Path(config.output_dir)
        made = not out.exists()
        from eval.report import REPORT, check_output_files, write_report
        from eval.runner import RECORD, has_results, missing_results, run_ab, unreported_results

        check_output_files(config)  # (a folder named report.md was a traceback once every result had been computed)
        foreign = unreported_results(config) if args.report_only else 0
        if foreign:  # another run's report: what the two share would replace it
            raise ConfigError(
                f"{out / RECORD} reports {foreign} results that are not this config's (another config, other overrides or "
                "changed adapters wrote it); rewrite it with the command on the Reproduce line of its report.md"
            )
        if args.report_only and not has_results(config):
            raise ConfigError(f"{out} holds no results of this config yet; run it without --report-only first")
        if not args.report_only and (args.fresh or missing_results(config)):  # a complete journal needs no model
            check_model_source(config.model)
        results = run_ab(config, resume=not args.fresh, compute=not args.report_only)
    except (ConfigError, kvgates.AdapterError, kvgates.UnsupportedModelError, KeyboardInterrupt) as err:
        from eval.runner import JOURNAL

        if out is not None and made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a run stopped before its first result leaves no empty folder
        elif isinstance(err, KeyboardInterrupt) and out is not None and (out / JOURNAL).is_file():
            print(f"python -m eval ab: interrupted; the results journalled in {out / JOURNAL} are kept, and the same command "
                  "resumes from them", file=sys.stderr)
        if isinstance(err, KeyboardInterrupt):  # Ctrl-C: what the run keeps, not the traceback (quiet_exits ends it)
            raise
        return usage_error("python -m eval ab", err)
    # The command that reproduces these results (what --fresh/--report-only did is not part of them).
    flags = ["--config", args.config] + ["--quick"] * args.quick + (["--out", args.out] if args.out else [])
    command = "python -m eval ab " + shlex.join(flags + args.overrides)
    print(write_report(results, command))
    print(f"\nreport: {Path(config.output_dir) / REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
