"""The A/B harness's tasks: their examples (deterministic from the run's seed, over the *test* essays, or the
validation essays while a recipe is being developed), how an arm runs a batch of them, and the metrics each result
carries.

Two families:

* **Answer tasks** (``needle``, ``multikey``, ``multivalue``, ``kv``, ``variable_tracking``, ``passkey``,
  ``common_words``; ``data.tasks`` builds them): the arm answers greedily and ``data.tasks.score`` grades the
  answer: ``recall`` (share of the answer reproduced, partial credit) and ``exact`` (binary, for McNemar).
  Haystack tasks put their first statement at evenly spaced depths; each prompt length gets the same depths
  and templates (cycled over the examples), with its own haystacks and values.
* **Reference tasks**, scored against the full cache's own behaviour on test-essay text:
  ``fidelity`` (the full cache generates ``new_tokens`` greedily; each arm is teacher-forced through them after
  its own compressed prompt: mean KL, top-1 agreement, first departure of its greedy choice),
  ``generation`` (each arm generates freely; agreement with the full cache's tokens) and ``perplexity`` (the
  text streamed through the budgeted cache in ``chunk``s, eviction as tokens arrive).

The full cache is an arm like the others and runs first: its results are the references (generated tokens,
log-probabilities) that the budgeted arms of the same batch are compared with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates
from data.tasks import make_example, score, split_ids, template_by_name
from eval.config import TaskSpec
from eval.fidelity import Batch, completion_fidelity, first_false, greedy_generate, make_batch, reference_logprobs, stream_nll


@dataclass(frozen=True)
class Metric:
    """A per-example score. ``binary`` scores (0/1) also get McNemar's test in comparisons."""

    name: str
    higher_is_better: bool
    binary: bool = False
    #: How the report prints the mean (a format spec).
    fmt: str = ".3f"


ANSWER_METRICS = (Metric("recall", True, fmt=".0%"), Metric("exact", True, binary=True, fmt=".0%"))
METRICS: dict[str, tuple[Metric, ...]] = {
    "fidelity": (Metric("kl", False, fmt=".4f"), Metric("top1", True, fmt=".1%"), Metric("first_divergence", True, fmt=".1f")),
    "generation": (Metric("prefix", True, fmt=".1f"), Metric("agreement", True, fmt=".1%"), Metric("identical", True, binary=True, fmt=".0%")),
    "perplexity": (Metric("nll", False, fmt=".4f"), Metric("ppl", False, fmt=".2f")),
}


def metrics_of(task: TaskSpec) -> tuple[Metric, ...]:
    """The task's metrics, the primary one (verdicts, plots) first."""
    return ANSWER_METRICS if task.answer else METRICS[task.task]


def binary_metric(task: TaskSpec) -> Metric | None:
    return next((m for m in metrics_of(task) if m.binary), None)


@dataclass
class Example:
    """One prompt of a task.

    Attributes:
        index: position in the task (part of the journal key).
        prompt: 1-D prompt token ids.
        meta: what the report groups by (``context_tokens``, ``depth``, ``template`` ...).
        source: answer tasks: the ``data.tasks`` example (answers, for scoring).
    """

    index: int
    prompt: torch.Tensor
    meta: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)


def build_examples(task: TaskSpec, tokenizer: PreTrainedTokenizerBase, seed: int, split: str = "test") -> list[Example]:
    """The task's examples from the ``split`` essays, deterministic from ``seed`` (same seed, same examples),
    grouped by prompt length."""
    examples = []
    for li, length in enumerate(task.context_tokens):
        for i in range(task.examples):
            index = li * task.examples + i
            if task.answer:
                examples.append(_answer_example(task, tokenizer, split, seed, index, length, i))
            else:
                examples.append(_text_example(task, tokenizer, split, seed, index, length, i))
    return examples


def _answer_example(task: TaskSpec, tokenizer, split: str, seed: int, index: int, length: int, i: int) -> Example:
    """Example ``i`` of one length: every length gets the same depths and templates (its own haystacks and
    values: ``make_example`` seeds by length too), so adding a length leaves the others' examples unchanged."""
    base = "needle" if task.task == "multikey" else task.task
    name = task.templates[i % len(task.templates)]
    template = template_by_name(base, name)
    depth = None if task.task == "common_words" else (i / (task.examples - 1) if task.examples > 1 else 0.5)
    ex = make_example(
        task.task, tokenizer, split, length, seed=seed * 100_003 + i, template_set=template.set, template=name,
        depth=depth, **task.options,
    )
    ids = tokenizer(ex["prompt"], return_tensors="pt")["input_ids"][0]
    meta = {"context_tokens": length, "depth": ex["depth"], "template": name, "template_set": template.set, "answers": ex["answers"]}
    return Example(index, ids, meta, ex)


