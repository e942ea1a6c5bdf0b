"""With a budget no smaller than the sequence, every policy must reproduce transformers' DynamicCache + sdpa."""

import pytest
import torch
from helpers import FAMILIES, POLICY_PARAMS, dynamic_cache, policy_on, teacher_forced_logits, tiny_model

from kvgates import POLICIES, BudgetCache, UnsupportedModelError
from kvgates.gates.adapter import gated_layers

PROMPT, DECODE = 24, 64
ATOL = 1e-4


def test_every_policy_has_test_parameters():
    assert set(POLICIES) <= set(POLICY_PARAMS), "add the new policy to tests/helpers.py POLICY_PARAMS"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_eviction_prefill_and_64_decode_steps(tiny, name):
    ref, model = tiny
    ids = torch.randint(1, 128, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(1))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, PROMPT)
    with policy_on(model, name, PROMPT + DECODE) as policy:
        got = teacher_forced_logits(model, BudgetCache(model.config, policy), ids, PROMPT)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_eviction_chunked_prefill(tiny, name):
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, 32)
    with policy_on(model, name, 64) as policy:
        got = teacher_forced_logits(model, BudgetCache(model.config, policy), ids, 32, chunk=7)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_eviction_left_padded_batch_generate(tiny, name):
    ref, model = tiny
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = ref.generate(ids, **kwargs)
        with policy_on(model, name, 64) as policy:
            cache = BudgetCache(model.config, policy)
            got = model.generate(ids, past_key_values=cache, **kwargs)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=ATOL, rtol=0)
    assert torch.equal(got.sequences, expected.sequences)
    # Padding never takes a slot: each row holds exactly its real tokens (prompt + generated - last token).
    held = cache.held_tokens()[:, :, 0]
    real = mask.sum(1) + 15
    assert torch.equal(held, real.expand_as(held))


def test_generate_sampled_matches_with_same_seed(tiny):
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=20, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    expected = ref.generate(ids, **kwargs)
    torch.manual_seed(7)
    got = model.generate(ids, past_key_values=BudgetCache(model.config, "h2o", budget=64), **kwargs)
    assert torch.equal(got, expected)


def test_generate_with_prefill_chunks(tiny):
    ref, model = tiny
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    expected = ref.generate(ids, max_new_tokens=10, do_sample=False)
    got = model.generate(
        ids, past_key_values=BudgetCache(model.config, "snapkv", budget=128, window=4), prefill_chunk_size=16,
        max_new_tokens=10, do_sample=False,
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_architectures_match_without_eviction_and_run_with_it(family):
    ref, model = tiny_model(family)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, 24)
    got = teacher_forced_logits(model, BudgetCache(model.config, "h2o", budget=64), ids, 24)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    cache = BudgetCache(model.config, "h2o", budget=12)
    teacher_forced_logits(model, cache, ids, 24)
    assert int(cache.held_tokens().max()) <= 12


@pytest.mark.parametrize("name", ["h2o", "snapkv", "trimkv", "kvzip"])
def test_a_sliding_window_that_covers_the_context_is_full_attention(name):
    """Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini declare a 262,144-token sliding window on every layer, twice their
    context: transformers calls every layer sliding, and kvgates refused them all (no full-attention layer). Such a
    layer is budgeted as the full-attention layer it is: the same logits, evicting, as the model without a window."""
    _, plain = tiny_model("phi3")
    _, model = tiny_model("phi3", sliding_window=2 * plain.config.max_position_embeddings)
    ids = torch.randint(1, 120, (2, 40), generator=torch.Generator().manual_seed(6))
    assert gated_layers(model) == list(range(model.config.num_hidden_layers))
    logits = []
    for each in (plain, model):
        torch.manual_seed(1)  # (the same fresh gates)
        with policy_on(each, name, 12) as policy:
            cache = BudgetCache(each.config, policy)
            logits.append(teacher_forced_logits(each, cache, ids, 24, chunk=8))
        assert int(cache.held_tokens().max()) < ids.shape[1]  # (evicting)
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)
    _, sliding = tiny_model("phi3", sliding_window=plain.config.max_position_embeddings - 1)  # (Phi-3-mini-4k's 2,047 of 4,096)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        BudgetCache(sliding.config, "h2o", budget=12)


def test_a_window_shorter_than_a_rope_scaled_context_still_slides():
    """A config extending its context by a RoPE factor (YaRN: Qwen2.5's 32,768 x 4) keeps the original
    ``max_position_embeddings``: a window that long covers the original context, not the extended one the model reads
    (``kvgates.models.context_length``). Such layers slide past it and are refused; they were budgeted as full
    attention, whose logits past the window silently differed from the model's. A window reaching the extended context
    is full attention."""
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
    scaled = dict(use_sliding_window=True, max_window_layers=0, max_position_embeddings=64, rope_parameters=rope)
    _, sliding = tiny_model("qwen2", sliding_window=64, **scaled)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        BudgetCache(sliding.config, "full")
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        gated_layers(sliding)
    ref, model = tiny_model("qwen2", sliding_window=256, **scaled)
    ids = torch.randint(1, 120, (1, 150), generator=torch.Generator().manual_seed(6))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, 140)
    got = teacher_forced_logits(model, BudgetCache(model.config, "full"), ids, 140)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_no_cache_forward_is_sdpa(tiny):
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=0, rtol=0)


def test_beam_search_and_multiple_returns_match(tiny):
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 14), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    expected = ref.generate(ids, **kwargs)
    got = model.generate(ids, past_key_values=BudgetCache(model.config, "h2o", budget=64), **kwargs)
    assert torch.equal(got, expected)
