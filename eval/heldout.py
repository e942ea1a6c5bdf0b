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
    _references: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

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

    def _reference(self, model: PreTrainedModel, index: int, batch: Batch) -> torch.Tensor:
        """Full-cache log-probabilities of row batch ``index`` (computed on first use; the model is frozen)."""
        if index not in self._references:
            self._references[index] = reference_logprobs(model, batch)
        return self._references[index]

    def evaluate(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        policy: kvgates.Policy,
        max_new_tokens: int = 8,
        shard: tuple[int, int] = (0, 1),
        gather: Callable[[list], list] | None = None,
    ) -> dict[str, float]:
        """``{kl, top1, needle_exact, needle_recall, needles, kv_mib}`` of ``policy`` (attached to ``model``): means
        over rows and needles; ``kv_mib`` is the mean KV memory a sequence holds at the end of its row.

        ``shard=(index, count)`` with ``gather`` (accelerate's ``gather_object``, a collective every process calls)
        splits the work over ``count`` processes: this one runs every ``count``-th of the row batches and needle
        batches from the ``index``-th, and the means are taken over what every process ran, in one process's order,
        so each returns what one process running them all would.
        """
        index, count = shard
        row_batches = self._row_batches()
        work = [(True, i) for i in range(len(row_batches))] + [(False, i) for i in range(0, len(self.needles), self.batch_size)]
        ran = []  # (position in work, {name: values})
        for position, (rows, i) in enumerate(work):
            if position % count != index:
                continue
            if rows:
                batch = row_batches[i]
                fids = completion_fidelity(model, policy, batch, self._reference(model, i, batch))
                values = {"kl": [f.mean_kl for f in fids], "top1": [float(f.top1.float().mean()) for f in fids],
                          "kv_mib": [f.kv_bytes / 2**20 for f in fids]}
            else:
                chunk = self.needles[i : i + self.batch_size]
                gen = greedy_generate(model, tokenizer, policy, [p for p, _ in chunk], max_new_tokens)
                scores = [score(example, tokenizer.decode(tokens, skip_special_tokens=True)) for tokens, (_, example) in zip(gen.tokens, chunk)]
                values = {"needle_exact": [s["exact"] for s in scores], "needle_recall": [s["recall"] for s in scores]}
            ran.append((position, values))
        joined: dict[str, list[float]] = {name: [] for name in ("kl", "top1", "kv_mib", "needle_exact", "needle_recall")}
        for _, values in sorted(gather(ran) if gather is not None else ran, key=lambda done: done[0]):
            for name, xs in values.items():
                joined[name] += xs
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {
            "kl": mean(joined["kl"]), "top1": mean(joined["top1"]), "needle_exact": mean(joined["needle_exact"]),
            "needle_recall": mean(joined["needle_recall"]), "needles": len(joined["needle_exact"]), "kv_mib": mean(joined["kv_mib"]),
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
