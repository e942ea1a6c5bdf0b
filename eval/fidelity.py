"""How closely a budgeted cache follows the full cache, measured on the inference path (hard eviction).

Every metric runs the policy through ``kvgates.BudgetCache`` exactly as generation does: the prompt is prefilled
(evicting at the end of each chunk), then the completion is fed one token at a time (a decode step each, with the
policy's decode-time evictions). The full-cache reference is one plain forward over prompt and completion,
computed once per example and shared by every arm.

Examples run as a batch (decoding is bound by reading the weights, so a batch of 8 costs little more than one
sequence): prompts are left-padded to a common end, completions right-padded, and padding never takes a cache
slot. Policies give a sequence the same result alone and in a padded batch (a test of every registered policy).

* ``completion_fidelity``: KL(full || policy) of the next-token distributions at each completion token, top-1
  agreement and the KV bytes each sequence holds.
* ``greedy_generate``: the policy's greedy continuations of a batch of prompts (token ids) and the memory held.
* ``stream_nll``: the negative log-likelihood of each token of a text streamed through the budgeted cache in
  chunks (eviction as tokens arrive); ``perplexity`` of it.

Memory is what each sequence really holds at the end: ``held_bytes`` (keys and values of the slots holding a
token) and ``state_bytes`` (the per-slot policy state beside them: cumulative attention, attention-row history,
retention scores ...).

Training validation (``train/``) and the A/B harness use these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates


@dataclass
class Fidelity:
    """Per-position comparison of one policy with the full cache on one example's completion."""

    kl: torch.Tensor  # [n] KL(full || policy) at each completion token
    top1: torch.Tensor  # [n] bool: the policy's most likely next token equals the full cache's
    kv_bytes: int  # KV bytes this sequence held at the end
    state_bytes: int = 0  # per-slot policy state bytes this sequence held at the end

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean())

    @property
    def first_divergence(self) -> int:
        """Index of the first position where the greedy choices differ (``len`` when they never do)."""
        return first_false(self.top1)


@dataclass
class Batch:
    """Prompts left-padded to end at column ``prompt_len``, completions right-padded after it.

    Attributes:
        ids, mask, positions: ``[B, prompt_len + max completion]``; ``positions`` counts real tokens only.
        prompt_len: the common prompt end.
        completion_lens: real completion length of each row.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    prompt_len: int
    completion_lens: list[int]

    @property
    def completion_len(self) -> int:
        return self.ids.shape[1] - self.prompt_len


def first_false(flags: torch.Tensor) -> int:
    """Index of the first False in a 1-D bool tensor, or its length when all are True."""
    bad = (~flags).nonzero()
    return int(bad[0, 0]) if len(bad) else int(flags.numel())


def kl_divergence(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` over the last axis of two log-probability tensors (float32)."""
    ref_logp, logp = ref_logp.float(), logp.float()
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0.0)


def make_batch(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int) -> Batch:
    """Lay out 1-D prompt and completion token tensors as a ``Batch``."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError("need as many completions as prompts, at least one")
    p = max(len(x) for x in prompts)
    n = max(len(x) for x in completions)
    ids = torch.full((len(prompts), p + n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[i, p - len(prompt) : p] = prompt
        ids[i, p : p + len(completion)] = completion
        mask[i, p - len(prompt) : p + len(completion)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids, mask, positions, p, [len(c) for c in completions])


def held_bytes(cache: kvgates.BudgetCache) -> list[int]:
    """KV bytes each sequence of ``cache`` holds in its budgeted layers (tokens held x key and value sizes)."""
    tokens = cache.held_tokens().sum(dim=(0, 2))  # [B]
    layer = cache.budget_layers[0]
    per_token = 2 * layer.head_dim * layer.keys.element_size()
    return [int(t) * per_token for t in tokens.tolist()]


def state_bytes(cache: kvgates.BudgetCache) -> list[int]:
    """Per-slot policy state bytes each sequence of ``cache`` holds beside its KV (slots holding a token x the
    state a slot carries, summed over budgeted layers); 0 for a policy that keeps no per-slot state."""
    total = None
    for layer in cache.budget_layers:
        per_slot = layer.slot_data.shape[-1] * layer.slot_data.element_size()
        held = layer.held().sum(-1) * per_slot  # [B]
        total = held if total is None else total + held
    return [int(x) for x in total.tolist()]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats) of ``targets`` ``[...]`` under ``logits`` ``[..., V]``, in float32."""
    return -torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def perplexity(nll: torch.Tensor) -> float:
    """``exp`` of the mean negative log-likelihood."""
    return float(torch.exp(nll.float().mean()))


