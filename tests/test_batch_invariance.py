"""Every policy gives a sequence the same result alone and inside a left-padded batch of longer and shorter rows."""

import pytest
import torch
from helpers import policy_on

from kvgates import POLICIES, BudgetCache

LENGTHS = (40, 18, 12, 9)  # the last two fit the budget until decode steps grow them
BUDGET, DECODE = 12, 6


def padded_logits(model, policy, rows: list[torch.Tensor], decode: torch.Tensor) -> list[torch.Tensor]:
    """Each row's logits ``[len + decode, V]`` over its real tokens: the left-padded prompt in one forward, then
    ``decode`` fed one token per step."""
    b, longest = len(rows), max(len(r) for r in rows)
    ids = torch.zeros((b, longest), dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :], mask[i, longest - len(r) :] = r, 1
    ids, mask = torch.cat([ids, decode], 1), torch.cat([mask, torch.ones_like(decode)], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = BudgetCache(model.config, policy)
    steps = [(0, longest)] + [(t, t + 1) for t in range(longest, ids.shape[1])]
    with torch.no_grad():
        logits = torch.cat(
            [
                model(ids[:, a:z], attention_mask=mask[:, :z], position_ids=positions[:, a:z], past_key_values=cache).logits
                for a, z in steps
            ],
            dim=1,
        )
    return [logits[i][mask[i].bool()] for i in range(b)]


#: Options whose decisions depend on more than the tokens held (amortised eviction, protected layers).
VARIANTS = [
    ("trimkv", {"buffer": 3}), ("trimkv-global", {"buffer": 5}), ("d2o", {"protect_edge_layers": True}), ("kvzip", {"normalize": True}),
    ("kvzap", {"threshold": 0.0}), ("d2o", {"slack": 2}), ("merge", {"base": "h2o", "base_params": {"slack": 2}}),
]


@pytest.mark.parametrize("name,overrides", [(name, {}) for name in sorted(POLICIES)] + VARIANTS)
def test_a_sequence_gets_the_same_logits_alone_and_in_a_padded_batch(tiny, name, overrides):
    _, model = tiny
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(1, 128, (n,), generator=g) for n in LENGTHS]
    decode = torch.randint(1, 128, (len(rows), DECODE), generator=g)
    torch.manual_seed(0)  # learned policies: the same fresh gates for every run
    with policy_on(model, name, BUDGET, **overrides) as policy:
        batched = padded_logits(model, policy, rows, decode)
        for i, row in enumerate(rows):
            alone = padded_logits(model, policy, [row], decode[i : i + 1])[0]
            torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=0, msg=lambda m, i=i: f"row {i} ({LENGTHS[i]} tokens): {m}")


#: Policies that read per-sequence budgets during decode evictions.
DECODE_BUDGETS = [("adakv", {"base": "h2o", "base_params": {}}), ("pyramidkv", {"decode": True}), ("kvzap", {"threshold": 0.0})]


@pytest.mark.parametrize("name,overrides", [(name, {}) for name in sorted(POLICIES)] + DECODE_BUDGETS)
def test_reordering_the_batch_reorders_every_per_sequence_state(tiny, name, overrides):
    """Beam search reorders the cache's sequences; every per-sequence value a policy keeps (budgets, thresholds,
    scratch) must follow, or the reordered rows continue with another row's state."""
    _, model = tiny
    g = torch.Generator().manual_seed(12)
    prompts = torch.randint(1, 128, (2, 30), generator=g)
    steps = torch.randint(1, 128, (2, 8), generator=g)
    swap = torch.tensor([1, 0])

    def run(first: torch.Tensor, reorder: bool) -> torch.Tensor:
        torch.manual_seed(0)  # learned policies: the same fresh gates for both runs
        with policy_on(model, name, BUDGET, **overrides) as policy, torch.no_grad():
            cache = BudgetCache(model.config, policy)
            model(prompts[first], past_key_values=cache)
            for t in range(3):
                model(steps[first, t : t + 1], past_key_values=cache)
            if reorder:
                cache.reorder_cache(swap)
            return torch.cat([model(steps[swap, t : t + 1], past_key_values=cache).logits for t in range(3, 8)], 1)

    torch.testing.assert_close(run(torch.tensor([0, 1]), reorder=True), run(swap, reorder=False), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,overrides", [("d2o", {"slack": 2}), ("merge", {"base": "h2o", "base_params": {"slack": 2}})])
def test_a_merging_policy_leaves_a_sequence_within_tolerance_as_it_would_be_alone(name, overrides):
    # With slack, a batch evicts where some sequences are over and others within tolerance: the selection runs for
    # the batch, and its merge of evicted tokens must not touch a sequence that evicts nothing (a row of 7 real
    # tokens after 33 pads, positions counted over the pads; 4 KV heads so that D2O's layer budgets differ: its
    # logits differed by 0.03 alone and in the batch).
    from helpers import tiny_model

    torch.manual_seed(0)
    _, model = tiny_model(num_key_value_heads=4)
    g = torch.Generator().manual_seed(3)
    prompt, steps = 40, 12
    ids = torch.randint(1, 128, (2, prompt + steps), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :33] = 0

    def logits(rows: list[int]) -> torch.Tensor:
        with policy_on(model, name, 10, **overrides) as policy:
            cache, x, m = BudgetCache(model.config, policy), ids[rows], mask[rows]
            with torch.no_grad():
                out = [model(x[:, :prompt], attention_mask=m[:, :prompt], past_key_values=cache).logits[:, -1]]
                for t in range(prompt, prompt + steps):
                    out.append(model(x[:, t : t + 1], attention_mask=m[:, : t + 1], past_key_values=cache).logits[:, -1])
        return torch.stack(out, 1)

    torch.testing.assert_close(logits([0, 1])[1], logits([1])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["h2o", "kvzip"])
def test_a_batch_selection_may_name_its_sequences_in_a_list(tiny, name):
    """``reorder_cache`` and ``batch_select_indices`` given a list of ints (transformers' own layers index with one)
    ended in an AttributeError in the first budgeted layer; they select as the same indices in a tensor do."""
    _, model = tiny
    prompts = torch.randint(1, 128, (3, 30), generator=torch.Generator().manual_seed(13))

    def held(select) -> list[torch.Tensor]:
        with policy_on(model, name, BUDGET) as policy, torch.no_grad():
            cache = BudgetCache(model.config, policy)
            model(prompts, past_key_values=cache)
            select(cache)
            logits = model(prompts[[2, 0], -1:], past_key_values=cache).logits
            return [logits] + [layer.keys for layer in cache.budget_layers]

    for how in ("reorder_cache", "batch_select_indices"):
        got = held(lambda cache: getattr(cache, how)([2, 0]))
        expected = held(lambda cache: getattr(cache, how)(torch.tensor([2, 0])))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
