"""Every Triton kernel equals its torch reference over a grid of small shapes.

On CPU this needs TRITON_INTERPRET=1 (set by `make test`); on a CUDA machine it runs on the GPU.
Tolerances: float32 tight (1e-5), float16/bfloat16 as stated per test (inputs rounded, fp32 accumulation).
"""

import json
import os
import re

import pytest
import torch

from kvgates.kernels import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    from kvgates.kernels import triton_ops

    return triton_ops


def test_host_grid_helpers_match_tritons(ops):
    """The launch wrappers' ceiling division and powers of two, plain Python (Triton's are constexpr functions whose
    calls from Python took half of a decode-attention call's host time), agree with Triton's."""
    import triton

    assert all(ops._cdiv(a, b) == triton.cdiv(a, b) for a in range(300) for b in range(1, 40))
    assert all(ops._pow2(n, 1) == triton.next_power_of_2(n) for n in range(1, 3000))
    assert [ops._pow2(n) for n in (0, 1, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, 128]


def flat_layer(b, caps, d, dtype, seed=0, holes=0.3):
    """Random flat storage (keys, values) and padded positions with holes, for the given head capacities."""
    g = torch.Generator().manual_seed(seed)
    s, cmax = sum(caps), max(caps)
    keys = torch.randn(b, s, d, generator=g).to(dtype)
    values = torch.randn(b, s, d, generator=g).to(dtype)
    pos = torch.full((b, len(caps), cmax), -1, dtype=torch.int64)
    for i in range(b):
        for h, c in enumerate(caps):
            perm = torch.randperm(c * 3, generator=g)[:c]
            keep = torch.rand(c, generator=g) > holes
            pos[i, h, :c] = torch.where(keep, perm, torch.full_like(perm, -1))
    return keys.to(DEVICE), values.to(DEVICE), pos.to(DEVICE)


SHAPES = [  # (batch, caps, query heads, head_dim)
    (1, [40, 40], 4, 16),
    (2, [65, 65, 65], 9, 64),
    (3, [17, 80, 33], 6, 32),  # ragged heads (Ada-KV)
    (1, [130], 8, 64),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,caps,h,d", SHAPES)
@pytest.mark.parametrize("reduce", ["sum", "none"])
def test_decode_attention(ops, b, caps, h, d, dtype, reduce):
    keys, values, pos = flat_layer(b, caps, d, dtype)
    q = torch.randn(b, h, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    scale = d**-0.5
    out, probs = ops.decode_attention_flat(q, keys, values, pos, caps, scale, reduce)
    ref_out, ref_probs = reference.decode_attention_flat(q, keys, values, pos, caps, scale, reduce)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol * 5, rtol=tol * 5)
    torch.testing.assert_close(probs, ref_probs, atol=tol, rtol=tol * 5)


def test_decode_attention_empty_heads(ops):
    keys, values, pos = flat_layer(1, [8, 8], 16, torch.float32)
    pos[:, 1] = -1  # a head holding nothing attends to nothing
    q = torch.randn(1, 4, 16, device=DEVICE)
    out, probs = ops.decode_attention_flat(q, keys, values, pos, [8, 8], 0.25)
    ref_out, ref_probs = reference.decode_attention_flat(q, keys, values, pos, [8, 8], 0.25)
    torch.testing.assert_close(out, ref_out)
    assert torch.all(probs[:, 1] == 0) and torch.all(out[:, 2:] == 0)


def test_decode_attention_gives_nan_for_a_nan_key_as_sdpa(ops):
    """A NaN key (a model's overflow) makes its head's output NaN on both backends, as sdpa's: the reference's softmax
    was cleaned of NaN to zero its empty heads, which turned that head's output to zeros on the CPU, and only where a
    policy asked for attention statistics."""
    keys, values, pos = flat_layer(1, [8, 8], 16, torch.float32, holes=0.0)
    keys[0, 3] = float("nan")  # head 0's slot 3
    q = torch.randn(1, 4, 16, device=DEVICE)
    for impl in (ops, reference):
        out, _ = impl.decode_attention_flat(q, keys, values, pos, [8, 8], 0.25)
        assert out[:, :2].isnan().all() and not out[:, 2:].isnan().any(), impl.__name__
    full = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys.view(1, 2, 8, 16), values.view(1, 2, 8, 16), scale=0.25, enable_gqa=True
    )
    assert full[:, :2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,caps,h,d", SHAPES)
@pytest.mark.parametrize("w,reduce", [(5, "sum"), (32, "mean")])
def test_window_scores(ops, b, caps, h, d, dtype, w, reduce):
    keys, values, pos = flat_layer(b, caps, d, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, w, d, generator=g).to(dtype).to(DEVICE)
    q_pos = torch.randint(0, max(caps) * 3, (b, w), generator=g).sort(-1).values.to(DEVICE)
    q_valid = (torch.rand(b, w, generator=g) > 0.2).to(DEVICE)
    got = ops.window_scores_flat(q, keys, values, pos, caps, q_pos, q_valid, d**-0.5, reduce)
    ref = reference.window_scores_flat(q, keys, values, pos, caps, q_pos, q_valid, d**-0.5, reduce)
    tol = TOL[dtype] * 10
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


PREFILL_SHAPES = [  # (batch, query heads, KV heads, prompt length, head_dim): lengths off the block sizes
    (1, 4, 2, 37, 64),
    (2, 8, 2, 70, 128),
    (1, 3, 3, 32, 64),  # MHA, exactly one query block
    (2, 4, 1, 1, 64),  # MQA, a one-token prompt
]


PREFILL_CASES = [  # both statistics over every shape and dtype; each one alone, and a window past the prompt
    *((dtype, shape, True, 8) for dtype in (torch.float32, torch.float16, torch.bfloat16) for shape in PREFILL_SHAPES),
    *((torch.float32, PREFILL_SHAPES[0], colsum, window) for colsum, window in ((True, 0), (False, 8), (False, 100))),
]


@pytest.mark.parametrize("dtype,shape,colsum,window", PREFILL_CASES)
def test_causal_attention_stats(ops, dtype, shape, colsum, window):
    b, h, hkv, n, d = shape
    g = torch.Generator().manual_seed(n)
    # Queries as the runtime passes them: a [B, H, n, D] view of [B, n, H, D] memory.
    q = torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    out, col, win = ops.causal_attention_stats(q, k, v, d**-0.5, colsum, window)
    ref_out, ref_col, ref_win = reference.causal_attention_stats(q, k, v, d**-0.5, colsum, window)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol * 5, rtol=tol * 5)
    assert (col is None) == (ref_col is None) and (win is None) == (ref_win is None)
    if colsum:  # sums of up to n probabilities
        torch.testing.assert_close(col, ref_col, atol=tol * 10, rtol=tol * 10)
    if window:
        torch.testing.assert_close(win, ref_win, atol=tol * 10, rtol=tol * 10)
    assert out.transpose(1, 2).is_contiguous()  # written where the model reads it: no copy on the way back


PREFILL_CONFIGS = [  # (forward BLOCK_M, BLOCK_N), (column pass BLOCK_N keys a program, BLOCK_M rows a step)
    ((32, 16), (16, 16)),  # the CPU default
    ((16, 16), (32, 16)),  # several row steps on each block's diagonal
    ((64, 16), (16, 64)),  # one row step past a block's diagonal; one forward block covers the prompt's first 64
    ((32, 32), (16, 32)),
    ((128, 64), (128, 64)),  # the GPU's at head dim 128, 16-bit (stop 59's columns): one block of keys, two row steps
]


@pytest.mark.parametrize("forward,columns", PREFILL_CONFIGS)
@pytest.mark.parametrize("colsum,window", [(True, 20), (True, 0), (False, 20), (False, 70), (True, 3)])
def test_causal_attention_stats_under_other_launch_configs(ops, forward, columns, colsum, window):
    """What the prefill sweep (``bench/kernels.py --sweep-prefill``) measures is the same attention and statistics:
    column steps on and past the causal diagonal, windows that start inside a row step or cover the prompt."""
    b, h, hkv, n, d = 2, 4, 2, 70, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, n, h, d, generator=g).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(DEVICE) for _ in range(2))
    cfg = {
        "forward": {"BLOCK_M": forward[0], "BLOCK_N": forward[1], "num_warps": 4, "num_stages": 1},
        "columns": {"BLOCK_N": columns[0], "BLOCK_M": columns[1], "num_warps": 4, "num_stages": 1},
    }
    got = ops.causal_attention_stats(q, k, v, d**-0.5, colsum, window, cfg)
    ref = reference.causal_attention_stats(q, k, v, d**-0.5, colsum, window)
    for a, r in zip(got, ref):
        assert (a is None) == (r is None)
        if a is not None:
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def test_causal_attention_stats_refuses_a_forward_block_off_its_steps(ops):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    cfg = ops._prefill_config(16, torch.float32, torch.device(DEVICE))
    cfg["forward"] = {**cfg["forward"], "BLOCK_M": 16, "BLOCK_N": 32}
    with pytest.raises(ValueError, match="BLOCK_M must be a multiple of its BLOCK_N"):
        ops.causal_attention_stats(q, q, q, 0.25, True, 0, cfg)


