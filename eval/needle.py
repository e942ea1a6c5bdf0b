"""Needle-in-a-haystack sweep: every policy at every budget on the Paul Graham essays, printed as a table.

    python -m eval.needle --config configs/needle_demo.yaml

Writes ``results.json``, ``report.md`` and ``needle_heatmap.png`` to the config's ``output_dir``. Each prompt's
result is also appended to ``results.jsonl`` there as soon as it is known, and a re-run of the same config picks up
where an interrupted one stopped (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import kvgates
from data.needle import NeedleTask, build_needle_dataset, is_correct
from eval.config import NeedleRunConfig
from eval.report import TABLE_LEGEND, accuracy_table, needle_heatmap

JOURNAL = "results.jsonl"


def _key(config: NeedleRunConfig, label: str, context_tokens: int, depth: float) -> str:
    """Identity of one prompt's result: everything that changes the answer."""
    return json.dumps(
        [config.model, config.seed, config.max_new_tokens, config.prefill_chunk_size, label, context_tokens, round(depth, 6)]
    )


def load_journal(path: Path) -> dict[str, dict]:
    """Results already recorded by an earlier (possibly interrupted) run, by key; a torn last line is ignored."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    text = path.read_text()
    if text and not text.endswith("\n"):
        with path.open("a") as f:
            f.write("\n")  # so the next append starts a fresh line after a torn one
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves at most one partial line
        done[row.pop("key")] = row
    return done


def _answer(model, tokenizer, policy, spec, budget, row: dict, ids: torch.Tensor, config: NeedleRunConfig) -> dict:
    """Generate the answer to one needle prompt under ``policy`` and score it."""
    cache = kvgates.BudgetCache(model.config, policy)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            past_key_values=cache,
            max_new_tokens=config.max_new_tokens,
            do_sample=False,
            prefill_chunk_size=config.prefill_chunk_size,
            pad_token_id=tokenizer.pad_token_id,
        )
    completion = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return {
        "policy": spec.name if not spec.params else spec.label(None),
        "label": spec.label(budget),
        "budget": budget,
        "context_tokens": row["context_tokens"],
        "prompt_tokens": ids.shape[1],
        "depth": row["depth"],
        "answer": row["answer"],
        "completion": completion,
        "correct": is_correct(completion, row["answer"]),
        "kv_bytes": cache.kv_bytes(),
        "seconds": time.perf_counter() - start,
    }


def run_needle(config: NeedleRunConfig, model=None, tokenizer=None, resume: bool = True) -> list[dict]:
    """Run the sweep and return one result dict per (policy, budget, context, depth), in sweep order.

    Results are journalled to ``<output_dir>/results.jsonl``; with ``resume`` those already there are reused.
    """
    journal = Path(config.output_dir) / JOURNAL
    journal.parent.mkdir(parents=True, exist_ok=True)
    if not resume:
        journal.unlink(missing_ok=True)
    done = load_journal(journal)
    if done:
        print(f"reusing results journalled in {journal} where they match this config (--fresh recomputes them all)")
    if model is None:
        model, tokenizer = kvgates.load_model(config.model)
    examples = []
    for ctx in config.context_tokens:
        for row in build_needle_dataset(tokenizer, NeedleTask(ctx, config.depths, config.seed)):
            examples.append((row, tokenizer(row["prompt"], return_tensors="pt")["input_ids"].to(model.device)))
    runs = [(spec, budget) for spec in config.policies for budget in (config.budgets if spec.budgeted else [None])]
    results = []
    bar = tqdm(total=len(runs) * len(examples), desc="needle", unit="prompt")
    for spec, budget in runs:
        policy = None
        for row, ids in examples:
            key = _key(config, spec.label(budget), row["context_tokens"], row["depth"])
            if key not in done:
                if policy is None:
                    policy = spec.build(budget).attach(model)
                done[key] = _answer(model, tokenizer, policy, spec, budget, row, ids, config)
                with journal.open("a") as f:
                    f.write(json.dumps({"key": key, **done[key]}) + "\n")
            results.append(done[key])
            bar.set_postfix_str(spec.label(budget))
            bar.update()
        if policy is not None:
            policy.detach()
    bar.close()
    return results


def write_report(config: NeedleRunConfig, results: list[dict]) -> str:
    """Write results.json, report.md and the heatmap; return the table with its legend, for the terminal."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = accuracy_table(results)
    heatmap = needle_heatmap(results, out / "needle_heatmap.png")
    (out / "report.md").write_text(
        f"# Needle in a haystack: {config.model}\n\n{TABLE_LEGEND}\n\n{table}\n\n![heatmap]({heatmap.name})\n"
    )
    return f"{TABLE_LEGEND}\n\n{table}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/needle_demo.yaml", help="YAML run config")
    parser.add_argument("--model", help="override the config's model")
    parser.add_argument("--depths", type=int, help="override the number of needle depths")
    parser.add_argument("--context-tokens", type=int, nargs="+", help="override the context lengths")
    parser.add_argument("--budgets", type=int, nargs="+", help="override the budgets")
    parser.add_argument("--output-dir", help="override where reports are written")
    parser.add_argument("--fresh", action="store_true", help=f"ignore results already journalled in {JOURNAL}")
    args = parser.parse_args(argv)
    config = NeedleRunConfig.from_yaml(
        args.config,
        model=args.model,
        depths=args.depths,
        context_tokens=args.context_tokens,
        budgets=args.budgets,
        output_dir=args.output_dir,
    )
    results = run_needle(config, resume=not args.fresh)
    print(write_report(config, results))
    print(f"\nreport: {Path(config.output_dir) / 'report.md'}")


if __name__ == "__main__":
    main()
