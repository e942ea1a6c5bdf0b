"""Decode steps on the packed layout's fast paths give the general path's logits.

A packed layer (every slot below each head's ``fill`` holds a token) decodes without a mask over positions: sdpa
over a slice of storage when every head holds as many tokens, and ``BudgetLayer._decode_packed_heads`` when heads
hold different numbers (Ada-KV's head budgets: ragged storage; KVMerger's merges: uniform storage, per-head fill).
The general path (``BudgetLayer._decode``: visibility from positions) is the reference.
"""

import pytest
import torch
from helpers import make_layer, policy_on, random_positions, tiny_model
from torch.nn.attention import sdpa_kernel

from kvgates import BudgetCache, make_policy
from kvgates.runtime import dispatch
from kvgates.runtime.launches import Launches
from kvgates.runtime.layer import BudgetLayer
from kvgates.runtime.scoring import discarded_forward
from kvgates.runtime.stats import NO_STATS
from kvgates.runtime.storage import KeptCounts

PROMPT, DECODE, BUDGET = 48, 40, 12


def general_path(self, query, scale):
    """``_decode_packed_heads`` replaced by the general decode path (positions, masked torch attention)."""
    return self._decode(query, self.keys, scale, NO_STATS, None)


def decode_logits(model, name, ids, check=None, **overrides):
    """Logits of the prompt's last token and of every decode step (teacher-forced), ``check(cache)`` after each."""
    with policy_on(model, name, BUDGET, **overrides) as policy:
        cache = BudgetCache(model.config, policy)
        out = []
        with torch.no_grad():
            for a, z in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
                out.append(model(ids[:, a:z], past_key_values=cache).logits[:, -1])
                if check is not None:
                    check(cache)
    return torch.stack(out, 1)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["adakv", "kvmerger"])