def test_prefill_config_override_from_the_environment(ops, monkeypatch):
    """``KVGATES_PREFILL_CONFIG`` overrides what it names of the prefill kernels' launch configurations (the sweep's
    fastest pair, measured end to end without a code edit); the prefill and the masked kernels run under it."""
    default = ops._prefill_config(32, torch.float32, torch.device(DEVICE))
    monkeypatch.setenv(ops.PREFILL_CONFIG_ENV, '{"forward": {"BLOCK_M": 64}, "columns": {"BLOCK_N": 32, "num_warps": 2}}')
    cfg = ops._prefill_config(32, torch.float32, torch.device(DEVICE))
    assert cfg == {
        "forward": {**default["forward"], "BLOCK_M": 64}, "columns": {**default["columns"], "BLOCK_N": 32, "num_warps": 2},
        "attention": default["attention"],
    }
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 70, 4, 32, generator=g).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(1, 2, 70, 32, generator=g).to(DEVICE) for _ in range(2))
    for a, r in zip(ops.causal_attention_stats(q, k, v, 0.2, True, 20), reference.causal_attention_stats(q, k, v, 0.2, True, 20)):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)
    pos, rows = torch.arange(70, device=DEVICE).expand(1, 2, 70), torch.arange(50, 70, device=DEVICE)[None]
    valid = torch.ones(1, 20, dtype=torch.bool, device=DEVICE)
    got = ops.masked_attention_colsum(q[:, :, 50:], k, v, pos, rows, valid, 0.2)
    ref = reference.masked_attention_colsum(q[:, :, 50:], k, v, pos, rows, valid, 0.2)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("colsum,window", [(True, 20), (False, 20), (True, 0)])
