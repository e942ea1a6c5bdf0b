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
    # Only the tokens outside the window are scored and pooled (the window's own scores never enter the pooling);
    # the window is kept whole.
    win = recent(list(scores), window)
    outside = {p: s for p, s in scores.items() if p not in win}
    pooled = pool(outside, kernel, mode) if kernel > 1 else outside
    return win | top_by_score(pooled, budget - len(win), set())


def pyramid_budgets(budget: int, window: int, prompt_len: int, layers: int, beta: int) -> list[int]:
    room = budget - window
    lo = room // beta
    hi = 2 * room - lo
    if hi >= prompt_len - window:
        hi = prompt_len - window
        lo = 2 * room - hi
    import math

    return [hi - math.floor(i * (hi - lo) / (layers - 1)) + window for i in range(layers)]


def tova(scores: dict[int, float], budget: int) -> set[int]:
    return top_by_score(scores, budget, set())


# ------------------------------------------------------------------------------------------------ seed policies
def morphkv(rows: list[dict[int, float]], positions: list[int], budget: int, recent_n: int, fusion: str) -> set[int]:
    """rows: one {position: prob} per recorded query (missing = 0)."""
    fused = {}
    for p in positions:
        vals = [r.get(p, 0.0) for r in rows]
        fused[p] = sum(vals) if fusion == "sum" else max(vals)
    win = recent(positions, recent_n)
    return win | top_by_score(fused, budget - len(win), win)


def variance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def d2o_layer_variance(per_head_scores: list[list[float]]) -> float:
    var = [variance(s) for s in per_head_scores]
    lo, hi = min(var), max(var)
    return sum(((v - lo) / (hi - lo) if hi > lo else 0.0) for v in var) / len(var)


def d2o_ratios(variances: list[float], rho: float, min_ratio: float = 0.01) -> list[float]:
    import math

    exps = [math.exp(-v) for v in variances]
    n = len(variances)
    return [min(1.0, max(min_ratio, e / sum(exps) * n * rho)) for e in exps]


def d2o_keep(scores: dict[int, float], budget: int, n_sinks: int, heavy: int, recent_share: int) -> set[int]:
    n_recent = round(budget * recent_share / (heavy + recent_share))
    forced = sinks(list(scores), n_sinks) | recent(list(scores), n_recent)
    return forced | top_by_score(scores, budget - len(forced), forced)


def cosine(a: list[float], b: list[float]) -> float:
    import math

    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def d2o_merge(keys: dict[int, list[float]], values: dict[int, list[float]], kept: set[int], evicted: set[int],
              tau: float | None, beta: float, rule: str) -> tuple[dict, dict, float]:
    """One head's merge; returns (new keys of kept tokens, new values, updated tau given this head alone)."""
    import math

    best = {}
    for e in evicted:
        sims = {c: cosine(keys[e], keys[c]) for c in kept}
        target = max(sims, key=lambda c: sims[c])
        best[e] = (sims[target], target)
    mean_m = sum(m for m, _ in best.values()) / len(best)
    tau = mean_m if tau is None else beta * mean_m + (1 - beta) * tau
    received: dict[int, list[tuple[float, int]]] = {c: [] for c in kept}
    for e, (m, target) in best.items():
        if m >= tau:
            received[target].append((m, e))
    new_k, new_v = {}, {}
    for c in kept:
        if not received[c]:
            new_k[c], new_v[c] = keys[c], values[c]
            continue
        if rule == "paper":
            denom = sum(math.exp(m) for m, _ in received[c]) + math.e
            wc = math.e / denom
            new_k[c] = [wc * x + sum(math.exp(m) / denom * keys[e][i] for m, e in received[c]) for i, x in enumerate(keys[c])]
            new_v[c] = [wc * x + sum(math.exp(m) / denom * values[e][i] for m, e in received[c]) for i, x in enumerate(values[c])]
        else:
            n = len(received[c])
            new_k[c] = [(x + sum(m * keys[e][i] for m, e in received[c])) / (1 + n) for i, x in enumerate(keys[c])]
            new_v[c] = [(x + sum(m * values[e][i] for m, e in received[c])) / (1 + n) for i, x in enumerate(values[c])]
    return new_k, new_v, tau