@torch.no_grad()
def reference_logprobs(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Full-cache log-probabilities ``[B, n, V]`` (CPU, float32): row ``j`` predicts completion token ``j``."""
    n = batch.completion_len
    dev = model.device
    logits = model(
        batch.ids.to(dev), attention_mask=batch.mask.to(dev), position_ids=batch.positions.to(dev), use_cache=False,
        logits_to_keep=n + 1,
    ).logits[:, :n]
    return torch.log_softmax(logits.float(), -1).cpu()


@torch.no_grad()
def completion_fidelity(
    model: PreTrainedModel,
    policy: kvgates.Policy,
    batch: Batch,
    reference: torch.Tensor,
    prefill_chunk: int | None = None,
) -> list[Fidelity]:
    """Teacher-force ``policy`` through each row's completion and compare with ``reference`` (``reference_logprobs``).

    The prompt is prefilled (in ``prefill_chunk`` pieces if given; a last piece of one token joins the one before,
    which the cache would take for a decode step), then each completion token is one decode step.
    """
    cache = kvgates.BudgetCache(model.config, policy)
    dev = model.device
    ids, mask, pos = batch.ids.to(dev), batch.mask.to(dev), batch.positions.to(dev)
    p, n = batch.prompt_len, batch.completion_len
    stops = [*range(prefill_chunk or p, p, prefill_chunk or p), p]
    if len(stops) > 1 and stops[-1] - stops[-2] == 1:  # a last piece of one token joins the one before
        del stops[-2]
    for start, stop in zip([0, *stops], stops):
        logits = model(
            ids[:, start:stop], attention_mask=mask[:, :stop], position_ids=pos[:, start:stop], past_key_values=cache,
            logits_to_keep=1,
        ).logits
    kls, top1 = [], []
    for j in range(n):
        logp = torch.log_softmax(logits[:, -1].float(), -1).cpu()
        kls.append(kl_divergence(reference[:, j], logp))
        top1.append(reference[:, j].argmax(-1) == logp.argmax(-1))
        if j + 1 < n:
            col = p + j
            logits = model(
                ids[:, col : col + 1], attention_mask=mask[:, : col + 1], position_ids=pos[:, col : col + 1],
                past_key_values=cache,
            ).logits
    kl, agree = torch.stack(kls, 1), torch.stack(top1, 1)
    held, state = held_bytes(cache), state_bytes(cache)
    return [Fidelity(kl[i, :m], agree[i, :m], held[i], state[i]) for i, m in enumerate(batch.completion_lens)]


@dataclass
class Generation:
    """Greedy continuations of a batch: ``tokens`` (each row's new token ids) and what each sequence held."""

    tokens: list[list[int]]
    kv_bytes: list[int]
    state_bytes: list[int]


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    policy: kvgates.Policy,
    prompts: list[torch.Tensor],
    max_new_tokens: int = 8,
    prefill_chunk: int | None = None,
    min_new_tokens: int = 0,
) -> Generation:
    """Greedy continuations of 1-D prompt tensors under ``policy`` (padding after an end of sequence dropped);
    ``min_new_tokens = max_new_tokens`` makes every row exactly that long."""
    batch = make_batch(prompts, [torch.zeros(0, dtype=torch.long)] * len(prompts), tokenizer.pad_token_id)
    cache = kvgates.BudgetCache(model.config, policy)
    out = model.generate(
        batch.ids.to(model.device),
        attention_mask=batch.mask.to(model.device),
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None,
        do_sample=False,
        prefill_chunk_size=prefill_chunk,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokens = []
    for row in out[:, batch.prompt_len :].tolist():
        stop = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        tokens.append(row[:stop])
    return Generation(tokens, held_bytes(cache), state_bytes(cache))


@torch.no_grad()
def stream_nll(model: PreTrainedModel, policy: kvgates.Policy, ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Stream ``ids`` ``[B, T]`` (rows of equal length) through a cache of ``policy`` ``chunk`` tokens at a time,
    evicting after each chunk as a long generation would.

    Returns ``(nll [B, T - 1], KV bytes held per row, state bytes held per row)``: ``nll[:, t]`` is the negative
    log-likelihood of token ``t + 1`` given what the cache held when it was predicted.
    """
    cache = kvgates.BudgetCache(model.config, policy)
    dev = model.device
    ids = ids.to(dev)
    nll = []
    for start in range(0, ids.shape[1] - 1, chunk):
        stop = min(start + chunk, ids.shape[1] - 1)
        logits = model(ids[:, start:stop], past_key_values=cache).logits
        nll.append(token_nll(logits, ids[:, start + 1 : stop + 1]).cpu())
    return torch.cat(nll, 1), held_bytes(cache), state_bytes(cache)


def split_prompt(input_ids: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A training row (``labels`` = -100 on the prompt) as 1-D ``(prompt_ids, completion_ids)``."""
    p = next((i for i, y in enumerate(labels) if y != -100), len(labels))
    if p == 0 or p == len(labels):
        raise ValueError("a row needs a non-empty prompt and a non-empty completion")
    return torch.tensor(input_ids[:p]), torch.tensor(input_ids[p:])
