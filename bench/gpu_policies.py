"""Every policy on a model's real shapes: its prefill against a plain sdpa prefill, and its decode step against
DynamicCache at the budget, at the full context and against the step's HBM roofline, in one run.

    python bench/gpu_policies.py --model random:llama-3.1-8b --layers 16 --contexts 8192 16384 --budget 1024 --batch 1 8
    python bench/gpu_policies.py --model random --layers 2 --contexts 160 --budget 64 --steps 2 --rounds 1   # CPU check

For each context and batch the prompt (essay tokens, or random ids for a random model; a different passage in every
row, ``common.essay_ids``) is prefilled by every arm once per round for ``--rounds`` interleaved rounds (after one
warm-up round; every other round runs the arms in reverse order, ``round_order``): a DynamicCache + sdpa (the
reference, 1.00x) and a ``BudgetCache`` per policy at ``--budget`` (its prompt scoring and compression included).
Then each arm's cache, and a DynamicCache of ``--budget`` tokens (what a cache of that size costs), decode
``--steps`` greedy steps once per round, interleaved in the same order, after one untimed warm-up round as the
prefill's (each round also runs two untimed steps first); DynamicCaches are cropped back to their prompt before each
round. Per-step evicting policies also run with amortised eviction over ``--slack + 1`` steps; a cache that evicts
every few steps times ``--steps`` rounded up to whole eviction periods (``timed_steps``), so that its step carries
its share of an eviction. The decode table gives the median ms/step, its ratio to both DynamicCaches, and the step's
HBM roofline: the bytes a step must read (every weight but the input embedding table, of which it reads one row per
sequence, plus the key/value bytes the cache holds) over the device's peak bandwidth (``hardware.PEAK_GBPS`` by GPU
name, or ``--peak-gbps``; ``-`` on CPU). Learned policies run with fresh gates of the model's shape.

``--compile inductor --compile-mode reduce-overhead`` adds captured decode rows to the same table: the forward
compiled once (``fullgraph``, a CUDA graph per cache kind on a GPU) over a transformers ``StaticCache`` holding the
budget's tokens (the captured reference) and a static ``BudgetCache`` (``static=True``) per policy whose decode step
compiles (``sync_free_decode``), labelled ``... captured`` (on the CPU the mode compiles as ``default`` does).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

from common import (
    attached,
    bench_policy,
    crop_to,
    decode_rounds,
    essay_ids,
    periods_note,
    round_order,
    setup,
    short_context,
    time_decode,
    time_prefill,
    timed_steps,
)
from decode_speed import AMORTISED, COMPILE_MODES, compile_mode_problem, compiled_forward, make_policy, static_arms, time_compiled
from hardware import peak_gbps
from transformers import DynamicCache, StaticCache

import kvgates
from kvgates.cli import quiet_exits
from kvgates.runtime.cache import dynamic_cache_bytes

POLICIES = ["snapkv", "pyramidkv", "adakv", "dynamickv", "streaming_llm", "h2o", "tova", "morphkv", "trimkv", "d2o"]
CAPTURED = " captured"  # the label suffix of arms whose decode steps run compiled


def step_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter but the input embedding table (unless it is tied to
    the output head, which reads all of it)."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    skip = None if output is not None and output.weight is embedding else embedding
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def held_bytes(cache) -> int:
    """Key/value bytes ``cache`` holds (what attention reads in a step)."""
    return cache.held_bytes() if isinstance(cache, kvgates.BudgetCache) else dynamic_cache_bytes(cache)


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n| " + " | ".join(header) + " |\n|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def check(args) -> str | None:
    """What is wrong with the parsed options, in one sentence, else None (``setup``'s ``check``)."""
    return compile_mode_problem(args) or short_context("--contexts", args.contexts, args.budget, prefill=True)


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, {"compile": ["inductor", "aot_eager"], "compile_mode": COMPILE_MODES}, zero_ok=("slack",), contexts=[8192, 16384],
        budget=1024, batch=[1, 8], steps=8, rounds=2, slack=32, peak_gbps=0.0, policies=POLICIES, compile=None,
        compile_mode="default", check=check,
    )
    peak = peak_gbps(args.device, args.peak_gbps)
    weights = step_weight_bytes(model)
    budget = args.budget
    decoded = (args.rounds + 1) * (args.steps + 2)  # tokens a cache decodes in a run (a warm-up round; each round 2 untimed)
    arms: dict[str, Callable[[], object]] = {"DynamicCache + sdpa": lambda: DynamicCache(config=model.config)}
    for name in args.policies:
        arms[name] = lambda name=name: kvgates.BudgetCache(model.config, bench_policy(model, name, budget))
        if name.partition(":")[0] in AMORTISED and args.slack:
            arms[f"{name} slack={args.slack}"] = lambda name=name: kvgates.BudgetCache(
                model.config, make_policy(model, name, budget, args.slack)
            )
    compiled = None
    if args.compile:
        compiled = compiled_forward(model, args.compile, args.compile_mode)
        arms.update(static_arms(model, list(arms)[1:], budget, decoded, CAPTURED))
    for context in args.contexts:
        for batch in args.batch:
            ids = essay_ids(tokenizer, context, args.device, batch)
            prefill: dict[str, list[float]] = {label: [] for label in arms}
            caches = dict.fromkeys(arms)  # (in the arms' order, whichever order the last round ran them in)
            for r in range(args.rounds + 1):  # round 0 warms up; the last round's caches go on to decode
                for label in round_order(list(arms), r):
                    seconds, cache = time_prefill(model, arms[label], ids, args.device)
                    if r:
                        prefill[label].append(seconds)
                    if r == args.rounds:
                        caches[label] = cache
                    del cache
            base = statistics.median(prefill["DynamicCache + sdpa"])
            rows = [[label, f"{statistics.median(t):.3f}", f"{statistics.median(t) / base:.2f}x"] for label, t in prefill.items()]
            table(f"prefill, context {context}, batch {batch}: median of {args.rounds} interleaved rounds", ["arm", "seconds", "vs sdpa"], rows)

            small = f"DynamicCache {budget}"
            caches[small] = time_prefill(model, arms["DynamicCache + sdpa"], ids[:, :budget], args.device)[1]
            if compiled is not None:  # the captured reference: a StaticCache holding the budget's tokens
                static = f"StaticCache {budget}{CAPTURED}"
                make = lambda: StaticCache(config=model.config, max_cache_len=budget + decoded)  # noqa: E731
                caches[static] = time_prefill(model, make, ids[:, :budget], args.device)[1]
            sizes = {small: budget, "DynamicCache + sdpa": context}  # what DynamicCaches are cropped back to
            token = ids[:, :1]  # the first decode input (a step costs the same whatever the token)
            held: dict[str, int] = {}
            windows = {label: timed_steps(cache, args.steps) for label, cache in caches.items()}

            def step_ms(label: str, cache) -> float:
                crop_to(cache, sizes.get(label))
                with attached(model, cache):
                    if label.endswith(CAPTURED):
                        seconds = time_compiled(compiled, cache, token, windows[label], args.device)
                    else:
                        seconds = time_decode(model, cache, token, windows[label], args.device)
                held[label] = held_bytes(cache)
                return 1e3 * seconds / windows[label]

            ms = {label: statistics.median(t) for label, t in decode_rounds(caches, args.rounds, step_ms).items()}
            rows = []
            for label, t in ms.items():
                roof = None if peak is None else 1e3 * (weights + held[label]) / (peak * 1e9)
                rows.append([
                    "DynamicCache " + str(context) if label == "DynamicCache + sdpa" else label, f"{t:.2f}",
                    f"{t / ms[small]:.2f}x", f"{t / ms['DynamicCache + sdpa']:.2f}x",
                    "-" if roof is None else f"{roof:.2f}", "-" if roof is None else f"{t / roof:.1f}x",
                ])
            table(
                f"decode, context {context}, budget {budget}, batch {batch}: median ms/step of {args.rounds} rounds x {args.steps} steps"
                + periods_note(windows, args.steps),
                ["cache", "ms/step", f"vs DynamicCache {budget}", f"vs DynamicCache {context}", "roofline ms", "vs roofline"],
                rows,
            )
            del caches


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
