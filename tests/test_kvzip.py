"""KVzip keeps what a literal eager implementation of its context-reconstruction scoring keeps."""

import brute
import pytest
import torch
from helpers import tiny_model

from kvgates import BudgetCache, make_policy

PROMPT_IDS = [5, 6, 7]


def literal_scores(ref, ids: list[int], chunk: int, normalize: bool = False) -> list[list[list[float]]]:
    """Scores ``[layer][kv head][token]`` of one sequence: for each chunk, an eager forward of the whole context, the
    repeat prompt and the chunk; each chunk token's score is the largest probability any query after the context
    gives it, over the query heads of its group (KVzip+ with ``normalize``: each probability times
    ``||W_O^g v_j|| / ||h_i||``)."""
    from transformers import DynamicCache

    n = len(ids)
    config = ref.config
    group = config.num_attention_heads // config.num_key_value_heads
    d = config.head_dim
    scores = [[[0.0] * n for _ in range(config.num_key_value_heads)] for _ in range(config.num_hidden_layers)]
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: hidden.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(ref.model.layers)
    ]
    for lo in range(0, n, chunk):
        tokens = ids + PROMPT_IDS + ids[lo : lo + chunk]
        cache = DynamicCache(config=config)
        with torch.no_grad():
            attentions = ref(torch.tensor([tokens]), past_key_values=cache, output_attentions=True).attentions
        for layer, probs in enumerate(attentions):
            w_o = ref.model.layers[layer].self_attn.o_proj.weight.detach()
            values = cache.layers[layer].values
            for h in range(config.num_key_value_heads):
                for j in range(lo, min(n, lo + chunk)):
                    best = 0.0
                    for g in range(h * group, (h + 1) * group):
                        col = float((w_o[:, g * d : (g + 1) * d] @ values[0, h, j]).norm()) if normalize else 1.0
                        for q in range(n, len(tokens)):
                            row = 1.0 / float(hidden[layer][0, q].norm()) if normalize else 1.0
                            best = max(best, float(probs[0, g, q, j]) * row * col)
                    scores[layer][h][j] = best
    for hook in hooks:
        hook.remove()
    return scores


def literal_kvzip(ref, ids: list[int], budget: int, chunk: int, sinks: int) -> list[list[set[int]]]:
    """Kept positions ``[layer][kv head]``: the ``sinks`` first tokens plus the best-scoring others."""
    kept = []
    for layer_scores in literal_scores(ref, ids, chunk):
        kept.append([])
        for head in layer_scores:
            by_position = dict(enumerate(head))
            first = brute.sinks(list(by_position), sinks)
            kept[-1].append(first | brute.top_by_score(by_position, budget - len(first), first))
    return kept


@pytest.mark.parametrize("length,chunk,budget,sinks", [(30, 64, 10, 2), (37, 16, 12, 0), (25, 8, 9, 4)])
def test_keeps_what_the_literal_scoring_keeps(length, chunk, budget, sinks):
    ref, model = tiny_model(seed=length)
    ref.set_attn_implementation("eager")
    ids = torch.randint(8, 128, (1, length), generator=torch.Generator().manual_seed(length))
    expected = literal_kvzip(ref, ids[0].tolist(), budget, chunk, sinks)
    policy = make_policy("kvzip", budget=budget, chunk_size=chunk, sinks=sinks, repeat_ids=PROMPT_IDS).attach(model)
    cache = BudgetCache(model.config, policy)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    policy.detach()
    for layer, heads in zip(cache.budget_layers, expected):
        for h, positions in enumerate(heads):
            got = {int(p) for p in layer.pos[0, h].tolist() if p >= 0}
            assert got == positions, f"layer {layer.layer_idx} head {h}"
        assert layer.seen == length  # the reconstruction tokens left no trace


def test_the_cache_holds_only_the_compressed_prompt_and_generation_continues(tiny):
    _, model = tiny
    ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    policy = make_policy("kvzip", budget=12, chunk_size=16, repeat_ids=PROMPT_IDS).attach(model)
    cache = BudgetCache(model.config, policy)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    policy.detach()
    assert out.shape[1] == 45 and cache.get_seq_length() == 44
    for layer in cache.budget_layers:
        held = layer.pos[layer.pos >= 0].view(1, layer.num_kv_heads, -1)
        assert held.shape[-1] == 16 and bool((held[..., -4:] == torch.arange(40, 44)).all())  # 12 + 4 decode steps



