"""Why the A/B harness never pads a batch: prefill of padded batches vs the same prompts one at a time.

    python bench/ab_batching.py --context 2000 --rows 4 --policies snapkv h2o

Greedy answers (12 new tokens) to ``rows`` needle prompts of about ``context`` tokens whose lengths differ by a
token or a few (row ``i`` asks for ``context - i``), under each policy: once as one left-padded batch (the prefill
takes the masked attention path) and once one prompt at a time (the causal path). Prints seconds and the ratio
padded / one at a time.
"""

from __future__ import annotations

import sys

import torch
from common import bench_policy, random_shape, setup, short_context, timed

from data.tasks import make_example
from eval.fidelity import greedy_generate
from kvgates.cli import quiet_exits


def check(args) -> str | None:
    """What this bench cannot run, in one sentence before the model loads (else None)."""
    if random_shape(args.model) is not None:
        return f"--model {args.model}: the prompts are text, so this bench needs a model with a tokenizer, not random weights"
    if args.context < 64:
        return f"--context {args.context}: a needle prompt needs at least 64 tokens"
    if args.rows < 2:
        return f"--rows {args.rows}: a padded batch needs at least 2 prompts"
    if args.context - args.rows + 1 < 64:
        return (f"--context {args.context}, --rows {args.rows}: the last prompt asks for {args.context - args.rows + 1} tokens "
                "(one fewer a row), and a needle prompt needs at least 64")
    return short_context("--context", [args.context], args.budget)


def needle_depths(rows: int) -> list[float]:
    """Where each of ``rows`` prompts holds its needle: evenly from its start (0) to its end (1)."""
    return [i / max(rows - 1, 1) for i in range(rows)]


def needle_prompts(tok, context: int, rows: int) -> list[torch.Tensor]:
    """The token ids of ``rows`` needle prompts (``needle_depths``), row ``i`` asking for ``context - i`` tokens: of
    lengths that differ, so that their batch is padded (asked for ``context`` tokens each, all eight of ``--context
    4000 --rows 8`` came out 3998 tokens long: a batch without padding)."""
    examples = [
        make_example("needle", tok, "test", context - i, seed=i, template_set="eval", depth=depth)
        for i, depth in enumerate(needle_depths(rows))
    ]
    return [tok(ex["prompt"], return_tensors="pt")["input_ids"][0] for ex in examples]


def main() -> None:
    args, model, tok = setup(__doc__, check=check, context=2000, rows=4, budget=256, policies=["snapkv", "h2o"])
    prompts = needle_prompts(tok, args.context, args.rows)
    print(f"prompt lengths {[len(p) for p in prompts]}")
    print("| policy | padded batch s | one at a time s | padded / one at a time |\n|---|---:|---:|---:|")
    for name in args.policies:
        with bench_policy(model, name, args.budget).attach(model) as policy:
            padded = timed(lambda: greedy_generate(model, tok, policy, prompts, 12), args.device)
            single = timed(lambda: [greedy_generate(model, tok, policy, [p], 12) for p in prompts], args.device)
        print(f"| {name} | {padded:.1f} | {single:.1f} | {padded / single:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
