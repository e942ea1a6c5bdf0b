"""Per-decode-step cost of each policy, as a fraction of the step time, in one run.

    python bench/policy_overhead.py --prompt 1024 --budget 256 --steps 64

Prefills ``--prompt`` essay tokens into a BudgetCache per policy, then decodes ``--steps`` tokens and times
(per step, summed over layers) the policy's own work (``BudgetLayer.step`` without the eviction: state updates,
quota and the keep decision) and applying evictions (``layer.evict``), against the whole step.
"""

from __future__ import annotations

import sys
import time

from common import attached, bench_policy, essay_ids, setup, short_context, sync, time_decode

import kvgates
from kvgates.cli import quiet_exits

DEFAULT = ["streaming_llm", "h2o", "snapkv", "pyramidkv", "tova", "morphkv", "d2o", "dynamickv", "kvmerger", "adakv"]


class Stopwatch:
    """Accumulates the time of the calls it wraps (instance attributes only; nothing global is patched)."""

    def __init__(self, device) -> None:
        self.total, self.device = 0.0, device

    def wrap(self, fn):
        def timed(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.total += time.perf_counter() - start
            return out

        return timed


def measure(model, spec: str, budget: int, ids, steps: int, device) -> tuple[float, float, float]:
    """(ms per step, ms of policy work per step, ms in evictions per step) of the policy ``spec`` (``bench_policy``)."""
    cache = kvgates.BudgetCache(model.config, bench_policy(model, spec, budget))
    step_clock, evict_clock = Stopwatch(device), Stopwatch(device)

    def instrument() -> None:  # after the prompt, so only decode steps are counted
        for layer in cache.budget_layers:
            layer.step = step_clock.wrap(layer.step)
            layer.evict = evict_clock.wrap(layer.evict)

    with attached(model, cache):
        total = time_decode(model, cache, ids, steps, device, instrument)
    return 1e3 * total / steps, 1e3 * (step_clock.total - evict_clock.total) / steps, 1e3 * evict_clock.total / steps


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, check=lambda args: short_context("--prompt", [args.prompt], args.budget), prompt=1024, budget=256, steps=64, policies=DEFAULT
    )
    ids = essay_ids(tokenizer, args.prompt, args.device)
    print(f"{'policy':16s} {'step ms':>8s} {'policy ms':>10s} {'evict ms':>9s} {'overhead':>9s}")
    for name in args.policies:
        step, policy, evict = measure(model, name, args.budget, ids, args.steps, args.device)
        print(f"{name:16s} {step:8.2f} {policy:10.2f} {evict:9.2f} {(policy + evict) / step:9.1%}")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