@pytest.mark.parametrize("how", ["reset", "copy"])
def test_a_reset_or_copied_cache_scores_the_prompt_it_holds(tiny, how):
    """The scoring pass reconstructs the prompt a cache has seen. After ``reset()`` it reconstructed the old prompt and
    the new one (the cache object was the same), keeping other tokens than a fresh cache and giving other logits; a
    copy (``copy.deepcopy``) lacked the prompt its original had seen, and a prompt chunk after the copy failed ("the
    policy kept other than min(held, quota) tokens")."""
    import copy

    _, model = tiny
    first, second = (torch.randint(8, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 24))
    policy = make_policy("kvzip", budget=10, chunk_size=16, repeat_ids=PROMPT_IDS).attach(model)
    try:
        with torch.no_grad():
            cache = BudgetCache(model.config, policy)
            model(first, past_key_values=cache)
            if how == "reset":  # as a fresh cache
                cache.reset()
                other = BudgetCache(model.config, policy)
            else:  # as the original
                other = copy.deepcopy(cache)
            got = model(second, past_key_values=cache).logits
            expected = model(second, past_key_values=other).logits
    finally:
        policy.detach()
    torch.testing.assert_close(got, expected)
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(cache.budget_layers, other.budget_layers))


@pytest.mark.parametrize("copied", [False, True])
def test_a_prompt_chunk_after_detach_and_attach_is_scored_with_the_chunks_before(tiny, copied):
    """The prompt a cache had seen was kept in the hooks ``attach`` puts on the model, which ``detach`` removes: with
    ``with policy.attach(model):`` around each call (or a cache copied while detached), the next prompt chunk was
    reconstructed alone, under an attention mask shorter than the cache, every score came out 0 and each head kept its
    sinks and its newest tokens, silently. The policy keeps the prompts now: what an unbroken attachment keeps."""
    import copy

    _, model = tiny
    ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    policy = make_policy("kvzip", budget=10, chunk_size=16, repeat_ids=PROMPT_IDS)
    with torch.no_grad():
        with policy.attach(model):
            expected_cache = BudgetCache(model.config, policy)
            model(ids[:, :20], past_key_values=expected_cache)
            expected = model(ids[:, 20:], past_key_values=expected_cache).logits
        with policy.attach(model):
            cache = BudgetCache(model.config, policy)
            model(ids[:, :20], past_key_values=cache)
        if copied:
            cache = copy.deepcopy(cache)
        with policy.attach(model):
            got = model(ids[:, 20:], past_key_values=cache).logits
    torch.testing.assert_close(got, expected)
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(cache.budget_layers, expected_cache.budget_layers))


SELECTIONS = {
    "reorder": (lambda cache: cache.reorder_cache(torch.tensor([1, 0])), lambda ids: ids.flip(0)),
    "select": (lambda cache: cache.batch_select_indices(torch.tensor([1])), lambda ids: ids[1:]),
    "repeat": (lambda cache: cache.batch_repeat_interleave(2), lambda ids: ids.repeat_interleave(2, dim=0)),
}


@pytest.mark.parametrize("how", list(SELECTIONS))
def test_a_prompt_chunk_after_a_batch_selection_is_scored_with_each_sequences_own_prompt(tiny, how):
    """The scoring pass reconstructs the prompt a cache has seen, kept beside the cache; ``reorder_cache``,
    ``batch_select_indices`` and ``batch_repeat_interleave`` (a shared prefix fanned out to several continuations)
    left it in its old batch. A prompt chunk after a selection or a repetition failed on its concatenation to it (a
    RuntimeError of tensor sizes), and after a reorder each sequence's scoring forwards reconstructed another sequence's
    earlier chunks. Now the cache scores what a fresh cache given each sequence's own prompt scores, and keeps what it
    keeps."""
    _, model = tiny
    ids = torch.randint(8, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    select, rows = SELECTIONS[how]
    policy = make_policy("kvzip", budget=10, chunk_size=16, repeat_ids=PROMPT_IDS).attach(model)
    scored = []
    reconstruct = policy.reconstruct
    policy._hooks.run = lambda model, cache, ids, *rest: (scored.append(ids), reconstruct(model, cache, ids, *rest))
    try:
        with torch.no_grad():
            cache, fresh = BudgetCache(model.config, policy), BudgetCache(model.config, policy)
            model(ids[:, :20], past_key_values=cache)
            select(cache)
            model(rows(ids)[:, :20], past_key_values=fresh)
            got = model(rows(ids)[:, 20:32], past_key_values=cache).logits
            expected = model(rows(ids)[:, 20:32], past_key_values=fresh).logits
    finally:
        policy.detach()
    torch.testing.assert_close(got, expected)
    assert torch.equal(scored[-2], rows(ids)[:, :32]) and torch.equal(scored[-1], rows(ids)[:, :32])
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(cache.budget_layers, fresh.budget_layers))


