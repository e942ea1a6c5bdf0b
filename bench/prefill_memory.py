"""Peak memory of long prefills: a 16K-token D2O prompt, and a left-padded batch of 4 in prompt chunks.

    python bench/prefill_memory.py --model random --layers 2 --tokens 8192 16384 --budget 256 --chunk 2048

For each prompt length it prints the peak resident memory a prefill adds on top of the loaded model (CPU:
the process's high-water mark, reset before each run) for

* ``d2o``: one sequence of ``--tokens`` tokens in one forward with D2O at ``--budget`` (its merge compares
  evicted tokens with kept ones);
* ``padded x4``: four left-padded rows of ``--tokens``, 3/4, 1/2 and 1/4 of it, fed in chunks of ``--chunk``
  tokens with H2O at ``--budget`` (each chunk attends over at most budget + chunk slots under a padding mask).

and the ratio of the peaks at the longest and the shortest length: about 1 when memory is bounded by the budget
and the chunk, the square of the length ratio when an intermediate grows with the prompt squared.
"""

from __future__ import annotations

import ctypes
import gc
import sys

import torch
from common import budget_problem, setup, short_context

import kvgates
from kvgates.cli import quiet_exits

#: The policy each of ``--runs`` prefills under.
RUN_POLICY = {"d2o": "d2o", "padded": "h2o"}


def check(args) -> str | None:
    """A device other than the CPU, a budget a run's policy refuses, or a length not over it, in one sentence before the
    model loads (else None)."""
    if not args.device.startswith("cpu"):  # (the default on a machine with a GPU)
        return f"--device {args.device}: this bench measures CPU memory (the process's resident high-water mark); pass --device cpu"
    problem = budget_problem({RUN_POLICY[run]: {} for run in args.runs}, args.budget)
    return problem or short_context("--tokens", args.tokens, args.budget, prefill=True)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak_extra_bytes(run) -> int:
    """Peak resident bytes ``run()`` adds to the process (Linux: VmHWM, reset through /proc/self/clear_refs).

    Freed heap memory is handed back to the system first, so an earlier run's leftovers do not hide this one's peak.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    run()
    return _status("VmHWM") - base


def d2o_prefill(model, tokens: int, budget: int) -> None:
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=kvgates.BudgetCache(model.config, RUN_POLICY["d2o"], budget=budget), logits_to_keep=1)


def padded_chunked_prefill(model, tokens: int, budget: int, chunk: int) -> None:
    lengths = [tokens, 3 * tokens // 4, tokens // 2, tokens // 4]
    ids = torch.randint(100, 40000, (len(lengths), tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.stack([torch.arange(tokens) >= tokens - n for n in lengths]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = kvgates.BudgetCache(model.config, RUN_POLICY["padded"], budget=budget)
    with torch.no_grad():
        for start in range(0, tokens, chunk):
            stop = min(tokens, start + chunk)
            model(ids[:, start:stop], attention_mask=mask[:, :stop], position_ids=positions[:, start:stop],
                  past_key_values=cache, logits_to_keep=1)


def main() -> None:
    args, model, _ = setup(
        __doc__, choices={"runs": ["d2o", "padded"]}, check=check,
        tokens=[8192, 16384], budget=256, chunk=2048, runs=["d2o", "padded"],
    )
    runs = {"d2o": ("d2o", lambda n: d2o_prefill(model, n, args.budget)),
            "padded": ("padded x4", lambda n: padded_chunked_prefill(model, n, args.budget, args.chunk))}
    for label, run in (runs[name] for name in args.runs):
        peaks = {n: peak_extra_bytes(lambda: run(n)) for n in args.tokens}
        cells = "  ".join(f"{n:6d} tok: {p / 2**20:8.0f} MiB" for n, p in peaks.items())
        lo, hi = min(args.tokens), max(args.tokens)
        print(f"{label:10s} peak above the model  {cells}   x{peaks[hi] / peaks[lo]:.2f} for x{hi / lo:.0f} tokens")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
