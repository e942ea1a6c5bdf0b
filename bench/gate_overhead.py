"""Cost of computing learned gate scores during decode, as a fraction of the step time, in one run.

    python bench/gate_overhead.py --prompt 1024 --budget 256 --steps 64

Runs TRIM-KV (retention gates), global TRIM-KV and Locret (retaining heads) with freshly initialised gates of
the model's shape, and times every gate evaluation (capture hand-over + gate MLP) against the whole decode
step, with the gates in each of `--gate-dtypes` (float32 and float16 by default; `auto`: the model's own dtype, what
a learned policy runs in unless told otherwise). The target for SmolLM2-135M on CPU is under 5%.
"""

from __future__ import annotations

import itertools
import sys

from common import budget_problem, essay_ids, setup, short_context, time_decode
from policy_overhead import Stopwatch

import kvgates
from kvgates.cli import quiet_exits
from kvgates.policies.learned import AUTO, GATE_DTYPES

KINDS = {"trimkv": kvgates.RetentionGates, "trimkv-global": kvgates.GlobalRetentionGates, "locret": kvgates.RetainingHeads}
#: Each kind's own parameters in this bench (Locret's stabilisers and local window).
PARAMS = {"trimkv": {}, "trimkv-global": {}, "locret": {"stabilizers": 32, "local": 32}}


def check(args) -> str | None:
    """A budget some kind refuses, or a prompt under it, in one sentence before the model loads (else None): each
    kind is built at ``--budget`` on placeholder gates."""
    return budget_problem(PARAMS, args.budget) or short_context("--prompt", [args.prompt], args.budget)


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, {"gate_dtypes": [AUTO, *GATE_DTYPES]}, check=check, prompt=1024, budget=256, steps=64, gate_dtypes=["float32", "float16"]
    )
    ids = essay_ids(tokenizer, args.prompt, args.device)
    print(f"{'policy':14s} {'gate dtype':>10s} {'gate params':>11s} {'step ms':>8s} {'gates ms':>9s} {'overhead':>9s}")
    for (name, kind), gate_dtype in itertools.product(KINDS.items(), args.gate_dtypes):
        gates = kind.for_model(model, training_budget=args.budget)
        policy = kvgates.make_policy(name, budget=args.budget, gates=gates, gate_dtype=gate_dtype, **PARAMS[name]).attach(model)
        cache = kvgates.BudgetCache(model.config, policy)
        clock = Stopwatch(args.device)

        def instrument(policy=policy, clock=clock) -> None:
            policy.new_token_scores = clock.wrap(policy.new_token_scores)

        total = time_decode(model, cache, ids, args.steps, args.device, instrument)
        policy.detach()
        params = sum(p.numel() for p in gates.parameters())
        step, gate = 1e3 * total / args.steps, 1e3 * clock.total / args.steps
        print(f"{name:14s} {gate_dtype:>10s} {params / 1e6:10.2f}M {step:8.2f} {gate:9.2f} {gate / step:9.1%}")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