def test_heads_holding_different_numbers_decode_with_the_general_paths_logits(tiny, monkeypatch, name, batch):
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(4)).repeat(batch, 1)
    calls = []
    fast = BudgetLayer._decode_packed_heads

    def counted(self, query, scale):
        calls.append(self.layer_idx)
        return fast(self, query, scale)

    ragged = []  # per forward: the layers whose heads hold different numbers of tokens

    def check(cache):
        assert all(layer.packed for layer in cache.budget_layers)
        ragged.append([layer.layer_idx for layer in cache.budget_layers if layer.dense_fill is None])
        for layer in cache.budget_layers:
            if name == "adakv":
                assert not layer.uniform  # storage follows the head budgets
            elif layer.dense_fill is None:  # the mask sliced from the ruler is the mask of the current fills
                expected = torch.arange(max(layer.fill))[None, :] < torch.tensor(layer.fill)[:, None]
                g = model.config.num_attention_heads // layer.num_kv_heads  # each KV head's row, once per query head
                assert torch.equal(layer._fill_mask(g)[0, :, 0] == 0, expected.repeat_interleave(g, 0))

    monkeypatch.setattr(BudgetLayer, "_decode_packed_heads", counted)
    got = decode_logits(model, name, ids, check)
    # Decode appends to every head, so a layer's heads differ at every step once they differ after the prompt.
    assert ragged[0] and all(r == ragged[0] for r in ragged)
    assert len(calls) == DECODE * len(ragged[0])
    monkeypatch.setattr(BudgetLayer, "_decode_packed_heads", general_path)
    expected = decode_logits(model, name, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_full_cache_is_packed_from_its_prompt_on(tiny):
    """The full cache decodes with sdpa over the held slice of its storage (it never evicts, so nothing else packs
    it)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(5))

    def check(cache):
        seen = cache.get_seq_length()
        assert all(layer.dense_fill == seen <= layer.max_slots for layer in cache.budget_layers)

    with torch.no_grad():
        cache = BudgetCache(model.config, "full")
        for a, z in [(0, 20)] + [(t, t + 1) for t in range(20, 30)]:
            model(ids[:, a:z], past_key_values=cache)
            check(cache)


@pytest.mark.parametrize("batch", [1, 3])
def test_adakv_dense_storage_keeps_the_same_tokens_and_logits_as_ragged(tiny, batch):
    """``AdaKV(ragged=False)``: every head padded to the largest head budget, one attention call over all heads;
    the same tokens held, the same logits, more memory."""
    _, model = tiny
    ids = torch.randint(1, 128, (batch, PROMPT + DECODE), generator=torch.Generator().manual_seed(5))
    seen = {True: [], False: []}

    def check(ragged):
        def record(cache):
            layers = cache.budget_layers
            assert batch > 1 or all(layer.packed for layer in layers)  # distinct sequences may hold different counts
            assert any(not layer.uniform for layer in layers) if ragged else all(layer.uniform for layer in layers)
            held = [sorted(p for p in layer.pos[b, h].tolist() if p >= 0) for layer in layers for b in range(batch)
                    for h in range(layer.num_kv_heads)]
            seen[ragged].append((held, sum(layer.kv_bytes() for layer in layers)))
        return record

    ragged = decode_logits(model, "adakv", ids, check(True))
    dense = decode_logits(model, "adakv", ids, check(False), ragged=False)
    torch.testing.assert_close(dense, ragged, atol=1e-5, rtol=0)
    assert [held for held, _ in seen[False]] == [held for held, _ in seen[True]]
    assert all(d >= r for (_, r), (_, d) in zip(seen[True], seen[False]))
    assert any(d > r for (_, r), (_, d) in zip(seen[True], seen[False]))


def test_growing_ragged_storage_keeps_every_heads_slots():
    """``BudgetLayer._grow`` on ragged storage (decode steps of Ada-KV append past a head's slots): every head's
    slots keep their keys, values, positions and state, each head gains the new empty slots after its own."""
    layer = make_layer(make_policy("h2o", budget=4), random_positions(2, 3, 6, held=4, seed=1))
    assert layer.slot_data.shape[-1]  # H2O keeps per-slot state
    layer.slot_data.uniform_()
    caps = [2, 5, 3]  # ragged: head h keeps its first caps[h] slots
    layer.relayout(torch.arange(6).expand(2, 3, 6).contiguous(), caps)
    before = [(k, v, layer.pos[:, h, :c], layer.slot_data[:, h, :c])
              for h, (c, k, v) in enumerate(zip(caps, layer.keys.split(caps, 1), layer.values.split(caps, 1)))]
    layer._grow(4)
    assert layer.head_slots == [6, 9, 7]
    for h, (c, k, v) in enumerate(zip(caps, layer.keys.split(layer.head_slots, 1), layer.values.split(layer.head_slots, 1))):
        assert torch.equal(k[:, :c], before[h][0]) and torch.equal(v[:, :c], before[h][1])
        assert torch.equal(layer.pos[:, h, :c], before[h][2]) and torch.equal(layer.slot_data[:, h, :c], before[h][3])
        assert not k[:, c:].any() and not v[:, c:].any()
        assert bool((layer.pos[:, h, c:] == -1).all())
        assert torch.equal(layer.slot_data[:, h, c:], layer.state_init.expand_as(layer.slot_data[:, h, c:]))


def decode_step_reads(model, name, ids, **overrides):
    """(the ``Launches`` of the third decode step after the prompt ``ids[:, :PROMPT]``, the cache, the policy)."""
    with policy_on(model, name, BUDGET, **overrides) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            for t in range(PROMPT, PROMPT + 2):
                model(ids[:, t : t + 1], past_key_values=cache)
            with Launches() as step:
                model(ids[:, -1:], past_key_values=cache)
    return step, cache, policy


@pytest.mark.parametrize(
    "name",
    ["full", "snapkv", "pyramidkv", "adakv", "streaming_llm", "h2o", "tova", "morphkv", "trimkv", "trimkv-morph", "d2o", "merge"],
)
def test_a_decode_step_reads_nothing_back_from_the_device(tiny, name):
    """An eager decode step of a batch, one that evicts a token per layer included, never waits for the device:
    what the host knows of a layer replaces the read-backs (before, for every per-step policy two per layer and
    step in the ranking and one in the eviction's counts, TOVA's head check a fourth; Ada-KV's unpacked layers
    counted their free slots each step; D2O, whose sequences get different layer budgets, 7 with its merging, and
    merging over H2O 5)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT + 3), generator=torch.Generator().manual_seed(5))
    step, cache, policy = decode_step_reads(model, name, ids)
    assert step.sync_ops == {}
    if policy.schedule.decode_every:
        assert all(int(layer.held().max()) == int(layer.quota.max()) for layer in cache.budget_layers)


def prompt_reads(model, name, ids):
    """(the ``Launches`` of a prompt forward of ``ids``, the cache)."""
    with policy_on(model, name, BUDGET) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad(), Launches() as prompt:
            model(ids, past_key_values=cache)
    return prompt, cache


