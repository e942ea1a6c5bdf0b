r"""Decode step cost of every policy against DynamicCache + sdpa at the held size and at the full context, in one run.

    python bench/decode_speed.py --configs 4096:256 8192:512 --batch 1 8 --steps 16 --rounds 3

A budgeted decode step should cost what a plain ``DynamicCache`` + sdpa step over as many tokens costs (what a
kvpress user pays after prefill-only compression). For each ``context:budget`` pair and each ``--batch`` the script
prefills ``context`` essay tokens a row, a different passage in every row (``common.essay_ids``: a batch of one
prompt repeated would let every row keep the same tokens in every head, hiding what ragged rows cost), into a new
cache of each kind: a DynamicCache of ``budget`` tokens (the physical reference, 1.00x), a DynamicCache of the full
context, and a ``BudgetCache`` per policy (per-step evicting policies also with amortised eviction over ``--slack +
1`` steps, timed over ``--steps`` rounded up to whole eviction periods, ``common.timed_steps``, so that a step
carries its share of an eviction). Every cache then decodes ``--steps`` greedy steps once per round (after two
untimed ones), for ``--rounds`` interleaved rounds after one untimed warm-up round (a first round's allocations,
autotuning and compilation stay out of the medians), every other round in reverse order (``common.decode_rounds``),
so that drifts of a shared machine hit all caches alike; the table gives the median ms/step and its ratio to both
DynamicCaches. The DynamicCaches are cropped back to their prompt before every round, so they keep their size;
budgeted caches of policies that do not evict during decode grow by the decoded tokens (which counts against them).
Learned policies run with fresh gates of the model's shape (their cost does not depend on the weights). A policy may
carry parameters, ``name:key=value,...`` (``--policies adakv adakv:ragged=false``).

With ``--compile BACKEND`` (``inductor``; ``aot_eager`` only checks the graphs) the run adds compiled decode
steps, ``torch.compile(model.forward, fullgraph=True, dynamic=False)`` (one graph per cache and batch size) with
positions passed as generate() passes them: a transformers ``StaticCache`` holding the budget's tokens, with room
for those a batch size decodes (the compiled reference; a new one at every batch size), and, for every policy whose
decode step compiles (``sync_free_decode``), a static ``BudgetCache`` (``static=True``), with and without slack.
Compare a policy's ``compiled`` row with its eager row.
``--compile-mode reduce-overhead`` captures each compiled step as a CUDA graph (what generate() does with a
compileable cache on CUDA; on the CPU the mode compiles as ``default`` does):

    python bench/decode_speed.py --model random:llama-3.1-8b --configs 16384:1024 --batch 8 --steps 16 --rounds 2 \
        --policies full snapkv streaming_llm h2o tova morphkv trimkv --compile inductor --compile-mode reduce-overhead
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from common import attached, bench_policy, crop_to, decode_rounds, essay_ids, periods_note, policy_problem, setup, sync, time_decode, timed_steps
from transformers import DynamicCache, StaticCache

import kvgates
from kvgates.cli import quiet_exits

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


#: ``torch.compile`` modes of the compiled decode steps (``reduce-overhead``: CUDA graphs on a GPU).
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]


def compile_mode_problem(args) -> str | None:
    """``--compile-mode`` without ``--compile`` (every row would run uncompiled), in one sentence, else None."""
    if args.compile_mode != "default" and args.compile is None:
        return f"--compile-mode {args.compile_mode} applies to compiled steps only; add --compile inductor (or aot_eager)"
    return None


def make_policy(model, name: str, budget: int, slack: int = 0) -> kvgates.Policy:
    """``name`` at ``budget`` (full: no budget), with amortised eviction when ``slack``."""
    return bench_policy(model, name, budget, **(AMORTISED[name.partition(":")[0]](slack) if slack else {}))


def compiled_forward(model, backend: str, mode: str):
    """``model.forward`` compiled as generate() compiles it for a static cache (``fullgraph``, one graph per cache
    kind and batch size; ``mode="reduce-overhead"``: a CUDA graph each on a GPU)."""
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend, mode=mode)


def static_arms(model, labels: list[str], budget: int, decoded: int, suffix: str) -> dict[str, Callable[[], object]]:
    """``{label + suffix: make a static BudgetCache}`` for the arms ``labels`` (``policy`` or ``policy slack=N``)
    whose decode step compiles (``sync_free_decode``); a policy that evicts only the prompt gets ``decoded`` slots
    for the tokens it decodes (at one batch size: every batch size prefills new caches)."""
    arms = {}
    for label in labels:
        name, _, slack = label.partition(" slack=")
        policy = make_policy(model, name, budget, int(slack or 0))
        if policy.sync_free_decode:
            arms[label + suffix] = lambda policy=policy: kvgates.BudgetCache(
                model.config, policy, static=True, decode_slots=0 if policy.schedule.decode_every else decoded
            )
    return arms


def time_compiled(forward, cache, token: torch.Tensor, steps: int, device) -> float:
    """Seconds of ``steps`` greedy decode steps through a compiled ``forward`` after two untimed ones (as
    ``time_decode`` does); positions are passed, as generate() passes them, since a compiled step does not read the
    cache's length back. ``token`` is copied into the layout the steps' own tokens have (a slice of the prompt,
    ``ids[:, :1]``, has its row's stride: the compiled step, guarded on strides, compiled again inside the timed steps;
    ``contiguous()`` leaves a batch of one as it is)."""
    start = int(cache.get_seq_length())
    b = token.shape[0]
    token = token.clone(memory_format=torch.contiguous_format)

    def step(token: torch.Tensor, t: int) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's graph outputs may be overwritten
        pos = torch.tensor([t], device=device)
        out = forward(token, position_ids=pos[None].expand(b, 1), cache_position=pos, past_key_values=cache)
        return out.logits[:, -1:].argmax(-1)

    with torch.no_grad():
        token = step(step(token, start), start + 1)  # the second call records the CUDA graph in reduce-overhead
        sync(device)
        begin = time.perf_counter()
        for t in range(start + 2, start + 2 + steps):
            token = step(token, t)
        sync(device)
    return time.perf_counter() - begin


def prefilled(model, make_cache, ids: torch.Tensor):
    """A cache holding ``ids`` and the greedy next token of each row, ``[batch, 1]``."""
    cache = make_cache()
    with attached(model, cache), torch.no_grad():
        token = model(ids, past_key_values=cache, logits_to_keep=1).logits.argmax(-1)
    return cache, token


def context_budget(config: str) -> tuple[int, int]:
    """``(context, budget)`` of a ``--configs`` entry ``CONTEXT:BUDGET``; ``ValueError`` in one sentence for any other."""
    context, sep, budget = config.partition(":")
    try:
        pair = int(context), int(budget)
    except ValueError:
        pair = None
    if not sep or pair is None or min(pair) < 1:
        raise ValueError(f"--configs {config}: each entry is CONTEXT:BUDGET, two whole numbers of at least 1 (e.g. 4096:256)")
    if pair[1] > pair[0]:
        raise ValueError(f"--configs {config}: the budget is more than the context, so nothing is evicted; give a budget of at most {pair[0]}")
    return pair


def check(args) -> str | None:
    """What is wrong with ``--configs``, a ``--policies`` entry at a ``--configs`` budget or ``--compile-mode``, in one
    sentence, before the model loads (else None)."""
    for config in args.configs:
        try:
            budget = context_budget(config)[1]
        except ValueError as err:
            return str(err)
        for spec in args.policies:  # setup builds them at --budget, which this bench has not: at each entry's budget
            problem = policy_problem(spec, budget, f" at --configs {config}")
            if problem is not None:
                return problem
    return compile_mode_problem(args)


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, {"compile": ["inductor", "aot_eager"], "compile_mode": COMPILE_MODES}, zero_ok=("slack",), check=check,
        configs=["4096:256", "8192:512"], batch=[1, 8], steps=16, rounds=3, slack=32, policies=POLICIES, compile=None,
        compile_mode="default",
    )
    compiled = compiled_forward(model, args.compile, args.compile_mode) if args.compile else None
    per_batch = (args.rounds + 1) * (args.steps + 2)  # tokens a cache decodes at one batch size (a warm-up round; 2 untimed a round)
    for config in args.configs:
        context, budget = context_budget(config)
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
        if compiled is not None:
            runs[f"StaticCache {budget} compiled"] = lambda: StaticCache(config=model.config, max_cache_len=budget + per_batch)
            policies = [label for label in runs if not label.startswith(("DynamicCache", "StaticCache"))]
            runs.update(static_arms(model, policies, budget, per_batch, " compiled"))
        for batch in args.batch:
            ids = essay_ids(tokenizer, context, args.device, batch)  # a different passage in every row
            caches = {}
            for label, make in runs.items():
                prompt = ids[:, :budget] if label in (f"DynamicCache {budget}", f"StaticCache {budget} compiled") else ids
                caches[label] = prefilled(model, make, prompt)
            windows = {label: timed_steps(cache, args.steps) for label, (cache, _) in caches.items()}

            def step_ms(label: str, arm: tuple) -> float:
                cache, token = arm
                if label.startswith("DynamicCache"):
                    crop_to(cache, budget if label == f"DynamicCache {budget}" else context)
                with attached(model, cache):
                    if label.endswith("compiled"):
                        seconds = time_compiled(compiled, cache, token, windows[label], args.device)
                    else:
                        seconds = time_decode(model, cache, token, windows[label], args.device)
                return 1e3 * seconds / windows[label]

            ms = {label: statistics.median(t) for label, t in decode_rounds(caches, args.rounds, step_ms, f", batch {batch}").items()}
            base, full = ms[f"DynamicCache {budget}"], ms[f"DynamicCache {context}"]
            print(
                f"\ncontext {context}, budget {budget}, batch {batch}: median of {args.rounds} rounds x {args.steps} steps"
                + periods_note(windows, args.steps)
            )
            print(f"| cache | ms/step | vs DynamicCache {budget} | vs DynamicCache {context} |")
            print("|---|---:|---:|---:|")
            for label, t in ms.items():
                print(f"| {label} | {t:.1f} | {t / base:.2f}x | {t / full:.2f}x |")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
