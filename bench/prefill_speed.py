"""Prefill time with SnapKV compression vs without, in one run.

    python bench/prefill_speed.py --context 2048 4096 --budget 256

Times one forward of the prompt through: DynamicCache + sdpa, the kvgates runtime with the full policy, and
SnapKV (window scoring + compaction at the end of the prompt). Prints seconds and the ratio to DynamicCache.
"""

from __future__ import annotations

import torch
from common import essay_ids, setup, timed
from transformers import DynamicCache

import kvgates


def main() -> None:
    args, model, tokenizer = setup(__doc__, context=[2048, 4096], budget=256, repeats=2, policies=["snapkv", "pyramidkv", "h2o"])
    for n in args.context:
        ids = essay_ids(tokenizer, n, args.device)

        def prefill(make_cache):
            with torch.no_grad():
                model(ids, past_key_values=make_cache(), logits_to_keep=1)

        base = timed(lambda: prefill(lambda: DynamicCache(config=model.config)), args.device, args.repeats)
        print(f"context {n}: DynamicCache + sdpa {base:.3f} s")
        runs = [("full (kvgates runtime)", lambda: kvgates.BudgetCache(model.config, "full"))]
        runs += [(f"{p}@{args.budget}", lambda p=p: kvgates.BudgetCache(model.config, p, budget=args.budget)) for p in args.policies]
        for label, make in runs:
            t = timed(lambda: prefill(make), args.device, args.repeats)
            print(f"  {label:26s} {t:.3f} s   {t / base:.2f}x")


if __name__ == "__main__":
    main()