def test_causal_attention_stats_with_torchs_attention_in_place_of_the_forward(ops, monkeypatch, colsum, window):
    """``KVGATES_PREFILL_CONFIG='{"attention": "sdpa"}'``: torch's fused attention (cuDNN's on a GPU, in bfloat16
    here; the CPU's flash attention) gives the attention and each row's log-sum-exp, the Triton forward does not run,
    and the column pass reads that log-sum-exp: the same attention and statistics, grouped KV heads included."""
    monkeypatch.setenv(ops.PREFILL_CONFIG_ENV, '{"attention": "sdpa"}')
    monkeypatch.setattr(ops, "_prefill_forward", None)  # launching it fails
    dtype, tol = (torch.bfloat16, 3e-2) if DEVICE == "cuda" else (torch.float32, 1e-4)
    b, h, hkv, n, d = 2, 8, 2, 150, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, n, h, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    got = ops.causal_attention_stats(q, k, v, d**-0.5, colsum, window)
    ref = reference.causal_attention_stats(q.float(), k.float(), v.float(), d**-0.5, colsum, window)
    for a, r in zip(got, ref):
        assert (a is None) == (r is None)
        if a is not None:
            torch.testing.assert_close(a.float(), r, atol=tol, rtol=tol)


def test_cudnns_attention_is_taken_only_where_it_takes_the_queries(ops):
    """The aten op is called past sdpa's checks: where cuDNN would refuse the queries (float32, a head dim not a
    multiple of 8 or over 128), the Triton forward runs instead of a cuDNN error."""
    takes = {(dtype, d): ops._cudnn_takes(torch.empty(1, 1, 1, d, dtype=dtype))
             for dtype in (torch.bfloat16, torch.float16, torch.float32) for d in (64, 66, 128, 256)}
    assert {key for key, ok in takes.items() if ok} == {(t, d) for t in (torch.bfloat16, torch.float16) for d in (64, 128)}


