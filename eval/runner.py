"""The A/B runner: every arm at every budget on exactly the same examples of every task, journalled as it goes.

    results = run_ab(ABConfig.load("configs/eval/ab.yaml"))

Work goes task by task and batch by batch; within a batch the full cache runs first (its results are the
batch's references, computed once and shared by every other arm), then each arm at each budget. Each example's
result is appended to ``<output_dir>/results.jsonl`` as soon as it is known; a re-run of the same config reuses
every journalled result whose key still matches (task settings, example, arm with the weights its adapter loaded,
budget, model, seed, and the device and dtype where they are not cpu and float32) and computes only the rest, so an interrupted run resumes.
``resume=False`` (``--fresh``) starts over. A config's ``reuse`` journals (other runs') supply the results whose keys
this run shares with them: they are copied into this run's journal, so its folder holds every result it reports.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvgates
from data.splits import check_corpus
from eval.arms import build_policy, prepare_arms
from eval.config import ABConfig, ArmSpec, ConfigError, TaskSpec, journal_row
from eval.stats import Comparison, compare, matched_memory
from eval.tasks import Example, binary_metric, build_examples, cost, metrics_of, run_batch, share_references
from kvgates.config import text_lines
from kvgates.models import past_context

JOURNAL = "results.jsonl"
#: The report's record of a run (``eval.report.write_report``); the runner reads back the wall time it holds.
RECORD = "results.json"


@dataclass
class ABResults:
    """What a run produced: one row per (task, example, arm, budget), the comparisons, and the run's timing.

    ``seconds`` is the wall time of the invocations that computed the output folder's results, summed: each one
    that computes adds its own to what ``results.json`` recorded, one that only reports (``compute=False``) adds
    nothing, and ``resume=False`` starts from zero. It is None when no computing invocation has finished yet (a
    report of a first run in progress); an interrupted invocation's time is lost with it.
    """

    config: ABConfig
    rows: list[dict]
    comparisons: list[Comparison]
    seconds: float | None  # wall time of the computing invocations (see above)
    compute_seconds: float  # model time summed over every row, journalled ones included
    expected: int  # results a complete run has (more than ``len(rows)`` while a run is in progress)
    #: The machine that computed: this one when the invocation computed results, else the one ``results.json``
    #: records (a report re-rendered, or a finished run run again, elsewhere does not move the results there).
    machine: str | None = None


def load_journal(path: Path) -> dict[str, dict]:
    """Rows recorded by an earlier (possibly interrupted) run, by key; a torn last line, and any line that is not a
    result (a JSON object with a ``key``; bytes that are no UTF-8 text among them), is skipped. Reads only:
    ``append_rows`` mends a torn end before writing."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    for line in text_lines(path):
        row = journal_row(line)  # (a run killed mid-write leaves at most one partial line)
        if row is not None:
            done[row["key"]] = row
    return done