def test_unattached_kvzip_says_what_to_do(tiny):
    _, model = tiny
    cache = BudgetCache(model.config, make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS))
    with pytest.raises(ValueError, match="attach"), torch.no_grad():
        model(torch.ones((1, 12), dtype=torch.long), past_key_values=cache)



def test_a_model_with_sliding_window_layers_is_refused_when_kvzip_attaches():
    """Its scoring forwards cannot drop what they add to transformers' own sliding-window layers: it was refused after
    the prompt forward had filled the cache, now before any forward."""
    from kvgates import UnsupportedModelError

    _, model = tiny_model("gemma3")
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS)
    with pytest.raises(UnsupportedModelError, match="^kvzip: scoring forwards need every cache layer to be budgeted"):
        policy.attach(model)
    assert not model._forward_pre_hooks

def test_multimodal_rope_positions_are_refused_before_the_prompt_is_cached():
    """Qwen2-VL's generate passes position_ids ``[4, B, T]`` (text positions, then multimodal RoPE's three): the
    prompt's positions were a RuntimeError from ``expand``; a scoring forward places each token at one position."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from kvgates import UnsupportedModelError, prepare_model

    text = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        bos_token_id=1, eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=120)).eval()
    prepare_model(model)
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS).attach(model)
    cache = BudgetCache(model.config, policy)
    with pytest.raises(UnsupportedModelError, match=r"^kvzip: .* position_ids of shape \[4, 1, 12\], several positions per token"):
        model.generate(torch.randint(3, 100, (1, 12)), past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 0
    policy.detach()


def test_repeat_ids_beyond_the_vocabulary_are_one_sentence(tiny):
    """They were the embedding's IndexError in the first scoring forward."""
    _, model = tiny
    vocab = model.get_input_embeddings().num_embeddings
    policy = make_policy("kvzip", budget=8, repeat_ids=[1, vocab])
    with pytest.raises(ValueError, match=rf"^kvzip: repeat_ids holds {vocab}, not a token id of this model \(its vocabulary has {vocab}\)$"):
        policy.attach(model)
    with pytest.raises(ValueError, match="not a token id of this model"):
        policy.scoring_reach(model, 16)


def test_adakv_wraps_kvzip(tiny):
    _, model = tiny
    ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    policy = make_policy("adakv", budget=10, base="kvzip", base_params={"repeat_ids": PROMPT_IDS}).attach(model)
    cache = BudgetCache(model.config, policy)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    policy.detach()
    for layer in cache.budget_layers:
        assert int(layer.held().sum()) <= 10 * layer.num_kv_heads + 1 and layer.seen == 40


@pytest.mark.parametrize("length,chunk", [(30, 64), (37, 16)])
def test_scoring_reach_is_how_far_past_the_prompt_the_scoring_forwards_run(tiny, length, chunk):
    """``Policy.scoring_reach`` (what the context checks of ``kvgates generate``, ``eval ab`` and ``train.py`` add to a
    prompt) is the last position a scoring forward runs at, past the prompt; a wrapper says its base's, others 0."""
    _, model = tiny
    policy = make_policy("kvzip", budget=10, repeat_ids=PROMPT_IDS, chunk_size=chunk).attach(model)
    positions = []

    def record(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            positions.append(int(kwargs["position_ids"].max()))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.randint(8, 128, (1, length), generator=torch.Generator().manual_seed(2)), past_key_values=BudgetCache(model.config, policy))
    finally:
        hook.remove()
        policy.detach()
    assert max(positions) + 1 == length + policy.scoring_reach(model, length) == length + len(PROMPT_IDS) + min(chunk, length)
    wrapped = make_policy("adakv", budget=10, base="kvzip", base_params={"repeat_ids": PROMPT_IDS, "chunk_size": chunk})
    assert wrapped.scoring_reach(model, length) == policy.scoring_reach(model, length)
    assert make_policy("snapkv", budget=64).scoring_reach(model, length) == 0


