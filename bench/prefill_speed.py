"""Prefill time of the kvgates runtime under each policy vs a plain DynamicCache + sdpa prefill, in one run.

    python bench/prefill_speed.py --context 2048 4096 --budget 256 --rounds 5 --policies snapkv h2o d2o kvmerger kvzip

Times one forward of the prompt through: DynamicCache + sdpa (the reference), the kvgates runtime with the full
policy, and each policy at ``--budget`` (its prompt scoring and compression included: KVzip's reconstruction
forwards too). After one warm-up call of
each, every arm runs once per round for ``--rounds`` interleaved rounds, so that drifts of a shared machine hit
all arms alike, each round starting at another arm so that no arm always runs after the same one (a run of every
policy in a fixed order put nine policies that only add work at 0.87-0.92x of the reference); the table gives each
arm's median seconds, its ratio to the reference's median, and the range of its ratio to the reference in the
same round (how far this machine's noise moves it).
"""

from __future__ import annotations

import statistics
import sys

from common import bench_policy, essay_ids, setup, short_context, time_prefill
from transformers import DynamicCache

import kvgates
from kvgates.cli import quiet_exits


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, check=lambda args: short_context("--context", args.context, args.budget, prefill=True), context=[2048, 4096], budget=256, rounds=3,
        policies=["snapkv", "pyramidkv", "h2o", "d2o", "kvmerger", "kvzip"],
    )
    arms = [("DynamicCache + sdpa", lambda: DynamicCache(config=model.config)), ("full (kvgates)", lambda: kvgates.BudgetCache(model.config, "full"))]
    arms += [
        (f"{p}@{args.budget}", lambda p=p: kvgates.BudgetCache(model.config, bench_policy(model, p, args.budget)))
        for p in args.policies if p != "full"  # (always an arm: "full (kvgates)")
    ]
    for n in args.context:
        ids = essay_ids(tokenizer, n, args.device)

        for _, make in arms:  # warm-up
            time_prefill(model, make, ids, args.device)
        times: dict[str, list[float]] = {label: [] for label, _ in arms}
        for r in range(args.rounds):
            start = r * len(arms) // args.rounds  # each round starts at another arm: no arm always follows the same one
            for label, make in arms[start:] + arms[:start]:
                times[label].append(time_prefill(model, make, ids, args.device)[0])
        seconds = {label: statistics.median(t) for label, t in times.items()}
        reference = times[arms[0][0]]
        base = seconds[arms[0][0]]
        print(f"\ncontext {n}: median of {args.rounds} interleaved rounds; the range is each round's ratio to that round's reference")
        print("| arm | seconds | vs DynamicCache + sdpa | range over rounds |\n|---|---:|---:|---:|")
        for label, s in seconds.items():
            ratios = [t / ref for t, ref in zip(times[label], reference)]
            print(f"| {label} | {s:.3f} | {s / base:.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
