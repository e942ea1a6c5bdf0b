"""The statistics the runtime hands to policies equal a naive softmax over visible slots."""

import pytest
import torch
from helpers import make_layer, random_positions

from kvgates import kernels
from kvgates.kernels import reference
from kvgates.policies.full import Full
from kvgates.runtime.stats import AttnStats, Phase, StatsRequest


def naive_probs(q, k, slot_pos, q_pos, scale):
    """[B, H, r, C] by explicit loops over (b, head, row)."""
    b, h, r, _ = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.zeros(b, h, r, c)
    for i in range(b):
        for head in range(h):
            kv = head // g
            for row in range(r):
                vis = [s for s in range(c) if 0 <= slot_pos[i, kv, s] <= q_pos[i, row]]
                if not vis:
                    continue
                logits = torch.stack([q[i, head, row] @ k[i, kv, s] * scale for s in vis])
                out[i, head, row, vis] = torch.softmax(logits, 0)
    return out


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_rows_and_colsum_match_naive(reduce):
    torch.manual_seed(0)
    pos = random_positions(2, 2, 12, held=9, seed=1)
    layer = make_layer(Full(), pos)
    k = layer.keys.view(2, 2, 12, 8)
    q = torch.randn(2, 6, 5, 8)
    q_pos = torch.tensor([[3, 6, 7, 8, 30], [0, 2, 4, 9, 30]])
    q_real = torch.tensor([[True, True, False, True, True], [True, True, True, True, True]])
    stats = AttnStats(phase=Phase.PREFILL, new_slots=torch.zeros(2, 2, 5, dtype=torch.long))
    layer._prefill_stats(q, layer.keys, 0.5, q_pos, q_real, StatsRequest(rows=3, window=4, colsum=True, reduce=reduce), stats)
    probs = naive_probs(q, k, pos, q_pos, 0.5) * q_real[:, None, :, None]
    torch.testing.assert_close(stats.rows, kernels.group_reduce(probs[:, :, -3:], 2, reduce), atol=1e-6, rtol=0)
    window = kernels.group_reduce(probs[:, :, -4:].sum(2), 2, reduce)
    torch.testing.assert_close(stats.window, window, atol=1e-6, rtol=0)
    assert stats.window_rows == 4
    torch.testing.assert_close(stats.colsum, kernels.group_reduce(probs.sum(2), 2, reduce), atol=1e-6, rtol=0)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_decode_probs_match_naive(reduce):
    pos = random_positions(2, 2, 10, held=7, seed=2)
    layer = make_layer(Full(), pos)
    k = layer.keys.view(2, 2, 10, 8)
    v = layer.values.view(2, 2, 10, 8)
    q = torch.randn(2, 6, 1, 8)
    stats = AttnStats(phase=Phase.DECODE, new_slots=torch.zeros(2, 2, 1, dtype=torch.long))
    out = layer._decode(q, layer.keys, 0.3, StatsRequest(rows=1, reduce=reduce), stats)
    probs = naive_probs(q, k, pos, torch.full((2, 1), 10**6), 0.3)
    torch.testing.assert_close(stats.rows[:, :, 0], kernels.group_reduce(probs[:, :, 0], 2, reduce), atol=1e-6, rtol=0)
    expected = torch.einsum("bhc,bhcd->bhd", probs[:, :, 0], v.repeat_interleave(3, 1))
    torch.testing.assert_close(out[:, :, 0], expected, atol=1e-5, rtol=0)


def test_pool_by_position_ignores_slot_order():
    scores = torch.tensor([[[0.1, 0.9, 0.0, 0.3, 0.2]]])
    pos = torch.tensor([[[4, 0, -1, 2, 1]]])
    # In position order: p0=0.9, p1=0.2, p2=0.3, p4=0.1 -> max-pool k=3 over [0.9, 0.2, 0.3, 0.1]
    pooled = kernels.pool_by_position(scores, pos, 3, "max")
    assert pooled[0, 0, 1] == pytest.approx(0.9)  # p0
    assert pooled[0, 0, 4] == pytest.approx(0.9)  # p1: neighbours p0, p2
    assert pooled[0, 0, 3] == pytest.approx(0.3)  # p2: neighbours p1, p4
    assert pooled[0, 0, 0] == pytest.approx(0.3)  # p4: neighbours p2 and padding


