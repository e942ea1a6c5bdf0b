"""Long chunks are processed in tiles of query rows (and D2O's merge in tiles of evicted tokens) so memory follows
the chunk and the budget, not their product for every head; tiling must not change any result."""

import pytest
import torch
from helpers import policy_on

from kvgates import BudgetCache
from kvgates.kernels import reference
from kvgates.kernels.host import LAUNCH_BOUND_ENV


def padded_chunked(model, name: str, chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of a left-padded batch fed in chunks, and each layer's kept positions (sorted)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (3, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :10], mask[2, :29] = 0, 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with policy_on(model, name, 12) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            logits = torch.cat(
                [
                    model(ids[:, a : a + chunk], attention_mask=mask[:, : a + chunk], position_ids=positions[:, a : a + chunk],
                          past_key_values=cache).logits
                    for a in range(0, 48, chunk)
                ],
                dim=1,
            )
    return logits, [layer.pos.sort(-1).values for layer in cache.budget_layers]


@pytest.mark.parametrize("name,chunk", [("d2o", 48), ("merge", 16), ("h2o", 16), ("snapkv", 48)])
def test_tiles_of_a_few_rows_give_the_same_results(tiny, monkeypatch, name, chunk):
    _, model = tiny
    logits, kept = padded_chunked(model, name, chunk)
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 200)  # a handful of rows (or evicted tokens) per tile
    assert reference.row_tile(3, 4, 48) == 1
    tiled_logits, tiled_kept = padded_chunked(model, name, chunk)
    torch.testing.assert_close(tiled_logits, logits, atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(tiled_kept, kept))


def test_tiles_on_a_gpu_hold_more_rows(monkeypatch):
    # On a GPU a tile costs its launches (D2O's merge after the last layer: five a tile, serial), not cache misses: an
    # 8K prompt at batch 1 with 8 KV heads matches its 7K evicted keys against 1K kept ones in one tile, not 14.
    monkeypatch.delenv(LAUNCH_BOUND_ENV, raising=False)
    rows = reference.row_tile(1, 8, 1024)
    assert rows == 512 and reference.row_tile(1, 8, 1024, torch.device("cpu")) == rows
    assert reference.row_tile(1, 8, 1024, torch.device("cuda")) >= 7 * 1024
    monkeypatch.setenv(LAUNCH_BOUND_ENV, "1")  # (the GPU's tiles on the CPU, to count their launches)
    assert reference.row_tile(1, 8, 1024, torch.device("cpu")) >= 7 * 1024