def test_kvzip_scores_label_every_token_as_the_literal_scoring_does():
    from kvgates.policies.kvzip import kvzip_scores

    ref, model = tiny_model(seed=3)
    ref.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(8, 128, (n,), generator=g) for n in (21, 14)]
    ids, mask = torch.zeros((2, 21), dtype=torch.long), torch.zeros((2, 21), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding
        ids[i, 21 - len(r) :], mask[i, 21 - len(r) :] = r, 1
    got = kvzip_scores(model, ids, mask, chunk_size=8, repeat_ids=PROMPT_IDS)
    assert got.shape == (3, 2, 2, 21)
    for i, r in enumerate(rows):
        expected = literal_scores(ref, r.tolist(), 8)
        pad = 21 - len(r)
        assert bool((got[:, i, :, :pad] == 0).all())
        torch.testing.assert_close(got[:, i, :, pad:], torch.tensor(expected), atol=1e-5, rtol=0)


def test_kvzip_plus_normalisation_matches_the_literal_scoring(tiny):
    from kvgates.policies.kvzip import kvzip_scores

    ref, model = tiny_model(seed=5)
    ref.set_attn_implementation("eager")
    ids = torch.randint(8, 128, (1, 19), generator=torch.Generator().manual_seed(5))
    got = kvzip_scores(model, ids, chunk_size=12, repeat_ids=PROMPT_IDS, normalize=True)
    expected = torch.tensor(literal_scores(ref, ids[0].tolist(), 12, normalize=True))
    torch.testing.assert_close(got[:, 0], expected, atol=1e-5, rtol=1e-4)
    plain = kvzip_scores(model, ids, chunk_size=12, repeat_ids=PROMPT_IDS)
    assert not torch.allclose(got, plain)  # the normalisation changes the scores


def test_a_static_cache_without_decode_slots_is_refused_in_one_sentence(tiny):
    """KVzip evicts only the prompt: a static cache needs slots for the tokens it will decode (its decode steps are
    tested compiled in test_compiled_decode.py)."""
    _, model = tiny
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS)
    with pytest.raises(ValueError, match="evicts only the prompt, so a static cache needs decode_slots"):
        BudgetCache(model.config, policy, static=True)


def test_a_prompt_through_a_model_kvzip_is_not_attached_to_is_refused(tiny):
    """Attached to one model instance and run on a copy (or its inner model), the scoring forwards never ran and every
    head held the whole prompt, silently."""
    import copy

    _, model = tiny
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS).attach(model)
    try:
        ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="^kvzip: this prompt goes through a model kvzip is not attached to"), torch.no_grad():
            copy.deepcopy(model)(ids, past_key_values=BudgetCache(model.config, policy))
        with pytest.raises(ValueError, match="not attached to"), torch.no_grad():
            model.model(ids, past_key_values=BudgetCache(model.config, policy))
        with torch.no_grad():  # the attached model still scores and evicts
            cache = BudgetCache(model.config, policy)
            model(ids, past_key_values=cache)
        assert int(cache.held_tokens().max()) == 8
    finally:
        policy.detach()
    with pytest.raises(ValueError, match=r"^kvzip: attach it to the model with the language-modelling head \(LlamaModel has none"):
        policy.attach(model.model)


def test_kvzip_plus_holds_no_hidden_states_of_the_prompt_forward(tiny):
    """KVzip+ captured the hidden state entering every layer's attention in every forward, the prompt's too, and
    never let go of them: 1.5 times a full cache of extra memory at 1,000 tokens of SmolLM2 while it scored."""
    _, model = tiny
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS, normalize=True).attach(model)
    held = []
    reconstruct = policy.reconstruct
    policy._hooks.run = lambda *args: (held.append(len(policy._hidden.inputs)), reconstruct(*args))
    try:
        with torch.no_grad():
            model(torch.randint(8, 128, (1, 30), generator=torch.Generator().manual_seed(0)), past_key_values=BudgetCache(model.config, policy))
        assert held == [0] and policy._hidden.inputs == {}
    finally:
        policy.detach()


def test_kvzip_options_that_would_be_ignored_are_refused():
    """repeat_prompt beside repeat_ids was silently ignored; kvzip_scores(budget=...) was a TypeError."""
    from kvgates.policies.kvzip import kvzip_scores

    with pytest.raises(ValueError, match=r"^kvzip: give repeat_prompt or repeat_ids, not both"):
        make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS, repeat_prompt="Summarise the text above:")
    with pytest.raises(ValueError, match="^kvzip_scores scores every token and evicts none: it takes no budget$"):
        kvzip_scores(None, torch.ones((1, 4), dtype=torch.long), budget=4)


def test_an_interrupted_prompt_forward_leaves_no_forward_taken_for_the_attached_model(tiny):
    """A prompt forward of the attached model stopped by an interrupt left it marked as running: a later prompt through
    another model (here its inner model) was taken for the attached one's and held every token, silently."""
    _, model = tiny
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS).attach(model)
    ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def interrupt(*args):
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(ids, past_key_values=BudgetCache(model.config, policy))
        handle.remove()
        with pytest.raises(ValueError, match="not attached to"), torch.no_grad():
            model.model(ids, past_key_values=BudgetCache(model.config, policy))
    finally:
        handle.remove()
        policy.detach()