def test_cudnns_attention_is_the_default_prefill_attention_on_hopper_gpus_only(ops, monkeypatch):
    """The scoring prefill's attention is cuDNN's on a Hopper or later GPU (measured faster there, stop 60), the Triton
    forward on older GPUs (unmeasured) and on the CPU; ``"attention": "triton"`` takes the forward back."""
    assert ops._prefill_config(64, torch.float32, torch.device("cpu"))["attention"] == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for capability, attention in (((8, 0), "triton"), ((9, 0), "sdpa"), ((10, 0), "sdpa")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert ops._prefill_config(128, torch.bfloat16, torch.device("cuda"))["attention"] == attention
    monkeypatch.setenv(ops.PREFILL_CONFIG_ENV, '{"attention": "triton"}')
    assert ops._prefill_config(128, torch.bfloat16, torch.device("cuda"))["attention"] == "triton"
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.delenv(ops.PREFILL_CONFIG_ENV)
    assert ops._prefill_config(128, torch.bfloat16, torch.device("cuda"))["attention"] == "triton"


@pytest.mark.parametrize("value,message", [
    ("{forward: 1}", "is not JSON"),
    ('{"backward": {}}', 'must be an object with "forward", "columns" and/or "attention"'),
    ('{"attention": "flash"}', "'s \"attention\" must be one of triton, sdpa, got 'flash'"),
    ('{"columns": {"BLOCK_K": 32}}', "'columns' must be an object of BLOCK_M, BLOCK_N, num_warps, num_stages"),
    ('{"forward": {"num_warps": 6}}', "forward.num_warps must be a power of two up to 32, got 6"),
    ('{"columns": {"num_warps": 64}}', "columns.num_warps must be a power of two up to 32, got 64"),
    ('{"forward": {"BLOCK_N": true}}', "forward.BLOCK_N must be a power of two from 16, got True"),
    ('{"columns": {"BLOCK_M": 8}}', "columns.BLOCK_M must be a power of two from 16, got 8"),
    ('{"columns": {"num_stages": 0}}', "columns.num_stages must be a whole number from 1, got 0"),
    # the CPU's forward default is 32 x 16: 128 keys a step is not a whole number of them
    ('{"forward": {"BLOCK_N": 64}}', "gives the prefill forward BLOCK_M 32 and BLOCK_N 64 here"),
])
def test_prefill_config_override_refuses_what_it_cannot_launch(ops, monkeypatch, value, message):
    monkeypatch.setenv(ops.PREFILL_CONFIG_ENV, value)
    with pytest.raises(ValueError, match=f"^KVGATES_PREFILL_CONFIG.*{re.escape(message)}"):
        ops._prefill_config(32, torch.float32, torch.device("cpu"))


def test_prefill_config_override_takes_every_default(ops, monkeypatch):
    """Every built-in configuration is a value the override takes (three pipeline stages included: a GPU's default,
    which a sweep's fastest pair often keeps)."""
    for d, dtype, device in [(64, torch.float16, "cuda"), (128, torch.bfloat16, "cuda"), (128, torch.float32, "cuda"), (32, torch.float32, "cpu")]:
        cfg = ops._prefill_config(d, dtype, torch.device(device))
        monkeypatch.setenv(ops.PREFILL_CONFIG_ENV, json.dumps(cfg))
        assert ops._prefill_config(d, dtype, torch.device(device)) == cfg
        monkeypatch.delenv(ops.PREFILL_CONFIG_ENV)


COLMAX_CASES = [  # (batch, query heads, KV heads, held slots, query rows, head_dim, layout)
    (1, 4, 2, 20, 20, 16, "chunk"),  # a prompt: no older token
    (2, 9, 3, 58, 21, 64, "chunk"),  # KVzip's reconstruction: 37 older tokens, then the chunk's own
    (1, 8, 1, 55, 5, 32, "chunk"),  # MQA, a chunk shorter than a block
    (2, 9, 3, 70, 19, 64, "any"),  # padded rows, empty and reused slots, a row seeing nothing
    (3, 4, 2, 33, 40, 32, "any"),
]


def colmax_inputs(b, hkv, c, n, layout, g):
    """Slot positions ``[B, H_kv, C]``, query positions ``[B, n]`` and their validity: the chunk layout
    (``reference.own_block_start``: older tokens, then the rows' own in order), or any (random positions with
    holes, rows at random positions, some padded)."""
    if layout == "chunk":
        first = c - n
        older = torch.stack([torch.randperm(first + 9, generator=g)[:first].sort().values for _ in range(b * hkv)])
        q_pos = torch.arange(first + 9, c + 9).expand(b, n)
        slot_pos = torch.cat([older.view(b, hkv, first), q_pos[:, None].expand(b, hkv, n)], -1)
        return slot_pos, q_pos, torch.ones(b, n, dtype=torch.bool)
    slot_pos = torch.stack([torch.randperm(3 * c, generator=g)[:c] for _ in range(b * hkv)]).view(b, hkv, c)
    slot_pos[torch.rand(b, hkv, c, generator=g) < 0.25] = -1
    q_pos = torch.randint(0, 3 * c, (b, n), generator=g).sort(-1).values
    q_pos[0, 0] = -5  # sees no slot
    valid = torch.rand(b, n, generator=g) > 0.2
    return slot_pos, torch.where(valid, q_pos, torch.iinfo(torch.int64).max), valid  # padded rows as the runtime places them


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,h,hkv,c,n,d,layout", COLMAX_CASES)
@pytest.mark.parametrize("weighted", [False, True, "sum"])
def test_masked_attention_stats(ops, dtype, b, h, hkv, c, n, d, layout, weighted):
    """Attention under position visibility and each slot's largest weighted probability (KVzip's reconstruction
    forwards), against ``reference.masked_attention_colmax`` (on the CPU its chunk path for the chunk layout, its
    tiles otherwise), with row weights with zeros and column weights zero outside a span; or their sum
    (``masked_attention_colsum``: H2O over a chunk after others)."""
    g = torch.Generator().manual_seed(c + n)
    q = torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2)  # the runtime's [B, H, q, D] view
    k, v = (torch.randn(b, hkv, c, d, generator=g).to(dtype) for _ in range(2))
    slot_pos, q_pos, q_valid = colmax_inputs(b, hkv, c, n, layout, g)
    assert (reference.own_block_start(slot_pos, q_pos, q_valid) is not None) == (layout == "chunk")
    rows = cols = None
    if weighted is True:
        rows = torch.rand(b, n, generator=g) * (torch.rand(b, n, generator=g) > 0.2)
        cols = torch.rand(b, h, c, generator=g)
        cols[..., : c // 3] = 0  # outside the scored span
        cols[-1, -1] = 0  # a query head of a sequence that scores no slot
    args = [t.to(DEVICE) for t in (q, k, v, slot_pos, q_pos, q_valid)] + [d**-0.5]
    if weighted == "sum":
        (out, best), (ref_out, ref_best), tol = ops.masked_attention_colsum(*args), reference.masked_attention_colsum(*args), TOL[dtype] * 2
    else:
        args += [None if t is None else t.to(DEVICE) for t in (rows, cols)]
        (out, best), (ref_out, ref_best), tol = ops.masked_attention_colmax(*args), reference.masked_attention_colmax(*args), TOL[dtype]
    valid = q_valid.to(DEVICE)[:, None, :, None]
    torch.testing.assert_close(out.float() * valid, ref_out.float() * valid, atol=tol * 5, rtol=tol * 5)
    torch.testing.assert_close(best, ref_best, atol=tol * 5, rtol=tol * 5)
    assert out.dtype == q.dtype and out.transpose(1, 2).is_contiguous()


def test_masked_attention_stats_read_nothing_back(ops):
    """The column pass skips slots weighing 0 on the device, per sequence and query head: no host sync (a GPU
    would wait there in every layer of every scoring forward)."""
    from kvgates.runtime.launches import Launches

    b, h, hkv, c, n, d = 2, 4, 2, 40, 8, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((b, h, n, d), (b, hkv, c, d), (b, hkv, c, d)))
    slot_pos, q_pos, q_valid = (t.to(DEVICE) for t in colmax_inputs(b, hkv, c, n, "any", g))
    cols = (torch.arange(c) >= c // 2).float().expand(b, h, c).to(DEVICE)
    with Launches() as counted:
        _, best = ops.masked_attention_colmax(q, k, v, slot_pos, q_pos, q_valid, d**-0.5, torch.rand(b, n).to(DEVICE), cols)
        ops.masked_attention_colsum(q, k, v, slot_pos, q_pos, q_valid, d**-0.5)
    assert counted.syncs == 0, counted.sync_ops
    assert best[..., : c // 2].eq(0).all() and best[..., c // 2 :].gt(0).any()


def test_merge_sets_of_one_token_keep_it(ops):
    """A head of one token (a length Triton compiles apart): its set of one is its own pivot, key and value unchanged."""
    keys, values = torch.randn(2, 1, 1, 4).to(DEVICE), torch.randn(2, 1, 1, 3).to(DEVICE)
    flags = torch.tensor([True, False]).view(2, 1, 1).to(DEVICE)
    merged_k, merged_v, pivot = ops.merge_sets(keys, values, flags, flags, torch.ones(2, 1, 1).to(DEVICE))
    assert pivot.flatten().tolist() == [True, False]
    torch.testing.assert_close(merged_k, keys)
    torch.testing.assert_close(merged_v, values)


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's launches (a GPU's Triton launch is no aten operator)")
def test_launches_count_an_interpreted_kernel_call_once_and_not_its_argument_copies(ops):
    """Under the interpreter a kernel call is one launch, named after its kernel, twice for two calls; the copies the
    interpreter makes of its arguments (``set_``, ``new_empty``, ``copy_``), which a GPU does not run, are not counted."""
    from kvgates.runtime.launches import Launches

    rows, cols, valid = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4), torch.ones(1, 2, 7, dtype=torch.int8)
    with Launches() as counted:
        ops.max_similarity(rows, cols, valid)
        ops.max_similarity(rows, cols, valid)
    assert counted.ops["triton:_max_similarity"] == 2
    assert not {"set_", "new_empty", "copy_"} & set(counted.ops), counted.ops


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's launches (a GPU's Triton launch is no aten operator)")
def test_window_scores_of_a_sliced_window_launch_three_kernels_and_nothing_else(ops, monkeypatch):
    """As the runtime calls it (the last rows of a longer query, their positions and flags sliced off, each with its
    own strides), the slots split across programs: the reference's scores from three kernel launches (row statistics,
    their splits' combine, columns), with no fill, no copy and no torch operator (a small batch's scoring is bound by
    launches)."""
    from kvgates.runtime.launches import Launches

    monkeypatch.setattr(ops, "_multiprocessors", lambda device: 16)
    keys, values, pos = flat_layer(2, [300, 90], 64, torch.float16, seed=9)
    g = torch.Generator().manual_seed(10)
    n, w = 20, 6
    query = torch.randn(2, n, 4, 64, generator=g).to(torch.float16).to(DEVICE).transpose(1, 2)  # [B, n, H, D] memory
    q_pos = torch.arange(880, 900).expand(2, n).contiguous().to(DEVICE)
    real = (torch.rand(2, n + 3, generator=g) > 0.2).to(DEVICE)[:, 3:]  # strides other than the positions'
    args = (query[:, :, n - w :], keys, values, pos, [300, 90], q_pos[:, n - w :], real[:, n - w :], 0.125)
    with Launches() as counted:
        got = ops.window_scores_flat(*args)
    kernels = {"triton:_window_row_stats", "triton:_window_combine", "triton:_window_columns"}
    assert set(counted.ops) == {"empty", *kernels} and all(counted.ops[k] == 1 for k in kernels), counted.ops
    assert counted.ops["empty"] == 2  # the scores and the splits' statistics
    torch.testing.assert_close(got, reference.window_scores_flat(*args), atol=2e-2, rtol=2e-2)


