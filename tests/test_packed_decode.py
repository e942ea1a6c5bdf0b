"""Decode steps on the packed layout's fast paths give the general path's logits.

A packed layer (every slot below each head's ``fill`` holds a token) decodes without a mask over positions: sdpa
over a slice of storage when every head holds as many tokens, and ``BudgetLayer._decode_packed_heads`` when heads
hold different numbers (Ada-KV's head budgets: ragged storage; KVMerger's merges: uniform storage, per-head fill).
The general path (``BudgetLayer._decode``: visibility from positions) is the reference.
"""

import pytest
import torch

from kvgates import BudgetCache


def test_a_full_cache_is_packed_from_its_prompt_on(tiny):
    """The full cache decodes with sdpa over its whole storage (it never evicts, so nothing else packs it)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(5))

    def check(cache):
        seen = cache.get_seq_length()
        assert all(layer.dense_fill == seen == layer.max_slots for layer in cache.budget_layers)

    with torch.no_grad():
        cache = BudgetCache(model.config, "full")
        for a, z in [(0, 20)] + [(t, t + 1) for t in range(20, 30)]:
            model(ids[:, a:z], past_key_values=cache)
            check(cache)