def _text_example(task: TaskSpec, tokenizer, split: str, seed: int, index: int, length: int, i: int) -> Example:
    """Window ``i`` of ``length`` consecutive tokens of the ``split`` essays, from a start seeded by the length and ``i``."""
    ids = split_ids(tokenizer, split)
    if length + 1 > len(ids):
        raise ValueError(f"task {task.name!r}: {length} tokens exceed the {split} essays ({len(ids)} tokens)")
    start = random.Random(f"{task.task}:{seed}:{length}:{i}").randrange(0, len(ids) - length)
    return Example(index, torch.tensor(ids[start : start + length]), {"context_tokens": length, "start": start})


def run_batch(
    task: TaskSpec,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    policy: kvgates.Policy,
    batch: list[Example],
    reference: list[dict] | None,
    prefill_chunk: int | None,
    cache: dict,
) -> list[dict]:
    """One arm on one batch: per example ``{metrics, kv_bytes, state_bytes, ...}``.

    ``reference``: the full cache's results on the same examples (``None`` when this *is* the full cache);
    ``cache``: a per-batch dict where references computed once (log-probabilities, by the examples they are of) are
    kept for the other arms (``share_references`` computes them there before an arm is timed).
    """
    prompts = [ex.prompt for ex in batch]
    if task.answer:
        gen = greedy_generate(model, tokenizer, policy, prompts, task.max_new_tokens, prefill_chunk)
        out = []
        for ex, tokens, kv, st in zip(batch, gen.tokens, gen.kv_bytes, gen.state_bytes):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            out.append({"metrics": score(ex.source, text), "completion": text, "kv_bytes": kv, "state_bytes": st})
        return out
    if task.task == "perplexity":
        nll, kv, st = stream_nll(model, policy, torch.stack(prompts), task.option("chunk"))
        return [
            {"metrics": {"nll": float(row.mean()), "ppl": float(row.mean().exp())}, "kv_bytes": k, "state_bytes": s}
            for row, k, s in zip(nll, kv, st)
        ]
    n = task.option("new_tokens")
    if reference is None or task.task == "generation":
        gen = greedy_generate(model, tokenizer, policy, prompts, n, prefill_chunk, min_new_tokens=n)
        if reference is None:  # the full cache: the reference itself
            full = METRICS[task.task]
            perfect = {"kl": 0.0, "top1": 1.0, "first_divergence": float(n), "prefix": float(n), "agreement": 1.0, "identical": 1.0}
            return [
                {"metrics": {m.name: perfect[m.name] for m in full}, "tokens": t, "kv_bytes": k, "state_bytes": s}
                for t, k, s in zip(gen.tokens, gen.kv_bytes, gen.state_bytes)
            ]
        out = []
        for ref, tokens, kv, st in zip(reference, gen.tokens, gen.kv_bytes, gen.state_bytes):
            same = torch.tensor(tokens) == torch.tensor(ref["tokens"])
            metrics = {"prefix": float(first_false(same)), "agreement": float(same.float().mean()), "identical": float(bool(same.all()))}
            out.append({"metrics": metrics, "kv_bytes": kv, "state_bytes": st})
        return out
    fid_batch, ref_logprobs = _fidelity_reference(model, tokenizer, batch, reference, cache)
    out = []
    for fid in completion_fidelity(model, policy, fid_batch, ref_logprobs, prefill_chunk):
        metrics = {"kl": fid.mean_kl, "top1": float(fid.top1.float().mean()), "first_divergence": float(fid.first_divergence)}
        out.append({"metrics": metrics, "kl_curve": [round(x, 6) for x in fid.kl.tolist()], "kv_bytes": fid.kv_bytes, "state_bytes": fid.state_bytes})
    return out


def share_references(
    task: TaskSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch: list[Example], reference: list[dict] | None,
    cache: dict,
) -> None:
    """Compute into ``cache`` the full-cache work that the budgeted arms of a batch share (``fidelity``: the
    log-probabilities of the full cache's completions), for the runner to call before it times an arm's
    ``run_batch``: no arm's seconds hold that work; nothing for other tasks, or for the full cache itself
    (``reference`` None). ``run_batch`` computes whatever it still lacks."""
    if task.task == "fidelity" and reference is not None:
        _fidelity_reference(model, tokenizer, batch, reference, cache)


def _fidelity_reference(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch: list[Example], reference: list[dict], cache: dict
) -> tuple[Batch, torch.Tensor]:
    """The batch laid out for teacher forcing through the full cache's completions, and their full-cache
    log-probabilities: computed once per set of examples (arms may run different parts of a batch, the rest
    journalled) and kept in ``cache``."""
    completions = [torch.tensor(ref["tokens"]) for ref in reference]
    fid_batch = make_batch([ex.prompt for ex in batch], completions, tokenizer.pad_token_id)
    examples = tuple(ex.index for ex in batch)
    if examples not in cache:
        cache[examples] = reference_logprobs(model, fid_batch)
    return fid_batch, cache[examples]


def cost(task: TaskSpec, example: Example) -> int:
    """Tokens an arm processes for ``example`` (the progress bar's unit)."""
    if task.answer:
        return len(example.prompt) + task.max_new_tokens
    return len(example.prompt) + (task.option("new_tokens") if task.task != "perplexity" else 0)
