"""Brute-force re-implementations of the policy specs (../shared/spec/policies.md), one (batch, head) at a time.

Each function takes plain Python lists for one KV head: ``tokens`` = [(position, score, ...)] of the held
tokens, and returns the set of positions kept. No tensors, no vectorisation: the spec, read literally.
"""

from __future__ import annotations


def recent(positions: list[int], n: int) -> set[int]:
    return set(sorted(positions)[-n:]) if n > 0 else set()


def sinks(positions: list[int], n: int) -> set[int]:
    return set(sorted(positions)[:n])


def top_by_score(scores: dict[int, float], n: int, exclude: set[int]) -> set[int]:
    # Highest score first; equal scores: the more recent token first.
    ranked = sorted((p for p in scores if p not in exclude), key=lambda p: (-scores[p], -p))
    return set(ranked[: max(n, 0)])


def streaming_llm(positions: list[int], budget: int, n_sinks: int) -> set[int]:
    return sinks(positions, n_sinks) | recent(positions, budget - n_sinks)


def h2o(scores: dict[int, float], budget: int, n_recent: int) -> set[int]:
    window = recent(list(scores), n_recent)
    return window | top_by_score(scores, budget - len(window), window)


def pool(scores: dict[int, float], kernel: int, mode: str) -> dict[int, float]:
    """1-D pooling over the tokens in position order, zero padding, padding counted in averages."""
    order = sorted(scores)
    half = kernel // 2
    out = {}
    for i, p in enumerate(order):
        vals = [scores[order[j]] if 0 <= j < len(order) else 0.0 for j in range(i - half, i + half + 1)]
        out[p] = max(vals) if mode == "max" else sum(vals) / kernel
    return out


def snapkv(scores: dict[int, float], budget: int, window: int, kernel: int, mode: str) -> set[int]:
    pooled = pool(scores, kernel, mode) if kernel > 1 else scores
    win = recent(list(scores), window)
    return win | top_by_score(pooled, budget - len(win), win)


def pyramid_budgets(budget: int, window: int, prompt_len: int, layers: int, beta: int) -> list[int]:
    room = budget - window
    lo = room // beta
    hi = 2 * room - lo
    if hi >= prompt_len - window:
        hi = prompt_len - window
        lo = 2 * room - hi
    import math

    return [hi - math.floor(l * (hi - lo) / (layers - 1)) + window for l in range(layers)]


def tova(scores: dict[int, float], budget: int) -> set[int]:
    return top_by_score(scores, budget, set())
