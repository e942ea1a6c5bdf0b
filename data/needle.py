"""Needle-in-a-haystack examples over the Paul Graham essays.

A five-digit passcode sentence is inserted at a sentence boundary at a given depth of a haystack of about
``context_tokens`` tokens of the *test* essays (``data.splits``); the prompt ends with a question and the start of
the answer, which a small base or instruct model completes ("... Answer: The secret passcode is"). The template is
one of ``data.tasks``' eval templates, never used in training. SmolLM2-135M with a full cache completes it
correctly at every depth at 1K and 2K tokens; eviction policies are judged by how much of that they keep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from data.tasks import make_example


@dataclass(frozen=True)
class NeedleTask:
    """Which examples to build.

    Attributes:
        context_tokens: target prompt length in tokens (haystack + needle + question).
        depths: number of needle depths, evenly spaced from 0 (start) to 1 (end).
        seed: chooses the passcodes and where in the corpus each haystack starts.
    """

    context_tokens: int = 2000
    depths: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.context_tokens < 64:
            raise ValueError(f"context_tokens must be at least 64, got {self.context_tokens}")
        if self.depths < 1:
            raise ValueError(f"depths must be >= 1, got {self.depths}")


def build_needle_dataset(tokenizer: PreTrainedTokenizerBase, task: NeedleTask) -> Dataset:
    """One row per depth: ``prompt`` (text), ``answer`` (passcode), ``depth``, ``context_tokens``.

    Haystacks come from the *test* essays only, and the template ("the secret passcode") is an eval template of
    ``data.tasks``: no training run sees either.
    """
    rows = []
    for i in range(task.depths):
        depth = i / (task.depths - 1) if task.depths > 1 else 0.5
        ex = make_example(
            "needle", tokenizer, "test", task.context_tokens, seed=task.seed * 1000 + i, template_set="eval",
            template="secret-passcode", depth=depth,
        )
        rows.append({"prompt": ex["prompt"], "answer": ex["answers"][0], "depth": depth, "context_tokens": task.context_tokens})
    return Dataset.from_list(rows)


def is_correct(completion: str, answer: str) -> bool:
    """The passcode appears in the completion."""
    return answer in completion


def digits_recalled(completion: str, answer: str) -> float:
    """Partial credit: the share of the passcode's digits that the completion's first number reproduces, in
    order from the first digit (``" 4393."`` for ``43936`` scores 0.8; no number scores 0)."""
    match = re.search(r"\d+", completion)
    got = match.group() if match else ""
    same = 0
    for a, b in zip(got, answer):
        if a != b:
            break
        same += 1
    return same / len(answer)
