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
    ("kvzap", {"threshold": 0.0}),
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