@pytest.mark.parametrize(("n", "shift"), [(1, 0.0), (7, 0.0), (40, 0.0), (40, 200.0), (40, -200.0)])
@pytest.mark.parametrize("window", [0, 5, 64])
def test_causal_attention_stats_matches_sdpa_and_column_sums(n, shift, window, monkeypatch):
    """Also with scores far above exp's range (``shift`` 200: every row overflows unshifted) or far below it (-200:
    every row underflows), which the row maxima the softmax subtracts bring back into range. The window scores are
    those of the last rows (all of them when the window is longer than the prompt), with or without column sums."""
    monkeypatch.setattr(reference, "FUSED_TILE_ELEMENTS", 6 * 2 * 40)  # several row tiles
    g = torch.Generator().manual_seed(n)
    q, k, v = torch.randn(2, 6, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    atol = 1e-5
    if shift:  # a component every key shares lifts (or sinks) every score by ``shift``
        q[..., 0], k[..., 0] = shift / 0.4 / 10, 10.0
        atol = 1e-4  # scores near 200 carry float32 rounding of ~2e-5 in any kernel
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4, enable_gqa=True)
    pos = torch.arange(n).expand(2, 2, n)
    q_pos = torch.arange(n).expand(2, n)
    sums = reference.column_sums(q, k, pos, q_pos, torch.ones(2, n, dtype=torch.bool), 0.4)
    w = min(window, n)
    in_window = torch.arange(n).expand(2, n) >= n - w
    window_sums = reference.column_sums(q, k, pos, q_pos, in_window, 0.4)
    for colsum in (True, False):
        out, col, win = reference.causal_attention_stats(q, k, v, 0.4, colsum=colsum, window=window)
        torch.testing.assert_close(out, expected, atol=atol, rtol=0)
        if colsum:
            torch.testing.assert_close(col, sums, atol=atol, rtol=0)
        else:
            assert col is None
        if window:
            torch.testing.assert_close(win, window_sums, atol=atol, rtol=0)
        else:
            assert win is None


def test_causal_attention_stats_of_an_empty_prompt_is_empty():
    """No query rows: an empty output and empty statistics, as the Triton kernel gives (the torch reference's tile
    of ``min(n, ...)`` rows was 0, and its loop over tiles raised)."""
    q, k = torch.randn(2, 6, 0, 8), torch.randn(2, 2, 0, 8)
    out, col, win = reference.causal_attention_stats(q, k, k, 0.4, colsum=True, window=4)
    assert out.shape == (2, 6, 0, 8) and col.shape == (2, 6, 0) and win is None


def test_a_product_that_does_not_split_copies_no_operand():
    """``_per_part`` made a contiguous copy even for one part: a layer's keys and values held as a strided view (a
    slice of a cache's storage) were copied whole on every call that did not split."""
    held = torch.randn(2, 3, 16, 8)[:, :, :10]  # a slice: not contiguous
    assert reference._per_part(held, 1).data_ptr() == held.data_ptr()
    split = reference._per_part(held, 2)
    assert split.shape == (2, 3, 2, 10, 8) and torch.equal(split[:, :, 1], held)


