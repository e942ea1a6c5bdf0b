"""Decode step cost of every policy against DynamicCache + sdpa at the held size and at the full context, in one run.

    python bench/decode_speed.py --configs 4096:256 8192:512 --batch 1 8 --steps 16 --rounds 3

A budgeted decode step should cost what a plain ``DynamicCache`` + sdpa step over as many tokens costs (what a
kvpress user pays after prefill-only compression). For each ``context:budget`` pair the script prefills
``context`` essay tokens once per cache at batch 1: a DynamicCache of ``budget`` tokens (the physical reference,
1.00x), a DynamicCache of the full context, and a ``BudgetCache`` per policy (per-step evicting policies also
with amortised eviction over ``--slack + 1`` steps). Batch > 1 repeats every prefilled cache
(``batch_repeat_interleave``).
Every cache then decodes ``--steps`` greedy steps once per round, for ``--rounds`` interleaved rounds, so that
drifts of a shared machine hit all caches alike; the table gives the median ms/step and its ratio to both
DynamicCaches. The DynamicCaches are cropped back to their prompt before every round, so they keep their size;
budgeted caches of policies that do not evict during decode grow by the decoded tokens (which counts against
them). Learned policies run with fresh gates of the model's shape (their cost does not depend on the weights).
A policy may carry parameters, ``name:key=value,...`` (``--policies adakv adakv:ragged=false``).
"""

from __future__ import annotations

import statistics

import torch
from common import attached, bench_policy, essay_ids, setup, time_decode
from transformers import DynamicCache

import kvgates

POLICIES = [
    "full", "snapkv", "pyramidkv", "adakv", "dynamickv", "kvmerger",
    "streaming_llm", "h2o", "tova", "morphkv", "trimkv", "trimkv-morph", "d2o",
]
#: Policies that evict on every decode step, and the parameter that amortises their evictions over ``slack + 1``
#: steps (``PerStepEviction.slack``; MorphKV's ``evict_every`` and TRIM-KV's ``buffer`` are the same mechanism).
AMORTISED = {
    "streaming_llm": lambda s: {"slack": s}, "h2o": lambda s: {"slack": s}, "tova": lambda s: {"slack": s},
    "morphkv": lambda s: {"evict_every": s + 1}, "trimkv": lambda s: {"buffer": s},
    "trimkv-morph": lambda s: {"evict_every": s + 1}, "d2o": lambda s: {"slack": s},
}


def make_policy(model, name: str, budget: int, slack: int = 0) -> kvgates.Policy:
    """``name`` at ``budget`` (full: no budget), with amortised eviction when ``slack``."""
    return bench_policy(model, name, budget, **(AMORTISED[name.partition(":")[0]](slack) if slack else {}))


def prefilled(model, make_cache, ids: torch.Tensor):
    """A cache holding ``ids`` and the greedy next token ``[1, 1]``."""
    cache = make_cache()
    with attached(model, cache), torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    return cache, token


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, configs=["4096:256", "8192:512"], batch=[1, 8], steps=16, rounds=3, slack=32, policies=POLICIES
    )
    for config in args.configs:
        context, budget = (int(x) for x in config.split(":"))
        ids = essay_ids(tokenizer, context, args.device)
        runs = {
            f"DynamicCache {budget}": lambda: DynamicCache(config=model.config),
            f"DynamicCache {context}": lambda: DynamicCache(config=model.config),
        }
        for name in args.policies:
            runs[name] = lambda name=name: kvgates.BudgetCache(model.config, make_policy(model, name, budget))
            if name.partition(":")[0] in AMORTISED and args.slack:
                runs[f"{name} slack={args.slack}"] = lambda name=name: kvgates.BudgetCache(
                    model.config, make_policy(model, name, budget, args.slack)
                )
        caches = {}
        for label, make in runs.items():
            prompt = ids[:, :budget] if label == f"DynamicCache {budget}" else ids
            caches[label] = prefilled(model, make, prompt)
        for batch in args.batch:
            if batch > 1:
                for label, (cache, token) in caches.items():
                    cache.batch_repeat_interleave(batch // token.shape[0])
                    caches[label] = (cache, token.repeat_interleave(batch // token.shape[0], dim=0))
            times: dict[str, list[float]] = {label: [] for label in caches}
            for _ in range(args.rounds):
                for label, (cache, token) in caches.items():
                    if isinstance(cache, DynamicCache):
                        cache.crop(-(cache.get_seq_length() - (budget if label == f"DynamicCache {budget}" else context)))
                    with attached(model, cache):
                        times[label].append(1e3 * time_decode(model, cache, token, args.steps, args.device) / args.steps)
            ms = {label: statistics.median(t) for label, t in times.items()}
            base, full = ms[f"DynamicCache {budget}"], ms[f"DynamicCache {context}"]
            print(f"\ncontext {context}, budget {budget}, batch {batch}: median of {args.rounds} rounds x {args.steps} steps")
            print(f"| cache | ms/step | vs DynamicCache {budget} | vs DynamicCache {context} |")
            print("|---|---:|---:|---:|")
            for label, t in ms.items():
                print(f"| {label} | {t:.1f} | {t / base:.2f}x | {t / full:.2f}x |")


if __name__ == "__main__":
    main()