def test_window_scores_read_flags_of_any_dtype_as_nonzero(ops):
    """``q_valid`` is a mask: as 0/1 integers or floats it gives what it gives as bools."""
    keys, values, pos = flat_layer(1, [40, 25], 32, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 4, 5, 32, generator=g).to(DEVICE)
    q_pos = torch.arange(60, 65).expand(1, 5).to(DEVICE)
    flags = torch.tensor([[True, False, True, True, False]], device=DEVICE)
    want = ops.window_scores_flat(q, keys, values, pos, [40, 25], q_pos, flags, 0.2)
    torch.testing.assert_close(want, reference.window_scores_flat(q, keys, values, pos, [40, 25], q_pos, flags, 0.2))
    for other in (flags.long(), flags.float(), flags.to(torch.uint8)):
        torch.testing.assert_close(ops.window_scores_flat(q, keys, values, pos, [40, 25], q_pos, other, 0.2), want, atol=0, rtol=0)


@pytest.mark.parametrize("block_n,programs_per_sm", [(16, 1), (32, 8), (128, 2)])
def test_decode_attention_under_every_swept_launch_configuration(ops, block_n, programs_per_sm):
    """The launch configurations ``bench/kernels.py --sweep-decode`` tries (tiles wider than a head's capacity,
    splits of one tile) compute the reference's attention and probabilities: a default chosen from the sweep is
    correct whatever it is."""
    keys, values, pos = flat_layer(1, [300, 90], 32, torch.float16, seed=7)
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(8)).to(torch.float16).to(DEVICE)
    cfg = {"BLOCK_N": block_n, "programs_per_sm": programs_per_sm, "num_warps": 4, "num_stages": 2}
    out, probs = ops.decode_attention_flat(q, keys, values, pos, [300, 90], 0.125, "sum", cfg)
    ref_out, ref_probs = reference.decode_attention_flat(q, keys, values, pos, [300, 90], 0.125, "sum")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(probs, ref_probs, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("reduce", ["sum", "none"])
def test_split_over_the_sequence_at_batch_one(ops, monkeypatch, reduce):
    """One sequence over long ragged heads, its slots split across many programs (as on a GPU with many SMs):
    the splits' partial outputs and normalisers combine into the reference's output, probabilities and window
    scores, including a split past a short head's capacity and probabilities past the first block of slots."""
    monkeypatch.setattr(ops, "_multiprocessors", lambda device: 16)
    keys, values, pos = flat_layer(1, [300, 90], 64, torch.float16, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 64, generator=g).to(torch.float16).to(DEVICE)
    out, probs = ops.decode_attention_flat(q, keys, values, pos, [300, 90], 0.125, reduce)
    ref_out, ref_probs = reference.decode_attention_flat(q, keys, values, pos, [300, 90], 0.125, reduce)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(probs, ref_probs, atol=2e-3, rtol=1e-2)
    if reduce == "sum":
        qw = torch.randn(1, 4, 6, 64, generator=g).to(torch.float16).to(DEVICE)
        q_pos = torch.arange(894, 900).expand(1, 6).to(DEVICE)
        q_valid = torch.ones(1, 6, dtype=torch.bool, device=DEVICE)
        got = ops.window_scores_flat(qw, keys, values, pos, [300, 90], q_pos, q_valid, 0.125)
        ref = reference.window_scores_flat(qw, keys, values, pos, [300, 90], q_pos, q_valid, 0.125)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel,mode", [(7, "max"), (3, "avg"), (5, "max"), (1, "avg")])
@pytest.mark.parametrize("c", [9, 200])
def test_pool_by_position(ops, kernel, mode, c):
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(2, 3, c, generator=g).to(DEVICE)
    pos = torch.stack([torch.randperm(c, generator=g) for _ in range(6)]).reshape(2, 3, c)
    pos = torch.where(torch.rand(2, 3, c, generator=g) > 0.25, pos, torch.full_like(pos, -1)).to(DEVICE)
    torch.testing.assert_close(ops.pool_by_position(scores, pos, kernel, mode), reference.pool_by_position(scores, pos, kernel, mode))


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool_by_position_spreads_a_nan_score_as_the_reference(ops, mode):
    """A NaN score (from NaN attention) reaches its neighbours in token order in both modes, as torch's pooling
    spreads it (the kernel's max pooling passed over it, so the backends kept different tokens)."""
    scores = torch.tensor([[[0.1, 0.5, float("nan"), 0.2, 0.3, 0.4]]], device=DEVICE)
    pos = torch.tensor([[[5, 0, 2, 3, -1, 1]]], device=DEVICE)  # token order: slots 1, 5, 2, 3, 0
    got = ops.pool_by_position(scores, pos, 3, mode)
    torch.testing.assert_close(got, reference.pool_by_position(scores, pos, 3, mode), equal_nan=True)
    assert got.isnan().flatten().tolist() == [False, False, True, True, False, True]


@pytest.mark.parametrize("f", [0, 1, 5])
@pytest.mark.parametrize(
    "old_caps,new_caps", [([20, 20], [12, 12]), ([20, 20], [30, 30]), ([10, 25, 7], [4, 25, 9]), ([0, 0], [16, 16])]
)
def test_compact_slots(ops, old_caps, new_caps, f):
    b = 2
    keys, values, pos = (flat_layer(b, old_caps, 16, torch.float16) if max(old_caps) else (
        torch.zeros(b, 0, 16, dtype=torch.float16, device=DEVICE), torch.zeros(b, 0, 16, dtype=torch.float16, device=DEVICE),
        torch.zeros(b, 2, 0, dtype=torch.int64, device=DEVICE)))
    g = torch.Generator().manual_seed(5)
    state = torch.randn(b, len(old_caps), max(old_caps), f, generator=g).to(DEVICE)
    init = torch.arange(f, dtype=torch.float32).to(DEVICE)
    index = torch.randint(0, max(max(old_caps), 1) + 5, (b, len(new_caps), max(new_caps)), generator=g).to(DEVICE)
    got = ops.compact_slots(keys, values, pos, state, index, old_caps, new_caps, init)
    ref = reference.compact_slots(keys, values, pos, state, index, old_caps, new_caps, init)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=0, rtol=0)