def append_rows(journal: Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``journal``, a line each, after ending a torn last line (a run killed mid-write) so that the
    first starts a line of its own."""
    torn = False
    if journal.is_file() and journal.stat().st_size:
        with journal.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with journal.open("a") as f:
        f.write("\n" * torn + "".join(json.dumps(row) + "\n" for row in rows))


def batches(task: TaskSpec, examples: list[Example], config: ABConfig) -> list[list[Example]]:
    """Examples of exactly the same prompt length (in tokens), at most ``max_batch`` rows and ``batch_tokens``
    prompt tokens each, in example order.

    Batches never pad: a padded prefill takes the masked attention path, which on a CPU costs about twice the
    causal one (``bench/ab_batching.py``), more than batching saves on a few decode steps. Text windows (fidelity,
    generation, perplexity) all have their task's length and batch fully; answer prompts differ by a few tokens
    and mostly run alone, which costs them nothing since their work is the prefill.
    """
    groups: dict[int, list[Example]] = {}
    for ex in examples:
        groups.setdefault(len(ex.prompt), []).append(ex)
    out: list[list[Example]] = []
    for length, same in groups.items():
        size = max(1, min(config.max_batch, config.batch_tokens // length))
        out += [same[i : i + size] for i in range(0, len(same), size)]
    return sorted(out, key=lambda batch: batch[0].index)


def _key(config: ABConfig, task: TaskSpec, index: int, arm: ArmSpec, budget: int | None) -> str:
    identity = task.identity(config.model, config.seed, config.prefill_chunk, config.split, config.device, config.dtype)
    return json.dumps([task.name, identity, index, arm.label, arm.identity(config.adapters), budget])


def _runs(config: ABConfig, task: TaskSpec) -> list[tuple[ArmSpec, int | None]]:
    """``(arm, budget)`` pairs of ``task``, the full cache first (once, unbudgeted)."""
    return [(arm, budget) for arm in config.all_arms for budget in config.arm_budgets(arm, task)]


def _keys(config: ABConfig) -> list[str]:
    """Every result's journal key, in report order: task, example, arm, budget."""
    return [
        _key(config, task, index, arm, budget)
        for task in config.tasks for index in range(task.examples * len(task.context_tokens)) for arm, budget in _runs(config, task)
    ]


def run_ab(
    config: ABConfig,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    resume: bool = True,
    compute: bool = True,
) -> ABResults:
    """Run every (task, example, arm, budget) not already journalled and return all rows and comparisons.

    ``compute=False`` runs nothing (no model is loaded): the results are what the journal holds so far, and
    comparisons use the examples both arms have, so a long run's progress can be reported while it goes on. A
    resumed run whose results are all journalled (in its own journal or one it reuses) loads no model either: its
    results were computed, and their context checked, under the same keys. The model loads on the config's device in
    its dtype (``ABConfig.placement``: a GPU this machine lacks is a ``ConfigError``); a ``model`` given must be there.
    Essays that cannot be read (``data.splits.check_corpus``: their package missing) are a ``ConfigError`` before it loads.
    """
    start = time.perf_counter()
    work = compute and (not resume or missing_results(config) > 0)
    if work:  # a task past the model's context, an arm's adapter for another model and an example that cannot be made
        # are refused before the folder is made, anything adopted into it or a journal --fresh discards is deleted
        device, dtype = config.placement()
        if any(task.task != "common_words" for task in config.tasks):  # (every other task reads the essays)
            check_corpus()
        if model is None:
            model, tokenizer = kvgates.load_model(config.model, dtype=dtype, device=device)
        elif (model.device.type, model.dtype) != (device.type, dtype):  # its results would be journalled as the config's
            raise ValueError(f"the model is in {model.dtype} on {model.device}, the config runs {dtype} on {device}; load it as the config says")
        check_context(config, model)
        gates = prepare_arms(config, model)
        examples = {task.name: _examples(task, tokenizer, config) for task in config.tasks}
    record = _record(config) if resume else {}
    recorded = record.get("seconds")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / JOURNAL
    if not resume:
        journal.unlink(missing_ok=True)
    done = load_journal(journal)
    keys = _keys(config)
    reused = sum(key in done for key in keys)
    if reused:
        print(f"{reused} of {len(keys)} results are already journalled in {journal} (--fresh recomputes them all)")
    if resume and config.reuse:  # (--report-only: in the report only; its journal stays what the run computed)
        _adopt(config, keys, done, journal if compute else None)
    if work:
        _compute(config, model, tokenizer, done, journal, gates, examples)
    rows = [done[key] for key in keys if key in done]
    seconds = sum(r["seconds"] for r in rows)
    wall = (recorded or 0.0) + time.perf_counter() - start if compute else recorded
    machine = platform.platform() if work else record.get("machine")  # (None: results reused, computed elsewhere)
    return ABResults(config, rows, comparisons(config, rows), wall, seconds, len(keys), machine)


def _record(config: ABConfig) -> dict:
    """What ``results.json`` of the run's output folder records (its wall time, ``ABResults.seconds``, and machine),
    empty without one."""
    path = Path(config.output_dir) / RECORD
    try:
        record = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # (JSONDecodeError, or bytes that are no UTF-8 text: a UnicodeDecodeError)
        return {}  # torn by a report killed mid-write before reports were written atomically: its time is lost
    return record if isinstance(record, dict) else {}


def _journalled(config: ABConfig) -> tuple[set[str], set[str]]:
    """Keys of all of ``config``'s results, and those of them the run's journal or a journal it reuses holds."""
    keys = set(_keys(config))
    journals = [Path(config.output_dir) / JOURNAL, *map(Path, config.reuse)]
    return keys, keys & {key for journal in journals for key in load_journal(journal)}


def has_results(config: ABConfig) -> bool:
    """Whether the run's own journal holds any result of ``config`` (what ``--report-only`` needs: the journals it
    reuses are reported with the run's results, not in their place, so a folder the run never computed in is not made
    into one)."""
    return bool(set(_keys(config)) & set(load_journal(Path(config.output_dir) / JOURNAL)))


def unreported_results(config: ABConfig) -> int:
    """How many results the report already in the run's output folder (its ``results.json``) holds that are not
    ``config``'s: written by another config, other overrides or adapters since changed, it is not this config's to
    rewrite from what it shares with it (``--report-only`` refuses it). 0 where there is no report."""
    rows = _record(config).get("rows")
    keys = set(_keys(config))
    return sum(not (isinstance(row, dict) and row.get("key") in keys) for row in rows) if isinstance(rows, list) else 0


def missing_results(config: ABConfig) -> int:
    """How many of ``config``'s results neither the run's journal nor a journal it reuses holds: what a resumed run
    computes (with none, it loads no model)."""
    keys, journalled = _journalled(config)
    return len(keys - journalled)


def _adopt(config: ABConfig, keys: list[str], done: dict[str, dict], journal: Path | None) -> None:
    """Take into ``done`` the results of ``config.reuse`` journals whose keys this run has and has not journalled yet,
    and copy them to ``journal`` (None: into ``done`` only)."""
    for other in config.reuse:
        found = load_journal(Path(other))
        new = [key for key in keys if key in found and key not in done]
        for key in new:
            done[key] = found[key]
        if journal is not None:
            append_rows(journal, [found[key] for key in new])
        print(f"{len(new)} of {len(keys)} results reused from {other}")


#: Tasks whose arms generate (or are teacher-forced through) ``new_tokens`` after the prompt.
GENERATING = ("fidelity", "generation")


def check_context(config: ABConfig, model: PreTrainedModel) -> None:
    """Refuse a task whose prompts, with the tokens generated after them or an arm's scoring forwards
    (``Policy.scoring_reach``: KVzip's reconstruction), run past the positions the model was trained on
    (``kvgates.models.past_context``): the arms would be scored on text the model cannot read (``ConfigError``)."""
    for task in config.tasks:
        context = max(task.context_tokens)
        new = int(task.option("new_tokens")) if task.task in GENERATING else task.max_new_tokens
        past = past_context(model, config.model, context + new)
        if past is not None:
            raise ConfigError(
                f"task {task.name!r}: context_tokens {context} and {new} new tokens {past}; "
                "shorten the task or use a model with a longer context"
            )
        for arm in config.all_arms:
            budgets = config.arm_budgets(arm, task)
            try:  # (an arm's options this model refuses: repeat_ids that are not its token ids)
                reach = build_policy(arm, budgets[0]).scoring_reach(model, context) if budgets and not arm.learned else 0
            except ValueError as err:
                raise ConfigError(f"arm {arm.label!r}: {err}") from None
            past = past_context(model, config.model, context + reach)
            if past is not None:
                raise ConfigError(
                    f"task {task.name!r}: context_tokens {context} and the {reach} positions after them where arm "
                    f"{arm.label!r} scores its prompt {past}; shorten the task or the arm's scoring chunks (chunk_size)"
                )


def _examples(task: TaskSpec, tokenizer: PreTrainedTokenizerBase, config: ABConfig) -> list[Example]:
    """``task``'s examples; one that cannot be made (statements longer than its context) is the config's error."""
    try:
        return build_examples(task, tokenizer, config.seed, config.split)
    except ValueError as err:
        raise ConfigError(f"task {task.name!r}: {err}") from None


def _compute(
    config: ABConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, done: dict[str, dict], journal: Path,
    gates: dict[str, kvgates.GateSet | None], examples: dict[str, list[Example]],
) -> None:
    """Run and journal every result missing from ``done`` (updated in place), batch by batch, with the arms' gates
    (``prepare_arms``) and each task's examples."""
    full_arm = config.all_arms[0]
    units = [
        (task, ex, _key(config, task, ex.index, arm, budget))
        for task in config.tasks for ex in examples[task.name] for arm, budget in _runs(config, task)
    ]
    bar = tqdm(
        total=sum(cost(t, ex) for t, ex, _ in units), initial=sum(cost(t, ex) for t, ex, k in units if k in done),
        desc="A/B", unit="tok", unit_scale=True, dynamic_ncols=True,
    )
    with torch.no_grad():
        for task in config.tasks:
            for batch in batches(task, examples[task.name], config):
                shared: dict = {}  # the batch's full-cache references, computed once for every arm
                for arm, budget in _runs(config, task):
                    # Only the batch's examples not journalled yet: a run with more examples than the one it reuses
                    # has batches that are partly done.
                    keyed = [(ex, _key(config, task, ex.index, arm, budget)) for ex in batch]
                    todo, keys = [ex for ex, k in keyed if k not in done], [k for _, k in keyed if k not in done]
                    if not todo:
                        continue
                    bar.set_postfix_str(f"{task.name} {arm.label}" + (f"@{budget}" if budget else ""), refresh=False)
                    reference = [done[_key(config, task, ex.index, full_arm, None)] for ex in todo] if arm.budgeted else None
                    share_references(task, model, tokenizer, todo, reference, shared)  # (untimed: every budgeted arm's)
                    policy = build_policy(arm, budget, gates[arm.label]).attach(model)
                    t0 = time.perf_counter()
                    try:
                        results = run_batch(task, model, tokenizer, policy, todo, reference, config.prefill_chunk, shared)
                    finally:
                        policy.detach()
                    seconds = (time.perf_counter() - t0) / len(todo)
                    rows = [
                        {
                            "key": key, "task": task.name, "kind": task.task, "example": ex.index, "arm": arm.label,
                            "policy": arm.policy, "budget": budget, "meta": ex.meta, "seconds": round(seconds, 3), **result,
                        }
                        for ex, key, result in zip(todo, keys, results)
                    ]
                    append_rows(journal, rows)
                    done.update((row["key"], row) for row in rows)
                    bar.update(sum(cost(task, ex) for ex in todo))
    bar.close()


def comparisons(config: ABConfig, rows: list[dict]) -> list[Comparison]:
    """The configured pairs on every task at every budget: the primary metric, with McNemar on a binary one.
    Pairs are formed over the examples both arms have results for (all of them once a run is complete).

    Each pair is also compared across budgets wherever a's point at one budget and b's at another held matched
    memory (``eval.stats.matched_memory``): a policy that appends while decoding holds at a small
    budget what an evicting one holds at a larger one, and the framework's comparisons are at matched memory."""
    by = {(r["task"], r["arm"], r["budget"], r["example"]): r for r in rows}
    found = []
    for task in config.tasks:
        primary, binary = metrics_of(task)[0], binary_metric(task)
        indices = sorted({r["example"] for r in rows if r["task"] == task.name})
        budgets = config.task_budgets(task)
        for a, b in config.pairs():
            both_budgeted = config.arm(a).budgeted and config.arm(b).budgeted
            cross = [(x, y) for x in budgets for y in budgets if x != y] if both_budgeted else []
            for budget, budget_b in [(x, x) for x in budgets] + cross:
                ka, kb = ((task.name, arm, bud if config.arm(arm).budgeted else None) for arm, bud in ((a, budget), (b, budget_b)))
                shared = [i for i in indices if (*ka, i) in by and (*kb, i) in by]
                if not shared:
                    continue
                ra, rb = [by[(*ka, i)] for i in shared], [by[(*kb, i)] for i in shared]
                kv_a, kv_b = (float(np.mean([r["kv_bytes"] for r in rs])) / 2**20 for rs in (ra, rb))
                if budget != budget_b and not matched_memory(kv_a, kv_b):
                    continue
                values = lambda rs, m: [r["metrics"][m] for r in rs]  # noqa: E731
                found.append(
                    compare(
                        values(ra, primary.name), values(rb, primary.name), task=task.name, budget=budget, a=a, b=b,
                        metric=primary.name, higher_is_better=primary.higher_is_better,
                        binary_a=values(ra, binary.name) if binary else None, binary_b=values(rb, binary.name) if binary else None,
                        n_boot=config.n_boot, seed=config.seed, kv_a=kv_a, kv_b=kv_b,
                        budget_b=None if budget == budget_b else budget_b,
                    )
                )
    return found