def test_a_batch_of_another_size_is_refused_in_the_cache_s_sentence(tiny):
    """With KVzip attached, the prompt hook concatenated the new batch's ids to the old one's first: a torch error."""
    _, model = tiny
    policy = make_policy("kvzip", budget=8, repeat_ids=PROMPT_IDS).attach(model)
    ids = torch.randint(8, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    try:
        cache = BudgetCache(model.config, policy)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            with pytest.raises(ValueError, match="this BudgetCache holds 2 sequences and the forward brings 1"):
                model(ids[:1, :5], past_key_values=cache)
    finally:
        policy.detach()



@pytest.mark.parametrize("prefill_chunk", [None, 24])
def test_a_left_padded_batch_without_position_ids_keeps_what_generate_s_positions_keep(tiny, prefill_chunk):
    """Without ``position_ids`` transformers places a left-padded row's real tokens after its padding (5 pads: at
    positions 5, 6, ...). The scoring forwards started at the row's count of real tokens, inside the positions the row
    held, and the discard of their tokens then evicted the row's own last prompt tokens (it kept 30 of its 35 at a
    budget of 100), and each chunk scored the slots of other positions than its own. A row keeps, 5 positions on,
    what it keeps at ``generate``'s positions (and, in one forward, what it keeps alone)."""
    _, model = tiny
    g = torch.Generator().manual_seed(3)
    full, short = torch.randint(8, 128, (1, 40), generator=g), torch.randint(8, 128, (1, 35), generator=g)
    ids = torch.cat([full, torch.nn.functional.pad(short, (5, 0))])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def kept(batch, attention_mask, positions, shift=0):
        """Positions kept ``[layer][row][kv head]``, less ``shift``."""
        cache = BudgetCache(model.config, policy)
        step = prefill_chunk or batch.shape[1]
        with torch.no_grad():
            for lo in range(0, batch.shape[1], step):
                model(
                    batch[:, lo : lo + step], attention_mask=attention_mask[:, : lo + step], past_key_values=cache,
                    position_ids=None if positions is None else positions[:, lo : lo + step],
                )
        assert all(layer.seen == batch.shape[1] for layer in cache.budget_layers)
        return [[[sorted(p - shift for p in head if p >= 0) for head in row] for row in layer.pos.tolist()] for layer in cache.budget_layers]

    for budget in (12, 100):
        policy = make_policy("kvzip", budget=budget, chunk_size=16, repeat_ids=PROMPT_IDS).attach(model)
        try:
            got = kept(ids, mask, None)
            got_short = kept(ids, mask, None, shift=5)
            expected = kept(ids, mask, (mask.cumsum(1) - 1).clamp(min=0))
            alone = kept(short, torch.ones_like(short), None)
        finally:
            policy.detach()
        for layer, (got_layer, short_layer, expected_layer, alone_layer) in enumerate(zip(got, got_short, expected, alone)):
            assert [len(head) for head in short_layer[1]] == [min(budget, 35)] * len(short_layer[1]), f"budget {budget} layer {layer}"
            assert [got_layer[0], short_layer[1]] == expected_layer, f"budget {budget} layer {layer}"
            if prefill_chunk is None:
                assert expected_layer[1] == alone_layer[0]


def test_generate_through_a_static_cache_of_a_model_whose_config_lists_layer_types_scores_the_prompt():
    """generate() gives a compileable cache's forwards one 4-D mask per layer type, in a dict, where the config lists
    layer types (Qwen2, Qwen3): KVzip's prompt hook took it for a tensor and ended in an AttributeError ('dict' object
    has no attribute 'dim'). A static cache generates what the dynamic one does, from a left-padded batch."""
    _, model = tiny_model("qwen3")
    ids = torch.randint(8, 128, (2, 20), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    policy = make_policy("kvzip", budget=8, chunk_size=16, repeat_ids=PROMPT_IDS).attach(model)
    try:
        out = {}
        for static in (False, True):
            cache = BudgetCache(model.config, policy, static=static, decode_slots=6 if static else 0)
            with torch.no_grad():
                out[static] = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
            assert int(cache.held_tokens().max()) == 8 + 5  # (the prompt evicted, then 5 decode steps appended)
    finally:
        policy.detach()
    assert torch.equal(out[True], out[False])