@pytest.mark.parametrize(("threads", "parts"), [(1, 1), (2, 2), (3, 3), (4, 4), (5, 1)])
def test_causal_attention_stats_splits_rows_to_balance_threads(threads, parts, monkeypatch):
    """Each KV head's rows of a tile are split into as many products as balance the CPU's threads (``_balanced_parts``:
    5 threads would need 5 parts, more than ``MAX_ROW_PARTS``); a last, shorter tile that does not split runs whole.
    The results are the unsplit ones."""
    monkeypatch.setattr(reference, "MIN_PART_ROWS", 1)
    monkeypatch.setattr(reference, "FUSED_TILE_ELEMENTS", 3 * 4 * 23)  # tiles of 4 rows: the last holds 3 (9 of a head)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 3, 23, 8, generator=g), torch.randn(1, 1, 23, 8, generator=g), torch.randn(1, 1, 23, 8, generator=g)
    unsplit = reference.causal_attention_stats(q, k, v, 0.4, window=5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert reference._balanced_parts(1, 3 * 4, q.device) == parts
    assert reference._balanced_parts(1, 3 * 4, torch.device("meta")) == 1  # a GPU: no split
    for got, expected in zip(reference.causal_attention_stats(q, k, v, 0.4, window=5), unsplit):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_row_parts_forces_a_split_that_gives_the_same_results(monkeypatch):
    """``reference.row_parts`` (what ``bench/cpu_attention.py`` times each split under) forces the parts of the CPU's
    split products, unsplit included, wherever a part keeps ``MIN_PART_ROWS`` rows, never on a GPU; the results are
    the default's, and the block's end restores the balancing choice."""
    monkeypatch.setattr(reference, "MIN_PART_ROWS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    default = reference.causal_attention_stats(q, k, v, 0.4, window=5)
    assert reference._stats_tile_plan(q, k)[1] == 1  # 2 KV heads on 2 threads: balanced unsplit
    for parts in (1, 2, 3, 4):
        with reference.row_parts(parts):
            assert reference._balanced_parts(2, 12, q.device) == (parts if 12 // parts >= 4 else 1)
            assert reference._balanced_parts(2, 12, torch.device("meta")) == 1
            assert reference._stats_tile_plan(q, k)[1] == parts
            for got, expected in zip(reference.causal_attention_stats(q, k, v, 0.4, window=5), default):
                torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert reference._stats_tile_plan(q, k)[1] == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="row_parts: parts must be a positive integer"), reference.row_parts(bad):
            pass


def test_causal_attention_stats_tiles_are_a_multiple_of_the_parts(monkeypatch):
    """A prompt long enough that ``FUSED_TILE_ELEMENTS`` makes a tile's rows odd (a head's 5 rows on 2 threads: 2 parts)
    ran every tile whole, over ``parts`` copies of its keys and values made for the split: the tile is now a multiple
    of what the parts divide (4 rows), as ``_prob_tile_plan``'s and ``_chunk_colmax``'s, and only the last splits not."""
    monkeypatch.setattr(reference, "MIN_PART_ROWS", 1)
    monkeypatch.setattr(reference, "FUSED_TILE_ELEMENTS", 5 * 23)  # tiles of at most 5 rows
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 23, 8, generator=g), torch.randn(1, 1, 23, 8, generator=g), torch.randn(1, 1, 23, 8, generator=g)
    unsplit = reference.causal_attention_stats(q, k, v, 0.4, window=5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    matmul, parts = torch.matmul, []

    def spy(a, b, **kwargs):
        parts.append(a.shape[2])  # [B, H_kv, parts, rows, D]
        return matmul(a, b, **kwargs)

    monkeypatch.setattr(torch, "matmul", spy)
    got = reference.causal_attention_stats(q, k, v, 0.4, window=5)
    monkeypatch.undo()
    assert parts[::2] == [2, 2, 2, 2, 2, 1]  # the scores of tiles of 4 rows, and of the last 3 (the outputs' between)
    for got_one, expected in zip(got, unsplit):
        torch.testing.assert_close(got_one, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tile_elements", [1 << 22, 6 * 2 * 12])  # one tile; a row or two per tile
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_masked_colmax_and_column_reductions_match_naive(monkeypatch, tile_elements, weighted, threads):
    """``masked_attention_colmax``, ``masked_attention_colsum``, ``column_max`` and ``column_sums`` against explicit
    loops: empty slots and positions out of order, padded rows (no output, no maximum, no sum), a real row that sees
    no slot (zero), row weights, and tiles of a row or two; on 3 threads each KV head's rows of a tile in 3 products
    (``_balanced_parts``: 4 KV heads of 2 rows; a tile of 5 rows made 3, then 2)."""
    monkeypatch.setattr(reference, "TILE_ELEMENTS", tile_elements)
    monkeypatch.setattr(reference, "MIN_PART_ROWS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(4)
    pos = random_positions(2, 2, 12, held=9, seed=2)
    k, v = torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    q = torch.randn(2, 6, 5, 8)
    q_pos = torch.tensor([[3, 6, -1, 8, 30], [0, 2, 4, 9, 30]])  # row (0, 2) sees nothing
    q_valid = torch.tensor([[True, True, True, False, True], [True, False, True, True, True]])
    weight = torch.rand(2, 5) if weighted else None
    probs = naive_probs(q, k, pos, q_pos, 0.4) * q_valid[:, None, :, None]
    scaled = probs * (1.0 if weight is None else weight[:, None, :, None])
    out, colmax = reference.masked_attention_colmax(q, k, v, pos, q_pos, q_valid, 0.4, weight)
    expected_out = probs @ v.repeat_interleave(3, 1)
    real = q_valid[:, None, :, None].expand_as(expected_out)
    torch.testing.assert_close(out[real], expected_out[real], atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(colmax, scaled.amax(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(reference.column_max(q, k, pos, q_pos, q_valid, 0.4, weight), scaled.amax(2), atol=1e-6, rtol=0)
    sums = reference.column_sums(q, k, pos, q_pos, q_valid, 0.4)
    torch.testing.assert_close(sums, probs.sum(2), atol=1e-5, rtol=0)
    out, sums = reference.masked_attention_colsum(q, k, v, pos, q_pos, q_valid, 0.4)
    torch.testing.assert_close(out[real], expected_out[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(sums, probs.sum(2), atol=1e-5, rtol=0)


def chunk_layout(b: int, hkv: int, older: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_pos, q_pos)`` of a chunk of ``n`` queries after ``older`` held tokens (in any slot order, per head),
    its own tokens in the last ``n`` slots: the layout of KVzip's reconstruction forwards."""
    g = torch.Generator().manual_seed(seed)
    q_pos = older + 3 + torch.randint(0, 4, (b, 1), generator=g) + torch.arange(n)
    held = torch.stack([torch.randperm(older + 3, generator=g)[:older] for _ in range(b * hkv)]).view(b, hkv, older)
    return torch.cat([held, q_pos[:, None].expand(b, hkv, n)], -1), q_pos


@pytest.mark.parametrize("tile_elements", [1 << 22, 2 * 6 * 7 * 3])  # one tile; three slots per tile
@pytest.mark.parametrize("older", [0, 11])
@pytest.mark.parametrize("threads", [1, 3])
def test_chunk_colmax_matches_naive(monkeypatch, tile_elements, older, threads):
    """A chunk over older tokens takes the chunk path (two flash calls, maxima from their log-sum-exps), which gives
    the naive output and weighted maxima: row weights (one zero), slot weights zero outside a span of slots that
    differs per row and head (the slots outside every span get 0), and grouped heads; on 3 threads each head's
    slots of a tile in 3 products (``_balanced_parts``; 4 KV heads of 2 rows), where the tile splits."""
    monkeypatch.setattr(reference, "TILE_ELEMENTS", tile_elements)
    monkeypatch.setattr(reference, "MIN_PART_ROWS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(5)
    pos, q_pos = chunk_layout(2, 2, older, 7, seed=older)
    c = pos.shape[-1]
    q, k, v = torch.randn(2, 6, 7, 8), torch.randn(2, 2, c, 8), torch.randn(2, 2, c, 8)
    valid = torch.ones(2, 7, dtype=torch.bool)
    assert reference.own_block_start(pos, q_pos, valid) == older
    row_weight = torch.rand(2, 7)
    row_weight[0, 3] = 0.0
    col_weight = torch.zeros(2, 6, c)
    col_weight[0, :, 2 : c - 2] = torch.rand(6, c - 4)
    col_weight[0, 0, c // 2 :] = 0.0  # the first row and head weigh a narrower span than the others
    col_weight[1, :, : c - 3] = torch.rand(6, c - 3)
    col_weight[1, 5, c - 1] = 0.7  # the second row's last head weighs the last own slot too
    probs = naive_probs(q, k, pos, q_pos, 0.4)
    for rows, cols in ((None, None), (row_weight, col_weight)):
        out, colmax = reference.masked_attention_colmax(q, k, v, pos, q_pos, valid, 0.4, rows, cols)
        torch.testing.assert_close(out, probs @ v.repeat_interleave(3, 1), atol=1e-5, rtol=0)
        weighted = probs * (1.0 if rows is None else rows[:, None, :, None])
        expected = weighted.amax(2) * (1.0 if cols is None else cols)
        torch.testing.assert_close(colmax, expected, atol=1e-6, rtol=0)


def test_other_layouts_take_the_tiles():
    """``own_block_start`` finds the chunk layout only: an empty or newer older slot (newer than its own row's first
    query), a padded row, own tokens out of order, or query positions that do not increase send the call to the
    tiled softmax."""
    pos, q_pos = chunk_layout(1, 2, 6, 4, seed=0)
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert reference.own_block_start(pos, q_pos, valid) == 6
    empty, newer, swapped = pos.clone(), pos.clone(), pos.clone()
    empty[0, 1, 2] = -1
    newer[0, 0, 0] = q_pos[0, 0]
    swapped[0, 1, [-1, -2]] = swapped[0, 1, [-2, -1]]
    for slots in (empty, newer, swapped):
        assert reference.own_block_start(slots, q_pos, valid) is None
    assert reference.own_block_start(pos, q_pos, torch.tensor([[False, True, True, True]])) is None
    assert reference.own_block_start(pos[..., :3], q_pos, valid) is None  # fewer slots than queries
    unordered = q_pos.clone()
    unordered[0, [1, 2]] = unordered[0, [2, 1]]  # own slots hold the queries' positions, which do not increase
    assert reference.own_block_start(torch.cat([pos[..., :6], unordered[:, None].expand(1, 2, 4)], -1), unordered, valid) is None
    rows_q = torch.tensor([[12, 13, 14, 15], [9, 10, 11, 12]])  # each row is checked against its own first query
    rows_pos = torch.cat([torch.arange(6).expand(2, 2, 6), rows_q[:, None].expand(2, 2, 4)], -1)
    assert reference.own_block_start(rows_pos, rows_q, torch.ones(2, 4, dtype=torch.bool)) == 6
    rows_pos[1, 0, 0] = 10  # older than the first row's first query, not the second's
    assert reference.own_block_start(rows_pos, rows_q, torch.ones(2, 4, dtype=torch.bool)) is None


def test_probability_reductions_of_no_query_rows_are_zero():
    """A call with no query rows (an empty chunk) reduces nothing: zeros, as before the tiles were shared."""
    q, k, v = torch.randn(1, 4, 0, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    pos, q_pos, valid = torch.arange(5).expand(1, 2, 5), torch.zeros(1, 0, dtype=torch.long), torch.ones(1, 0, dtype=torch.bool)
    out, best = reference.masked_attention_colmax(q, k, v, pos, q_pos, valid, 0.3)
    assert out.shape == (1, 4, 0, 8) and not best.any()
    assert not reference.column_sums(q, k, pos, q_pos, valid, 0.3).any()
    assert not reference.column_max(q, k, pos, q_pos, valid, 0.3).any()