@pytest.mark.parametrize(
    "name",
    ["full", "snapkv", "pyramidkv", "streaming_llm", "h2o", "tova", "morphkv", "trimkv", "trimkv-snap", "trimkv-morph", "locret", "kvzap"],
)
def test_a_prompt_forward_reads_nothing_back_where_the_host_knows_what_each_head_keeps(tiny, name):
    """A prompt forward of a batch (each layer evicts its prompt to the budget) never waits for the device where the
    host knows what each head keeps, and makes no tensor from host numbers on the layer's device (on a GPU such a copy
    waits for the stream like a read back). Before: every layer uploaded its quota and its slot states' initial values
    (H2O's prefill on an H100 waited 2.5 times a layer, with launches after each no longer hidden); PyramidKV read its
    prompt lengths and its budgets' range back."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    prompt, cache = prompt_reads(model, name, ids)
    assert prompt.sync_ops == {}
    if name != "full":
        assert all(bool((layer.held() <= layer.quota).all()) for layer in cache.budget_layers)


def test_adakv_s_prompt_forward_reads_back_its_head_budgets_range_alone(tiny):
    """Ada-KV's head budgets depend on the scores: a layer reads back their range (which sizes its ragged storage),
    and nothing else: a head budget is never below its forced tokens, so the selection keeps exactly min(held, quota)
    and the eviction knows its counts (before, also the kept counts, whether any sequence was over and the largest
    room, per layer)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    prompt, cache = prompt_reads(model, "adakv", ids)
    assert prompt.sync_ops == {"tolist": len(cache.budget_layers)}
    assert all(torch.equal(layer.held(), torch.minimum(layer.quota, torch.tensor(PROMPT))) for layer in cache.budget_layers)


@pytest.mark.parametrize("ragged", [True, False])
def test_adakv_over_a_base_keeping_its_own_mask_claims_no_exact_quota(tiny, ragged):
    """Global TRIM-KV's ``select`` keeps its own selection across layers, not Ada-KV's head budgets: Ada-KV over it
    must read its kept counts back (claiming an exact quota, it tripped the eviction's device check) and must not
    take global TRIM-KV's range for its own quota."""
    from kvgates.gates import GATE_KINDS

    _, model = tiny
    gates = GATE_KINDS["retention-global"].for_model(model, init_bias=2.0)
    torch.manual_seed(3)
    for p in gates.parameters():
        torch.nn.init.normal_(p, std=1.0)
    policy = make_policy("adakv", budget=BUDGET, base="trimkv-global", base_params={"gates": gates}, ragged=ragged)
    assert not policy.exact_quota
    ids = torch.randint(1, 128, (2, PROMPT + 4), generator=torch.Generator().manual_seed(1))
    policy.attach(model)
    try:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids[:, :PROMPT], past_key_values=cache)
            for t in range(PROMPT, PROMPT + 4):
                model(ids[:, t : t + 1], past_key_values=cache)
    finally:
        policy.detach()
    assert all(int(layer.held().min()) > 0 for layer in cache.budget_layers)  # (it ran: before, a RuntimeError)