def _merging_inputs(b, h, n, d, seed):
    """Unit keys (correlated: long sets), which tokens are mergeable, each token's stop (the first later one that is
    not, ``n`` if none) and ``first_from`` (the first mergeable one at or after each position)."""
    g = torch.Generator().manual_seed(seed)
    kn = torch.nn.functional.normalize(torch.randn(b, h, n, d, generator=g).cumsum(2), dim=-1)
    mergeable = torch.rand(b, h, n, generator=g) > 0.05
    j = torch.arange(n)
    stop = torch.where(~mergeable[..., None, :] & (j > j[:, None]), j, n).amin(-1)  # [B, H, L]
    first_from = torch.where(torch.cat([mergeable, torch.ones(b, h, 1, dtype=torch.bool)], -1), torch.arange(n + 1), n)
    first_from = first_from.flip(-1).cummin(-1).values.flip(-1)
    return kn, stop, first_from, g


@pytest.mark.parametrize("b,h,n,d,e,window", [(1, 1, 5, 4, 1, 9), (2, 3, 150, 8, 5, 150), (2, 3, 150, 8, 5, 7), (1, 2, 200, 64, 16, 100)])
def test_merging_set_ends_are_the_first_dissimilar_or_stopping_token_in_the_window(ops, b, h, n, d, e, window):
    """KVMerger's set ends within a window: for each anchor and threshold, the first later token at most that similar,
    or the anchor's stop, or the window's end, whichever comes first, against every pair's similarity at once."""
    kn, stop, _, g = _merging_inputs(b, h, n, d, n + window)
    eps = torch.rand(e, b, generator=g) * 1.6 - 0.6
    got = ops.merging_set_ends(kn.to(DEVICE), stop.to(DEVICE), eps.to(DEVICE), window).cpu()
    j = torch.arange(n)
    sim = kn @ kn.transpose(-1, -2)  # [B, H, L, L]
    first = torch.where((j > j[:, None]) & (sim <= eps[:, :, None, None, None]), j, n).amin(-1)
    assert torch.equal(got, torch.minimum(torch.minimum(first, stop), j + 1 + window))
    assert n < 100 or window < 64 or (got - j > 64).any()  # sets past a block of later tokens


