"""StreamingLLM's position shift (rerotate=True): re-rotated attention equals RoPE applied at cache ranks."""

import copy
import sys

import pytest
import torch
from helpers import _COMMON, dynamic_cache, teacher_forced_logits
from transformers import CohereConfig, CohereForCausalLM, GlmConfig, GlmForCausalLM

import kvgates
from kvgates import BudgetCache, UnsupportedModelError, make_policy
from kvgates.policies import StreamingLLM
from kvgates.policies.base import Policy
from kvgates.policies.wrappers import Wrapper
from kvgates.runtime.rope import rotary_of, shift_rotary

#: Families whose RoPE rotates interleaved feature pairs (2i, 2i+1) instead of halves (i, i + D/2); GLM also
#: rotates only half of each head (partial rotary).
INTERLEAVED = {"cohere": (CohereConfig, CohereForCausalLM), "glm": (GlmConfig, GlmForCausalLM)}


def pair(family):
    """(reference sdpa model, kvgates model) of a tiny random ``family`` model."""
    config_cls, model_cls = INTERLEAVED[family]
    torch.manual_seed(0)
    ref = model_cls(config_cls(**_COMMON)).eval()
    ref.set_attn_implementation("sdpa")
    return ref, kvgates.prepare_model(copy.deepcopy(ref))


def rope(model, x, positions):
    """transformers' own RoPE of ``x`` [B, H, T, D] at ``positions`` [B, T], by the model's own modeling code."""
    cos, sin = model.model.rotary_emb(x, positions)
    return sys.modules[type(model).__module__].apply_rotary_pos_emb(x, x, cos, sin)[0]


@pytest.mark.parametrize("family", ["llama", "cohere", "glm"])
def test_shift_equals_rope_at_the_new_position(tiny, family):
    model = tiny[1] if family == "llama" else pair(family)[1]
    x = torch.randn(1, 2, 6, 16)
    pos = torch.tensor([[0, 3, 7, 20, 21, 40]])
    new = torch.tensor([[0, 1, 2, 3, 4, 5]])
    shifted = shift_rotary(rope(model, x, pos), (new - pos)[:, None, :], rotary_of(model))
    torch.testing.assert_close(shifted, rope(model, x, new), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(INTERLEAVED))
def test_interleaved_rope_without_eviction_is_unchanged(family):
    ref, model = pair(family)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, 20)
    policy = StreamingLLM(budget=64, sinks=2, rerotate=True).attach(model)
    torch.testing.assert_close(teacher_forced_logits(model, BudgetCache(model.config, policy), ids, 20), expected, atol=1e-4, rtol=0)


def test_a_rotary_layout_that_does_not_compose_is_refused(monkeypatch):
    """A model whose rotation kvgates cannot reproduce by shifting is refused at attach, not run with wrong keys."""
    _, model = pair("cohere")
    module = sys.modules[type(model).__module__]
    rotate = module.apply_rotary_pos_emb
    # Pairs counted from the last feature: a rotation, but of other feature pairs than either layout turns.
    mirrored = lambda q, k, cos, sin, **kw: tuple(t.flip(-1) for t in rotate(q.flip(-1), k.flip(-1), cos, sin, **kw))  # noqa: E731
    monkeypatch.setattr(module, "apply_rotary_pos_emb", mirrored)
    with pytest.raises(UnsupportedModelError, match="rerotate=True"):
        StreamingLLM(budget=8, sinks=2, rerotate=True).attach(model)


def test_no_eviction_is_unchanged(tiny):
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = teacher_forced_logits(ref, dynamic_cache(ref), ids, 24)
    policy = StreamingLLM(budget=64, sinks=2, rerotate=True).attach(model)
    got = teacher_forced_logits(model, BudgetCache(model.config, policy), ids, 24)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "cohere", "glm"])
def test_attention_after_eviction_uses_cache_ranks(tiny, family):
    model = tiny[1] if family == "llama" else pair(family)[1]
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    policy = StreamingLLM(budget=8, sinks=2, rerotate=True).attach(model)
    cache = BudgetCache(model.config, policy)
    attn = model.model.layers[0].self_attn
    captured = {}
    handle = attn.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out[0]))
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        for t in range(20, 30):
            model(ids[:, t : t + 1], past_key_values=cache)
        handle.remove()
        # Layer 0 sees only embeddings, so its q/k/v can be rebuilt for any token set.
        kept = [0, 1] + list(range(30 - 7, 30))  # sinks + the most recent 7 (the current token included)
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[:, kept]))
        shape = (1, len(kept), -1, 16)
        q = attn.q_proj(hidden[:, -1:]).view(1, 1, -1, 16).transpose(1, 2)
        k = attn.k_proj(hidden).view(shape).transpose(1, 2)
        v = attn.v_proj(hidden).view(shape).transpose(1, 2)
        ranks = torch.arange(len(kept))[None]
        q, k = rope(model, q, ranks[:, -1:]), rope(model, k, ranks)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) * attn.scaling, -1)
        expected = attn.o_proj((probs @ v).transpose(1, 2).reshape(1, 1, -1))
    torch.testing.assert_close(captured["out"], expected, atol=1e-5, rtol=1e-5)


def test_rerotate_needs_attach(tiny):
    _, model = tiny
    with pytest.raises(RuntimeError, match="call policy.attach"):
        model(torch.randint(1, 128, (1, 6)), past_key_values=BudgetCache(model.config, StreamingLLM(budget=4, sinks=1, rerotate=True)))


def test_position_window_says_how_far_attention_runs_within_the_cache():
    """``Policy.position_window`` (what ``kvgates generate`` reads before warning about a prompt past the model's
    context): StreamingLLM with ``rerotate`` holds at most its budget and slack before a forward, also inside a
    wrapper; no other policy attends within its cache."""
    assert StreamingLLM(budget=16, rerotate=True).position_window == 16
    assert StreamingLLM(budget=16, rerotate=True, slack=3).position_window == 19
    assert StreamingLLM(budget=16).position_window is None
    assert make_policy("merge", budget=16, base="streaming_llm", base_params={"rerotate": True}).position_window == 16
    assert make_policy("merge", budget=16, base="h2o").position_window is None


def test_every_policy_that_shifts_positions_says_how_far():
    """A registered policy overriding ``position_shift`` declares ``position_window`` too (``kvgates generate`` reads
    it to say whether a long stream runs past the model's context); wrappers forward both."""
    for name, cls in kvgates.POLICIES.items():
        if cls.position_shift is not Policy.position_shift and not issubclass(cls, Wrapper):
            assert cls.position_window is not Policy.position_window, name
