"""Shared builders for the tests: tiny random models of several families, policy parameters, layer states."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvgates
from kvgates.runtime.cache import BudgetCache

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=0,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": 8, "layer_types": None, "num_hidden_layers": 4}),
}

#: Small-model parameters for every registered policy (a new policy must add itself here to be tested).
POLICY_PARAMS = {
    "full": {},
    "streaming_llm": {"sinks": 2},
    "h2o": {},
    "snapkv": {"window": 4, "kernel": 3},
    "pyramidkv": {"window": 4, "kernel": 3},
    "tova": {},
    "morphkv": {"recent": 4},
    "d2o": {"sinks": 2},
    "dynamickv": {"window": 4, "kernel": 3, "update_every": 2},
    "kvmerger": {"window": 4, "heavy": 2},
    "kvzip": {"repeat_ids": [5, 6, 7], "chunk_size": 16, "sinks": 2},
    "adakv": {"base": "snapkv", "base_params": {"window": 4, "kernel": 3}},
    "merge": {"base": "h2o"},
    "trimkv": {},
    "trimkv-global": {},
    "trimkv-morph": {"recent": 4, "gate_keep": 3},
    "trimkv-snap": {"window": 4, "kernel": 3, "gate_keep": 3},
    "locret": {"stabilizers": 2, "local": 2},
    "dms": {"window": 2},
    "kvzap": {"window": 2, "sinks": 1},
}

#: Gate kind of each learned policy (fresh, randomly initialised gates in tests).
LEARNED = {
    "trimkv": "retention", "trimkv-global": "retention-global", "trimkv-morph": "retention", "trimkv-snap": "retention",
    "locret": "retaining-head", "dms": "dms", "kvzap": "kvzap-mlp",
}


def policy_kwargs(name: str, budget: int | None) -> dict:
    params = dict(POLICY_PARAMS[name])
    if name != "full":
        params["budget"] = budget
    return params


@contextmanager
def policy_on(model, name: str, budget: int | None, **overrides):
    """A registered policy with small-model parameters, attached to ``model`` for the block (learned policies get
    fresh gates of the model's shape with a moderate bias, so their scores vary)."""
    from kvgates.gates import GATE_KINDS

    params = {**policy_kwargs(name, budget), **overrides}
    if name in LEARNED:
        params["gates"] = GATE_KINDS[LEARNED[name]].for_model(model, init_bias=2.0)
    policy = kvgates.make_policy(name, **params).attach(model)
    try:
        yield policy
    finally:
        policy.detach()


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """(reference model with sdpa, same weights prepared for kvgates), both eval, float32."""
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    layer_types = kwargs.pop("layer_types", "keep")
    config = config_cls(**kwargs)
    if family == "gemma3" and layer_types is None:
        config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    elif isinstance(layer_types, list):
        config.layer_types = layer_types
    torch.manual_seed(seed)
    ref = model_cls(config).eval()
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    kvgates.prepare_model(model)
    return ref, model


def teacher_forced_logits(model, cache, ids: torch.Tensor, prompt_len: int, chunk: int | None = None) -> torch.Tensor:
    """Logits of a prompt (optionally in chunks) then one token at a time, concatenated ``[B, T, V]``."""
    outs = []
    with torch.no_grad():
        step = chunk or prompt_len
        for start in range(0, prompt_len, step):
            outs.append(model(ids[:, start : min(prompt_len, start + step)], past_key_values=cache).logits)
        for t in range(prompt_len, ids.shape[1]):
            outs.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    return torch.cat(outs, dim=1)


def gate_batch(padded: bool = False, length: int = 64, completion: int = 16) -> dict[str, torch.Tensor]:
    """A collated training batch of two random rows (the second right-padded by 10 with ``padded``), the last
    ``completion`` tokens of each real row its completion."""
    ids = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -10:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, -completion:] = ids[:, -completion:]
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def dynamic_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def make_layer(policy, positions: torch.Tensor, head_dim: int = 8, seed: int = 0, device: str = "cpu"):
    """A standalone BudgetLayer whose slots hold ``positions`` (``[B, H_kv, C]``, -1 = empty) and random K/V (drawn
    on the CPU, the same on every ``device``), on ``device``."""
    b, hkv, c = positions.shape
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=hkv, num_key_value_heads=hkv, hidden_size=hkv * head_dim, head_dim=head_dim
    )
    cache = BudgetCache(config, policy)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, c, head_dim, generator=g).to(device)
    layer.lazy_initialization(k, k)
    layer._grow(c)
    layer.keys.copy_(k.reshape(b, hkv * c, head_dim))
    layer.values.copy_(torch.randn(b, hkv * c, head_dim, generator=g).to(device))
    layer.pos.copy_(positions)
    return layer


def random_positions(b: int, hkv: int, c: int, held: int, seed: int = 0) -> torch.Tensor:
    """Slot positions with ``held`` distinct tokens per head scattered over ``c`` slots (holes = -1)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.full((b, hkv, c), -1, dtype=torch.int64)
    for i in range(b):
        for h in range(hkv):
            slots = torch.randperm(c, generator=g)[:held]
            tokens = torch.sort(torch.randperm(held + 10, generator=g)[:held]).values
            pos[i, h, slots] = tokens
    return pos


def save_tiny_checkpoint(folder, family: str = "llama", **overrides):
    """Save a tiny random model (``overrides``: config values) and a character-level tokenizer to ``folder`` (a local
    "model id")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars[: VOCAB - 3])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    _, model = tiny_model(family, **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