def test_a_wrapper_answers_its_base_s_quota_range(tiny):
    """Merging over PyramidKV knows the pyramid budgets' range as PyramidKV does (``Wrapper.quota_range``; before,
    each layer read it back)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    with policy_on(model, "merge", BUDGET, base="pyramidkv", base_params={"window": 4, "kernel": 3}) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad(), Launches() as prompt:
            model(ids, past_key_values=cache)
    assert prompt.sync_ops == {}
    assert all(bool((layer.held() <= layer.quota).all()) for layer in cache.budget_layers)


def test_d2o_s_prompt_forward_reads_every_layer_s_budget_range_at_once(tiny):
    """D2O's layer budgets come from the prompt's attention variances: their range is read back once for every
    layer after the last one (before: once a layer, each read waiting for the previous layer's eviction)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    prompt, cache = prompt_reads(model, "d2o", ids)
    assert prompt.sync_ops == {"tolist": 1}
    assert all(bool((layer.held() <= layer.quota).all()) for layer in cache.budget_layers)


def test_dynamickv_s_prompt_forward_reads_back_once_a_reallocation(tiny):
    """DynamicKV counts the global top scores per layer and allocates the budgets on the device, and reads their
    range back once a reallocation, which gives each layer's quota range while the layer's sequences hold as many
    tokens per head (here the same prompt twice; sequences given different budgets leave their layers unpacked, and
    a later reallocation reads those back). Before: two reads a layer, one a sequence and reallocation, and a
    host-to-device copy of each layer's budgets."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(6)).repeat(2, 1)
    prompt, cache = prompt_reads(model, "dynamickv", ids)
    layers, every = len(cache.budget_layers), cache.policy.update_every
    reallocations = sum((rank + 1) % every == 0 or rank == layers - 1 for rank in range(layers))
    assert prompt.sync_ops == {"tolist": reallocations}
    assert all(bool((layer.held() <= layer.quota).all()) for layer in cache.budget_layers)


@pytest.mark.parametrize("moved", [1, 3])
def test_evicting_from_a_full_dense_layer_moves_the_last_slots_into_the_holes(moved):
    """``evict`` on a dense layer whose every slot holds a token (a decode step's eviction: one slot per row, the
    sort-free path; several: the general one): each row keeps the same tokens with their keys, values and state,
    in its first slots, wherever its holes were (the first slot, the last ones, anywhere)."""
    b, hkv, c = 2, 3, 8
    pos = torch.arange(c).expand(b, hkv, c).contiguous()
    layer = make_layer(make_policy("h2o", budget=c - moved), pos, seed=3)
    layer.fill, layer.packed = [c] * hkv, True
    layer.slot_data.uniform_()
    rows = {}
    for i in range(b):
        for h in range(hkv):
            dropped = torch.randperm(c, generator=torch.Generator().manual_seed(i * hkv + h))[:moved].tolist()
            rows[i, h] = dropped if (i, h) != (0, 0) else list(range(c - moved, c))  # one row drops its last slots
    rows[1, 2] = [0] if moved == 1 else [0, 3, 5]
    keep = torch.ones(b, hkv, c, dtype=torch.bool)
    for (i, h), dropped in rows.items():
        keep[i, h, dropped] = False
    keys, values, state = layer.keys.view(b, hkv, c, -1).clone(), layer.values.view(b, hkv, c, -1).clone(), layer.slot_data.clone()
    layer.evict(keep, slack=moved, counts=KeptCounts([c - moved] * hkv, [c - moved] * hkv, [moved] * hkv))
    assert layer.fill == [c - moved] * hkv and layer.packed
    for (i, h), dropped in rows.items():
        held = layer.pos[i, h, : c - moved].tolist()
        assert sorted(held) == [p for p in range(c) if p not in dropped]
        assert bool((layer.pos[i, h, c - moved :] == -1).all())
        for s, p in enumerate(held):  # position p sat in slot p before
            assert torch.equal(layer.keys.view(b, hkv, c, -1)[i, h, s], keys[i, h, p])
            assert torch.equal(layer.values.view(b, hkv, c, -1)[i, h, s], values[i, h, p])
            assert torch.equal(layer.slot_data[i, h, s], state[i, h, p])


def test_a_decode_step_of_d2o_reads_nothing_back_where_its_sequences_got_different_budgets():
    """D2O gives each sequence its own layer budgets (here with 4 KV heads: with 2, a layer's min-max normalised
    head variances always average 0.5 and every budget is the same), so its layers hold different numbers per
    sequence and are not packed; the host still knows that every head holds its quota plus the tokens written since
    the last eviction (``held_over_quota``), and the step reads nothing back (before: 7 reads per layer and step)."""
    _, model = tiny_model(num_key_value_heads=4)
    ids = torch.randint(1, 128, (2, PROMPT + 3), generator=torch.Generator().manual_seed(0))
    step, cache, _ = decode_step_reads(model, "d2o", ids)
    layers = cache.budget_layers
    assert any(len(set(layer.quota[:, 0].tolist())) > 1 for layer in layers)
    assert not all(layer.packed for layer in layers)
    assert step.sync_ops == {}
    assert all(torch.equal(layer.held(), layer.quota) for layer in layers)


def test_a_decode_step_of_global_trimkv_reads_back_once(tiny):
    """Global TRIM-KV on a batch whose sequences hold as many tokens (the same prompt twice) decides who is over and
    ranks without reading anything back, and reads how many tokens each head of every layer keeps after its
    selection across layers (which sets that head's storage) once for all layers (before: 4.75 reads per layer and
    step)."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + 3), generator=torch.Generator().manual_seed(5)).repeat(2, 1)
    step, cache, _ = decode_step_reads(model, "trimkv-global", ids)
    layers = cache.budget_layers
    assert step.sync_ops == {"tolist": 1}
    assert all(layer.packed for layer in layers)
    assert sum(int(layer.held()[0].sum()) for layer in layers) == BUDGET * len(layers) * layers[0].num_kv_heads


def test_the_held_slot_mask_follows_every_change_of_positions():
    """``valid`` is computed once per state of ``pos`` (a decode step asks for it several times): in-place writes
    through views, ``scatter_``, ``masked_fill_`` and a new ``pos`` tensor each give a fresh mask, and under
    ``torch.inference_mode`` (no version counter) it is computed every time."""
    pos = random_positions(1, 2, 6, held=3, seed=1)
    layer = make_layer(make_policy("h2o", budget=2), pos)
    first = layer.valid
    assert layer.valid is first and torch.equal(first, pos >= 0)
    writes = [
        lambda: layer.pos[:, :, :2].fill_(7),
        lambda: layer.pos.scatter_(2, torch.tensor([[[5], [5]]]), -1),
        lambda: layer.pos.masked_fill_(layer.pos == 7, -1),
        lambda: setattr(layer, "pos", torch.full_like(layer.pos, 3)),
    ]
    for write in writes:
        before = layer.valid.clone()
        write()
        assert torch.equal(layer.valid, layer.pos >= 0) and not torch.equal(layer.valid, before)
    with torch.inference_mode():
        layer.pos = torch.full_like(layer.pos, -1)
        assert not layer.valid.any()
        layer.pos[0, 0, 0] = 4
        assert layer.valid.sum() == 1


def test_a_dense_layer_s_decode_probabilities_read_zero_past_the_fill_after_a_shrinking_eviction():
    """The buffer of a dense layer's decode probabilities is kept across evictions: slots a larger earlier fill
    wrote and an eviction freed read 0 again at the next step."""
    layer = make_layer(make_policy("h2o", budget=4), torch.arange(10).expand(1, 2, 10).contiguous())
    first = layer._dense_probs(torch.rand(1, 2, 10) + 1, 10)
    again = layer._dense_probs(torch.full((1, 2, 6), 0.5), 6)
    assert again is first
    assert bool((again[..., :6] == 0.5).all()) and not again[..., 6:].any()


def test_an_eviction_keeping_nothing_of_a_dense_layer_frees_every_slot():
    """``evict`` leaves the positions of a dense layer to ``_fill_holes``, which frees the slots past what is kept
    even when nothing moves (nothing kept)."""
    b, hkv, c = 2, 3, 5
    layer = make_layer(make_policy("h2o", budget=1), torch.arange(c).expand(b, hkv, c).contiguous())
    layer.fill, layer.packed = [c] * hkv, True
    layer.evict(torch.zeros(b, hkv, c, dtype=torch.bool), slack=c, counts=KeptCounts([0] * hkv, [0] * hkv, [c] * hkv))
    assert not layer.valid.any() and layer.fill == [0] * hkv


def test_decode_attention_on_cuda_keeps_off_cudnn():
    """On CUDA, decode attention's sdpa runs without cuDNN's backend (which builds a plan per new cache length, and
    failed on KVMerger's fill mask on an H100); elsewhere sdpa picks as it does."""
    with dispatch.decode_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    with dispatch.decode_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize(
    ("name", "static"),
    [("full", False), ("kvmerger", False), ("adakv", False), ("snapkv", True)],
    ids=["dense-slice", "uniform-fill-mask", "ragged-heads", "static-mask"],
)
def test_every_decode_sdpa_call_runs_within_the_decode_backends(tiny, monkeypatch, name, static):
    """Each of the runtime's decode paths that calls sdpa (a slice of dense storage, packed heads at different fills
    in uniform and in ragged storage, a static layer) calls it within ``decode_backends``: on the CPU, made to give
    the CUDA context, every call sees cuDNN's backend off."""
    _, model = tiny
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []  # per sdpa call of a decode step: whether cuDNN's attention was enabled

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    ids = torch.randint(1, 128, (1, PROMPT + 4), generator=torch.Generator().manual_seed(4))
    with policy_on(model, name, BUDGET) as policy, torch.no_grad():
        cache = BudgetCache(model.config, policy, static=static, decode_slots=4 if static else 0)
        model(ids[:, :PROMPT], past_key_values=cache)
        monkeypatch.setattr(dispatch, "decode_backends", lambda device: sdpa_kernel(dispatch.DECODE_BACKENDS))
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
    assert len(seen) >= 4 and not any(seen)



def test_a_padded_prompt_forward_reads_back_once_whether_every_token_is_real():
    """With padding, a forward's 4-D mask says which new tokens are real; whether all are is read back once a forward,
    since every layer gets the same mask: a model twice as deep reads as often (before: once a layer more, each read
    draining a GPU's queue, in every padded batch and in each of KVzip's scoring forwards, whose mask always covers
    the prompt)."""
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    reads = []
    for layers in (2, 6):
        _, model = tiny_model("llama", num_hidden_layers=layers)
        cache = BudgetCache(model.config, "full")
        with torch.no_grad(), Launches() as prompt:
            out = model(ids, attention_mask=mask, past_key_values=cache).logits
        reads.append(prompt.syncs)
        assert out.isfinite().all() and [int(n) for n in cache.budget_layers[-1].held()[:, 0]] == [PROMPT, PROMPT - 5]
    assert reads[0] == reads[1]



@pytest.mark.parametrize("name", ["h2o", "kvzip"])
def test_a_masked_forward_runs_under_inference_mode(tiny, name):
    """A tensor made under ``torch.inference_mode`` has no version counter: keying the mask's read on it raised in
    every padded batch and every KVzip prompt (whose scoring forwards always pass a mask). Same tokens as under
    ``no_grad``."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    held = []
    for mode in (torch.no_grad, torch.inference_mode):
        with policy_on(model, name, BUDGET, **({"repeat_ids": [5, 6, 7]} if name == "kvzip" else {})) as policy:
            cache = BudgetCache(model.config, policy)
            with mode():
                model(ids, attention_mask=mask, past_key_values=cache)
        held.append([torch.sort(layer.pos, -1).values.clone() for layer in cache.budget_layers])
    assert all(torch.equal(a, b) for a, b in zip(*held))


def test_a_reset_cache_drops_an_eviction_left_for_the_next_layer(tiny):
    """A prompt forward stopped between two layers leaves the first one's deferred eviction (``_defer``); a reset
    cache must not run it on its next prompt (old statistics and quota over new storage)."""
    _, model = tiny
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    with policy_on(model, "adakv", BUDGET) as policy:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            first = cache.budget_layers[0]
            first._deferred = lambda: pytest.fail("a reset cache ran an eviction left from before it")
            cache.reset()
            assert first._deferred is None
            model(ids, past_key_values=cache)
    assert all(int(layer.held().max()) < PROMPT for layer in cache.budget_layers)

def test_a_scoring_forward_drops_its_tokens_without_reading_back_what_each_layer_keeps():
    """A scoring forward (KVzip's reconstruction) drops the tokens it added; every layer keeps what it held before,
    which the host knows where each head holds as many tokens: a model twice as deep reads as often (before: one read
    a layer and forward, each draining a GPU's queue), and the cache holds exactly what it held."""
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    extra = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    extra_mask = torch.ones_like(extra)
    extra_mask[0, 6:] = 0  # a shorter row, as KVzip pads its last chunk
    reads = []
    for layers in (2, 6):
        _, model = tiny_model("llama", num_hidden_layers=layers)
        cache = BudgetCache(model.config, "full")
        with torch.no_grad():
            model(ids, past_key_values=cache)
            before = [(layer.pos.clone(), layer.keys.clone()) for layer in cache.budget_layers]
            with Launches() as scoring:
                discarded_forward(model, cache, torch.ones_like(ids), extra, extra_mask)
        reads.append(scoring.syncs)
        for layer, (pos, keys) in zip(cache.budget_layers, before):
            held = layer.valid
            assert torch.equal(layer.pos[held].view(2, -1, PROMPT), pos.view(2, -1, PROMPT)) and layer.seen == PROMPT
            assert torch.equal(layer.keys.view(*layer.pos.shape, -1)[held], keys.view(*pos.shape, -1).flatten(0, 2))
    assert reads[0] == reads[1]



@pytest.mark.parametrize("batch", [1, 2])
def test_adakv_evicts_each_layer_but_the_last_at_the_next_layers_end_what_it_would_keep_right_away(batch):
    """Ada-KV's head budgets have a range the host does not know: a layer's prompt eviction waits for the end of the
    next layer's step, the range's copy queued by then (``BudgetLayer._defer``; on a GPU the read no longer drains the
    queue, and the next layer's work runs while the host evicts); the last layer evicts right away. The layers end
    exactly as evicted right away (as a policy deciding across layers is, here forced)."""
    _, model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(1, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(6))
    caches, orders = {}, {}
    enforce = BudgetLayer.enforce
    for cross in (False, True):
        order = orders[cross] = []
        policy = make_policy("adakv", budget=BUDGET, base_params={"window": 4, "kernel": 3})
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(policy), "cross_layer", property(lambda self, cross=cross: cross))
            patch.setattr(BudgetLayer, "enforce", lambda layer, *args, **kw: order.append(layer.rank) or enforce(layer, *args, **kw))
            caches[cross] = BudgetCache(model.config, policy)
            with torch.no_grad():
                model(ids, past_key_values=caches[cross])
    assert orders == {False: [0, 1, 3, 2], True: [0, 1, 2, 3]}
    for a, b in zip(caches[False].budget_layers, caches[True].budget_layers):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys) and a.head_slots == b.head_slots
        assert a._deferred is None and int(a.held().max()) < PROMPT


@pytest.mark.parametrize("batch", [1, 2])
def test_kvmerger_compacts_each_layer_but_the_last_at_the_next_layers_end_what_it_would_keep_right_away(batch):
    """What KVMerger keeps depends on the data (its pivots), so the host reads it back before compacting: a layer's
    selection and merges run at its own step, the kept range's copy is queued, and the compaction waits for the end
    of the next layer's step (``BudgetLayer._evict_everyone(later=True)``; on a GPU the read no longer drains the
    queue there, and the selection's launches hide behind the next layer's work); the last layer compacts right away.
    The layers end exactly as compacted right away (as a policy deciding across layers is, here forced)."""
    from kvgates.runtime.storage import SlotStorage

    _, model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(1, 128, (batch, 96), generator=torch.Generator().manual_seed(3))
    caches, orders, logits = {}, {}, {}
    evict = SlotStorage.evict
    for cross in (False, True):
        order = orders[cross] = []  # (layer, whether its kept range was read back before the compaction)
        policy = make_policy("kvmerger", budget=32)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(policy), "cross_layer", property(lambda self, cross=cross: cross))
            patch.setattr(
                SlotStorage, "evict",
                lambda layer, *args, **kw: order.append((layer.rank, kw.get("kept_range") is not None)) or evict(layer, *args, **kw),
            )
            caches[cross] = BudgetCache(model.config, policy)
            with torch.no_grad():
                model(ids, past_key_values=caches[cross])
                logits[cross] = model(ids[:, -1:], past_key_values=caches[cross]).logits  # a decode step after it
    prompt = {cross: order[:4] for cross, order in orders.items()}
    assert prompt == {False: [(0, True), (1, True), (3, False), (2, True)], True: [(r, False) for r in range(4)]}
    torch.testing.assert_close(logits[False], logits[True], atol=0, rtol=0)
    for a, b in zip(caches[False].budget_layers, caches[True].budget_layers):
        for name in ("pos", "keys", "values", "slot_data", "quota"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in ("head_slots", "fill", "packed", "free_floor", "held_over_quota"):
            assert getattr(a, name) == getattr(b, name), name
        assert a._deferred is None and int(a.held().max()) < 97


@pytest.mark.parametrize("batch", [1, 2])
def test_kvmerger_s_prompt_eviction_on_a_gpu_s_path_reads_back_less_and_merges_alike(batch, monkeypatch):
    """On a GPU's path (``launch_bound``) KVMerger's selection reads back neither whether the slots are in position
    order, nor how many sets there are, nor where the pivots are (it writes every slot); on any device the heavy
    hitters' excess is not read (the host knows the layer): 7 reads a layer before, at most 3 now (the scan's walk,
    the eviction's counts; the CPU path reads more, its scan stopping early). The layers end with the same tokens and
    the same merged keys and values."""
    from kvgates.kernels.host import LAUNCH_BOUND_ENV

    _, model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(1, 128, (batch, 96), generator=torch.Generator().manual_seed(2))
    caches, reads = {}, {}
    for bound in (False, True):
        if bound:
            monkeypatch.setenv(LAUNCH_BOUND_ENV, "1")
        caches[bound] = BudgetCache(model.config, "kvmerger", budget=24, window=4, heavy=2)
        with torch.no_grad(), Launches() as prompt:
            model(ids, past_key_values=caches[bound])
        reads[bound] = prompt.syncs / 3
    assert reads[True] <= 3, reads
    for a, b in zip(caches[False].budget_layers, caches[True].budget_layers):
        assert torch.equal(a.pos, b.pos) and int(a.held().max()) <= 24
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize("bound", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_kvmerger_skips_sorting_slots_the_layer_knows_are_in_position_order(batch, bound, monkeypatch):
    """After a prompt without padding the layer knows its slots hold positions in order (``in_position_order``):
    KVMerger's selection then neither sorts nor permutes slots, on the CPU's path or a GPU's (which wrote every slot
    through the permutation), and each layer ends as it would after sorting. A second turn after the eviction (slots
    compacted in order, then appended: a chunked prompt) skips it too."""
    from kvgates.kernels.host import LAUNCH_BOUND_ENV
    from kvgates.runtime.storage import SlotStorage

    if bound:
        monkeypatch.setenv(LAUNCH_BOUND_ENV, "1")
    _, model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(1, 128, (batch, 120), generator=torch.Generator().manual_seed(5))
    caches, sorts = {}, {}
    for known in (True, False):
        if not known:  # as if the host did not know: sorted and permuted
            monkeypatch.setattr(SlotStorage, "in_position_order", property(lambda self: False))
        caches[known] = BudgetCache(model.config, "kvmerger", budget=24, window=4, heavy=2)
        with torch.no_grad(), Launches() as launches:
            model(ids[:, :96], past_key_values=caches[known])
            model(ids[:, 96:], past_key_values=caches[known])
        sorts[known] = launches.ops["sort"]
    assert sorts[False] - sorts[True] == 2 * 3, sorts  # KVMerger's sort, a layer and a turn
    for a, b in zip(caches[True].budget_layers, caches[False].budget_layers):
        assert torch.equal(a.pos, b.pos) and int(a.held().max()) <= 24
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_a_write_from_outside_the_layer_loses_its_position_order():
    """``in_position_order`` holds with the ``pos`` tensor's version: a write the layer did not make (a test's, a
    caller's) drops it; the layer's appending writes keep it, under ``torch.inference_mode`` too (no version counter)."""
    policy = make_policy("kvmerger", budget=32)
    layer = make_layer(policy, torch.full((1, 2, 4), -1, dtype=torch.int64))
    assert not layer.in_position_order  # make_layer wrote positions itself
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            cache = BudgetCache(layer.cache.config, policy)
            k = torch.randn(1, 2, 5, 8)
            fresh = cache.layers[0]
            fresh.lazy_initialization(k, k)
            fresh.insert(k, k, torch.arange(5)[None], all_real=True)
            assert fresh.in_position_order
            fresh.insert(k[:, :, :1], k[:, :, :1], torch.tensor([[-1]]))  # padding
            assert not fresh.in_position_order


@pytest.mark.parametrize("per_group", [5, 2])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["d2o", "dynamickv"])
def test_alike_layers_are_selected_at_once_on_a_gpu_s_path_as_one_at_a_time(name, batch, per_group, monkeypatch):
    """A decision across layers selects for each of them (D2O's prompt eviction after the last layer, with merges;
    DynamicKV's truncations after a reallocation): on a GPU's path (``launch_bound``) a ``stackable`` policy's alike
    layers go as a ``LayerStack`` (in groups of at most ``STACK_ELEMENTS`` key elements; here of 5 layers, or 2), one
    set of launches a group, where each layer's ~100 launches waited for the host one layer
    after another. Every layer ends with the same tokens, keys, values and policy values as selected alone, and a
    group launches less."""
    from kvgates.kernels.host import LAUNCH_BOUND_ENV
    from kvgates.policies import POLICIES, base
    from kvgates.runtime import stack

    _, model = tiny_model("llama", num_hidden_layers=5)
    ids = torch.randint(1, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(4))
    groups_of = stack.stack_groups  # (groups of per_group layers, whatever their size)
    monkeypatch.setattr(stack, "STACK_ELEMENTS", 1 << 40)
    monkeypatch.setattr(base, "stack_groups", lambda layers: [g[i : i + per_group] for g in groups_of(layers) for i in range(0, len(g), per_group)])
    groups = []
    monkeypatch.setattr(stack.LayerStack, "finish", lambda self, finish=stack.LayerStack.finish: groups.append(len(self.layers)) or finish(self))
    monkeypatch.setenv(LAUNCH_BOUND_ENV, "1")
    params = {"d2o": {"sinks": 2}, "dynamickv": {"window": 4, "kernel": 3, "update_every": 2}}[name]
    caches, launches = {}, {}
    for stacked in (False, True):
        monkeypatch.setattr(POLICIES[name], "stackable", stacked)
        caches[stacked] = BudgetCache(model.config, name, budget=BUDGET, **params)
        with torch.no_grad(), Launches() as launches[stacked]:
            model(ids, past_key_values=caches[stacked])
    for a, b in zip(caches[False].budget_layers, caches[True].budget_layers):
        assert torch.equal(a.pos, b.pos) and a.head_slots == b.head_slots and int(a.held().max()) < PROMPT
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-6)
        sa, sb = a.policy_state(caches[False].policy), b.policy_state(caches[True].policy)
        for field in ("tau", "quota"):
            if hasattr(sa, field):
                assert torch.equal(getattr(sa, field), getattr(sb, field)) and getattr(sb, field).shape[0] == batch
    # (layers whose sequences hold different numbers, as DynamicKV's after a first truncation of a batch, take the
    # general path: each reads back who is over, and selects alone)
    assert groups and 1 not in groups and max(groups) <= per_group and (max(groups) == per_group or batch > 1), groups
    assert launches[True].launches < launches[False].launches, (launches[True].launches, launches[False].launches)
