"""The real embedded SmolLM2-135M (slow; CI runs the tests marked ci_slice)."""

import pytest
import torch
from transformers import DynamicCache

from kvgates import BudgetCache

pytestmark = pytest.mark.slow


@pytest.mark.ci_slice
def test_embedded_model_matches_dynamic_cache_without_eviction(smollm):
    from data.corpus import paul_graham_essays

    model, tok = smollm
    ids = tok(paul_graham_essays()[:3000], return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        ref_cache, cache = DynamicCache(config=model.config), BudgetCache(model.config, "snapkv", budget=1024)
        expected = [model(ids, past_key_values=ref_cache).logits[:, -1]]
        got = [model(ids, past_key_values=cache).logits[:, -1]]
        token = expected[0].argmax(-1, keepdim=True)
        for _ in range(8):
            expected.append(model(token, past_key_values=ref_cache).logits[:, -1])
            got.append(model(token, past_key_values=cache).logits[:, -1])
            token = expected[-1].argmax(-1, keepdim=True)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-4, rtol=0)


@pytest.mark.ci_slice
def test_needle_found_with_full_cache_and_budget_holds(smollm):
    from data.needle import NeedleTask, build_needle_dataset, is_correct

    model, tok = smollm
    rows = build_needle_dataset(tok, NeedleTask(context_tokens=1000, depths=2))
    for row in rows:
        ids = tok(row["prompt"], return_tensors="pt")["input_ids"]
        for policy, params in [("full", {}), ("snapkv", {"budget": 512})]:
            cache = BudgetCache(model.config, policy, **params)
            out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
            if policy == "full":  # a heuristic's accuracy is a measurement (eval/), not an invariant
                assert is_correct(tok.decode(out[0, ids.shape[1]:]), row["answer"]), row["depth"]
            else:
                assert int(cache.held_tokens().max()) <= 512 + 8


def test_needle_demo_config_runs(tmp_path):
    from eval.config import NeedleRunConfig
    from eval.needle import run_needle, write_report

    config = NeedleRunConfig.from_yaml("configs/needle_demo.yaml", depths=2, context_tokens=[600], budgets=[128], output_dir=str(tmp_path))
    results = run_needle(config)
    table = write_report(config, results)
    assert "snapkv" in table and (tmp_path / "needle_heatmap.png").is_file()


def test_needle_run_resumes_from_its_journal(tmp_path, smollm):
    from eval.config import NeedleRunConfig
    from eval.needle import JOURNAL, run_needle

    model, tok = smollm
    config = NeedleRunConfig.from_yaml("configs/needle_demo.yaml", depths=2, context_tokens=[400], budgets=[128], output_dir=str(tmp_path))
    first = run_needle(config, model, tok)
    journal = tmp_path / JOURNAL
    lines = journal.read_text().splitlines()
    assert len(lines) == len(first)
    journal.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # interrupted mid-write: last result torn

    calls = []
    generate = model.generate
    model.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    try:
        again = run_needle(config, model, tok)
    finally:
        del model.generate
    assert len(calls) == 1  # only the torn result is recomputed
    assert [r["completion"] for r in again] == [r["completion"] for r in first]
    assert len(journal.read_text().splitlines()) == len(first) + 1  # the torn line stays, skipped


def test_embedded_model_is_named_by_its_hub_id_and_loads_by_it_offline(smollm, monkeypatch):
    """An adapter for the embedded model names the upstream Hub id (and the embedded name), and that id loads the
    embedded copy when the Hub cannot be reached: an adapter's base model loads anywhere."""
    import huggingface_hub

    import kvgates
    from kvgates.models import embedded_name_of, hub_id_of

    model, _ = smollm
    assert hub_id_of(model) == "HuggingFaceTB/SmolLM2-135M-Instruct" and embedded_name_of(model) == "smollm2-135m"
    config = kvgates.RetentionGates.for_model(model).config
    assert (config.base_model, config.base_model_embedded) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    again, _ = kvgates.load_model(config.base_model)
    assert kvgates.model_fingerprint(again) == config.fingerprint


def test_converting_the_embedded_model_prints_nothing_to_stdout_and_imports_no_deepspeed(tmp_path):
    import os
    import subprocess
    import sys

    code = "import sys, kvgates; kvgates.load_model('smollm2-135m'); print('deepspeed' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "KVGATES_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"


def test_generate_answers_an_instruct_question_without_the_chat_flag(capsys):
    from kvgates.cli import main

    assert main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and out.count("\n") == 1
