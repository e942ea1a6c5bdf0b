"""Each policy's keep decision equals a literal re-implementation of the spec, on random small layers."""

import brute
import pytest
import torch
from helpers import make_layer, random_positions, tiny_model

from kvgates.policies import H2O, TOVA, PyramidKV, SnapKV, StreamingLLM
from kvgates.policies.h2o import CUMULATIVE
from kvgates.policies.pyramidkv import pyramid_budgets
from kvgates.runtime.stats import AttnStats, Phase

B, HKV, C = 2, 3, 24


def kept_positions(layer, keep, b, h):
    return {int(p) for p in layer.pos[b, h][keep[b, h]].tolist()}


def head_scores(layer, scores, b, h):
    return {int(p): float(s) for p, s in zip(layer.pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}


def stats_with(rows=None, colsum=None, phase=Phase.PREFILL, window=None):
    return AttnStats(
        phase=phase, new_slots=torch.zeros(B, HKV, 1, dtype=torch.long), rows=rows, colsum=colsum,
        window=None if window is None else window.sum(2), window_rows=0 if window is None else window.shape[2],
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,sinks", [(8, 4), (10, 0), (5, 2)])
def test_streaming_llm(seed, budget, sinks):
    policy = StreamingLLM(budget=budget, sinks=sinks)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    keep = policy.select(layer, stats_with(), budget)
    for b in range(B):
        for h in range(HKV):
            positions = [p for p in layer.pos[b, h].tolist() if p >= 0]
            assert kept_positions(layer, keep, b, h) == brute.streaming_llm(positions, budget, sinks)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,recent", [(8, None), (10, 3), (6, 0)])
def test_h2o(seed, budget, recent):
    policy = H2O(budget=budget, recent=recent)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    layer.state[CUMULATIVE] = torch.rand(B, HKV, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(), budget)
    for b in range(B):
        for h in range(HKV):
            scores = head_scores(layer, layer.state[CUMULATIVE], b, h)
            assert kept_positions(layer, keep, b, h) == brute.h2o(scores, budget, policy.recent)


def test_h2o_accumulates_prefill_and_decode_scores():
    policy = H2O(budget=8)
    layer = make_layer(policy, random_positions(B, HKV, C, held=10, seed=0))
    first, second = torch.rand(B, HKV, C), torch.rand(B, HKV, C)
    policy.observe(layer, stats_with(colsum=first))
    policy.observe(layer, stats_with(colsum=second, phase=Phase.DECODE))
    torch.testing.assert_close(layer.state[CUMULATIVE], first + second)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,kernel,pooling", [(4, 7, "max"), (3, 3, "avg"), (2, 1, "max")])
def test_snapkv(seed, window, kernel, pooling):
    budget = 9
    policy = SnapKV(budget=budget, window=window, kernel=kernel, pooling=pooling)
    layer = make_layer(policy, random_positions(B, HKV, C, held=17, seed=seed))
    rows = torch.rand(B, HKV, window, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(window=rows), budget)
    for b in range(B):
        for h in range(HKV):
            scores = head_scores(layer, rows.sum(2), b, h)
            assert kept_positions(layer, keep, b, h) == brute.snapkv(scores, budget, window, kernel, pooling)


@pytest.mark.parametrize("policy", [SnapKV(budget=9, window=4, kernel=7), PyramidKV(budget=9, window=4, kernel=7)])
def test_snapkv_pooling_stays_outside_the_observation_window(policy):
    """The window's large self-attention must not leak into its neighbours through the pooling: with a heavy
    token 1 and a window (13-16) attending mostly to itself, the 5 kept outside tokens are token 1's
    neighbourhood, not tokens 10-12 next to the window."""
    pos = torch.arange(17).expand(1, 1, 17).contiguous()
    layer = make_layer(policy, pos)
    scores = torch.full((1, 1, 17), 0.01)
    scores[..., 1] = 0.5
    scores[..., 13:] = 1.0
    keep = policy.select(layer, stats_with(window=scores[:, :, None].expand(1, 1, 4, 17) / 4), 9)
    assert kept_positions(layer, keep, 0, 0) == {0, 1, 2, 3, 4, 13, 14, 15, 16}
    assert kept_positions(layer, keep, 0, 0) == brute.snapkv(head_scores(layer, scores, 0, 0), 9, 4, 7, "max")


@pytest.mark.parametrize("budget,window,prompt,layers", [(64, 8, 500, 30), (32, 4, 40, 5), (20, 4, 21, 3), (16, 2, 300, 7)])
def test_pyramid_budgets(budget, window, prompt, layers):
    got = pyramid_budgets(budget, window, prompt, layers, 20)
    assert got == brute.pyramid_budgets(budget, window, prompt, layers, 20)
    assert got == sorted(got, reverse=True)


def test_pyramidkv_uses_layer_budget(tiny):
    _, model = tiny
    from kvgates import BudgetCache

    cache = BudgetCache(model.config, PyramidKV(budget=16, window=4, kernel=3))
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    expected = pyramid_budgets(16, 4, 60, 3, 20)
    assert [int(layer.quota.max()) for layer in cache.budget_layers] == expected
    assert cache.held_tokens()[:, 0, 0].tolist() == expected


def test_pyramidkv_chunked_prompt_keeps_one_pyramid(tiny):
    """A prompt given in chunks ends with every layer at the pyramid of the whole prompt. Before, each layer built its
    pyramid from what it held itself, and a deeper layer, holding less, got its top clipped and a larger budget: 11%
    over the mean budget at 6 layers and chunks of 32."""
    _, model = tiny
    from kvgates import BudgetCache

    cache = BudgetCache(model.config, PyramidKV(budget=16, window=4, kernel=3))
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for start in range(0, 200, 32):
            model(ids[:, start : start + 32], past_key_values=cache)
    expected = pyramid_budgets(16, 4, 200, 3, 20)
    assert [int(layer.quota.max()) for layer in cache.budget_layers] == expected
    assert cache.held_tokens()[:, 0, 0].tolist() == expected


@pytest.mark.parametrize("chunk", [None, 8])
def test_pyramidkv_gives_a_padded_row_the_budgets_it_gets_alone(tiny, chunk):
    """A left-padded row of a batch given without position_ids (the model numbers every column, padding included) got
    the pyramid of the padded length: layer budgets [18, 12, 2] where alone it gets [18, 12, 6]."""
    _, model = tiny
    from kvgates import BudgetCache

    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0

    def held(rows: torch.Tensor, rows_mask: torch.Tensor) -> list[list[int]]:
        cache = BudgetCache(model.config, PyramidKV(budget=12, window=2, kernel=3))
        step = chunk or rows.shape[1]
        with torch.no_grad():
            for start in range(0, rows.shape[1], step):
                model(rows[:, start : start + step], attention_mask=rows_mask[:, : start + step], past_key_values=cache)
        return cache.held_tokens()[:, :, 0].T.tolist()  # [row][layer] (head 0)

    both = held(ids, mask)
    assert both[1] == held(ids[1:, 12:], mask[1:, 12:])[0]
    assert both[0] == held(ids[:1], mask[:1])[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_head", [False, True])
def test_tova(seed, per_head):
    budget = 7
    policy = TOVA(budget=budget, per_head=per_head)
    pos = random_positions(B, 1, C, held=15, seed=seed).expand(B, HKV, C).contiguous()
    layer = make_layer(policy, pos)
    rows = torch.rand(B, HKV, 1, C, generator=torch.Generator().manual_seed(seed))
    keep = policy.select(layer, stats_with(rows=rows), budget)
    for b in range(B):
        shared = head_scores(layer, rows[:, :, 0].mean(1, keepdim=True).expand(B, HKV, C), b, 0)
        for h in range(HKV):
            scores = head_scores(layer, rows[:, :, 0], b, h) if per_head else shared
            assert kept_positions(layer, keep, b, h) == brute.tova(scores, budget)


@pytest.mark.parametrize("seed", range(6))
def test_single_drop_fast_path_matches_full_ranking(seed):
    """With at most one slot too many per row (every decode step), topk_mask skips sorting; same decisions."""
    from kvgates.policies.selection import topk_mask

    g = torch.Generator().manual_seed(seed)
    pos = random_positions(B, HKV, C, held=12, seed=seed)
    valid = pos >= 0
    scores = torch.randint(0, 4, (B, HKV, C), generator=g).float()  # many ties
    k = torch.tensor([[11, 12, 13], [11, 11, 12]])  # drop one, none, none / one, one, none
    keep = topk_mask(scores, k, valid, pos)
    for b in range(B):
        for h in range(HKV):
            s = {int(p): float(x) for p, x in zip(pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}
            assert {int(p) for p in pos[b, h][keep[b, h]].tolist()} == brute.top_by_score(s, int(k[b, h]), set())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bound", [1, 3, 24])
def test_a_host_bound_on_the_excess_gives_the_same_decisions(seed, bound):
    """``excess`` (what a packed layer's host knows of how many slots a row holds over budget) replaces the
    read-backs of topk_mask: the single-drop shortcut when it is <= 1, a ranking of every slot otherwise."""
    from kvgates.policies.selection import topk_mask

    g = torch.Generator().manual_seed(seed)
    pos = random_positions(B, HKV, C, held=12, seed=seed)
    valid = pos >= 0
    scores = torch.randint(0, 4, (B, HKV, C), generator=g).float()
    k = torch.randint(max(12 - bound, 0), 14, (B, HKV), generator=g)  # rows hold 12 candidates: at most `bound` over k
    keep = topk_mask(scores, k, valid, pos, excess=bound)
    for b in range(B):
        for h in range(HKV):
            s = {int(p): float(x) for p, x in zip(pos[b, h].tolist(), scores[b, h].tolist()) if p >= 0}
            assert {int(p) for p in pos[b, h][keep[b, h]].tolist()} == brute.top_by_score(s, int(k[b, h]), set())


def _rows_over_by_at_most_one(seed: int, every_row_over: bool, scores_kind: str):
    """A layer whose heads hold ``C``, ``C - 1``, ``C - 4`` or no tokens (holes anywhere), quotas that leave each
    at most one over (every head exactly one over with ``every_row_over``), forced slots at random with a head
    forcing all it holds and one forcing more than its quota, and scores with many ties (``ties``), integers
    (``int``) or ``+inf`` on every slot of some heads (``inf``)."""
    g = torch.Generator().manual_seed(seed)
    held = torch.tensor([C, C, C - 1, C - 4, 0])[torch.randint(0, 5, (B, HKV), generator=g)]
    held[0, 0] = held[1, 1] = C
    pos = torch.full((B, HKV, C), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(HKV):
            slots = torch.randperm(C, generator=g)[: held[b, h]]
            pos[b, h, slots] = torch.sort(torch.randperm(C + 10, generator=g)[: held[b, h]]).values
    layer = make_layer(H2O(budget=C - 1), pos, seed=seed)
    if every_row_over:
        layer.pos[..., 0] = torch.where(layer.pos[..., 0] < 0, C + 20, layer.pos[..., 0])  # no head is empty
        quota = layer.held() - 1
    else:
        quota = torch.randint(C - 1, C + 1, (B, HKV), generator=g)
    layer.quota, layer._quota_source = quota, quota
    layer._quota_range = (quota.amin(0).tolist(), quota.amax(0).tolist())
    if every_row_over:
        layer.held_over_quota = 1
    else:  # a packed layer's bound: its fill (C) over the least quota
        layer.fill, layer.packed = [C] * HKV, True
    forced = torch.rand(B, HKV, C, generator=g) < 0.3
    forced[0, 0] = True  # forces everything it holds: no other slot, more than its quota
    forced[1, 1] = torch.arange(C) < C - 2  # forced slots alone within budget
    if scores_kind == "int":
        scores = torch.randint(0, 4, (B, HKV, C), generator=g)
    else:
        scores = torch.randint(0, 4, (B, HKV, C), generator=g).float()
        if scores_kind == "inf":
            scores[0, 1] = scores[1, 2] = float("inf")
    return layer, scores, forced


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("every_row_over", [False, True])
@pytest.mark.parametrize("scores_kind", ["ties", "int", "inf"])
def test_the_single_drop_path_keeps_what_the_ranking_keeps(seed, every_row_over, scores_kind):
    """``keep_forced_and_top`` with the layer's quota, when the host knows that no head holds more than one token
    over it (``over_quota_bound`` <= 1), drops each over head's worst unforced slot without a ranking and without a
    read-back; it keeps what the general path (the same quota as another tensor: no bound, one read-back) and the
    spec keep: heads under their quota, empty heads, heads without unforced slots, heads forced over quota, ties
    (the older token goes), integer and infinite scores."""
    from kvgates.policies.selection import keep_forced_and_top
    from kvgates.runtime.launches import Launches

    layer, scores, forced = _rows_over_by_at_most_one(seed, every_row_over, scores_kind)
    assert layer.over_quota_bound <= 1
    with Launches() as fast_path:
        keep = keep_forced_and_top(layer, scores, layer.quota, forced)
    with Launches() as general_path:
        expected = keep_forced_and_top(layer, scores, layer.quota.clone(), forced)
    assert fast_path.syncs == 0 and general_path.syncs > 0  # (the paths taken)
    assert torch.equal(keep, expected)
    for b in range(B):
        for h in range(HKV):
            s = head_scores(layer, scores.double(), b, h)
            kept_forced = {p for p in s if forced[b, h][layer.pos[b, h] == p].item()}
            room = int(layer.quota[b, h]) - len(kept_forced)
            assert kept_positions(layer, keep, b, h) == kept_forced | brute.top_by_score(s, room, kept_forced)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [0, 1, 5, 12, 30])
def test_recent_and_sink_masks_mark_what_a_ranking_of_positions_marks(seed, n):
    """``recent_mask`` and ``sink_mask`` with an int ``n`` find the ``n``-th position with one top-k instead of
    ranking every slot; the same slots as ``topk_mask`` of the positions, with holes and heads holding fewer."""
    from kvgates.policies.selection import recent_mask, sink_mask, topk_mask

    pos = random_positions(B, HKV, C, held=12, seed=seed)
    pos[1, 2, pos[1, 2] >= 0] = torch.arange(100, 112)[: int((pos[1, 2] >= 0).sum())]
    pos[0, 1, :] = torch.where(torch.arange(C) % 3 == 0, pos[0, 1], -1)  # a head holding fewer than 12
    layer = make_layer(H2O(budget=4), pos)
    assert torch.equal(recent_mask(layer, n), topk_mask(layer.pos, n, layer.valid, sync_free=True))
    assert torch.equal(sink_mask(layer, n), topk_mask(-layer.pos, n, layer.valid, sync_free=True))
    for b in range(B):
        for h in range(HKV):
            held = sorted(p for p in layer.pos[b, h].tolist() if p >= 0)
            assert kept_positions(layer, sink_mask(layer, n), b, h) == set(held[:n])


# ------------------------------------------------------------------------------------------------ end to end
def record_attention(monkeypatch) -> list[tuple[int, Phase, torch.Tensor, torch.Tensor]]:
    """Record, at each budgeted layer's policy step (after its attention, before any eviction), ``(rank, phase, pos,
    probs)``: its slots' positions and the attention probabilities ``[B, H, n, C]`` of the forward's queries over
    its slots, computed literally here (a float64 softmax of ``q . k`` over the held keys at or before the query's
    position), not by the runtime whose statistics the policies read."""
    from kvgates.runtime.dispatch import AttentionDispatch
    from kvgates.runtime.layer import BudgetLayer

    records, queries = [], []
    attend, step = AttentionDispatch.attend, BudgetLayer.step

    def recorded_attend(layer, query, scale, *args):
        queries.append((query, scale))
        return attend(layer, query, scale, *args)

    def recorded_step(layer, stats):
        query, scale = queries.pop()
        b, h, n, _ = query.shape
        g = h // layer.num_kv_heads
        pos = layer.pos.clone()
        keys = layer.keys.view(b, layer.num_kv_heads, layer.max_slots, -1).double().repeat_interleave(g, 1)
        q_pos = pos[:, :1].gather(-1, stats.new_slots[:, :1])[:, :, :, None]  # [B, 1, n, 1]
        slot_pos = pos.repeat_interleave(g, 1)[:, :, None, :]
        logits = torch.einsum("bhqd,bhcd->bhqc", query.double(), keys) * scale
        probs = torch.softmax(logits.masked_fill((slot_pos < 0) | (slot_pos > q_pos), float("-inf")), -1)
        records.append((layer.rank, stats.phase, pos, probs))
        return step(layer, stats)

    monkeypatch.setattr(AttentionDispatch, "attend", recorded_attend)
    monkeypatch.setattr(BudgetLayer, "step", recorded_step)
    return records


def at_positions(pos: torch.Tensor, values: torch.Tensor) -> dict[int, float]:
    """``{position: value}`` of one head's held slots (``pos`` and ``values`` ``[C]``)."""
    return {int(p): float(v) for p, v in zip(pos.tolist(), values.tolist()) if p >= 0}


def spec_keeps(name: str, params: dict, memory: dict, phase: Phase, held: list[int], rows: dict) -> set[int]:
    """What the spec keeps of one KV head after one forward: ``held`` its positions (the forward's tokens included),
    ``rows`` the forward's query rows as ``{position: probability}`` (``mean`` or ``sum`` over the head's GQA group;
    ``all``: the last row's mean over every query head of the layer), ``memory`` what the head carries between
    forwards (H2O's cumulative scores, MorphKV's recorded rows)."""
    budget = params["budget"]
    if name == "h2o":
        for row in rows["mean"]:
            for p, s in row.items():
                memory[p] = memory.get(p, 0.0) + s
    if name == "morphkv":  # a prompt (chunk) ends on the prompt's last R rows; a decode step on the R rows before its own
        recent, before = params["recent"], memory.get("rows", [])
        memory["rows"] = before + rows["sum"]
        fused = memory["rows"][-recent:] if phase is Phase.PREFILL else before[-recent:]
    if len(held) <= budget:
        return set(held)
    if name == "streaming_llm":
        return brute.streaming_llm(held, budget, params["sinks"])
    if name == "h2o":
        return brute.h2o({p: memory[p] for p in held}, budget, params.get("recent", budget // 2))
    if name == "tova":
        return brute.tova(rows["mean"][-1] if params.get("per_head") else rows["all"], budget)
    if name == "morphkv":
        return brute.morphkv(fused, held, budget, params["recent"], params.get("fusion", "sum"))
    if phase is Phase.DECODE:  # snapkv: decode appends
        return set(held)
    window = rows["mean"][-params["window"] :]
    scores = {p: sum(row[p] for row in window) for p in held}
    return brute.snapkv(scores, budget, len(window), params["kernel"], params.get("pooling", "max"))


@pytest.fixture(scope="module")
def peaked():
    """A tiny GQA model whose attention is peaked (queries scaled up): a random model's near-uniform attention ranks
    the tokens by their age alone, where a wrong group reduction would keep the same tokens."""
    _, model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return model


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize(
    "name,params",
    [("streaming_llm", {"sinks": 2}), ("h2o", {}), ("h2o", {"recent": 2}), ("tova", {}), ("tova", {"per_head": True}),
     ("morphkv", {"recent": 4}), ("morphkv", {"recent": 4, "fusion": "max"}), ("morphkv", {"recent": 10}),
     ("snapkv", {"window": 4, "kernel": 3}),
     ("snapkv", {"window": 4, "kernel": 5, "pooling": "avg"})],
)
def test_what_a_model_keeps_is_what_the_spec_keeps_from_its_attention(peaked, monkeypatch, name, params, chunk):
    """The tests above feed each policy statistics made by hand; here a tiny GQA model runs a prompt (whole or in
    chunks) and decode steps, and after every forward each KV head of each layer holds what the spec keeps given the
    attention of that forward's queries, computed literally: which query rows are read, how a GQA group and the
    rows combine, the recent window at a decode step, when eviction runs. (MorphKV with R = 10 and chunks of 16: the
    last chunk's 8 rows alone once ranked the prompt's end and seeded the first decode steps, not the prompt's last 10.)"""
    from kvgates import BudgetCache, make_policy

    model = peaked
    params = {"budget": 12, **params}
    records = record_attention(monkeypatch)
    cache = BudgetCache(model.config, make_policy(name, **params))
    ids = torch.randint(1, 128, (2, 52), generator=torch.Generator().manual_seed(5))
    prompt = [(a, min(40, a + (chunk or 40))) for a in range(0, 40, chunk or 40)]
    memory = {}
    with torch.no_grad():
        for a, z in prompt + [(t, t + 1) for t in range(40, 52)]:
            records.clear()
            model(ids[:, a:z], past_key_values=cache)
            for rank, phase, pos, probs in records:
                layer = cache.budget_layers[rank]
                g = probs.shape[1] // layer.num_kv_heads
                for b in range(2):
                    for h in range(layer.num_kv_heads):
                        group = probs[b, h * g : (h + 1) * g]
                        rows = {
                            "mean": [at_positions(pos[b, h], row) for row in group.mean(0)],
                            "sum": [at_positions(pos[b, h], row) for row in group.sum(0)],
                            "all": at_positions(pos[b, h], probs[b, :, -1].mean(0)),
                        }
                        held = [p for p in pos[b, h].tolist() if p >= 0]
                        expected = spec_keeps(name, params, memory.setdefault((rank, b, h), {}), phase, held, rows)
                        assert kept_positions(layer, layer.valid, b, h) == expected, f"layer {rank} at token {a}"


def test_pyramidkv_decoding_after_a_prompt_shorter_than_its_window_keeps_the_window(tiny):
    """A prompt of 3 tokens under a window of 4 clipped the first layer's pyramid budget to the prompt, 3 tokens, below
    the window that ``decode=True``'s evictions keep: the first decode eviction ended in a RuntimeError ('the policy
    kept other than min(held, quota) tokens'). Every layer's budget is at least the window."""
    _, model = tiny
    from kvgates import BudgetCache

    cache = BudgetCache(model.config, PyramidKV(budget=12, window=4, kernel=3, decode=True))
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :3], past_key_values=cache)
        for t in range(3, 30):
            model(ids[:, t : t + 1], past_key_values=cache)
    assert cache.held_tokens()[:, 0, 0].tolist() == pyramid_budgets(12, 4, 3, 3, 20) == [4, 12, 20]
    assert sorted(p for p in cache.budget_layers[0].pos[0, 0].tolist() if p >= 0) == list(range(26, 30))  # (the window)
