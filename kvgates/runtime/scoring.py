"""Scoring passes: extra forwards of the same model through the same cache after a prompt, which only produce
attention statistics and whose tokens are then discarded (KVzip's context reconstruction).

A policy that scores the prompt this way evicts nothing at the end of a prompt forward by itself (its ``schedule`` is
``NEVER``, as KVzip's). ``PromptScoring`` hooks the model instance the policy is attached to: after each prompt forward through
a ``BudgetCache`` running the policy (alone or inside a wrapper such as Ada-KV) it hands the policy the prompt's
token ids, the policy runs its scoring forwards with ``discarded_forward``, and ``enforce_prompt`` then evicts every
budgeted layer through the runtime's one eviction path. Everything that prefills through ``model(...)`` or
``model.generate(...)`` with an attached policy gets this, with no code of its own: the command line, the A/B
runner, the held-out table. The prompt's own outputs (its logits, the first generated token) are those of the full
prompt, as for every other prompt-compression policy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvgates.errors import UnsupportedModelError
from kvgates.runtime.cache import BUDGETED_LAYER_TYPES, BudgetCache, layer_kinds
from kvgates.runtime.dispatch import EAGER_ONLY, real_tokens
from kvgates.runtime.stats import AttnStats, Phase
from kvgates.runtime.storage import KeptCounts

#: ``run(model, cache, ids, mask, positions)``: a policy's scoring forwards over the prompt ``ids`` ``[B, T]`` (``mask``:
#: 1 for real tokens; ``positions``: where the prompt forwards placed each token) that the cache holds.
ScoringRun = Callable[[torch.nn.Module, BudgetCache, torch.Tensor, torch.Tensor, torch.Tensor], None]


def forward_cache(kwargs: dict) -> Any:
    """The cache a model forward was called with, from a forward pre-hook's ``kwargs`` (transformers 5.24 renamed
    ``past_key_values`` to ``cache``)."""
    return kwargs.get("past_key_values", kwargs.get("cache"))


def runs_policy(cache: Any, policy: Any) -> bool:
    """Whether ``cache`` is a ``BudgetCache`` running ``policy``, itself or inside wrappers (``inner``)."""
    current = getattr(cache, "policy", None) if isinstance(cache, BudgetCache) else None
    while current is not None:
        if current is policy:
            return True
        current = getattr(current, "inner", None)
    return False


SCORING_NEEDS_BUDGETED_LAYERS = (
    "scoring forwards need every cache layer to be budgeted: they would change the model's sliding-window layers, "
    "which cannot drop tokens again"
)


def discarded_forward(model: torch.nn.Module, cache: BudgetCache, context_mask: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Run ``ids`` ``[B, n]`` (``mask``: 1 for real tokens, padding anywhere) after what ``cache`` holds, then drop
    every token they added, so that the cache holds exactly what it held before, statistics recorded by the policy
    aside.

    ``context_mask`` ``[B, seen]`` is the attention mask of everything the cache has seen; each row's new tokens take
    the positions after every position the cache holds for it, wherever the prompt put its tokens (a left-padded row
    given without ``position_ids`` holds them after its padding), so that the tokens dropped are theirs alone. The
    policy must not evict during such a forward (a scoring policy's ``schedule`` is ``NEVER``: it evicts nothing at
    the end of a prompt forward). Only the last position's logits are computed.
    """
    _check_unsettled(cache)
    if len(cache.budget_layer_ids) != len(cache.layers):
        raise UnsupportedModelError(SCORING_NEEDS_BUDGETED_LAYERS)
    layers = cache.budget_layers
    seen = [layer.seen for layer in layers]
    # What each layer keeps is what it holds now: where every head of every sequence holds as many tokens, the host
    # knows it, and dropping the forward's tokens reads nothing back (a read a layer and forward drained a GPU's queue).
    kept = [layer.fill[0] if layer.packed and len(set(layer.fill)) == 1 else None for layer in layers]
    context_mask = context_mask.to(ids.device).long()
    last = torch.full((ids.shape[0],), -1, dtype=torch.long, device=ids.device)  # each row's last position held
    for layer in layers:
        if layer.pos.shape[-1]:
            last = torch.maximum(last, layer.pos.flatten(1).amax(1).to(ids.device))
    start = last[:, None] + 1  # on the device: no read-back
    positions = start + (mask.long().cumsum(1) - 1).clamp(min=0)
    model(
        input_ids=ids,
        attention_mask=torch.cat([context_mask, mask.long()], dim=1),
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    slack = cache.policy.schedule.slack
    for layer, before, held in zip(layers, seen, kept):
        counts = None if held is None else KeptCounts([held] * layer.num_kv_heads, [held] * layer.num_kv_heads, [ids.shape[1]] * layer.num_kv_heads)
        layer.evict(layer.valid & (layer.pos < start[:, :, None].to(layer.device)), slack=slack, counts=counts)
        layer.seen = before


def _check_unsettled(cache: BudgetCache) -> None:
    """Refuse scoring forwards in a static cache whose layout is settled (they add and drop tokens)."""
    if any(layer.static for layer in cache.budget_layers):
        raise ValueError(
            "scoring forwards add and drop tokens, which a static BudgetCache cannot once its layout is settled (a "
            "prompt given in several forwards); use static=False"
        )


def enforce_prompt(cache: BudgetCache) -> None:
    """Bring every budgeted layer within the policy's budget, as the end of a prompt forward does."""
    for layer in cache.budget_layers:
        empty = torch.zeros((layer.batch_size, layer.num_kv_heads, 0), dtype=torch.long, device=layer.device)
        layer.enforce(AttnStats(phase=Phase.PREFILL, new_slots=empty))


class SeenPrompts:
    """What each ``BudgetCache`` running a scoring policy has seen of its prompt, ``(ids, mask, positions)`` ``[B, seen]``
    (held weakly by cache): the prompt its scoring forwards reconstruct. The policy keeps it, not its hooks
    (``PromptScoring``), so that it outlives ``detach()``: a cache filled by one attachment and given its next prompt
    chunk under another (``with policy.attach(model):`` around each call) is scored with everything it has seen."""

    def __init__(self) -> None:
        self._by_cache: weakref.WeakKeyDictionary[BudgetCache, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()

    def __getitem__(self, cache: BudgetCache) -> tuple[torch.Tensor, ...]:
        return self._by_cache[cache]

    def extend(self, cache: BudgetCache, new: tuple[torch.Tensor, ...]) -> None:
        """Append ``new`` ``(ids, mask, positions)`` ``[B, n]`` to what ``cache`` has seen."""
        seen = self._by_cache.get(cache, [t[:, :0] for t in new])
        self._by_cache[cache] = tuple(torch.cat([before, t], 1) for before, t in zip(seen, new))

    def forget(self, cache: BudgetCache) -> None:
        """``cache`` begins a new prompt (a fresh or reset cache): what an earlier one gave is not part of it."""
        self._by_cache.pop(cache, None)

    def copied(self, cache: BudgetCache, twin: BudgetCache) -> None:
        """Give ``twin``, a copy of ``cache`` (``BudgetCache.__deepcopy__``), the prompt ``cache`` has seen, so that a
        prompt chunk after the copy is scored with everything before it, as in the original."""
        if cache in self._by_cache:
            self._by_cache[twin] = tuple(t.clone() for t in self._by_cache[cache])

    def batch_selected(self, cache: BudgetCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reorder, repeat or select the sequences of the prompt ``cache`` has seen as ``fn`` did the cache's
        (``BudgetCache.reorder_cache`` ...), so that a prompt chunk after it is scored with each sequence's own prompt:
        the prompt kept its old batch, and the chunk's concatenation to it failed (or, reordered, each sequence's
        scoring forwards reconstructed another's earlier chunks)."""
        if cache in self._by_cache:
            self._by_cache[cache] = tuple(fn(t) for t in self._by_cache[cache])


class PromptScoring:
    """Hooks on one model instance that run ``run`` after each prompt forward through a ``BudgetCache`` running
    ``policy``, over the prompt the cache has seen (kept in ``prompts``, the policy's), then evict (``enforce_prompt``);
    removed with ``remove()``.

    A prompt given in several forwards (chunked prefill) is scored after each one over everything it has seen so
    far, and evicted each time, as other policies evict at the end of every prompt chunk.
    """

    def __init__(self, model: torch.nn.Module, policy: Any, run: ScoringRun, prompts: SeenPrompts):
        """Refuses a model with layers kvgates leaves to transformers (``discarded_forward`` could not drop their
        tokens) before any forward."""
        layer_types, _ = layer_kinds(model.config.get_text_config(decoder=True))
        if any(kind not in BUDGETED_LAYER_TYPES for kind in layer_types):
            raise UnsupportedModelError(f"{policy.name}: {SCORING_NEEDS_BUDGETED_LAYERS}")
        self.model, self.policy, self.run, self.prompts = model, policy, run, prompts
        self._current: BudgetCache | None = None
        self._busy = False
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def prompting(self, cache: BudgetCache) -> bool:
        """Whether a prompt forward of the hooked model through ``cache`` is in progress (not a forward of another
        model instance, nor of this one that stopped part-way)."""
        return self._current is cache

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._current = None
        cache = forward_cache(kwargs)
        if self._busy or not runs_policy(cache, self.policy):
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError(f"{self.policy.name} needs the prompt's token ids (input_ids), not inputs_embeds")
        layer = cache.budget_layers[0]
        if layer.static and ids.shape[1] == 1:  # a static decode step (said first: a test of ``seen`` in a compiled step made
            return  # it compile again for every prompt length)
        if layer.seen and (ids.shape[1] == 1 or layer.decoding):  # a decode step (BudgetLayer.phase)
            return
        if layer.is_initialized and ids.shape[0] != layer.batch_size:  # refused by the cache's first update
            return
        _check_unsettled(cache)  # before the prompt forward writes anything
        n = ids.shape[1]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # generate()'s for a compileable cache of a config listing layer types (Qwen2, Qwen3):
            mask = next(iter(mask.values()))  # one per type, each with a token's own column masked iff it is padding
        if mask is None:
            mask = torch.ones_like(ids)
        elif mask.dim() == 4:  # what generate() gives a compileable (static) cache
            mask = real_tokens(mask, layer.seen, n).to(ids.device).expand(ids.shape[0], n).long()
        else:
            mask = mask[:, -n:].to(ids.device).long()
        positions = kwargs.get("position_ids")
        if positions is not None and positions.dim() > 2:  # before the prompt forward writes anything
            raise UnsupportedModelError(
                f"{self.policy.name}: {type(module).__name__} is given position_ids of shape {list(positions.shape)}, several "
                f"positions per token (multimodal RoPE, as Qwen2-VL's generate passes), and {self.policy.name}'s scoring forwards "
                "place each token at one position; use a text-only model"
            )
        if positions is None:  # transformers' own: after every token the cache has seen, padding included
            positions = torch.arange(n, device=ids.device) + layer.seen
        positions = positions.to(ids.device).long().reshape(-1, n).expand(ids.shape[0], n)
        if not layer.seen:
            self.prompts.forget(cache)
        self.prompts.extend(cache, (ids, mask, positions))
        self._current = cache

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache, self._current = self._current, None
        if cache is not None:
            self._score(cache)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _score(self, cache: BudgetCache) -> None:
        """The scoring forwards over the prompt ``cache`` has seen, then its eviction (and a static layout), eagerly
        inside ``torch.compile`` too (``generate()`` compiles the forwards of its chunked prefill)."""
        self._busy = True
        try:
            self.run(self.model, cache, *self.prompts[cache])
        finally:
            self._busy = False
        enforce_prompt(cache)
        if cache.static:  # the layout its decode steps compile for, now that the prompt is evicted
            for layer in cache.budget_layers:
                layer.settle_static()
