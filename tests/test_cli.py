"""The ``kvgates`` command line on a tiny local checkpoint."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import policy_on, save_tiny_checkpoint, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvgates
from kvgates import POLICIES, BudgetCache, RetentionGates, load_model
from kvgates.cli import BROKEN_PIPE, INTERRUPTED, USAGE_ERROR, WRITE_ERROR, main, quiet_exits

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_generate_prints_text_and_memory(checkpoint, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog " * 4)
    code = main(
        ["generate", "--model", checkpoint, "--policy", "snapkv", "--budget", "24", "--window", "4", "--kernel", "3",
         "--prompt-file", str(prompt), "--max-new-tokens", "5"]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "policy=snapkv" in err and "KV held" in err and "vs full cache" in err



def test_generate_runs_in_the_dtype_and_on_the_device_asked(checkpoint, capsys):
    """``kvgates generate`` ran every model on the CPU in float32, on a GPU machine too; ``--device`` and ``--dtype``
    choose (``auto``: the GPU where there is one, in bfloat16), and the run's summary names both."""
    assert main(["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "8", "--prompt", "hello there " * 5,
                 "--max-new-tokens", "3", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().err.rstrip().endswith(" s on cpu (bfloat16)")
    assert main(["generate", "--model", checkpoint, "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    expected = f"on cuda ({'bfloat16' if native else 'float16'})" if torch.cuda.is_available() else "on cpu (float32)"
    assert capsys.readouterr().err.rstrip().endswith(f" s {expected}")


def test_auto_dtype_is_float16_on_a_gpu_whose_bfloat16_torch_only_emulates(monkeypatch):
    """A GPU before Ampere (a T4, a V100) has no bfloat16 arithmetic: torch emulates it, and
    ``torch.cuda.is_bf16_supported()`` says yes unless asked about the hardware. ``--dtype auto`` took bfloat16 there."""
    from kvgates.models import device_and_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for hardware, dtype in ((False, torch.float16), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, hardware=hardware: hardware or including_emulation)
        assert device_and_dtype("auto", "auto", auto=True) == (torch.device("cuda"), dtype)
        assert device_and_dtype("cuda", "float32", auto=True) == (torch.device("cuda"), torch.float32)  # what is asked, as asked


def test_the_dtype_choices_are_those_models_load_in_and_auto():
    """The CLI writes its ``--dtype`` choices out (``--help`` imports no torch): the same as ``kvgates.models``'."""
    from kvgates import cli, models

    assert cli.DTYPES == ("auto", *models.DTYPES)


def test_a_gpu_that_is_not_there_is_refused_before_the_model_loads(checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run(["generate", "--model", checkpoint, "--device", "cuda", "--prompt", "x"]) == USAGE_ERROR
    assert "--device cuda: this machine has no CUDA GPU that torch can use; use --device cpu" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run(["generate", "--model", checkpoint, "--device", "cuda:2", "--prompt", "x"]) == USAGE_ERROR
    assert "--device cuda:2: this machine has 2 CUDA GPUs (cuda:0 to cuda:1)" in capsys.readouterr().err


def test_a_long_prompt_s_prefill_is_announced_on_stderr_only(checkpoint, monkeypatch, capsys):
    """``kvgates generate`` said nothing while a long prompt was prefilled (minutes, on a long context): a prompt of
    ``LONG_PROMPT`` tokens or more gets a line on stderr as its prefill starts and one as it ends; stdout still holds
    the generated text alone, as it does for a short prompt, which gets neither line. (``--device cpu``: the line names
    where the prompt runs, on a machine with a GPU by default the GPU.)"""
    from kvgates import cli

    assert f"({cli.LONG_PROMPT:,} tokens or more)" in cli.__doc__  # what kvgates --help says
    argv = ["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "16", "--prompt", "hello there " * 5,
            "--max-new-tokens", "3", "--prefill-chunk", "8", "--device", "cpu"]
    assert main(argv) == 0
    quiet = capsys.readouterr()
    assert "prefill" not in quiet.err
    monkeypatch.setattr(cli, "LONG_PROMPT", 60)  # the prompt's 60 characters are its tokens
    assert main(argv) == 0
    loud = capsys.readouterr()
    assert loud.out == quiet.out
    lines = loud.err.splitlines()
    assert lines[0] == "kvgates generate: prefilling the prompt (60 tokens, in chunks of 8) on cpu in float32 ..."
    assert re.fullmatch(r"kvgates generate: prompt prefilled; first new token after \d+\.\d s", lines[1]), lines
    untimed = [[re.sub(r"\d+\.\d s on", "s on", line) for line in err] for err in (lines[2:], quiet.err.splitlines())]
    assert untimed[0] == untimed[1]  # then the run's summary, as without them


def test_a_prompt_file_may_be_a_pipe(checkpoint, capsys):
    """``--prompt-file /dev/stdin`` and a shell's ``<(...)`` name a pipe, not a regular file: it was refused as a file
    that "does not exist"."""
    read, write = os.pipe()
    os.write(write, b"hello there")
    os.close(write)
    try:
        assert main(["generate", "--model", checkpoint, "--prompt-file", f"/dev/fd/{read}", "--max-new-tokens", "2"]) == 0
    finally:
        os.close(read)
    assert "tokens=13 (prompt 11, new 2;" in capsys.readouterr().err


def test_a_prompt_file_s_byte_order_mark_is_not_part_of_the_prompt(checkpoint, tmp_path, capsys):
    """A UTF-8 file some editors (Windows Notepad) open with a byte order mark: the mark was read as a character of the
    prompt and tokenized ahead of it (3 tokens more on the embedded SmolLM2), changing the text generated."""
    (tmp_path / "marked.txt").write_bytes(b"\xef\xbb\xbfhello there")
    assert main(["generate", "--model", checkpoint, "--prompt-file", str(tmp_path / "marked.txt"), "--max-new-tokens", "2"]) == 0
    assert "tokens=13 (prompt 11, new 2;" in capsys.readouterr().err  # as the same text without the mark


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_full_policy_holds_all_of_a_full_cache(family, tmp_path, capsys):
    """The report's full cache counted the budgeted layers alone, and held bytes every layer: on Gemma 3, whose
    sliding-window layers kvgates leaves to transformers, the full policy held 107.8% of a full cache."""
    folder = save_tiny_checkpoint(tmp_path / family, family)
    assert main(["generate", "--model", str(folder), "--policy", "full", "--prompt", "the quick brown fox " * 4, "--max-new-tokens", "4"]) == 0
    assert re.search(r"KV held ([\d.]+) MiB vs full cache \1 MiB \(100\.0%\)", capsys.readouterr().err)

def test_generate_sampled_with_chunks(checkpoint, capsys):
    code = main(["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "8", "--prompt", "hello there " * 5,
                 "--sample", "--prefill-chunk", "16", "--max-new-tokens", "4"])
    assert code == 0


def test_a_sampled_generation_repeats_with_its_seed_and_defaults_to_seed_0(checkpoint, capsys):
    texts = []
    for seed in (["--seed", "5"], ["--seed", "5"], [], ["--seed", "0"]):
        argv = ["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "8", "--prompt", "hello there " * 5,
                "--sample", "--max-new-tokens", "6", *seed]
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_generate_with_kvzip_in_prompt_chunks(checkpoint, capsys):
    """KVzip encodes its repeat prompt with the checkpoint's own tokenizer and scores every prompt chunk."""
    code = main(["generate", "--model", checkpoint, "--policy", "kvzip", "--budget", "12", "--prompt", "hello there " * 5,
                 "--prefill-chunk", "16", "--chunk-size", "8", "--max-new-tokens", "4"])
    assert code == 0
    assert "policy=kvzip" in capsys.readouterr().err


def test_generate_with_kvzip_repeat_ids(checkpoint, capsys):
    """--repeat-ids is listed for kvzip; every value was refused ("repeat_ids must be a list or null, got '5,6'")."""
    code = main(["generate", "--model", checkpoint, "--policy", "kvzip", "--budget", "12", "--prompt", "hello there " * 5,
                 "--repeat-ids", "5,6,7", "--max-new-tokens", "2"])
    assert code == 0
    assert "policy=kvzip" in capsys.readouterr().err


@pytest.fixture(scope="module")
def foreign_gates(tmp_path_factory):
    """A gate adapter made for another model of the same shapes."""
    folder = tmp_path_factory.mktemp("foreign")
    RetentionGates.for_model(tiny_model("llama", seed=1)[1]).save_pretrained(folder)
    return str(folder)


def run(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns it or exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    """Config-only model folders kvgates must refuse before loading weights: Gemma-2 (no sdpa), Mamba (no
    attention), a Llama whose config says ``hidden_size: "big"``; and tiny checkpoints saved without their tokenizer
    or with truncated weights."""
    from helpers import _COMMON
    from transformers import Gemma2Config, LlamaConfig, MambaConfig

    root = tmp_path_factory.mktemp("bad-models")
    Gemma2Config(**_COMMON).save_pretrained(root / "gemma2")
    MambaConfig(vocab_size=_COMMON["vocab_size"], hidden_size=16, num_hidden_layers=2).save_pretrained(root / "mamba")
    LlamaConfig(**_COMMON).save_pretrained(root / "big")
    config = json.loads((root / "big" / "config.json").read_text())
    (root / "big" / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    no_tokenizer = save_tiny_checkpoint(root / "no-tokenizer")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / file).unlink()
    weights = save_tiny_checkpoint(root / "truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return {"GEMMA2": str(root / "gemma2"), "MAMBA": str(root / "mamba"), "BIG": str(root / "big"),
            "NO_TOKENIZER": str(root / "no-tokenizer"), "TRUNCATED": str(root / "truncated")}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--policy", "adakv", "--budget", "8", "--base-params", "window=x", "--prompt", "x"],
         "policy 'snapkv': window must be an integer, got 'x'"),
        (["--model", "GEMMA2", "--prompt", "x"], "Gemma2ForCausalLM does not support transformers' sdpa attention"),
        (["--model", "MAMBA", "--prompt", "x"], "MambaForCausalLM does not route attention through transformers' AttentionInterface"),
        (["--model", "BIG", "--prompt", "x"], "hidden_size"),
        # "Couldn't instantiate the backend tokenizer from one of:", the first of five lines:
        (["--model", "NO_TOKENIZER", "--prompt", "x"], "no-tokenizer cannot be loaded (Couldn't instantiate"),
        # A SafetensorError traceback:
        (["--model", "TRUNCATED", "--prompt", "x"], "truncated are truncated or corrupt (Error while deserializing header"),
        (["--policy", "snapkv", "--budget", "8", "--window", "16", "--prompt", "x"], "observation window"),
        (["--policy", "h2o", "--budget", "0", "--prompt", "x"], "at least 1"),
        (["--model", "smollm2-135m", "--policy", "trimkv", "--budget", "0", "--prompt", "x"], "trimkv: budget must be at least 1"),
        (["--model", "smollm2-135m", "--policy", "adakv", "--base", "trimkv-snap", "--budget", "-4", "--prompt", "x"],
         "budget must be at least 1"),
        # The usage block of the parser that finds the policy's options, named after the script ("cli.py"):
        (["--prompt", "x", "--policy"], "kvgates generate: argument --policy: expected one argument (see kvgates generate"),
        (["--policy", "h2o", "--budget", "8", "--prompt-file", "/nonexistent"], "does not exist"),
        (["--policy", "h2o", "--budget", "8", "--prompt-file", "EMPTY"], "is a folder; name a text file"),
        (["--policy", "h2o", "--budget", "8", "--prompt-file", "BINARY"], "prompt.bin is not UTF-8 text"),
        (["--policy", "h2o", "--budget", "8", "--prompt-file", ""], "--prompt-file: the file name is empty"),  # was ". is a folder"
        (["--sample", "--temperature", "0", "--prompt", "x"], "--temperature: must be a positive number, got '0' (greedy"),
        (["--sample", "--temperature", "nan", "--prompt", "x"], "--temperature: must be a positive number, got 'nan'"),
        (["--temperature", "1.2", "--prompt", "x"], "--temperature sets how --sample samples; add --sample"),  # was ignored
        (["--seed", "3", "--prompt", "x"], "--seed sets what --sample draws; add --sample"),  # was ignored
        (["--max-new-tokens", "-1", "--prompt", "x"], "--max-new-tokens: must be a positive integer, got '-1'"),
        (["--prefill-chunk", "0", "--prompt", "x"], "--prefill-chunk: must be a positive integer, got '0'"),
        # Chunks of one left the prompt uncompressed: every call after the first was a decode step.
        (["--prefill-chunk", "1", "--prompt", "x"],
         "--prefill-chunk: must be at least 2 tokens, got '1' (a one-token call after the prompt is a decode step"),
        # OverflowError tracebacks ("int too big to convert") and torch's "Overflow when unpacking long long":
        (["--policy", "h2o", "--budget", "9" * 20, "--prompt", "x"], "--budget: must be a whole number below 2**63"),
        (["--prefill-chunk", "9" * 20, "--prompt", "x"], "--prefill-chunk: must be a whole number below 2**63"),
        (["--policy", "h2o", "--budget", "x", "--prompt", "x"], "--budget: must be a whole number, got 'x'"),
        # Torch's "Overflow when unpacking long long" once the model had loaded.
        (["--seed", "99999999999999999999999", "--prompt", "x"], "--seed: must be a whole number from 0 to 2**64 - 1, got '9999"),
        (["--policy", "trimkv", "--budget", "8", "--gates", "/tmp/nonexistent", "--prompt", "x"],
         "/tmp/nonexistent is neither an adapter folder nor a Hub repository id"),
        (["--policy", "trimkv", "--budget", "8", "--gates", "", "--prompt", "x"], "the adapter name is empty"),  # was ". has no config.json"
        (["--policy", "trimkv", "--budget", "8", "--gates", "FOREIGN", "--prompt", "x"], "were trained for"),
        (["--policy", "trimkv", "--budget", "8", "--gates", "FOREIGN", "--prompt", "x"], "pass --strict false to attach them"),
        (["--policy", "locret", "--budget", "8", "--prompt", "x"], "--policy locret needs --gates"),
        (["--policy", "snap", "--prompt", "x"], "unknown policy 'snap'; available policies: adakv, "),
        (["--policy", "adakv", "--base", "trimkv-snap", "--budget", "8", "--prompt", "x"],
         "--policy trimkv-snap needs --base-params gates=..."),
        (["--policy", "adakv", "--budget", "8", "--base-params", "window", "--prompt", "x"], "--base-params: expected key=value"),
        # A yaml ParserError traceback (exit status 1):
        (["--policy", "adakv", "--budget", "8", "--base", "kvzip", "--base-params", "repeat_ids=[1,2", "--prompt", "x"],
         "--base-params: base parameter repeat_ids: '[1,2' opens a bracket it never closes"),
        # transformers' "Cannot use chat template functions because tokenizer.chat_template is not set and ...".
        (["--chat", "--prompt", "x"], "has no chat template; leave out --chat to send the prompt as it is"),
        (["--policy", "kvzip", "--budget", "8", "--repeat-ids", "5,x", "--prompt", "x"],
         "--repeat-ids: expected whole numbers separated by commas, got '5,x'"),
        (["--model", "EMPTY", "--prompt", "x"], "is not a model folder (no config.json there)"),
        (["--model", "MISSING", "--prompt", "x"], "/no-such-model does not exist; pass a model folder"),  # was "is not a model folder"
        (["--model", "", "--prompt", "x"], "the model name is empty; pass a model folder"),  # was " is not a model folder"
        # An adapter given as the model: 'not in the local Hugging Face cache and the Hub cannot be reached', and
        # 'the model config of ... cannot be read (Unrecognized model ...)'.
        (["--device", "gpu0", "--prompt", "x"], "--device: 'gpu0' is not a device; use auto, cpu, cuda or cuda:N"),
        (["--device", "meta", "--prompt", "x"], "--device meta: kvgates generate runs on cpu or cuda"),
        (["--dtype", "fp16", "--prompt", "x"], "argument --dtype: invalid choice: 'fp16'"),
        (["--model", "smollm2-135m-trimkv", "--prompt", "x"],
         "smollm2-135m-trimkv is a kvgates gate adapter (retention gates for smollm2-135m), not a model; name it as the gates"),
        (["--model", "FOREIGN", "--prompt", "x"], "is a kvgates gate adapter (retention gates for llama), not a model"),
    ],
)
def test_bad_input_is_one_clear_error(checkpoint, foreign_gates, bad_models, tmp_path, capsys, argv, message):
    if "BINARY" in argv:
        (tmp_path / "prompt.bin").write_bytes(b"\xff\xfe hello")
    paths = {"FOREIGN": foreign_gates, "EMPTY": str(tmp_path), "MISSING": str(tmp_path / "no-such-model"), "BINARY": str(tmp_path / "prompt.bin")}
    argv = [{**paths, **bad_models}.get(a, a) for a in argv]
    if "--model" not in argv:
        argv = ["--model", checkpoint, *argv]
    assert run(["generate", *argv]) == USAGE_ERROR  # every user error: the same status
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert lines[0].startswith("kvgates generate: "), lines  # the command's name, as its parser's errors give it


def test_policy_help_states_each_option_s_real_default(capsys):
    """``--gates`` of a learned policy defaults to the shipped adapter (not "None"), a wrapper's ``--base-params`` to
    no parameters; every option says what its policy's docstring says of it, so a default computed from the budget
    is not "None" (H2O's recent window, KVMerger's heavy hitters), and an inherited one is found in the base's."""
    for policy, option, default in (
        ("trimkv", "--gates", "the adapter shipped for this policy"), ("adakv", "--base-params", "default: {}"),
        ("h2o", "--recent", "recent-window size in tokens (default `budget // 2`"),
        ("kvmerger", "--heavy", "(default `budget // 8`, at least 1)"),
        ("pyramidkv", "--window", "observation window (default 32)"), ("pyramidkv", "--beta", "(default 20)"),
        ("kvzip", "--repeat-ids", "the repeat prompt's token ids"), ("trimkv", "--gate-dtype", "auto (the model's own)"),
    ):
        assert run(["generate", "--policy", policy, "--help"]) == 0
        help_text = " ".join(capsys.readouterr().out.split())
        entry = help_text.split(f"{policy} parameters:")[1].split(f"{option} {option.lstrip('-').replace('-', '_').upper()} ")[1]
        assert default in entry.split(" --")[0], entry
        assert "other parameters" not in entry.split(" --")[0]


def test_generate_help_says_where_the_policy_options_are(capsys):
    """``kvgates generate --help`` (the full policy's: no parameters) said nothing of the policies' options."""
    assert run(["generate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "kvgates generate --policy NAME --help lists them" in help_text
    assert "kvgates policies describes each" in help_text


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvgates {kvgates.__version__}"


def test_python_m_kvgates_is_the_command():
    """``python -m kvgates`` (an environment whose scripts folder is not on PATH) said "No module named
    kvgates.__main__"; it runs the ``kvgates`` command, its exit status included."""
    done = subprocess.run([sys.executable, "-m", "kvgates", "--version"], capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, f"kvgates {kvgates.__version__}"), done.stderr
    done = subprocess.run([sys.executable, "-m", "kvgates", "nonsense"], capture_output=True, text=True)
    assert done.returncode == USAGE_ERROR and done.stderr.startswith("kvgates: unknown command 'nonsense'")


def test_version_and_help_import_neither_torch_nor_transformers():
    """``kvgates --version`` and ``--help`` answer at once: the console script imports no heavy library for them."""
    code = (
        "import sys; from kvgates.cli import main; assert main(sys.argv[1:]) == 0; "
        "assert not {'torch', 'transformers'} & set(sys.modules), sorted({'torch', 'transformers'} & set(sys.modules))"
    )
    for flag in ("--version", "--help"):
        done = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", [["eval"], ["eval", "softhard"], ["train.ship"], ["data.splits"]])
def test_every_python_m_commands_help_reads_without_rest_markup(command, capsys):
    """``python -m eval --help`` (and ``softhard``'s, ``train.ship``'s, ``data.splits``') showed the docstring's
    reStructuredText inline literals with their double backticks; the description now goes through
    ``kvgates.cli.plain`` (single backticks), as ``kvgates --help`` and the policies' options do. (The bench scripts'
    help: ``test_bench_scripts``.)"""
    import importlib

    main = importlib.import_module({"eval": "eval.__main__"}.get(command[0], command[0])).main
    with pytest.raises(SystemExit) as done:
        main([*command[1:], "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: python -m {' '.join(command)}") and "``" not in out
    assert "`" in out  # the literals still marked


def test_require_installed_names_the_missing_modules_and_the_extra(capsys):
    from kvgates.cli import require_installed

    require_installed("prog", ["json", "torch"])  # installed: nothing said
    with pytest.raises(SystemExit) as done:
        require_installed("prog", ["json", "kvgates_no_such_module"])
    err = capsys.readouterr().err
    assert done.value.code == USAGE_ERROR and err.count("\n") == 1
    assert err.startswith("prog: kvgates_no_such_module is not installed here;") and "pip install -e '.[train]'" in err


@pytest.mark.parametrize(
    "module, args, missing",
    [("train.py", ["--check"], "trl"), ("train.py", ["--check"], "datasets"), ("eval", ["ab", "--config", "configs/eval/demo.yaml"], "matplotlib")],
)
def test_a_script_without_the_train_extra_says_so_in_one_sentence(module, args, missing, tmp_path):
    """Without the ``train`` extra (the core alone: ``pip install -e .``), ``train.py`` stopped in
    an import's traceback (datasets), or passed ``--check`` and failed once the model had loaded (trl); ``python -m
    eval ab`` stopped in its report's import of matplotlib. Each now says what is missing and how to install it."""
    driver = (
        f"import runpy, sys\nsys.modules[{missing!r}] = None\n"  # (None in sys.modules: not importable, find_spec None)
        f"sys.argv = [{module!r}, *{args!r}]\n"
        + (f"runpy.run_path({module!r}, run_name='__main__')\n" if module.endswith(".py") else f"runpy.run_module({module!r}, run_name='__main__')\n")
    )
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, cwd=REPO, timeout=300)
    prog = "python -m eval" if module == "eval" else module
    assert result.returncode == USAGE_ERROR, result.stderr
    assert result.stderr.startswith(f"{prog}: {missing} is not installed here;") and result.stderr.count("\n") == 1, result.stderr
    assert "pip install -e '.[train]'" in result.stderr


@pytest.mark.parametrize(
    "module, args, interrupted",
    [
        ("train.ship", ["checkpoints/run/adapter", "a-name"], "kvgates.load_gates"),  # before anything is written
        ("data.splits", [], "kvgates.gates.adapter.atomic_write"),  # as it writes data/essay_split.json
        ("train.py", ["--check"], "train.config.read_yaml"),  # reading the config, before the run's own handling of Ctrl-C
    ],
)
def test_ctrl_c_ends_ship_splits_and_train_quietly(module, args, interrupted):
    """Ctrl-C in ``python -m train.ship`` or ``python -m data.splits`` (or in ``train.py`` before its run) printed the
    traceback of wherever it was; each now ends as ``kvgates`` does (``kvgates.cli.quiet_exits``): SIGINT's status,
    no traceback. (What they write goes through temporary files, whole or not at all.)"""
    owner, _, name = interrupted.rpartition(".")
    driver = (
        f"import importlib, runpy, sys\n"
        f"def interrupted(*args, **kwargs):\n    raise KeyboardInterrupt\n"
        f"setattr(importlib.import_module({owner!r}), {name!r}, interrupted)\n"
        f"sys.argv = [{module!r}, *{args!r}]\n"
        + (f"runpy.run_path({module!r}, run_name='__main__')\n" if module.endswith(".py") else f"runpy.run_module({module!r}, run_name='__main__')\n")
    )
    split = (REPO / "data" / "essay_split.json").read_bytes()
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert (result.returncode, result.stderr) == (INTERRUPTED, "")
    assert (REPO / "data" / "essay_split.json").read_bytes() == split


def test_help_goes_to_stdout_and_a_bad_command_is_a_usage_error(capsys):
    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: kvgates") and err == "" and "``" not in out
    assert main(["generat"]) == USAGE_ERROR
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "kvgates: unknown command 'generat'; commands: generate, policies (see kvgates --help)"


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_that_cannot_load_is_refused_at_once_with_the_embedded_names(monkeypatch, capsys, offline):
    """A typo (``smollm2-1.7b``) offline: no download retries, one sentence listing the embedded models, whether
    HF_HUB_OFFLINE says so or the Hub cannot be reached."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert run(["generate", "--model", "smollm2-1.7b", "--prompt", "x"]) == USAGE_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    reason = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached (ConnectionError)"
    assert len(lines) == 1 and reason in lines[0] and "embedded model (smollm2-135m)" in lines[0], lines


def test_the_run_summary_names_the_adapter(checkpoint, tmp_path, capsys):
    model, _ = load_model(checkpoint)
    RetentionGates.for_model(model).save_pretrained(tmp_path / "gates")
    code = main(["generate", "--model", checkpoint, "--policy", "trimkv", "--budget", "8", "--gates", str(tmp_path / "gates"),
                 "--prompt", "hello there " * 3, "--max-new-tokens", "2"])
    assert code == 0
    assert f"policy=trimkv gates={tmp_path / 'gates'} tokens=" in capsys.readouterr().err


def test_gates_of_other_shapes_are_refused_before_the_model_loads(checkpoint, monkeypatch, capsys):
    """A shipped adapter (SmolLM2-135M's 30 layers) named for a model of other shapes was refused only once that model's
    weights had loaded (minutes for an 8B one); the gates' shapes are now checked against the model's config first, as
    ``train.py`` checks ``gates.init_from``, a wrapped learned base's gates too."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model's weights loaded before the gates were refused")

    monkeypatch.setattr(kvgates, "load_model", load_model)
    for argv in (["--policy", "trimkv", "--gates", "smollm2-135m-trimkv"],
                 ["--policy", "adakv", "--base", "dms", "--base-params", "gates=smollm2-135m-dms-lora"]):
        assert run(["generate", "--model", checkpoint, *argv, "--budget", "64", "--prompt", "x"]) == USAGE_ERROR
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and "trained for HuggingFaceTB/SmolLM2-135M-Instruct and do not fit local:" in lines[0], lines


def test_the_run_summary_counts_the_prompt_and_every_new_token(checkpoint, capsys):
    """The summary's ``tokens=`` was the cache's count, one less than the prompt and the new tokens it listed:
    generate() never runs the last new token through the model. It now counts the text's tokens and says how many
    the cache saw (what the memory figures are of)."""
    assert main(["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "8", "--prompt", "hello there " * 5,
                 "--max-new-tokens", "4"]) == 0
    found = re.search(r"tokens=(\d+) \(prompt (\d+), new (\d+); the cache saw (\d+), all but the last new token\)", capsys.readouterr().err)
    tokens, prompt, new, seen = map(int, found.groups())
    assert new == 4 and tokens == prompt + new and seen == tokens - 1


def test_a_prompt_past_the_context_is_warned_about(checkpoint, capsys):
    """The tiny model has 1,024 positions: a prompt past them still generates (eviction bounds the cache, not the
    positions), with one warning line on stderr; a prompt within them gets none, and neither does StreamingLLM
    attending at positions within its cache (``rerotate``) when the prompt comes in chunks; in one forward the
    prompt's own tokens are attended at their positions, past the context, and that is warned about."""
    long = "hello there " * 90  # 1,080 tokens with the tiny tokenizer
    rerotate = ["--rerotate", "true"]
    for prompt, extra, warned in (
        (long, [], True), ("hello there", [], False), (long, [*rerotate, "--prefill-chunk", "64"], False), (long, rerotate, True),
    ):
        code = main(["generate", "--model", checkpoint, "--policy", "streaming_llm", "--budget", "16", "--prompt", prompt,
                     "--max-new-tokens", "2", *extra])
        err = capsys.readouterr().err
        assert code == 0
        lines = [line for line in err.splitlines() if "warning" in line]
        assert len(lines) == int(warned)
        if warned and not extra:
            assert "run past the 1024 positions" in lines[0] and "tokens) and --max-new-tokens 2" in lines[0]
        elif warned:
            assert "a prompt forward of 1080 tokens" in lines[0] and "pass --prefill-chunk 1008 or less" in lines[0]


def test_kvzip_scoring_past_the_context_is_warned_about(checkpoint, capsys):
    """KVzip's scoring forwards run after the prompt (``Policy.scoring_reach``: its repeat prompt, 28 tokens with the
    tiny tokenizer, then a chunk of the prompt): a 600-token prompt within the tiny model's 1,024 positions is warned
    about with the default ``chunk_size`` (600 + 28 + 600 positions), not with ``--chunk-size 300`` (928)."""
    for extra, warned in (([], True), (["--chunk-size", "300"], False)):
        code = main(["generate", "--model", checkpoint, "--policy", "kvzip", "--budget", "16", "--prompt", "hello there " * 50,
                     "--max-new-tokens", "2", *extra])
        lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert code == 0 and len(lines) == int(warned), lines
        if warned:
            assert "the prompt (600 tokens) and the 628 positions kvzip's scoring forwards take after it run past the 1024 positions" in lines[0]
            assert lines[0].endswith("; kvzip may keep the wrong tokens")


def test_stdout_holds_the_generated_text_only(checkpoint, capsys):
    code = main(["generate", "--model", checkpoint, "--prompt", "the lazy dog", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    model, tok = load_model(checkpoint)
    ids = tok("the lazy dog", return_tensors="pt")["input_ids"]
    expected = tok.decode(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:],
                          skip_special_tokens=True)
    assert code == 0 and out == expected + "\n"
    assert "KV held" in err and "allocated" in err


def prompt_lengths(checkpoint, capsys) -> dict[bool, int]:
    """The prompt's token count ``kvgates generate`` reports for "hi" with the chat template (False) and with
    ``--no-chat`` (True)."""
    prompts = {}
    for flag in ([], ["--no-chat"]):
        assert main(["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-new-tokens", "2", *flag]) == 0
        prompts[bool(flag)] = int(re.search(r"prompt (\d+)", capsys.readouterr().err).group(1))
    return prompts


def test_chat_template_is_the_default_when_the_tokenizer_has_one(tmp_path, capsys):
    checkpoint = save_tiny_checkpoint(tmp_path)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    tok.save_pretrained(checkpoint)
    assert prompt_lengths(checkpoint, capsys) == {False: len("<user>hi<assistant>"), True: len("hi")}  # one token per character


def test_a_chat_template_s_special_tokens_are_not_added_again(tmp_path, capsys):
    """A template that writes the BOS token itself (Llama 3, Gemma 3) got a second one from a tokenizer that adds
    it: the prompt began with two. A raw prompt (--no-chat) still gets the tokenizer's."""
    from tokenizers.processors import TemplateProcessing

    checkpoint = save_tiny_checkpoint(tmp_path)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", 2)])
    tok.bos_token = "<eos>"  # the tiny vocabulary has no other special token to begin with
    tok.chat_template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    tok.save_pretrained(checkpoint)
    assert prompt_lengths(checkpoint, capsys) == {False: 1 + len("<user>hi<assistant>"), True: 1 + len("hi")}


def test_unknown_policy(capsys):
    assert main(["generate", "--policy", "nope", "--prompt", "x"]) == 2
    assert "available policies" in capsys.readouterr().err


def test_policies_lists_registry(capsys):
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(POLICIES)
    assert [line for line in lines if not line.endswith(".")] == []  # each a whole sentence (kvzap's was cut mid-way)
    assert [line for line in lines if "``" in line] == []  # no reST markup, as in the options' help ("``DynamicCache``")
    assert run(["policies", "--help"]) == 0  # help, not the list
    assert capsys.readouterr().out.startswith("usage: kvgates policies")
    assert run(["policies", "snapkv"]) == USAGE_ERROR  # an argument it takes none of is refused, not ignored
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "kvgates policies: unrecognized arguments: snapkv (see kvgates policies --help)"


def test_load_model_with_an_accelerate_device_map(checkpoint):
    model, tok = load_model(checkpoint, device_map={"": "cpu"})
    assert all(p.device.type == "cpu" for p in model.parameters()) and not model.training
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    out = model.generate(ids, past_key_values=BudgetCache(model.config, "h2o", budget=4), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3 and torch.isfinite(model(ids).logits).all()


#: Layouts of the tiny model's modules over devices, and what each needs. accelerate *offloads* the modules a
#: ``device_map`` puts on ``"cpu"`` beside a GPU (their weights wait on ``meta`` and run on the GPU), as it does
#: those on ``"disk"``: only two GPUs run layers on two devices.
_MODULES = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "model.rotary_emb", "lm_head")
LAYOUTS = {
    "disk-offload": (dict(zip(_MODULES, ["disk", "disk", "cpu", "cpu", "cpu", "cpu", "cpu"])), 0),
    "cpu-offload-to-gpu": (dict(zip(_MODULES, ["cpu", "cpu", 0, 0, 0, 0, 0])), 1),
    "two-gpus": (dict(zip(_MODULES, [0, 0, 1, 1, 1, 1, 1])), 2),
}


def assert_within_budget(name: str, cache: BudgetCache, budget: int) -> None:
    """Every layer within ``budget`` tokens per head; DynamicKV's budget is the average over layers."""
    held = cache.held_tokens()  # [layers, B, H_kv]
    if name == "dynamickv":
        assert int(held.sum(0).max()) <= budget * held.shape[0]
    else:
        assert int(held.max()) <= budget


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["d2o", "dynamickv", "trimkv-global"])
def test_cross_layer_policies_over_a_device_map(checkpoint, tmp_path, name, layout):
    """A device_map may offload modules (weights on ``meta`` until their forward: ``prepare_model``'s dry run
    must run anyway) or put layers on different devices; policies that decide across layers work the same, within
    their budget (12 tokens, plus the 10 decoded: decode appends)."""
    device_map, gpus = LAYOUTS[layout]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPU(s)")
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for placement in ({"": "cpu"}, device_map):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=placement, offload_folder=str(tmp_path))
        kvgates.prepare_model(model)
        torch.manual_seed(0)
        with policy_on(model, name, 12) as policy, torch.no_grad():
            cache = BudgetCache(model.config, policy)
            out = [model(ids[:, :30], past_key_values=cache).logits[:, -1]]
            out += [model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in range(30, 40)]
        logits.append(torch.stack(out).cpu())
        assert_within_budget(name, cache, 12 + 10)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("command", [["policies"], ["--version"], ["--help"], ["policies", "--help"], ["generate", "--help"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(command):
    """``kvgates policies | head -0``: the pipe is closed before the command writes. It stops with SIGPIPE's status
    and says nothing (it said "kvgates: [Errno 32] Broken pipe", a user error, and Python's exit-time flush failed
    again; ``--version`` and ``--help``, answered before the others, printed a BrokenPipeError traceback; a
    command's own ``--help``, which argparse writes ignoring a failed write, ended with status 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvgates.cli", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even imported kvgates
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == BROKEN_PIPE, stderr
    assert stderr == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device that takes no writes")
@pytest.mark.parametrize("command", [["policies"], ["--version"], ["--help"], ["policies", "--help"], ["generate", "--help"]])
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_standard_output_that_takes_nothing_is_one_sentence(command, unbuffered):
    """``kvgates --version > /dev/full`` printed an OSError traceback, and ``kvgates policies > /dev/full`` said
    "kvgates: [Errno 28] No space left on device" as a user error (status 2), or, its text buffered, nothing but
    Python's exit-time "Exception ignored"; each is now one sentence and status 1, buffered (the text written at the
    end) or not (``PYTHONUNBUFFERED``: at the first line). ``kvgates generate --help > /dev/full`` said nothing and
    ended with status 0 (argparse's help ignores a failed write)."""
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "kvgates.cli", *command], stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert (result.returncode, result.stderr) == (WRITE_ERROR, "kvgates: cannot write to standard output (No space left on device)\n")


def test_an_error_that_is_not_standard_outputs_passes_on(capfd):
    """``quiet_exits`` ends a command in one sentence only where standard output (here a file) failed: another
    OSError (a full disk under the command's own files) is not taken for it."""
    def fails() -> int:
        print("some output")
        raise OSError(28, "No space left on device")

    sys.stdout.fileno()  # (a file, which stdout_failure writes to: not a stream in memory)
    with pytest.raises(OSError, match="No space left on device"):
        quiet_exits(fails, "kvgates")
    assert capfd.readouterr() == ("some output\n", "")


@pytest.mark.parametrize("stdout", [None, "closed", "object"])
def test_an_error_of_the_commands_own_passes_on_where_there_is_no_standard_output_to_ask(stdout, monkeypatch):
    """With no standard output to ask (None under ``pythonw``, a closed file, an object with no ``fileno``),
    ``stdout_failure`` failed with an ``AttributeError`` or ``ValueError`` of its own, hiding the command's OSError."""
    if stdout == "closed":
        stdout = open(os.devnull, "w")
        stdout.close()
    elif stdout == "object":
        stdout = object()
    monkeypatch.setattr(sys, "stdout", stdout)

    def fails() -> int:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        quiet_exits(fails, "kvgates")


def test_ctrl_c_ends_the_command_quietly(checkpoint, monkeypatch, capsys):
    """Ctrl-C during a generation stops it with SIGINT's status and says nothing (it printed the traceback of wherever
    the model was, tens of lines)."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvgates, "load_model", interrupted)
    assert main(["generate", "--model", checkpoint, "--prompt", "x"]) == INTERRUPTED
    assert capsys.readouterr() == ("", "")