def dynamickv_budgets(counts: list[int], room: int, num_layers: int, r_max: float) -> list[int]:
    import math

    top = max(max(counts), 1)
    z = [math.floor(r_max * room * c / top) for c in counts]
    if sum(z) == 0:
        return [room] * len(counts)
    r = sum(z) / (room * num_layers)
    return [math.floor(x / r) for x in z]


def kvmerger_sets(keys: list[list[float]], mergeable: list[bool], eps: float) -> list[list[int]]:
    """Merging sets (lists of indices into the position-ordered tokens)."""
    sets, current, anchor = [], None, None
    for j, ok in enumerate(mergeable):
        if not ok:
            current = None
            continue
        if current is not None and cosine(keys[anchor], keys[j]) > eps:
            current.append(j)
        else:
            current, anchor = [j], j
            sets.append(current)
    return sets


def kvmerger_merge(keys, values, scores, members: list[int], sigma: float | None, scale_values: bool):
    """Pivot index and merged (key, value) of one set."""
    import math

    pivot = max(members, key=lambda i: (scores[i], -i))
    dist = {i: math.dist(keys[pivot], keys[i]) for i in members}
    if sigma is None:
        others = [dist[i] for i in members if i != pivot]
        sigma = max(sum(others) / max(len(others), 1), 1e-6)
    g = {i: math.exp(-dist[i] ** 2 / (2 * sigma**2)) for i in members}
    total = sum(g.values())
    w = {i: g[i] / total for i in members}
    scale = len(members) if scale_values else 1
    k = [sum(w[i] * keys[i][d] for i in members) for d in range(len(keys[pivot]))]
    v = [sum(w[i] * scale * values[i][d] for i in members) for d in range(len(values[pivot]))]
    return pivot, k, v


def adakv_budgets(per_head_scores: list[dict[int, float]], forced: list[set[int]], budget: int, alpha: float) -> list[int]:
    import math

    rooms = [budget - len(f) for f in forced]
    flat = [(s, h) for h, scores in enumerate(per_head_scores) for p, s in scores.items() if p not in forced[h]]
    flat.sort(key=lambda t: -t[0])
    counts = [0] * len(per_head_scores)
    for _, h in flat[: sum(rooms)]:
        counts[h] += 1
    return [round(counts[h] * (1 - alpha) + math.floor(alpha * rooms[h])) + len(forced[h]) for h in range(len(counts))]


# ------------------------------------------------------------------------------------------------ learned
def trimkv(log_beta: dict[int, float], t: int, budget: int, window: int) -> set[int]:
    """Keep the recent window plus the top (t - pos) * log_beta."""
    scores = {p: (t - p) * lb for p, lb in log_beta.items()}
    win = recent(list(scores), window)
    return win | top_by_score(scores, budget - len(win), win)


def trimkv_global(heads: list[tuple[dict[int, float], int]], total: int, window: int, min_per_head: int) -> list[set[int]]:
    """heads: [(log_beta by position, t)] for every (layer, head) of one sequence; returns kept positions per head."""
    scored = [{p: (t - p) * lb for p, lb in lbs.items()} for lbs, t in heads]
    forced = []
    for s in scored:
        win = recent(list(s), window)
        forced.append(win | top_by_score(s, min_per_head, set()))
    room = total - sum(len(f) for f in forced)
    rest = [(s[p], p, h) for h, s in enumerate(scored) for p in s if p not in forced[h]]
    rest.sort(key=lambda x: (-x[0], -x[1]))
    kept = [set(f) for f in forced]
    for _, p, h in rest[: max(room, 0)]:
        kept[h].add(p)
    return kept
