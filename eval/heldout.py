"""A small held-out comparison of policies: completion KL to the full cache and needle answers, per policy.

Training uses it twice: for validation during the run (validation essays, one arm: the gates being trained) and
for the table that ends a run (test essays, eval templates: trained gates, untrained gates, heuristics, full).
Full-cache references are computed once per example and shared by every arm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates
from data.tasks import score
from eval.fidelity import Batch, completion_fidelity, greedy_generate, make_batch, reference_logprobs, split_prompt


@dataclass
class HeldOut:
    """Prepared examples.

    Attributes:
        rows: ``(prompt_ids, completion_ids)`` 1-D pairs scored by completion KL.
        needles: ``(prompt_ids, example)`` pairs scored by the greedy answer (``data.tasks.score``).
        pad_id: the tokenizer's padding id (examples run in padded batches of ``batch_size``).
    """

    rows: list[tuple[torch.Tensor, torch.Tensor]]
    needles: list[tuple[torch.Tensor, dict]]
    pad_id: int
    batch_size: int = 8
    _references: list[torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, rows, needle_examples: list[dict], batch_size: int = 8) -> HeldOut:
        """From dataset rows (``input_ids``/``labels``, see ``data.build``) and ``data.tasks`` examples."""
        pairs = [split_prompt(r["input_ids"], r["labels"]) for r in rows]
        needles = [(tokenizer(ex["prompt"], return_tensors="pt")["input_ids"][0], ex) for ex in needle_examples]
        return cls(pairs, needles, tokenizer.pad_token_id, batch_size)

    def _row_batches(self) -> list[Batch]:
        b = self.batch_size
        return [
            make_batch([p for p, _ in self.rows[i : i + b]], [c for _, c in self.rows[i : i + b]], self.pad_id)
            for i in range(0, len(self.rows), b)
        ]

    def references(self, model: PreTrainedModel) -> list[torch.Tensor]:
        """Full-cache log-probabilities of every row batch (computed on first use; the model is frozen)."""
        if self._references is None:
            self._references = [reference_logprobs(model, batch) for batch in self._row_batches()]
        return self._references

    def evaluate(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, policy: kvgates.Policy, max_new_tokens: int = 8
    ) -> dict[str, float]:
        """``{kl, top1, needle_exact, needle_recall, needles, kv_mib}`` of ``policy`` (attached to ``model``): means
        over rows and needles; ``kv_mib`` is the mean KV memory a sequence holds at the end of its row."""
        kls, top1, kv = [], [], []
        for batch, ref in zip(self._row_batches(), self.references(model)):
            for fid in completion_fidelity(model, policy, batch, ref):
                kls.append(fid.mean_kl)
                top1.append(float(fid.top1.float().mean()))
                kv.append(fid.kv_bytes / 2**20)
        exact, recall = [], []
        for i in range(0, len(self.needles), self.batch_size):
            chunk = self.needles[i : i + self.batch_size]
            gen = greedy_generate(model, tokenizer, policy, [p for p, _ in chunk], max_new_tokens)
            for tokens, (_, example) in zip(gen.tokens, chunk):
                s = score(example, tokenizer.decode(tokens, skip_special_tokens=True))
                exact.append(s["exact"])
                recall.append(s["recall"])
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {
            "kl": mean(kls), "top1": mean(top1), "needle_exact": mean(exact), "needle_recall": mean(recall),
            "needles": len(exact), "kv_mib": mean(kv),
        }

    def compare(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        arms: dict[str, Callable[[], kvgates.Policy]],
        max_new_tokens: int = 8,
    ) -> dict[str, dict[str, float]]:
        """``evaluate`` each arm (a function building its policy); learned arms are attached and detached here."""
        results = {}
        for name, build in tqdm(arms.items(), desc="held-out arms", unit="arm"):
            policy = build().attach(model)
            try:
                results[name] = self.evaluate(model, tokenizer, policy, max_new_tokens)
            finally:
                policy.detach()
        return results


def markdown_table(results: dict[str, dict[str, float]]) -> str:
    """One row per arm: mean KL to the full cache, greedy top-1 agreement, needles answered exactly, KV MiB held
    per sequence."""
    lines = [
        "| arm | mean KL to full cache | top-1 agreement | needles exact | needle digits recalled | KV held per sequence (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        n = int(r["needles"])
        needles = f"{round(r['needle_exact'] * n)}/{n} | {r['needle_recall']:.0%}" if n else "— | —"  # (none asked for)
        lines.append(f"| {name} | {r['kl']:.4f} | {r['top1']:.1%} | {needles} | {r['kv_mib']:.2f} |")
    return "\n".join(lines)
