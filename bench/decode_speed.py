"""Decode speed at a long context: budgeted caches vs transformers' DynamicCache, in one run.

    python bench/decode_speed.py --context 4096 --budget 256 --steps 64

Prefills the same ``--context`` tokens of the Paul Graham essays into each cache, then times ``--steps``
greedy decode steps. Prints tokens/s and the ratio to DynamicCache + sdpa measured in the same run.
"""

from __future__ import annotations

import torch
from common import essay_ids, setup, time_decode
from transformers import DynamicCache

import kvgates


def decode_rate(model, cache, ids: torch.Tensor, steps: int, device) -> float:
    """Tokens/s of ``steps`` decode steps after prefilling ``ids`` (prefill not timed)."""
    return steps / time_decode(model, cache, ids, steps, device)


def main() -> None:
    args, model, tokenizer = setup(__doc__, context=4096, budget=256, steps=64, policies=["streaming_llm", "h2o", "snapkv", "tova"])
    ids = essay_ids(tokenizer, args.context, args.device)
    baseline = decode_rate(model, DynamicCache(config=model.config), ids, args.steps, args.device)
    print(f"{'DynamicCache + sdpa':28s} {baseline:8.1f} tok/s   1.00x")
    runs = [("full (kvgates runtime)", kvgates.BudgetCache(model.config, "full"))]
    runs += [(f"{p}@{args.budget}", kvgates.BudgetCache(model.config, p, budget=args.budget)) for p in args.policies]
    for label, cache in runs:
        rate = decode_rate(model, cache, ids, args.steps, args.device)
        print(f"{label:28s} {rate:8.1f} tok/s   {rate / baseline:.2f}x   (KV {cache.kv_bytes() / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
