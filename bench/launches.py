"""Kernel launches and host syncs of a decode step and a prefill per policy, against DynamicCache, counted on any device.

    python bench/launches.py --model random --layers 4 --context 1024 --budget 256
    python bench/launches.py --policies full snapkv h2o --slack 32

On a GPU a budgeted decode step was measured at 5.5-11x its memory roofline (issue 26): launches and host syncs,
not bandwidth, set its pace. Both can be counted without a GPU (``kvgates.runtime.launches.Launches``): every aten
operator that is not a view is at least one kernel launch on a GPU, and a read back to the host (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``, ``nonzero``, ``equal``...) makes the host wait for the device. This script
counts both over one prefill of ``--context`` tokens and over one decode step (the
third after the prompt, as caches are warm by then), per arm: a DynamicCache + sdpa (the reference) and a
``BudgetCache`` per policy at ``--budget`` (per-step evicting policies also with ``--slack``). It prints the counts
per layer and their ratio to the reference, and with ``--ops N`` the N most frequent operators of each prefill
and decode step, and the operators behind each arm's host syncs. Counts do not depend on timing, so a CPU run predicts what
changes on a GPU, with two differences: on the CPU a prefill's attention and statistics are the torch reference's,
tile by tile (one Triton launch or a few on a GPU), and a few policies take other paths on a GPU, where launches
and reads cost more than arithmetic (``kvgates.kernels.host.launch_bound``: D2O's merge tiles, KVMerger's scan):
``--launch-bound`` counts those paths on the CPU.
"""

from __future__ import annotations

import os
import sys

import torch
from common import attached, bench_policy, essay_ids, setup, short_context
from decode_speed import AMORTISED, make_policy
from transformers import DynamicCache

import kvgates
from kvgates.cli import quiet_exits
from kvgates.kernels.host import LAUNCH_BOUND_ENV
from kvgates.runtime.launches import Launches

POLICIES = ["full", "snapkv", "pyramidkv", "adakv", "streaming_llm", "h2o", "tova", "morphkv", "trimkv", "d2o", "kvmerger"]


def count(model, make_cache, ids: torch.Tensor) -> tuple[Launches, Launches]:
    """(prefill count, decode-step count) of ``ids`` into a fresh ``make_cache()``."""
    cache, prefill, step = make_cache(), Launches(), Launches()
    with attached(model, cache), torch.no_grad():
        with prefill:
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(2):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        with step:
            model(token, past_key_values=cache)
    return prefill, step


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, check=lambda args: short_context("--context", [args.context], args.budget, prefill=True), zero_ok=("slack",), context=1024,
        budget=256, batch=1, slack=32, ops=0, policies=POLICIES, launch_bound=False,
    )
    if args.launch_bound:
        os.environ[LAUNCH_BOUND_ENV] = "1"
    layers = model.config.num_hidden_layers
    arms = {"DynamicCache + sdpa": lambda: DynamicCache(config=model.config)}
    for name in args.policies:
        arms[name] = lambda name=name: kvgates.BudgetCache(model.config, bench_policy(model, name, args.budget))
        if name.partition(":")[0] in AMORTISED and args.slack:
            arms[f"{name} slack={args.slack}"] = lambda name=name: kvgates.BudgetCache(
                model.config, make_policy(model, name, args.budget, args.slack)
            )
    ids = essay_ids(tokenizer, args.context, args.device, args.batch)
    counts = {label: count(model, make, ids) for label, make in arms.items()}
    base_prefill, base_step = counts["DynamicCache + sdpa"]
    print(f"\nper layer ({layers} layers), context {args.context}, budget {args.budget}, batch {args.batch}")
    print("| arm | prefill launches | vs DynamicCache | prefill syncs | decode launches | vs DynamicCache | decode syncs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (prefill, step) in counts.items():
        print(
            f"| {label} | {prefill.launches / layers:.1f} | {prefill.launches / base_prefill.launches:.2f}x "
            f"| {prefill.syncs / layers:.1f} | {step.launches / layers:.1f} | {step.launches / base_step.launches:.2f}x "
            f"| {step.syncs / layers:.2f} |"
        )
    for label, (prefill, step) in counts.items():
        for phase, counted in (("prefill", prefill), ("decode step", step)):
            if counted.syncs:
                syncs = ", ".join(f"{name} {n / layers:.1f}" for name, n in counted.sync_ops.most_common())
                print(f"{label}, {phase}: host syncs per layer by operator: {syncs}")
    if args.ops:
        for label, (prefill, step) in counts.items():
            for phase, counted in (("prefill", prefill), ("decode step", step)):
                top = ", ".join(f"{name} {n / layers:.1f}" for name, n in counted.ops.most_common(args.ops))
                print(f"\n{label}, {phase} per layer: {top}")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
