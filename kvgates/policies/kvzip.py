"""KVzip: prompt compression scored by how much the model attends to each token when asked to repeat the prompt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from kvgates.gates.capture import GateCapture, attention_modules
from kvgates.policies.base import NEVER, Policy, register_policy
from kvgates.policies.selection import sink_mask
from kvgates.runtime.scoring import PromptScoring, SeenPrompts, discarded_forward
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase, StatsRequest
from kvgates.runtime.storage import POS_BIG

SCORE = "kvzip"
#: The paper's repeat prompt (``KVzip.repeat_prompt``'s default).
REPEAT_PROMPT = "Repeat the previous context:"


@register_policy
@dataclass
class KVzip(Policy):
    """KVzip (Kim et al. 2025, arXiv:2505.23416): query-agnostic prompt compression by context reconstruction.

    After the prompt is in the cache, the same frozen model is fed, teacher-forced, the repeat prompt followed by the
    prompt itself, in chunks of ``chunk_size`` prompt tokens (one forward per chunk: repeat prompt + chunk; each
    forward's tokens are discarded afterwards). A prompt token's score is the largest attention probability it
    receives from any query of its own chunk's forward, maxed over the query heads of its GQA group. Each KV head of
    each layer then keeps its ``sinks`` first tokens plus the best-scoring others, ``budget`` in all. Decode appends.

    The forwards run through the runtime (``kvgates.runtime.scoring``): the policy must be attached to the model
    (``policy.attach(model)``, which every kvgates caller does). The cost: one more forward as long as the prompt
    plus the repeat prompts, whose queries attend over the whole prompt; the maxima are taken over the slots of the
    prompt chunk being reconstructed only (on the CPU from the flash kernel's log-sum-exps, elsewhere from every
    probability; measured against a plain prefill in docs/results.md; kvpress states 2-3x).

    How it departs from the paper and from kvpress's ``KVzipPress`` (0.5.5):

    * Budget: ``budget`` tokens per KV head and layer, like every kvgates policy (wrap it in Ada-KV for head-wise
      budgets). The paper and kvpress rank scores across all heads and, by default, all layers (non-uniform).
    * Softmax: a reconstruction query's probabilities are over everything it sees (the whole cache and the preceding
      reconstruction tokens), as the model computes them. kvpress (like the authors' code) recomputes them over the
      sinks, the chunk being reconstructed and the reconstruction tokens only.
    * Inputs: the repeat prompt is ``repeat_prompt`` (the paper's "Repeat the previous context:") and then the chunk, with no
      chat-template turn around them and no carry-over of the previous chunk's last tokens; kvpress wraps the
      prompt in the chat template's assistant header and, from the second chunk, repeats "starting with" the
      previous chunk's last 8 tokens. The whole prompt (chat template and question included) is the context.
    * Prefill in chunks (``prefill_chunk``): the context seen so far is scored and evicted after every prompt chunk,
      as kvgates' other prompt policies do; the paper prefills the whole context first.

    Args:
        budget: tokens kept per KV head.
        chunk_size: prompt tokens reconstructed per scoring forward (default 2048, as the paper and kvpress).
        sinks: first tokens always kept (default 4, as kvpress).
        normalize: KVzip+ (the KVzap paper; kvpress's ``kvzip_plus_normalization``): a probability ``p_ij`` counts
            as ``p_ij ||W_O^g v_j|| / ||h_i||``, with ``h_i`` the (normed) hidden state entering the attention of
            reconstruction query ``i`` and ``W_O^g`` the output projection of query head ``g``: how much token ``j``
            moves the residual stream relative to its size.
        repeat_prompt: the repeat prompt, encoded with the model's own tokenizer (``kvgates.models.tokenizer_source``) when
            the policy is attached.
        repeat_ids: the repeat prompt's token ids, in place of ``repeat_prompt`` (not both).
    """

    name = "kvzip"
    schedule = NEVER  # the scoring pass evicts (kvgates.runtime.scoring), not the end of a prompt forward
    sync_free_decode = True  # decode appends; a static layout settles after the scoring forwards
    prompt_only = True  # the scoring pass evicts the prompt; decode appends (a new turn too)

    chunk_size: int = 2048
    sinks: int = 4
    repeat_prompt: str = REPEAT_PROMPT
    repeat_ids: list[int] | None = None
    normalize: bool = False
    _hooks: PromptScoring | None = field(default=None, init=False, repr=False)
    _seen: SeenPrompts = field(default_factory=SeenPrompts, init=False, repr=False, compare=False)
    _prompt: torch.Tensor | None = field(default=None, init=False, repr=False)
    _hidden: GateCapture | None = field(default=None, init=False, repr=False)
    _gram: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _chunk: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(1, "chunk_size")
        self._at_least(0, "sinks")
        self._require_budget(self.sinks, f"sinks={self.sinks}")
        if self.repeat_ids is not None and (
            not isinstance(self.repeat_ids, (list, tuple)) or not self.repeat_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.repeat_ids)
        ):
            raise ValueError(f"{self.name}: repeat_ids must be a non-empty list of token ids (whole numbers >= 0), got {self.repeat_ids!r}")
        if not self.repeat_ids and not self.repeat_prompt:
            raise ValueError(f"{self.name}: the repeat prompt is empty; give a repeat_prompt or repeat_ids")
        if self.repeat_ids is not None and self.repeat_prompt != REPEAT_PROMPT:
            raise ValueError(f"{self.name}: give repeat_prompt or repeat_ids, not both (repeat_ids replaces the prompt's text)")

    # -- lifecycle: the scoring pass needs the model
    def attach(self, model: Any) -> KVzip:
        if model.get_output_embeddings() is None:
            raise ValueError(
                f"{self.name}: attach it to the model with the language-modelling head ({type(model).__name__} has none; "
                "a ...ForCausalLM, whose forward the prompt goes through)"
            )
        self.detach()
        self._prompt = torch.tensor(self._repeat(model), dtype=torch.long)
        self._hooks = PromptScoring(model, self, self.reconstruct, self._seen)
        if self.normalize:  # KVzip+: the hidden state entering each attention (during the scoring forwards), each head's W_O
            modules = attention_modules(model)
            self._hidden = GateCapture(model, "hidden", sorted(modules), when=lambda: self._chunk is not None)
            for idx, module in modules.items():
                heads = module.config.num_attention_heads
                w = module.o_proj.weight.detach().float().view(-1, heads, module.head_dim).transpose(0, 1)  # [H, hidden, D]
                self._gram[idx] = w.transpose(1, 2) @ w  # W_h^T W_h: ||W_h v||^2 = v^T (W_h^T W_h) v
        return self

    def detach(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._hidden is not None:
            self._hidden.remove()
            self._hidden = None
        self._gram = {}

    def scoring_reach(self, model: Any, prompt_tokens: int) -> int:
        """The repeat prompt and a chunk of up to ``chunk_size`` prompt tokens follow the prompt in each scoring forward."""
        return len(self._repeat(model)) + min(self.chunk_size, prompt_tokens)

    def _repeat(self, model: Any) -> list[int]:
        """The repeat prompt's token ids: ``repeat_ids`` (each below ``model``'s vocabulary size, or a ValueError), else
        ``repeat_prompt`` in ``model``'s tokenizer."""
        if self.repeat_ids is None:
            return _encode(model, self.repeat_prompt)
        vocab = model.get_input_embeddings().num_embeddings
        beyond = [i for i in self.repeat_ids if i >= vocab]
        if beyond:  # the embedding's IndexError in the first scoring forward otherwise
            raise ValueError(f"{self.name}: repeat_ids holds {beyond[0]}, not a token id of this model (its vocabulary has {vocab})")
        return self.repeat_ids

    # -- what the runtime asks
    def stats_request(self, phase: Phase) -> StatsRequest:
        if self._hooks is None:
            raise ValueError(
                f"{self.name} scores the prompt with extra forwards of the model: attach it first (policy.attach(model))"
            )
        return StatsRequest(colmax=True, reduce="max") if self._chunk is not None and phase is Phase.PREFILL else NO_STATS

    def slot_state(self) -> dict[str, SlotState]:
        return {SCORE: SlotState()}

    def colmax_weights(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Slots outside the chunk being reconstructed weigh 0: only the chunk's tokens take a score from this
        forward, and the attention need not score the others. KVzip+ (``normalize``): rows weighted by ``1 / ||h_i||``
        (the hidden state entering attention), the chunk's slots by ``||W_O^g v_j||`` per query head ``g``."""
        lo, hi = (t.to(layer.device)[:, None, None] for t in self._chunk)
        g = layer.cache.config.num_attention_heads // layer.num_kv_heads
        mine = ((layer.pos >= lo) & (layer.pos < hi)).repeat_interleave(g, 1).float()  # [B, H, max_slots]
        if not self.normalize:
            return None, mine
        rows = 1.0 / self._hidden.pop(layer.layer_idx).float().norm(dim=-1).clamp(min=1e-12)
        gram = self._gram[layer.layer_idx].to(layer.device)
        cols = []
        for heads, _, values, _ in layer.head_views():
            m = gram[heads.start * g : heads.stop * g].view(heads.stop - heads.start, g, *gram.shape[1:])
            norms = torch.einsum("bkcd,kgde,bkce->bkgc", values.float(), m, values.float()).clamp(min=0).sqrt()
            cols.append(torch.nn.functional.pad(norms.flatten(1, 2), (0, layer.max_slots - norms.shape[-1])))
        return rows.to(layer.device), torch.cat(cols, dim=1) * mine

    def observe(self, layer, stats: AttnStats) -> None:
        if self._chunk is None:
            if stats.phase is Phase.PREFILL and not self._hooks.prompting(layer.cache):
                raise ValueError(
                    f"{self.name}: this prompt goes through a model {self.name} is not attached to (its scoring forwards "
                    "run after a prompt forward of the attached model), so its budget would not be held; attach the "
                    "policy to the model you run (policy.attach(model))"
                )
        elif stats.colmax is not None:  # (0 outside the chunk: ``colmax_weights``)
            layer.state[SCORE] = torch.maximum(layer.state[SCORE], stats.colmax)

    def cache_copied(self, cache, twin) -> None:
        """``twin`` copies ``cache``: it gets the prompt ``cache`` has seen (``SeenPrompts.copied``)."""
        self._seen.copied(cache, twin)

    def cache_batch_selected(self, cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``cache``'s sequences were reordered, repeated or selected: so is the prompt it has seen
        (``SeenPrompts.batch_selected``)."""
        self._seen.batch_selected(cache, fn)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.state[SCORE], sink_mask(layer, self.sinks)

    # -- the scoring pass
    def reconstruct(self, model: torch.nn.Module, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Score the prompt ``ids`` ``[B, T]`` (``mask``: 1 for real tokens) held by ``cache``: one discarded forward
        per chunk of ``chunk_size`` real tokens of each row, the repeat prompt then the chunk. ``positions`` ``[B, T]``
        are where the prompt forwards placed the tokens, ascending along a row's real tokens (0, 1, ... as ``generate``
        places them; after the padding without ``position_ids``)."""
        for layer in cache.budget_layers:
            layer.state[SCORE] = torch.zeros_like(layer.state[SCORE])
        rows = [row[m.bool()] for row, m in zip(ids, mask.to(ids.device))]
        longest = max(len(r) for r in rows)
        prompt = self._prompt.to(ids.device)
        real = mask.to(ids.device).bool()
        rank = real.long().cumsum(1) - 1  # each real token's index among its row's
        positions = positions.to(ids.device)
        try:
            for lo in range(0, longest, self.chunk_size):
                parts = [torch.cat([prompt, r[lo : lo + self.chunk_size]]) if lo < len(r) else r[:0] for r in rows]
                width = max(len(p) for p in parts)
                chunk_ids = torch.zeros((len(rows), width), dtype=ids.dtype, device=ids.device)
                chunk_mask = torch.zeros_like(chunk_ids)
                for i, part in enumerate(parts):
                    chunk_ids[i, : len(part)], chunk_mask[i, : len(part)] = part, 1
                # The positions of each row's chunk, found on the device (moved from the host a layer, each copy from
                # pageable memory made a GPU's host wait for the stream); a row with none past ``lo``: an empty range.
                ours = real & (rank >= lo) & (rank < lo + self.chunk_size)
                self._chunk = (torch.where(ours, positions, POS_BIG).amin(1), torch.where(ours, positions + 1, 0).amax(1))
                discarded_forward(model, cache, mask, chunk_ids, chunk_mask)
        finally:
            self._chunk = None
            if self._hidden is not None:  # what a forward that stopped part-way captured
                self._hidden.inputs.clear()


def _encode(model: Any, text: str) -> list[int]:
    """``text``'s token ids with ``model``'s own tokenizer (no special tokens), loaded offline."""
    from kvgates.models import tokenizer_source

    return list(_encode_with(tokenizer_source(model), text))


@lru_cache(maxsize=16)
def _encode_with(source: str | None, text: str) -> tuple[int, ...]:
    """``_encode`` by tokenizer source, kept: the repeat prompt is encoded for the context checks
    (``KVzip.scoring_reach``) and again when the policy is attached, without loading the tokenizer twice."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"kvzip: cannot load the tokenizer of {source or 'this model'!r} to encode its repeat prompt ({err}); "
            "pass repeat_ids"
        ) from err
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def kvzip_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
    """KVzip's importance of every token of ``input_ids`` ``[B, T]``: ``[L, B, H_kv, T]`` float32 over the model's
    ``L`` budgeted layers, per KV head (0 at padding), as ``KVzip`` (with ``params``: ``chunk_size``, ``repeat_ids``
    ...) scores a prompt before it evicts; nothing is evicted here. A training label (KVzap regresses on it) and the
    scores a KVzip teacher ranks by. ``model`` must be prepared for kvgates (``kvgates.load_model`` does it)."""
    from kvgates.runtime.cache import BudgetCache

    if "budget" in params:
        raise ValueError("kvzip_scores scores every token and evicts none: it takes no budget")
    length = input_ids.shape[1]
    positions = None if attention_mask is None else (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    policy = KVzip(budget=max(length, params.get("sinks", 4) + 1), **params).attach(model)
    cache = BudgetCache(model.config, policy)
    try:
        with torch.no_grad():
            model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1,
            )
    finally:
        policy.detach()
    # Column t of a row holds the token at position positions[t] (padding: the zero past the last position).
    column = torch.arange(length)[None] if positions is None else torch.where(attention_mask.bool(), positions, length)
    out = []
    for layer in cache.budget_layers:
        by_position = torch.zeros((*layer.pos.shape[:2], length + 1), dtype=torch.float32, device=layer.device)
        by_position.scatter_(2, torch.where(layer.valid, layer.pos, length), layer.state[SCORE])
        index = column.to(layer.device)[:, None, :].expand(by_position.shape[0], by_position.shape[1], length)
        out.append(by_position.gather(2, index))
    return torch.stack(out)