@pytest.mark.parametrize("b,h,e,k,d", [(1, 1, 1, 1, 4), (2, 3, 70, 130, 8), (1, 2, 200, 65, 64), (1, 1, 0, 5, 4), (1, 2, 3, 0, 4)])
def test_max_similarity(ops, b, h, e, k, d):
    """D2O's matches: each row's largest product with the valid columns and the first column reaching it; a head with
    no valid column, or no column at all, gives -inf. Repeated columns make ties (the first wins). Entries are
    multiples of 1/4 below 1, whose products sum exactly in any order and precision (tf32 included): a tie stays a
    tie whichever tile computes it (random unit vectors' products differ in their last bit between tiles under the
    interpreter's numpy, which made the first of two tied columns lose)."""
    g = torch.Generator().manual_seed(e + k)
    rows = torch.randint(-3, 4, (b, h, e, d), generator=g) / 4
    cols = torch.randint(-3, 4, (b, h, k, d), generator=g) / 4
    cols[..., k // 2 :, :] = cols[..., : k - k // 2, :].clone()  # every column of the second half repeats one of the first
    valid = torch.rand(b, h, k, generator=g) > 0.3
    valid[0, 0] = False  # a head with nothing to match
    got = ops.max_similarity(*(t.to(DEVICE) for t in (rows, cols, valid)))
    ref = reference.max_similarity(rows, cols, valid)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])
    assert e == 0 or got[0][0, 0].eq(float("-inf")).all()
    half = reference.max_similarity(rows.half(), cols.half(), valid)  # float32 best of any input, as documented
    assert half[0].dtype == torch.float32 and torch.equal(half[0], ref[0]) and torch.equal(half[1], ref[1])


def test_max_similarity_matches_nothing_with_a_nan_product(ops):
    """A NaN key (from an infinite one, normalised) matches nothing on either backend: a NaN column is passed over as
    an invalid one, and a row of NaN products has no match (-inf, column 0), which D2O's merge leaves unmerged. (The
    torch reference took a NaN column as every row's maximum, the kernel passed over it, and the interpreter's kernel
    raised on a tile of NaN products.)"""
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [float("nan"), 0.0]]).view(1, 1, 3, 2)
    cols = torch.tensor([[float("nan"), 1.0], [1.0, 0.0], [0.6, 0.8]]).view(1, 1, 3, 2)
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    for impl in (ops, reference):
        best, target = impl.max_similarity(*(t.to(DEVICE) for t in (rows, cols, valid)))
        assert best.flatten().tolist() == pytest.approx([1.0, 0.8, float("-inf")]), impl.__name__
        assert target.flatten().tolist() == [1, 2, 0], impl.__name__


