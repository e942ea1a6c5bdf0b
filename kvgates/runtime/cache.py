"""``BudgetCache``: a transformers ``Cache`` whose full-attention layers hold at most a policy's budget."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvgates.errors import UnsupportedModelError
from kvgates.runtime.dispatch import EAGER_ONLY
from kvgates.runtime.layer import NOT_CROPPABLE, BudgetLayer
from kvgates.runtime.protocol import CachePolicy, make_policy
from kvgates.typecheck import as_int

#: Layer types kvgates budgets, and layer types it leaves exactly as transformers builds them.
BUDGETED_LAYER_TYPES = ("full_attention",)
PASSTHROUGH_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def context_positions(config: PreTrainedConfig) -> int | None:
    """The positions a model of ``config`` reads (of its text config): ``max_position_embeddings``, times the RoPE
    scaling factor when its rotary embedding is scaled (YaRN, linear, dynamic, ...: configs that extend a model past its
    trained length keep the original ``max_position_embeddings``), the factor applied to the scaling's
    ``original_max_position_embeddings`` where it names one, and never less than ``max_position_embeddings`` (Llama
    3.1's ``llama3`` type gives 131,072, already the extended length of its original 8,192); None when the config gives
    no length. ``kvgates.models.context_length`` of a model."""
    config = config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"
    if not scaled:
        return int(limit)
    factor = max(1.0, float(rope.get("factor") or 1.0))
    # The scaling extends the original length by its factor (Qwen3's YaRN: 32,768 x 4 past a config's 40,960), and a
    # config may already give the extended length (Llama 3.1: 131,072, its original 8,192 x 8 being less).
    return max(int(limit), int(int(rope.get("original_max_position_embeddings") or limit) * factor))


def window_covers_context(window: int | None, config: PreTrainedConfig | None) -> bool:
    """Whether a sliding ``window`` reaches every position a model of ``config`` reads (``context_positions``, RoPE
    scaling included: a YaRN factor extending the context past the window leaves it sliding), so that its layer is a
    full-attention one whatever the config calls it."""
    context = context_positions(config) if isinstance(config, PreTrainedConfig) else None
    return window is not None and context is not None and window >= context


def layer_kinds(text_config: PreTrainedConfig) -> tuple[list[str], list[dict]]:
    """Each layer's type and its cache layer's arguments, as transformers reads them (``get_layer_types_and_kwargs``),
    but a sliding-window layer whose window covers the model's whole context (``window_covers_context``) is the
    ``"full_attention"`` layer it is: Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini declare a 262,144-token window for
    every layer, twice their context, so transformers calls them all sliding and kvgates refused to budget them."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    kinds, kwargs = [], []
    for kind, each in zip(layer_types, layer_kwargs):
        if kind == "sliding_attention" and window_covers_context(each.get("sliding_window"), text_config):
            kind, each = "full_attention", {}
        kinds.append(kind)
        kwargs.append(each)
    return kinds, kwargs


class BudgetCache(Cache):
    """KV cache that keeps each full-attention layer within ``policy``'s budget.

    Use it like any transformers cache, with the model's attention set to ``"kvgates"``::

        model.set_attn_implementation("kvgates")
        cache = BudgetCache(model.config, "snapkv", budget=256)
        model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

    With ``static=True`` each budgeted layer keeps a fixed number of slots once the prompt is stored (its quota
    plus the slots decoding needs before the next eviction) and its single-token decode steps run in place with
    fixed shapes and no host sync, so ``torch.compile(model.forward, fullgraph=True)`` (``mode="reduce-overhead"``
    on CUDA) can compile them; policies whose decode step allows it say so (``sync_free_decode``).

    Args:
        config: the model's config (its text config is used for multimodal models).
        policy: a built policy (a ``kvgates.Policy``), or a registered policy name built with ``policy_params``
            (``kvgates.make_policy``).
        static: the static layout above (refused for a model with sliding-window or chunked-attention layers,
            whose transformers cache layers do not compile).
        decode_slots: with ``static``, the tokens a policy that evicts only the prompt may decode (its layers hold
            that many slots beyond the quota); policies that evict while decoding need none.
        **policy_params: parameters of the named policy (``budget``, ``window``, ...).

    Sliding-window and chunked-attention layers (Gemma-3, Llama-4 ...) keep transformers' own cache layers and
    attention; only full-attention layers are budgeted.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        policy: CachePolicy | str = "full",
        static: bool = False,
        decode_slots: int = 0,
        **policy_params: Any,
    ):
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(f"config must be the model's config (BudgetCache(model.config, ...)), got {type(config).__name__}")
        if isinstance(policy, str):
            policy = make_policy(policy, **policy_params)
        elif policy_params:
            raise ValueError("pass policy parameters either inside the Policy instance or with a policy name, not both")
        if isinstance(policy, type):
            raise TypeError(f"policy must be a Policy instance ({policy.__name__}(budget=...)) or a registered name, not the class")
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"policy must be a kvgates Policy or a registered name, got {type(policy).__name__}")
        if not isinstance(static, (bool, np.bool_)):
            raise TypeError(f"static must be True or False, got {static!r}")
        if as_int(decode_slots) is None:  # (a numpy integer or a 0-d tensor: the int it holds)
            raise TypeError(f"decode_slots must be a whole number of tokens, got {decode_slots!r}")
        static, decode_slots = bool(static), as_int(decode_slots)
        if static:
            check_static(policy, decode_slots)
        elif decode_slots:
            raise ValueError("decode_slots sizes a static cache; pass static=True with it")
        self.static, self.decode_slots = static, decode_slots
        text_config = config.get_text_config(decoder=True)
        if getattr(text_config, "is_encoder_decoder", False):
            raise UnsupportedModelError("kvgates budgets decoder-only models; encoder-decoder models are not supported")
        layer_types, layer_kwargs = layer_kinds(text_config)
        layers = []
        for idx, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind in BUDGETED_LAYER_TYPES:
                layers.append(BudgetLayer(self, idx, rank=sum(isinstance(layer, BudgetLayer) for layer in layers)))
            elif kind in PASSTHROUGH_LAYER_TYPES:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
            else:
                raise UnsupportedModelError(
                    f"layer {idx} of {text_config.model_type!r} is a {kind!r} layer, which kvgates cannot budget; "
                    f"supported layer types are {BUDGETED_LAYER_TYPES + PASSTHROUGH_LAYER_TYPES}"
                )
        self.budget_layer_ids = [i for i, layer in enumerate(layers) if isinstance(layer, BudgetLayer)]
        if not self.budget_layer_ids:
            raise UnsupportedModelError(
                f"{text_config.model_type!r} has no full-attention layer (all layers use sliding or chunked "
                "attention), so there is no cache for kvgates to budget"
            )
        if static and len(self.budget_layer_ids) < len(layers):
            kinds = sorted({kind for kind in layer_types if kind not in BUDGETED_LAYER_TYPES})
            raise ValueError(
                f"a static BudgetCache compiles its decode steps, which {text_config.model_type!r}'s {' and '.join(kinds)} "
                "layers cannot: they keep transformers' own dynamic cache layers (a recompile at every step; generate() "
                "does not compile them); use static=False"
            )
        self.policy = policy
        self.config = text_config
        self._pending_layer: int | None = None
        self._forward_at: int | None = None  # the last layer a forward has done (-1: none yet), until it ends
        self._real: tuple[Any, ...] | None = None  # ``real_queries``' last answer and what it was for
        self._said_turn = False  # whether ``several_after_decoding`` has warned
        super().__init__(layers=layers)

    # ------------------------------------------------------------------ the transformers Cache API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``, with the forward's progress over every layer recorded (``check_forward``): it begins at
        layer 0's update, a passthrough layer holds its tokens once its update returns, a budgeted one once its step
        ends (``layer_done``). A static cache's compiled decode steps are not recorded (nor are they checked). Every
        other call runs eagerly inside ``torch.compile`` (``EAGER_ONLY``), as its attention does."""
        if layer_idx < len(self.layers) and self._static_step(key_states):
            return self._update(key_states, value_states, layer_idx, *args, **kwargs)
        return self._update_eager(key_states, value_states, layer_idx, *args, **kwargs)

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"this BudgetCache has {len(self.layers)} layers and the model's layer {layer_idx} attends: build the cache "
                "from this model's config (BudgetCache(model.config, ...))"
            )
        tracked = not self._static_step(key_states)
        if layer_idx == 0:  # (every layer of a forward brings the same batch, and one model's layers alike heads)
            self._check_shapes(self.layers[0], key_states)
            self.check_forward()
            if not torch.compiler.is_compiling():  # (dynamo traces neither is_inference nor the mode; torch says it there)
                self._check_inference_mode()
            if tracked:
                self._forward_at = -1
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if tracked and not isinstance(self.layers[layer_idx], BudgetLayer):
            self.layer_done(layer_idx)
        return out

    _update_eager = torch.compiler.disable(_update, reason=EAGER_ONLY)

    def _static_step(self, key_states: torch.Tensor) -> bool:
        """Whether a forward bringing ``key_states`` is a static layout's decode step (``BudgetLayer._attend_static``)."""
        return key_states.shape[-2] == 1 and self.layers[self.budget_layer_ids[0]].static

    def _check_inference_mode(self) -> None:
        """Refuse, before anything is written, a forward outside ``torch.inference_mode()`` through a cache filled
        under it (``generate()`` runs under ``no_grad``): its tensors take no in-place write there, and torch's error
        came from a layer's first write, leaving the forward stopped part-way (``check_forward``). A static layout's
        eager decode step is checked too; a compiled one meets torch's own error at its first write."""
        pos = self.layers[self.budget_layer_ids[0]].pos
        if pos is not None and pos.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                "this BudgetCache was filled under torch.inference_mode(), whose tensors take no in-place write outside "
                "it: continue it under torch.inference_mode() too (wrap generate() in it), or fill it under torch.no_grad()"
            )

    @staticmethod
    def _check_shapes(layer: Any, key_states: torch.Tensor) -> None:
        """Refuse, before anything is written, keys of another batch size (a new batch in a used cache) or of another
        number of KV heads or head size (another model's) than the first layer, ``layer``, holds."""
        if not layer.is_initialized:
            return
        held = layer.keys  # [B, slots, D] in a budgeted layer, [B, H_kv, T, D] in transformers' own
        heads = layer.num_kv_heads if isinstance(layer, BudgetLayer) else held.shape[1]
        if key_states.shape[0] != held.shape[0]:
            raise ValueError(
                f"this BudgetCache holds {held.shape[0]} sequences and the forward brings {key_states.shape[0]}: call "
                "cache.reset() (or make a new BudgetCache) before another batch"
            )
        if key_states.shape[1] != heads or key_states.shape[-1] != held.shape[-1]:
            raise ValueError(
                f"layer 0 of this BudgetCache holds {heads} KV heads of {held.shape[-1]} dimensions and this "
                f"forward brings {key_states.shape[1]} of {key_states.shape[-1]}: build a cache from each model's own config"
            )

    # ------------------------------------------------------------------ bookkeeping used by BudgetLayer
    def check_forward(self) -> None:
        """Refuse a forward (at layer 0's update) while the previous one stopped part-way: an exception or an
        interrupt inside the model left some layers with its tokens and the others without (and a layer's eviction
        deferred to the next layer, ``BudgetLayer._defer``, undone). Until ``reset()`` a forward would append to
        layers that disagree on what they have seen, and give wrong outputs without an error (or fail on shapes)."""
        if self._pending_layer is None and self._forward_at is None:
            return
        if self._pending_layer is not None:
            raise RuntimeError(
                f"layer {self._pending_layer} stored keys in this BudgetCache and its attention did not run: either the "
                "model's attention is not 'kvgates' (call model.set_attn_implementation('kvgates'); kvgates.load_model "
                "does it for you), or the previous forward stopped there (an exception or an interrupt: call "
                "cache.reset(), or make a new BudgetCache)"
            )
        where = "in layer 0" if self._forward_at < 0 else f"after layer {self._forward_at}"
        raise RuntimeError(
            f"the previous forward through this BudgetCache stopped part-way ({where} of layers 0-{len(self.layers) - 1}; "
            "an exception or an interrupt inside the model, or a model with fewer layers than the config the cache was "
            "built from), so its layers hold different tokens; call cache.reset() (or make a new BudgetCache from the "
            "model's own config) and give the prompt again"
        )

    def layer_done(self, layer_idx: int) -> None:
        """Record that layer ``layer_idx`` holds the forward's tokens (``check_forward``'s evidence): the forward has
        ended at the last layer."""
        self._forward_at = None if layer_idx == len(self.layers) - 1 else layer_idx

    def __deepcopy__(self, memo: dict) -> BudgetCache:
        """A copy holding copies of every layer's tokens and state, running the same policy object (not a copy): a
        policy keeps its values per layer under its identity, and a learned or scoring policy is attached to the
        model (its hooks feed the policy object), so the copy continues exactly as the original would (a prompt
        cache copied for several continuations)."""
        memo[id(self.policy)] = self.policy
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        self.policy.cache_copied(self, twin)
        return twin

    def reset(self) -> None:
        """Empty every layer, and forget a forward that stopped part-way (``check_forward``) and whether a new turn was
        warned of (``several_after_decoding``: the reset cache holds another conversation)."""
        super().reset()
        self._pending_layer = self._forward_at = self._real = None
        self._said_turn = False

    def reorder_cache(self, beam_idx: torch.LongTensor | Sequence[int]) -> None:
        """``Cache.reorder_cache`` (beam search), applied too to what the policy keeps per sequence outside the cache
        (``Policy.cache_batch_selected``: KVzip's prompt seen). ``beam_idx`` may be a sequence of ints."""
        beam_idx = torch.as_tensor(beam_idx)  # (a list failed in the first budgeted layer)
        super().reorder_cache(beam_idx)
        self.policy.cache_batch_selected(self, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``Cache.batch_repeat_interleave``, applied too to what the policy keeps per sequence outside the cache."""
        super().batch_repeat_interleave(repeats)
        self.policy.cache_batch_selected(self, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor | Sequence[int]) -> None:
        """``Cache.batch_select_indices``, applied too to what the policy keeps per sequence outside the cache.
        ``indices`` may be a sequence of ints."""
        indices = torch.as_tensor(indices)  # (a list failed in the first budgeted layer)
        super().batch_select_indices(indices)
        self.policy.cache_batch_selected(self, lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        """Refused (``BudgetLayer.crop``) before any layer changes: transformers' ``Cache.crop`` crops layer by layer,
        so a model's sliding-window layers (Gemma-3's first) were cropped before a budgeted one refused, or refused
        first with transformers' own advice (``activate_past_recording``), which cannot make this cache croppable."""
        self.budget_layers[0].crop(tokens_to_remove)

    def activate_past_recording(self) -> None:
        """Refused as ``crop`` is: generate()'s assisted decoding and prompt lookup call it before their first forward,
        to crop the cache after it; the refusal came from that crop, after a verification forward had prefilled the
        prompt and the drafts."""
        raise NotImplementedError(NOT_CROPPABLE)

    def several_after_decoding(self, n: int) -> None:
        """Warn, once per conversation (a cache's first, and again after ``reset()``), of a call of ``n`` tokens after
        decoding began under a policy that evicts only its prompt: the runtime takes such a call for decode steps
        (speculative verification), so a new user turn is kept whole, past the budget, where a user expects it
        compressed (``BudgetLayer.phase``)."""
        if self._said_turn or not self.policy.prompt_only:
            return
        self._said_turn = True
        warnings.warn(
            f"{n} tokens given after decoding began are taken as decode steps, which {self.policy.name} appends "
            "without evicting: a new turn of a conversation is kept whole, past the budget; to compress it, give the "
            "conversation so far as the prompt of a new cache (cache.reset())",
            stacklevel=2,
        )

    def claim_pending(self, layer_idx: int) -> None:
        """Record that ``layer_idx`` staged tokens; a previous layer's unconsumed tokens mean a wrong attention."""
        if self._pending_layer is not None:
            raise RuntimeError(
                f"layer {self._pending_layer} stored keys in a BudgetCache but its attention did not run through "
                "kvgates; call model.set_attn_implementation('kvgates') (kvgates.load_model does it for you)"
            )
        self._pending_layer = layer_idx

    def release_pending(self) -> None:
        """The staged tokens were consumed by their attention call."""
        self._pending_layer = None

    def real_queries(
        self, attention_mask: torch.Tensor, where: tuple[Any, ...], read: Callable[[], tuple[torch.Tensor, bool]]
    ) -> tuple[torch.Tensor, bool]:
        """``read()``: which of a forward's new tokens are real under ``attention_mask`` and whether all are (a read
        back), computed once for the layers of a forward that get the same mask object, unchanged, at the same
        ``where`` (tokens seen before, batch, new tokens, device); ``read()`` again otherwise. (A forward's 4-D mask
        is one object every layer of an attention type gets; ``device_map`` moves it, a copy, to a layer on another
        device.)"""
        key = (*where, None if attention_mask.is_inference() else attention_mask._version)  # (no counter in inference mode)
        if self._real is not None and self._real[0]() is attention_mask and self._real[1] == key:
            return self._real[2]
        answer = read()
        self._real = (weakref.ref(attention_mask), key, answer)
        return answer

    # ------------------------------------------------------------------ views for policies and reports
    @property
    def budget_layers(self) -> list[BudgetLayer]:
        return [self.layers[i] for i in self.budget_layer_ids]

    @property
    def num_budget_layers(self) -> int:
        return len(self.budget_layer_ids)

    def kv_bytes(self) -> int:
        """Bytes of key/value storage allocated by every layer (budgeted and passthrough): held tokens plus the
        free slots kept for the next ones."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, BudgetLayer):
                total += layer.kv_bytes()
            else:
                total += _passthrough_bytes(layer)
        return total

    def held_bytes(self) -> int:
        """Bytes of key/value storage holding tokens (budgeted layers' valid slots, passthrough layers' tokens)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, BudgetLayer):
                if layer.is_initialized:
                    per_slot = (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
                    total += int(layer.held().sum()) * per_slot
            else:
                total += _passthrough_bytes(layer)
        return total

    def full_bytes(self) -> int:
        """Bytes of key/value storage a cache that evicts nothing would hold after what this one has seen: every token
        seen (padding included) in each budgeted layer and KV head, plus the passthrough layers' own tokens (a
        sliding-window layer holds the same either way). ``held_bytes() / full_bytes()`` is the share of a full
        cache's memory held."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, BudgetLayer):
                if layer.is_initialized:
                    per_token = (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
                    total += layer.batch_size * layer.num_kv_heads * layer.get_seq_length() * per_token
            else:
                total += _passthrough_bytes(layer)
        return total

    def held_tokens(self) -> torch.Tensor:
        """``[num_budget_layers, B, H_kv]`` tokens currently held by each budgeted layer and head (on the first
        budgeted layer's device, when ``device_map`` spread the layers over several); ``B`` is 0 before the first
        forward (and after ``reset()``)."""
        layers = [layer for layer in self.budget_layers if layer.is_initialized]
        if not layers:
            return torch.zeros((self.num_budget_layers, 0, self.config.num_key_value_heads), dtype=torch.long)
        none = torch.zeros_like(layers[0].held())  # a layer the forward has not reached (it stopped part-way) holds nothing
        return torch.stack([layer.held().to(none.device) if layer.is_initialized else none for layer in self.budget_layers])

    def __repr__(self) -> str:
        return f"BudgetCache(policy={self.policy!r}, layers={len(self.layers)})"



def _passthrough_bytes(layer: Any) -> int:
    """Key and value bytes a layer kvgates leaves to transformers (a sliding-window layer) holds: all it allocates."""
    if getattr(layer, "is_initialized", False) and layer.keys is not None:
        return layer.keys.numel() * layer.keys.element_size() * 2
    return 0

def check_static(policy: CachePolicy, decode_slots: int) -> None:
    """Raise when ``policy`` cannot run in a static cache with ``decode_slots`` (one sentence saying why)."""
    if not policy.sync_free_decode:
        raise ValueError(
            f"{policy.name} cannot run in a static BudgetCache: its decode step needs host syncs or changes storage "
            "shapes (ragged heads, budgets across layers at every step, or not examined); use static=False"
        )
    if decode_slots < 0:
        raise ValueError(f"decode_slots must be >= 0, got {decode_slots}")
    if not policy.schedule.decode_every and decode_slots < 1:
        raise ValueError(
            f"{policy.name} evicts only the prompt, so a static cache needs decode_slots (the tokens it may decode)"
        )


def dynamic_cache_bytes(cache: Cache) -> int:
    """Bytes of key/value storage held by a transformers cache (for full-cache comparisons)."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total
