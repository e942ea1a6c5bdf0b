"""KV memory over a long generation: budgeted caches stay flat, DynamicCache grows linearly.

    python bench/kv_memory.py --tokens 2000 --budget 128 --every 250

Generates ``--tokens`` tokens greedily after a short essay prompt and prints the key/value bytes each cache
allocates every ``--every`` tokens and after the last one (a budgeted cache's slots, held or free; DynamicCache's
tokens), plus the ratio to DynamicCache at the end and whether that stayed flat. A policy may carry parameters, ``name:key=value,...``;
learned policies run with fresh gates of the model's shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import attached, bench_policy, essay_ids, setup, short_context
from transformers import DynamicCache

import kvgates
from kvgates import dynamic_cache_bytes
from kvgates.cli import quiet_exits
from kvgates.config import ConfigError, check_output_file, output_path
from kvgates.gates.adapter import atomic_write


def sampled_steps(tokens: int, every: int) -> list[int]:
    """The generated-token counts a size is taken at: every ``every`` tokens, and the last token where ``every`` does
    not divide ``tokens`` (the figures "at the end" were those of the last multiple of ``every``)."""
    return sorted({*range(every, tokens + 1, every), tokens})


def trace(model, cache, ids, tokens: int, every: int, size) -> tuple[list[int], set[int]]:
    """KV bytes at each of ``sampled_steps``, and the distinct per-head token counts seen after every step."""
    sampled = set(sampled_steps(tokens, every))
    sizes, held = [], set()
    with attached(model, cache), torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for step in range(1, tokens + 1):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            if isinstance(cache, kvgates.BudgetCache):
                held.update(cache.held_tokens().unique().tolist())
            if step in sampled:
                sizes.append(size(cache))
    return sizes, held


def plot(columns: dict[str, list[int]], steps: list[int], path: Path) -> None:
    """Draw the KV bytes of each cache against the generated tokens to ``path``, in the format its suffix names where
    matplotlib writes it (``.svg``, ``.pdf``), else PNG, through a temporary file (a plot stopped mid-write, Ctrl-C,
    leaves none half-written; the temporary file's name says no format, hence ``format``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (name, sizes) in enumerate(columns.items()):  # budgeted caches overlap exactly: vary the line style
        ax.plot(steps, [s / 2**20 for s in sizes], marker="os^v"[i % 4],
                linestyle=styles[i % 4], markersize=max(3, 7 - i), label=name)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title("KV memory during generation")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    suffix = path.suffix[1:].lower()
    kind = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    atomic_write(path, lambda p: fig.savefig(p, format=kind, dpi=110))
    plt.close(fig)


def problem(args) -> str | None:
    """What is wrong with the options before any generation: a prompt under the budget (a budgeted cache would grow
    until it held the budget, not flat), or a plot that cannot be written (``check_output_file``)."""
    short = short_context("--prompt", [args.prompt], args.budget)
    if short:
        return short
    if args.plot is not None:
        try:
            check_output_file(args.plot, "--plot", "plot file")
        except ConfigError as err:
            return str(err)
    return None


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, check=problem, prompt=200, tokens=2000, budget=128, every=250, policies=["streaming_llm", "h2o", "tova", "morphkv"],
        plot=None,
    )
    ids = essay_ids(tokenizer, args.prompt, args.device)
    columns, held = {}, {}
    columns["DynamicCache"], _ = trace(model, DynamicCache(config=model.config), ids, args.tokens, args.every, dynamic_cache_bytes)
    for policy in args.policies:
        cache = kvgates.BudgetCache(model.config, bench_policy(model, policy, args.budget))
        label = policy if policy.partition(":")[0] == "full" else f"{policy}@{args.budget}"
        columns[label], held[label] = trace(model, cache, ids, args.tokens, args.every, lambda c: c.kv_bytes())
    names, steps = list(columns), sampled_steps(args.tokens, args.every)
    print("generated  " + "  ".join(f"{n:>18s}" for n in names) + "   (KV MiB allocated)")
    for i, step in enumerate(steps):
        row = "  ".join(f"{columns[n][i] / 2**20:18.2f}" for n in names)
        print(f"{step:9d}  {row}")
    if args.plot:
        path = output_path(args.plot)  # the file problem() checked (a leading ~ is the home folder)
        plot(columns, steps, path)
        print(f"plot: {path}")
    base = columns["DynamicCache"][-1]
    for n in names[1:]:
        # One sample shows no trend either way.
        flat = "one sample: no trend" if len(columns[n]) < 2 else "flat" if len(set(columns[n])) == 1 else "NOT flat"
        counts = sorted(held[n])
        print(f"{n}: {columns[n][-1] / base:.3f}x DynamicCache at the end, {flat}; tokens per head after every step: "
              f"{counts[0]}..{counts[-1]}")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