@pytest.mark.parametrize("window", [0, 1, 5, 64, 400])
def test_merging_chain_follows_each_row_from_its_first_anchor_up_to_its_cap(ops, window):
    """KVMerger's chain of anchors from the window's ends, each set the window did not end measured on: the sets the
    token-by-token scan finds, each row cut after ``cap + 1`` anchors (a negative cap marks nothing)."""
    import brute

    e, b, h, n, d = 3, 2, 2, 150, 8
    kn, stop, first_from, g = _merging_inputs(b, h, n, d, window)
    eps = torch.tensor([[-1.1, -1.1], [0.9, 0.5], [0.97, 0.95]])
    cap = torch.randint(-1, 14, (e, b, h), generator=g)
    cap[0], cap[1, 0, 0] = n, -1
    ends = ops.merging_set_ends(kn.to(DEVICE), stop.to(DEVICE), eps.to(DEVICE), window)
    got = ops.merging_chain(*(t.to(DEVICE) for t in (kn, stop, first_from, ends, eps, cap)), window).cpu()
    assert got.dtype == torch.bool
    long_sets = 0
    for k in range(e):
        for i in range(b):
            for j in range(h):
                free = [bool(first_from[i, j, t] == t) for t in range(n)]  # mergeable tokens: their own first
                sets = brute.kvmerger_sets(kn[i, j].tolist(), free, float(eps[k, i]))
                expected = [s[0] for s in sets][: max(0, int(cap[k, i, j]) + 1)]
                assert got[k, i, j].nonzero().flatten().tolist() == expected
                long_sets += sum(len(s) > window + 1 for s in sets)
    assert long_sets or window >= 64  # sets the window did not end


def test_merging_kernels_refuse_a_negative_window(ops):
    """A window is a number of tokens: a negative one would end every set before its anchor."""
    kn, stop, first_from, _ = _merging_inputs(1, 1, 10, 4, 0)
    eps, cap = torch.zeros(1, 1), torch.full((1, 1, 1), 10)
    ends = torch.zeros(1, 1, 1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="at least 0"):
        ops.merging_set_ends(kn, stop, eps, -1)
    with pytest.raises(ValueError, match="at least 0"):
        ops.merging_chain(kn, stop, first_from, ends, eps, cap, -1)


@pytest.mark.parametrize("sigma,scale,dtype", [(None, False, torch.float32), (0.7, True, torch.float32), (None, True, torch.bfloat16)])
def test_merge_sets(ops, sigma, scale, dtype):
    """KVMerger's merges: each set's pivot (the first of equal scores) and its weighted key and value, over sets of one
    token, sets longer than a block of tokens (64) and a head with nothing mergeable; every other token unchanged."""
    g = torch.Generator().manual_seed(2)
    b, h, n, d, dv = 2, 3, 300, 8, 12
    keys = torch.randn(b, h, n, d, generator=g).cumsum(2).to(dtype)
    values = torch.randn(b, h, n, dv, generator=g).to(dtype)
    mergeable = torch.rand(b, h, n, generator=g) > 0.1
    mergeable[0, 1] = False
    mergeable[1, 2, 50:200] = True
    after_gap = mergeable & ~torch.nn.functional.pad(mergeable, (1, 0))[..., :-1]  # (these must open a set)
    starts = after_gap | (mergeable & (torch.rand(b, h, n, generator=g) > 0.9))
    starts[1, 2, 50:201], mergeable[1, 2, 200] = False, True
    starts[1, 2, 50], starts[1, 2, 200] = True, True  # one set of 150 tokens
    score = torch.rand(b, h, n, generator=g).round(decimals=1)  # ties
    inputs = (keys, values, starts, mergeable, score)
    got = ops.merge_sets(*(t.to(DEVICE) for t in inputs), sigma, scale)
    ref = reference.merge_sets(*inputs, sigma, scale)
    assert torch.equal(got[2].cpu(), ref[2]) and ref[2][1, 2, 50:200].sum() == 1 and not ref[2][0, 1].any()
    for a, r in zip(got[:2], ref[:2]):
        assert a.dtype == r.dtype == dtype
        torch.testing.assert_close(a.cpu(), r, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[0].cpu()[~ref[2]], keys[~ref[2]]) and torch.equal(got[1].cpu()[~ref[2]], values[~ref[2]])
    assert (ref[0][ref[2]] != keys[ref[2]]).any()  # merges that moved keys


def test_retention_scores(ops):
    g = torch.Generator().manual_seed(6)
    log_beta = -torch.rand(2, 3, 50, generator=g).to(DEVICE)
    pos = torch.randint(-1, 40, (2, 3, 50), generator=g).to(DEVICE)
    t = torch.tensor([45, 60]).to(DEVICE)
    torch.testing.assert_close(ops.retention_scores(log_beta, pos, t), reference.retention_scores(log_beta, pos, t))
    # Half-precision gates: float32 scores of exact ages on both (bfloat16 ages past 256 were rounded, by up to 4 at 1000)
    half, late = log_beta.to(torch.bfloat16), t + 1000
    want = (late[:, None, None] - pos).float() * half.float()
    for impl in (ops, reference):
        torch.testing.assert_close(impl.retention_scores(half, pos, late), want.masked_fill(pos < 0, float("-inf")))


@pytest.mark.parametrize("shape", [(3, 17), (2, 2, 130), (1, 64)])
def test_retention_sum_and_gradient(ops, shape):
    g = torch.Generator().manual_seed(7)
    base = (-torch.rand(*shape, generator=g) * 0.2).to(DEVICE)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    got, ref = ops.retention_sum(a), reference.retention_sum(b)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    weights = torch.randn(*shape, generator=g).to(DEVICE)
    (got * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-3, rtol=1e-4)
