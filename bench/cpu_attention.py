"""The CPU's scoring prefill attention against sdpa, per split of its batched products, in one run.

    python bench/cpu_attention.py                                      # SmolLM2-135M's heads, 4K, this machine's threads
    python bench/cpu_attention.py --shape llama-3.1-8b --contexts 2048 4096 --threads 16 8 4 2
    python bench/cpu_attention.py --parts 1 2 3 4 6 --rounds 15

One layer's prompt attention with the column sums H2O, D2O and KVMerger ask for
(``kvgates.kernels.reference.causal_attention_stats``, ``--window`` adds the window scores of SnapKV's family), on
random queries, keys and values of a ``RANDOM_SHAPES`` model's heads, against torch sdpa's causal attention without
them. On the CPU each KV head's rows of a tile are split into as many batched products as balance the threads
(``reference._balanced_parts``: SmolLM2's 3 KV heads on 2 threads left a thread idle); this bench times that
default and each forced split (``reference.row_parts``, 1 = unsplit) at each ``--threads`` count, in ``--rounds``
interleaved rounds paired with sdpa's, and prints each arm's median milliseconds, its median ratio to sdpa in the
same round and the range of that ratio. The default's row names the parts it chose; every split gives the same
results (checked before timing: the same bits on this project's CPU, within rounding on any). A split whose parts
would keep fewer than ``MIN_PART_ROWS`` rows runs unsplit and is not timed, and more threads than the machine's
cores time nothing useful (it says either).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import RANDOM_SHAPES
from tqdm import tqdm

from kvgates.cli import OneLineParser, plain, quiet_exits
from kvgates.kernels import reference


def parse() -> argparse.Namespace:
    parser = OneLineParser(description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=list(RANDOM_SHAPES), help="whose heads (default: smollm2-135m)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096], help="prompt lengths (default: 4096)")
    parser.add_argument("--batch", type=int, default=1, help="default: 1")
    parser.add_argument("--window", type=int, default=0, help="window rows scored too (default: 0, column sums only)")
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()], help="default: torch's threads now")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], help="forced splits timed beside the default (default: 1 2 3 4)")
    parser.add_argument("--rounds", type=int, default=7, help="default: 7")
    args = parser.parse_args()
    for name in ("contexts", "batch", "threads", "parts", "rounds"):
        for value in getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]:
            if value < 1:
                parser.error(f"--{name} must be at least 1, got {value}")
    if args.window < 0:
        parser.error(f"--window must be at least 0, got {args.window}")
    for name in ("contexts", "threads", "parts"):
        twice = next((v for i, v in enumerate(getattr(args, name)) if v in getattr(args, name)[:i]), None)
        if twice is not None:
            parser.error(f"--{name} {twice} is given twice; give each once")
    return args


def main() -> None:
    args = parse()
    shape = RANDOM_SHAPES[args.shape]
    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    cores = os.cpu_count() or 1
    print(f"CPU: {cores} cores; {args.shape}'s heads ({heads} query, {kv_heads} KV, dim {dim}); batch {args.batch}; "
          f"window {args.window}; float32")
    for threads in args.threads:
        torch.set_num_threads(threads)
        if threads > cores:
            print(f"\nnote: {threads} threads on {cores} cores: oversubscribed, the times below say nothing of the split")
        for n in args.contexts:
            torch.manual_seed(0)
            q = torch.randn(args.batch, heads, n, dim)
            k, v = (torch.randn(args.batch, kv_heads, n, dim) for _ in range(2))
            scale = dim**-0.5

            def stats(parts: int | None = None, q=q, k=k, v=v, scale=scale):  # None: the default split
                with contextlib.nullcontext() if parts is None else reference.row_parts(parts):
                    return reference.causal_attention_stats(q, k, v, scale, True, args.window)

            arms = {"sdpa (no statistics)": lambda q=q, k=k, v=v, scale=scale: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)}
            tile, chosen = reference._stats_tile_plan(q, k)
            arms[f"default ({chosen} part{'s' * (chosen > 1)})"] = stats
            timed = []
            for p in args.parts:
                with reference.row_parts(p):
                    runs = reference._stats_tile_plan(q, k)[1]
                if runs == p:
                    timed.append(p)
                else:  # (row_parts keeps MIN_PART_ROWS rows a part: the arm would be the unsplit one again)
                    print(f"note: --parts {p} at {n} tokens: a part would keep fewer than {reference.MIN_PART_ROWS} rows "
                          f"({heads // kv_heads * tile} a KV head's tile); it runs unsplit, not timed")
            arms.update({f"{p} part{'s' * (p > 1)}": (lambda p=p: stats(p)) for p in timed})
            first = stats()
            for arm in arms.values():  # a warm-up call of each
                arm()
            for p in timed:  # the same results whatever the split (the same bits here; another BLAS may round apart)
                pairs = [(a, b) for a, b in zip(first, stats(p)) if a is not None]
                if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs):
                    raise SystemExit(f"cpu_attention.py: {p} parts gave other results than the default's; a kvgates defect")
                if not all(torch.equal(a, b) for a, b in pairs):
                    print(f"note: {p} parts: results within rounding of the default's, not the same bits (this BLAS)")
            times: dict[str, list[float]] = {label: [] for label in arms}
            labels = list(arms)
            for r in tqdm(range(args.rounds), desc=f"{threads} threads, {n} tokens", unit="round", leave=False, file=sys.stderr):
                start = r % len(labels)  # each round starts at another arm
                for label in labels[start:] + labels[:start]:
                    began = time.perf_counter()
                    arms[label]()
                    times[label].append(time.perf_counter() - began)
            reference_times = times[labels[0]]
            print(f"\n{threads} threads, {n} tokens: median of {args.rounds} interleaved rounds; ratios to sdpa in the same round")
            print("| arm | ms | vs sdpa | range |\n|---|---:|---:|---:|")
            for label, ts in times.items():
                ratios = sorted(t / s for t, s in zip(ts, reference_times))
                print(f"| {label} | {statistics.median(ts) * 1e3:.1f} | {statistics.median(ratios):.2f}x | {ratios[0]:.2f}-{ratios[-1]:.2f}x |")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
