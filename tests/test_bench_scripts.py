"""The GPU benchmark script stays runnable: its --smoke mode under the Triton interpreter."""

import argparse
import ast
import collections
import errno
import importlib.util
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")))
def test_every_bench_script_imports(script, monkeypatch):
    """Each script's imports resolve (``bench/ab_batching.py`` imported helpers that ``bench/common.py`` no longer
    had, so it failed at once); its ``main`` is not run."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", ROOT / "bench" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


BENCH_COMMANDS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in ("common.py", "hardware.py"))


def _run_help(script: str, monkeypatch) -> None:
    """Import the bench script ``script`` and run its ``main`` with ``--help``."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # (kernels.py and triton_compile.py add the repository root)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_help_{script[:-3]}", ROOT / "bench" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    module.main()


class _FullOutput(io.StringIO):
    """A standard output that takes no writes, as ``/dev/full``."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("script", BENCH_COMMANDS)
def test_every_bench_scripts_help_raises_a_failed_write(script, monkeypatch):
    """``bench/kernels.py --help > /dev/full`` (and ``| head -0``; triton_compile.py's and kvpress_peer_check.py's too)
    ended with status 0, silently: their parsers were argparse's, whose help ignores a failed write. Every bench
    script's parser is a ``kvgates.cli.OneLineParser`` now: the failed write reaches ``quiet_exits``, which ends the
    script as every command (status 1 and one sentence, or 141)."""
    monkeypatch.setattr(sys, "stdout", _FullOutput())
    with pytest.raises(OSError, match="No space left"):
        _run_help(script, monkeypatch)


@pytest.mark.parametrize("script", BENCH_COMMANDS)
def test_every_bench_scripts_help_reads_without_rest_markup(script, monkeypatch, capsys):
    """``--help`` showed the docstring's reStructuredText inline literals with their double backticks: the description
    now goes through ``kvgates.cli.plain`` (single backticks)."""
    with pytest.raises(SystemExit) as done:
        _run_help(script, monkeypatch)
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: ") and "``" not in out


@pytest.mark.parametrize("script", BENCH_COMMANDS)
def test_ctrl_c_ends_a_bench_script_quietly(script, monkeypatch, capsys):
    """Ctrl-C printed the traceback of wherever the bench was (tens of lines); each script now ends as ``kvgates``
    does (``kvgates.cli.quiet_exits``): SIGINT's status, no traceback."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "path", list(sys.path))  # (kernels.py, triton_compile.py and kvpress_peer_check.py add the repository root)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "argv", [script])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", interrupted)  # the first thing every script does
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    except KeyboardInterrupt:
        pytest.fail(f"Ctrl-C in {script} escaped as a KeyboardInterrupt (a traceback)")
    assert done.value.code == 130 and capsys.readouterr() == ("", "")


def test_an_interrupted_plot_or_trace_leaves_no_half_written_file(tmp_path, monkeypatch):
    """Ctrl-C while ``bench/kv_memory.py --plot`` or ``bench/policy_profile.py --trace`` wrote left a truncated PNG or
    JSON trace, and ``bench/kvpress_peer_check.py``'s sides a torn ``.pt`` file the next side failed to read: each is
    now written through a temporary file, and nothing is left of it."""
    import matplotlib.figure

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    modules = {}
    for name in ("kv_memory", "policy_profile", "kvpress_peer_check"):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])

    def half_then_interrupt(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_interrupt)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", half_then_interrupt)
    monkeypatch.setattr(torch, "save", lambda obj, path: half_then_interrupt(None, path))
    with pytest.raises(KeyboardInterrupt):
        modules["kvpress_peer_check"].save({"inputs": []}, tmp_path / "prompts.pt")
    with pytest.raises(KeyboardInterrupt):
        modules["kv_memory"].plot({"DynamicCache": [1, 2]}, [1, 2], tmp_path / "kv.png")
    with pytest.raises(KeyboardInterrupt):
        modules["policy_profile"].run_profiled(lambda: None, "cpu", tmp_path / "trace.json")
    assert list(tmp_path.iterdir()) == []


def test_kv_memory_plots_in_the_format_its_file_names(tmp_path, monkeypatch):
    """``bench/kv_memory.py --plot kv.svg`` (or ``.pdf``) wrote a PNG under that name once the plot went through a
    temporary file (whose name says no format); matplotlib wrote the format the suffix names before, as it does again.
    A name without a known suffix gets a PNG under that very name."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_kv_memory_formats", ROOT / "bench" / "kv_memory.py")
    kv_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv_memory)
    starts = {"kv.svg": b"<?xml", "kv.PDF": b"%PDF", "kv.png": b"\x89PNG", "kv": b"\x89PNG", "kv.plot": b"\x89PNG"}
    for name, start in starts.items():
        kv_memory.plot({"DynamicCache": [1, 2]}, [1, 2], tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(start), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(starts)


@pytest.mark.slow
def test_ab_batching_bench_runs_on_the_embedded_model():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ab_batching.py"), "--context", "120", "--rows", "2", "--budget", "32", "--policies", "h2o:recent=8"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "| h2o:recent=8 |" in result.stdout and "padded / one at a time" in result.stdout


def test_ab_batching_places_every_rows_needle_within_its_prompt(monkeypatch):
    """``--rows 5`` put the last needle at depth 4/3 (``i / 3``): make_example's ValueError once the model had loaded."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_ab_batching_depths", ROOT / "bench" / "ab_batching.py")
    ab_batching = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_batching)
    assert ab_batching.needle_depths(1) == [0.0] and ab_batching.needle_depths(4) == [0.0, 1 / 3, 2 / 3, 1.0]
    assert ab_batching.needle_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_ab_batching_pads_its_batch(monkeypatch, embedded_tokenizer):
    """Every row asked for ``--context`` tokens: all eight prompts of ``--context 4000 --rows 8`` (and all four of
    ``--context 260 --rows 4``) came out one length, so the 'padded batch' held no padding and took the causal path."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_ab_batching_prompts", ROOT / "bench" / "ab_batching.py")
    ab_batching = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_batching)
    for context, rows in ((4000, 8), (260, 4), (386, 2)):
        lengths = [len(p) for p in ab_batching.needle_prompts(embedded_tokenizer, context, rows)]
        assert len(set(lengths)) > 1 and max(lengths) <= context, (context, rows, lengths)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")
def test_kernel_bench_smoke():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    for kernel in ("decode+probs", "prefill+stats", "window scores", "compaction", "retention", "retention sum"):
        assert kernel in result.stdout


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")
def test_decode_sweep_smoke_ranks_the_configurations():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--sweep-decode"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "decode sweep fp32 D=16 B=1 C=64" in result.stdout and "4 configurations" in result.stdout
    assert "#1 " in result.stdout and "#4 " in result.stdout
    # Each configuration is printed as it is measured, after its shape's header: a sweep cut short leaves them.
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("decode sweep "))
    assert [line.split("]")[0].strip() for line in lines[header + 1 : header + 5]] == ["[1/4", "[2/4", "[3/4", "[4/4"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")
def test_prefill_sweep_smoke_ranks_both_passes(tmp_path):
    best = tmp_path / "best.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--sweep-prefill", "--best-json", str(best)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "prefill sweep fp32 D=16 B=1 N=64" in result.stdout
    assert "forward alone (attention and logsumexp), 2 configurations" in result.stdout
    assert "2 column configurations" in result.stdout and "column pass" in result.stdout
    assert result.stdout.count("(default)") == 2 and "fastest pair" in result.stdout
    # The fastest pair, written as KVGATES_PREFILL_CONFIG takes it (once after each pass), and the ranking's first.
    assert result.stdout.count(f"fastest so far written to {best}") == 2
    from kvgates.kernels.triton_ops import _prefill_override

    fastest = _prefill_override(best.read_text())
    ranks = [line for line in result.stdout.splitlines() if line.lstrip().startswith("#1 ")]
    assert [ast.literal_eval(line[line.index("{") : line.rindex("}") + 1]) for line in ranks] == [fastest["forward"], fastest["columns"]]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")
def test_both_sweeps_run_one_after_the_other(tmp_path):
    """``--sweep-decode --sweep-prefill --best-json PATH`` ran the decode sweep alone: no prefill sweep, PATH not written."""
    best = tmp_path / "best.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--sweep-decode", "--sweep-prefill", "--best-json", str(best)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert 0 <= result.stdout.find("decode sweep fp32 ") < result.stdout.find("prefill sweep fp32 ")
    from kvgates.kernels.triton_ops import _prefill_override

    assert set(_prefill_override(best.read_text())) == {"forward", "columns"}


@pytest.fixture
def bench_kernels(monkeypatch):
    """``bench/kernels.py`` as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    return kernels


def _cpu_attention(monkeypatch, capsys, *args: str) -> str:
    """``bench/cpu_attention.py ARGS`` run in this process (torch's threads put back after it); its stdout."""
    threads = torch.get_num_threads()
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "argv", ["cpu_attention.py", *args])
    try:
        runpy.run_path(str(ROOT / "bench" / "cpu_attention.py"), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None)
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def test_the_cpu_attention_bench_times_each_split_of_the_default_s_results(monkeypatch, capsys):
    """``bench/cpu_attention.py``: per thread count and length, sdpa, the default split (naming its parts) and each
    forced one (``reference.row_parts``), whose results it checks equal before timing; threads back as they were."""
    out = _cpu_attention(monkeypatch, capsys, "--contexts", "128", "--rounds", "2", "--threads", "1", "2", "--parts", "1", "2", "--window", "8")
    assert "smollm2-135m's heads (9 query, 3 KV, dim 64)" in out
    for header in ("1 threads, 128 tokens", "2 threads, 128 tokens"):
        table = out.split(header)[1]
        assert all(f"| {arm} |" in table for arm in ("sdpa (no statistics)", "1 part", "2 parts")), table
    assert "| default (1 part) |" in out.split("2 threads")[0] and "| default (2 parts) |" in out.split("2 threads")[1]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cpu_attention.py"), "--parts", "2", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("cpu_attention.py: --parts must be at least 1, got 0")


def test_the_cpu_attention_bench_times_no_split_that_runs_unsplit(monkeypatch, capsys):
    """``reference.row_parts`` runs a forced split whose parts would keep fewer than ``MIN_PART_ROWS`` rows unsplit: the
    bench timed it all the same under its name ('8 parts': SmolLM2's 3 query heads of a 64-row tile are 192 rows, 24 a
    part), a second unsplit arm, as ``gpu_session.sh``'s ``cpu-threads`` asked at 4K. It now says so and times it not."""
    out = _cpu_attention(monkeypatch, capsys, "--contexts", "128", "--rounds", "1", "--threads", "1", "--parts", "1", "8")
    assert "| 1 part |" in out and "| 8 parts |" not in out, out
    assert "note: --parts 8 at 128 tokens: a part would keep fewer than 32 rows (192 a KV head's tile); it runs unsplit, not timed" in out, out


def test_every_configuration_the_prefill_sweep_measures_is_one_the_override_takes(bench_kernels):
    """``bench/kernels.py --sweep-prefill --best-json`` writes its fastest pair for KVGATES_PREFILL_CONFIG: any
    configuration of its grids (on a GPU, not the smoke run's) must parse there, or ``prefill-tuned`` measures
    nothing."""
    kernels = bench_kernels
    from kvgates.kernels.triton_ops import _prefill_override

    forwards = [c for c in kernels.configurations(kernels.PREFILL_FORWARD_GRID) if c["BLOCK_M"] % c["BLOCK_N"] == 0]
    columns = kernels.configurations(kernels.PREFILL_COLUMN_GRID)
    assert (len(forwards), len(columns)) == (18, 36)
    for forward in forwards:
        for column in columns:
            _prefill_override(json.dumps({"forward": forward, "columns": column}))
    # The GPU's 16-bit defaults are among them, so that a sweep measures and marks them (stop 59's column default is
    # the H200 sweep's fastest).
    from kvgates.kernels.triton_ops import _prefill_config

    for d in (64, 128):
        default = _prefill_config(d, torch.bfloat16, torch.device("cuda"))
        assert default["forward"] in forwards and default["columns"] in columns
    assert _prefill_config(128, torch.bfloat16, torch.device("cuda"))["columns"] == {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


def test_the_kernels_stage_times_the_prefill_reference_only_up_to_one_8k_sequence(bench_kernels, capsys):
    """The scoring prefill's torch reference took 2.9 s a call at batch 1, 32K on an H200 and 8.7 s at batch 4 (about
    seven calls a shape): the GPU session's ``kernels`` stage (batch 1-32, 4K-32K) ran past its 240 s before batch 8
    was done. Above one 8K sequence's work it is skipped, and its line says so."""
    timed = [(b, c) for b in (1, 4, 8, 32) for c in (4096, 16384, 32768) if bench_kernels.times_reference_prefill(b, c)]
    assert timed == [(1, 4096), (4, 4096)]
    assert bench_kernels.times_reference_prefill(1, 8192) and not bench_kernels.times_reference_prefill(2, 8192)
    bench_kernels.row("prefill+stats", "shape", 1e-3, None, 10**9, None, "extra")
    bench_kernels.row("prefill+stats", "shape", 1e-3, 2e-3, 10**9, None, "extra")
    skipped, timed_line = capsys.readouterr().out.splitlines()
    assert "skipped" in skipped and "2.00x" in timed_line and len(skipped) == len(timed_line)


@pytest.mark.parametrize(
    "where, message",
    [
        # an IsADirectoryError traceback once the forward's sweep had run (a GPU's: minutes), a best.json.partial left beside it
        ("folder", "--best-json {tmp} is a folder; name the JSON file to write"),
        # a PermissionError (FileNotFoundError in /proc) traceback at the same point
        ("/proc/best.json", "--best-json /proc/best.json: its folder /proc takes no new files ("),
        ("", "--best-json is empty; name the JSON file to write"),  # nothing written, and no word of it
    ],
)
def test_a_best_json_that_cannot_be_written_is_one_sentence_before_the_sweep(tmp_path, where, message):
    path = str(tmp_path) if where == "folder" else where
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--sweep-prefill", "--best-json", path],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith(f"kernels.py: {message.format(tmp=tmp_path)}"), result.stderr
    assert "prefill sweep" not in result.stdout and list(tmp_path.iterdir()) == []
    assert not Path(f"{tmp_path}.partial").exists()


def test_a_negative_peak_bandwidth_is_one_sentence_before_the_kernels_are_measured():
    """``bench/kernels.py --peak-gbps -5`` measured every kernel and printed each one's bandwidth as -0.0% of that peak
    (``bench/gpu_policies.py`` refuses it)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--peak-gbps", "-5"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("kernels.py: --peak-gbps must be at least 0, got -5.0"), result.stderr
    assert "us" not in result.stdout


def test_best_json_is_the_prefill_sweeps_and_a_bad_prefill_config_is_one_sentence(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--best-json", str(tmp_path / "best.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 2 and "--best-json is the prefill sweep's: add --sweep-prefill" in result.stderr
    env = {**os.environ, "KVGATES_PREFILL_CONFIG": '{"columns": {"BLOCK_N": 48}}'}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefill_speed.py"), "--model", "random", "--layers", "1", "--context", "64",
         "--budget", "32", "--policies", "h2o"], capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "prefill_speed.py: KVGATES_PREFILL_CONFIG's columns.BLOCK_N must be a power of two from 16, got 48 (see prefill_speed.py --help)"
    )
    # Well formed, but not with the defaults it leaves on this device (a forward of 32 rows a program on the CPU, 64
    # or 128 on a GPU): refused before the model loads too, not at the first prefill.
    env["KVGATES_PREFILL_CONFIG"] = '{"forward": {"BLOCK_N": 256}}'
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefill_speed.py"), "--model", "random", "--layers", "1", "--context", "64",
         "--budget", "32", "--policies", "h2o"], capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert re.search(r"BLOCK_M (32|64|128) and BLOCK_N 256 here \(with the defaults it leaves\): BLOCK_M must be a multiple of BLOCK_N",
                     result.stderr), result.stderr


def test_train_step_bench_runs_on_a_small_random_model():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_step.py"), "--model", "random", "--layers", "2", "--lengths", "160",
         "--budget", "64", "--repeats", "1", "--eviction", "soft", "hard", "relaxed"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ")[0] + " |" for line in result.stdout.splitlines() if line.startswith("| ") and " | 160 |" in line]
    # TRIM-KV once per eviction; Locret trains one way only.
    assert rows == ["| trimkv |", "| trimkv (hard) |", "| trimkv (relaxed) |", "| locret |"]


def test_decode_speed_bench_runs_on_a_small_random_model():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_speed.py"), "--model", "random", "--layers", "2", "--configs", "160:64",
         "--batch", "1", "2", "--steps", "2", "--rounds", "1", "--slack", "4", "--policies", "snapkv", "h2o", "morphkv", "trimkv", "trimkv-morph"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = ("| DynamicCache 64 |", "| DynamicCache 160 |", "| snapkv |", "| h2o |", "| h2o slack=4 |", "| morphkv slack=4 |",
            "| trimkv slack=4 |", "| trimkv-morph slack=4 |")
    for row in rows:
        assert result.stdout.count(row) == 2, row  # batch 1 and batch 2


def test_a_bench_refuses_an_unknown_policy_or_a_missing_gpu_in_one_sentence_before_its_model():
    """``--policies snapk`` (or ``--device cuda`` without a GPU) ended in a traceback once the model had been built."""
    argv = [[sys.executable, str(ROOT / "bench" / "decode_speed.py"), "--model", "random", "--layers", "1", "--policies", "h2o", "snapk"]]
    if not torch.cuda.is_available():
        argv.append([sys.executable, str(ROOT / "bench" / "kv_memory.py"), "--model", "random", "--device", "cuda"])
    messages = ("--policies: unknown policy 'snapk'; available policies: adakv", "--device cuda: this machine has no CUDA GPU that torch can use")
    for args, message in zip(argv, messages):
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and message in lines[-1] and "Traceback" not in result.stderr, result.stderr
        assert "device:" not in result.stdout  # the header line printed once the model is loaded


def test_decode_speed_bench_compiles_static_caches():
    """--compile adds the compiled StaticCache reference and a compiled static BudgetCache per policy (batch 2: the
    StaticCache is prefilled again, its layers cannot repeat their batch); --compile-mode reaches torch.compile
    (reduce-overhead marks each step for CUDA graphs; on the CPU it compiles as default does)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_speed.py"), "--model", "random", "--layers", "2", "--configs", "160:64",
         "--batch", "2", "--steps", "2", "--rounds", "1", "--slack", "4", "--policies", "snapkv", "h2o", "--compile", "aot_eager",
         "--compile-mode", "reduce-overhead"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    for row in ("| h2o |", "| StaticCache 64 compiled |", "| snapkv compiled |", "| h2o compiled |", "| h2o slack=4 compiled |"):
        assert row in result.stdout, row


def test_prefill_speed_bench_runs_on_a_small_random_model():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefill_speed.py"), "--model", "random", "--layers", "2", "--context", "160",
         "--budget", "64", "--rounds", "2", "--policies", "h2o", "d2o", "kvmerger", "trimkv", "kvzip", "adakv:base=trimkv-snap"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr  # a wrapper around a learned policy got no gates ('gates are required')
    for row in ("| DynamicCache + sdpa |", "| full (kvgates) |", "| h2o@64 |", "| d2o@64 |", "| kvmerger@64 |", "| trimkv@64 |", "| kvzip@64 |",
                "| adakv:base=trimkv-snap@64 |"):
        assert row in result.stdout, row
    assert "| DynamicCache + sdpa | " in result.stdout and " | 1.00x | 1.00-1.00x |" in result.stdout  # its own rounds


def test_gpu_policies_bench_runs_on_a_small_random_model():
    """Prefill and decode tables for every batch, with a roofline when a peak bandwidth is given (none on CPU); a
    second round crops the DynamicCaches back to their prompts (which failed under transformers 5.23's ``crop``)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_policies.py"), "--model", "random", "--layers", "2", "--contexts", "96",
         "--budget", "48", "--batch", "1", "2", "--steps", "2", "--rounds", "2", "--slack", "4", "--peak-gbps", "50",
         "--policies", "h2o", "snapkv"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("prefill, context 96") == 2 and out.count("decode, context 96, budget 48") == 2
    assert out.count("| DynamicCache + sdpa | ") == 2  # the prefill reference, per batch
    for row in ("| h2o | ", "| h2o slack=4 | ", "| snapkv | "):
        assert out.count(row) == 4, row  # a prefill and a decode row per batch
    decode_rows = [line for line in out.splitlines() if line.count("|") == 7 and not line.startswith(("| cache", "|---"))]
    assert len(decode_rows) == 2 * 5  # DynamicCache at the context and at the budget, h2o (twice), snapkv; per batch
    assert all(line.endswith("x |") for line in decode_rows)  # every step against its roofline


def test_gpu_policies_bench_adds_captured_decode_rows():
    """--compile adds the compiled StaticCache reference and a compiled static BudgetCache per policy whose decode
    compiles (h2o with and without slack, snapkv), in the same decode table with their rooflines. The first decode
    token, a slice of the prompt, had its row's stride and the steps' own tokens not: the step compiled again within
    the timed steps (``TORCH_LOGS=recompiles``: 'stride mismatch at index 0')."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_policies.py"), "--model", "random", "--layers", "2", "--contexts", "96",
         "--budget", "48", "--batch", "2", "--steps", "2", "--rounds", "1", "--slack", "4", "--peak-gbps", "50",
         "--policies", "h2o", "snapkv", "--compile", "aot_eager", "--compile-mode", "reduce-overhead"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TORCH_LOGS": "recompiles"},
    )
    assert result.returncode == 0, result.stderr
    assert "[__recompiles]" in result.stderr and "stride mismatch" not in result.stderr  # (one graph per cache kind)
    for row in ("| StaticCache 48 captured | ", "| h2o captured | ", "| h2o slack=4 captured | ", "| snapkv captured | "):
        line = next(line for line in result.stdout.splitlines() if line.startswith(row))
        assert line.endswith("x |"), line
    assert result.stdout.count("| h2o captured | ") == 2  # a prefill row and a decode row


def _bench(monkeypatch, script: str, *args: str):
    """``bench/SCRIPT.py`` as a module whose ``main()`` runs ``args`` on a one-layer random model: to run in this
    process with its timings stubbed."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{script}", ROOT / "bench" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--model", "random", "--layers", "1", *args])
    return module


def _gpu_policies(monkeypatch, *args: str):
    """``_bench`` of ``bench/gpu_policies.py`` at context 96, budget 48, batch 1."""
    return _bench(monkeypatch, "gpu_policies", "--contexts", "96", "--budget", "48", "--batch", "1", *args)


def _decode_rows(out: str, columns: int = 6) -> dict[str, list[str]]:
    """``{cache: [its cells]}`` of the decode tables of ``columns`` columns in ``out`` (the last table's where several
    have a cache)."""
    rows = [
        line.strip("| ").split(" | ") for line in out.splitlines() if line.count("|") == columns + 1 and not line.startswith(("| cache", "|---"))
    ]
    return {row[0]: row[1:] for row in rows}


def test_gpu_policies_decode_medians_leave_out_a_warm_up_round(monkeypatch, capsys):
    """Each arm's first decode round was one of the rounds its median took: on an H200 DynamicCache + sdpa ran 67.7,
    23.5 and 13.0 ms/step in rounds 1-3, and a median of two rounds is their mean."""
    module = _gpu_policies(monkeypatch, "--steps", "2", "--rounds", "2", "--slack", "0", "--policies", "h2o")
    calls = collections.Counter()

    def time_decode(model, cache, token, steps, device):  # 1000 ms/step in a cache's first round, 4 in the others
        calls[id(cache)] += 1
        return steps * (1.0 if calls[id(cache)] == 1 else 0.004)

    monkeypatch.setattr(module, "time_decode", time_decode)
    module.main()
    out = capsys.readouterr()
    rows = _decode_rows(out.out)
    assert sorted(rows) == ["DynamicCache 48", "DynamicCache 96", "h2o"] and all(cells[0] == "4.00" for cells in rows.values()), rows
    assert sorted(calls.values()) == [3, 3, 3]  # a warm-up round and two
    assert "  warm-up round: h2o 1000.00 ms/step\n" in out.err and "  round 2/2: h2o 4.00 ms/step\n" in out.err


def test_gpu_policies_times_an_amortised_arm_over_whole_eviction_periods(monkeypatch, capsys):
    """An arm that evicts every ``slack + 1`` steps was timed over ``--steps``: at the defaults (8 steps, two rounds,
    slack 32) it decoded 20 tokens and never evicted, and its row was the cost of a step without eviction."""
    module = _gpu_policies(monkeypatch, "--steps", "6", "--rounds", "1", "--slack", "4", "--policies", "h2o", "morphkv", "snapkv")
    monkeypatch.setattr(module, "time_decode", lambda model, cache, token, steps, device: steps * steps / 1e3)  # ms/step: its steps
    module.main()
    out = capsys.readouterr().out
    assert {label: cells[0] for label, cells in _decode_rows(out).items()} == {
        "DynamicCache 96": "6.00", "h2o": "6.00", "h2o slack=4": "10.00", "morphkv": "6.00", "morphkv slack=4": "10.00", "snapkv": "6.00",
        "DynamicCache 48": "6.00",
    }
    assert "median ms/step of 1 rounds x 6 steps (10 for the caches that evict every few steps: whole eviction periods)\n" in out


def test_gpu_policies_runs_the_arms_in_reverse_order_every_other_round(monkeypatch, capsys):
    """Every round ran the arms in one order, DynamicCache + sdpa (every ratio's reference) first: a drift across a
    round (on an H200 the first arm's decode was still 23.5 ms/step in round 2, the last arm's 12.9) fell on the same
    arms in every round. The tables keep the arms' order."""
    module = _gpu_policies(monkeypatch, "--steps", "1", "--rounds", "2", "--slack", "0", "--policies", "h2o", "snapkv")
    makes = []
    time_prefill = module.time_prefill

    def recording_prefill(model, make, ids, device):
        makes.append(make)
        return time_prefill(model, make, ids, device)

    monkeypatch.setattr(module, "time_prefill", recording_prefill)
    monkeypatch.setattr(module, "time_decode", lambda model, cache, token, steps, device: 1e-3 * steps)
    module.main()
    out = capsys.readouterr()
    assert makes[3:6] == makes[:3][::-1] and makes[6:9] == makes[:3]  # the warm-up round and two (then the small DynamicCache)
    order = ["DynamicCache + sdpa", "h2o", "snapkv", "DynamicCache 48"]
    runs = [line.split(": ", 1)[1].rsplit(" ", 2)[0] for line in out.err.splitlines() if "round" in line and " ms/step" in line]
    assert runs == order + order[::-1] + order
    assert list(_decode_rows(out.out)) == ["DynamicCache 96", "h2o", "snapkv", "DynamicCache 48"]
    prefill = [line.split(" | ")[0] for line in out.out.splitlines() if line.startswith("| ") and line.count("|") == 4]
    assert prefill == ["| arm", "| DynamicCache + sdpa", "| h2o", "| snapkv"]


def test_decode_speed_medians_leave_out_a_warm_up_round(monkeypatch, capsys):
    """Each cache's first round at a batch size was one of the rounds its median took (on the CPU at --rounds 2,
    snapkv's step at batch 2 was 48.0 and 25.9 ms in rounds 1 and 2, and 37.0 in the table, 1.44x the DynamicCaches')."""
    module = _bench(monkeypatch, "decode_speed", "--configs", "96:48", "--batch", "1", "2", "--steps", "2", "--rounds", "2", "--slack", "0",
                    "--policies", "h2o")
    calls = collections.Counter()

    def time_decode(model, cache, token, steps, device):  # 1000 ms/step in a cache's first round at a batch size, 4 in the others
        calls[id(cache), token.shape[0]] += 1
        return steps * (1.0 if calls[id(cache), token.shape[0]] == 1 else 0.004)

    monkeypatch.setattr(module, "time_decode", time_decode)
    module.main()
    out = capsys.readouterr()
    rows = _decode_rows(out.out, columns=4)
    assert list(rows) == ["DynamicCache 48", "DynamicCache 96", "h2o"] and all(cells[0] == "4.0" for cells in rows.values()), out.out
    assert out.out.count("| h2o | 4.0 | 1.00x | 1.00x |") == 2  # batch 1 and batch 2
    assert sorted(calls.values()) == [3] * 6  # a warm-up round and two, per cache and batch
    assert "  warm-up round, batch 2: h2o 1000.00 ms/step\n" in out.err and "  round 2/2, batch 2: h2o 4.00 ms/step\n" in out.err


def test_decode_speed_runs_the_caches_in_reverse_order_every_other_round(monkeypatch, capsys):
    """Every round ran the caches in one order, the DynamicCache of the budget (every ratio's reference) first: a drift
    across a round fell on the same caches in every round. The table keeps the caches' order."""
    module = _bench(monkeypatch, "decode_speed", "--configs", "96:48", "--batch", "1", "--steps", "1", "--rounds", "2", "--slack", "0",
                    "--policies", "h2o", "snapkv")
    monkeypatch.setattr(module, "time_decode", lambda model, cache, token, steps, device: 1e-3 * steps)
    module.main()
    out = capsys.readouterr()
    order = ["DynamicCache 48", "DynamicCache 96", "h2o", "snapkv"]
    runs = [line.split(": ", 1)[1].rsplit(" ", 2)[0] for line in out.err.splitlines() if "round" in line and " ms/step" in line]
    assert runs == order + order[::-1] + order  # the warm-up round and two
    assert list(_decode_rows(out.out, columns=4)) == order


def test_decode_speed_times_an_amortised_cache_over_whole_eviction_periods(monkeypatch, capsys):
    """A cache that evicts every ``slack + 1`` steps was timed over ``--steps``: at the defaults (16 steps, slack 32) a
    round's 18 decoded tokens held one eviction or none, and its median was mostly steps without one."""
    module = _bench(monkeypatch, "decode_speed", "--configs", "96:48", "--batch", "1", "--steps", "6", "--rounds", "1", "--slack", "4",
                    "--policies", "h2o", "morphkv", "snapkv")
    monkeypatch.setattr(module, "time_decode", lambda model, cache, token, steps, device: steps * steps / 1e3)  # ms/step: its steps
    module.main()
    out = capsys.readouterr().out
    assert {label: cells[0] for label, cells in _decode_rows(out, columns=4).items()} == {
        "DynamicCache 48": "6.0", "DynamicCache 96": "6.0", "h2o": "6.0", "h2o slack=4": "10.0", "morphkv": "6.0", "morphkv slack=4": "10.0",
        "snapkv": "6.0",
    }
    assert "median of 1 rounds x 6 steps (10 for the caches that evict every few steps: whole eviction periods)\n" in out


def test_decode_speed_times_a_batch_of_a_different_prompt_in_every_row(monkeypatch, capsys):
    """Every cache was prefilled at batch 1 and repeated (``batch_repeat_interleave``) for a larger batch: every row
    held the same prompt, so a policy's per-row choices coincided (every row keeping the same tokens in every head)
    and the step's cost of ragged rows went unmeasured. Each batch size now prefills its own caches from a passage a
    row (``common.essay_ids``)."""
    module = _bench(monkeypatch, "decode_speed", "--configs", "96:48", "--batch", "2", "4", "--steps", "1", "--rounds", "1",
                    "--slack", "0", "--policies", "h2o", "adakv")
    prompts, timed = {}, collections.defaultdict(list)

    def prefilled(model, make_cache, ids):
        cache, token = real_prefilled(model, make_cache, ids)
        prompts[id(cache)] = ids
        return cache, token

    def time_decode(model, cache, token, steps, device):
        timed[token.shape[0]].append(prompts[id(cache)])
        return 1e-3 * steps

    real_prefilled = module.prefilled
    monkeypatch.setattr(module, "prefilled", prefilled)
    monkeypatch.setattr(module, "time_decode", time_decode)
    module.main()
    assert sorted(timed) == [2, 4] and all(len(runs) == 2 * 4 for runs in timed.values())  # a warm-up round and one, 4 caches
    for batch, ids in timed.items():
        assert all(len({tuple(row.tolist()) for row in prompt}) == batch for prompt in ids), batch
    assert "| h2o | 1.0 |" in capsys.readouterr().out


def test_decode_speed_sizes_the_compiled_static_cache_for_one_batch(monkeypatch, capsys):
    """The compiled reference, a StaticCache prefilled anew at every batch size, had room for the tokens of every batch
    size's rounds, and every step attends over all its slots: at the defaults (batch 1 and 8) the 'StaticCache 256'
    row held 364 slots. It now has the budget's and one batch size's: a warm-up round and ``--rounds``, each
    ``--steps`` and two untimed, in a new cache at every batch (``--batch 1 1 2``: not the first one's again)."""
    module = _bench(monkeypatch, "decode_speed", "--configs", "96:48", "--batch", "1", "1", "2", "--steps", "3", "--rounds", "2",
                    "--slack", "0", "--policies", "h2o", "--compile", "aot_eager")
    seen = {}

    def time_compiled(forward, cache, token, steps, device):
        if isinstance(cache, module.StaticCache):
            seen.setdefault(id(cache), (cache, token.shape[0], cache.get_max_length()))
        return 1e-3 * steps

    monkeypatch.setattr(module, "time_compiled", time_compiled)
    monkeypatch.setattr(module, "time_decode", lambda model, cache, token, steps, device: 1e-3 * steps)
    module.main()
    assert [(batch, slots) for _, batch, slots in seen.values()] == [(1, 48 + 3 * 5), (1, 48 + 3 * 5), (2, 48 + 3 * 5)]
    assert capsys.readouterr().out.count("| StaticCache 48 compiled | ") == 3


def _gpu_session(tmp_path: Path, *stages: str, seconds: str = "1500", cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``bench/gpu_session.sh STAGE...`` at toy sizes, its files in ``tmp_path``, run in ``cwd``; ``env`` overrides."""
    env = {**os.environ, "OUT": str(tmp_path), "GPU_SESSION_SMOKE": "1", "PYTHON": sys.executable, "GPU_SESSION_SECONDS": seconds, **env}
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_session.sh"), *stages], capture_output=True, text=True, timeout=1800, env=env, cwd=cwd
    )


def test_gpu_session_env_stage_logs_versions_and_an_unknown_stage_is_refused(tmp_path):
    result = _gpu_session(tmp_path, "env")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.log"]  # no profile: no traces' archive
    log = (tmp_path / "session.log").read_text()
    assert "torch" in log and "kernels" in log and "=== env done, exit status 0" in log
    assert "=== summary\nenv: exit status 0, " in log
    # A misspelt stage is refused before any stage runs (a lent GPU's minutes are not spent on the ones before it).
    (tmp_path / "session.log").unlink()
    result = _gpu_session(tmp_path, "env", "decoder")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "unknown stage 'decoder': choose from issue27 env tests decode-sweep prefill-sweep profile prefill-b1 decode captured captured-evict "
        "captured-merge prefill prefill-rest kernels train train-dms cpu-threads"
    )
    assert list(tmp_path.iterdir()) == []
    # A call's stages end within GPU_SESSION_SECONDS of its start: one with under 10 s left is skipped, a failure.
    result = _gpu_session(tmp_path, "env", seconds="5")
    assert result.returncode == 1
    log = (tmp_path / "session.log").read_text()
    assert log.startswith("=== env skipped: ") and "of the call's 5 s" in log and "\n=== summary\nenv: skipped, " in log


def test_gpu_session_cpu_threads_stage_times_the_cpu_split_at_toy_sizes(tmp_path):
    """``cpu-threads`` (the CPU's split products timed at each thread count) runs both its benches."""
    result = _gpu_session(tmp_path, "cpu-threads")
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "session.log").read_text()
    assert log.count("=== cpu-threads done, exit status 0") == 2 and log.count("| default (2 parts) |") == 2, log


def test_gpu_session_refuses_seconds_that_are_not_a_whole_number_before_it_makes_anything(tmp_path):
    """``GPU_SESSION_SECONDS=300s`` (or ``abc``) ran no stage and exited 0, or ended in 'unbound variable'."""
    for seconds in ("300s", "abc"):
        result = _gpu_session(tmp_path / "out", "env", seconds=seconds)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"GPU_SESSION_SECONDS={seconds}: give the seconds the call's stages may take as a whole number (570 by default)"
        )
        assert not (tmp_path / "out").exists()


def test_gpu_session_writes_a_relative_out_under_the_callers_folder(tmp_path):
    """A relative ``OUT`` was taken after the script's ``cd`` to the repository root, and written there."""
    result = _gpu_session(Path("relative"), "env", cwd=tmp_path)
    assert result.returncode == 0 and (tmp_path / "relative" / "session.log").is_file(), result.stderr
    assert not (ROOT / "relative").exists()


def test_gpu_session_records_a_failed_policy_listing_and_goes_on(tmp_path):
    """``prefill-b1`` lists the registered policies first; where that failed, ``set -e`` ended the call there: no
    footer, no summary, no later stage. (Under 10 s left: the stages after it are skipped, not run.)"""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\ncase "$*" in *kvgates.POLICIES*) echo "ImportError: no kvgates here" >&2; exit 3;; esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    result = _gpu_session(tmp_path / "out", "prefill-b1", "env", seconds="5", PYTHON=str(python))
    assert result.returncode == 1 and "ImportError: no kvgates here" in result.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert log.startswith("ImportError: no kvgates here\n=== prefill-b1 not run: listing the registered policies failed, exit status 3\n")
    summary = log[log.index("=== summary\n") :].splitlines()[1:]
    assert summary[0] == "prefill-b1: exit status 3, listing the registered policies"
    assert [line.partition(":")[0] for line in summary] == ["prefill-b1", "prefill-b8", "env"]


def test_gpu_session_smoke_takes_the_gpus_paths_in_the_first_calls_and_collects_the_kernels_tests(tmp_path):
    """A smoke run's ``issue27`` and ``prefill-sweep`` took the CPU's paths (the reference kernels, the CPU's tiles and
    reads), not the GPU's, and ran another test file than the kernels' (a file renamed failed on the GPU only). The
    bench scripts are recorded here, not run (the slow test runs them)."""
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\necho "${{KVGATES_KERNELS:-auto}} ${{KVGATES_LAUNCH_BOUND:-0}} $*" >> {calls}\n'
        'case "$1" in bench/*)\n'
        '    for arg; do [ "$last" = --best-json ] && echo {{}} > "$arg"; last=$arg; done  # (prefill-tuned runs after it)\n'
        '    exit 0;;\nesac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    result = _gpu_session(tmp_path / "out", "issue27", "prefill-sweep", PYTHON=str(python))
    assert result.returncode == 0, (tmp_path / "out" / "session.log").read_text()
    lines = calls.read_text().splitlines()
    policies = [line for line in lines if " bench/gpu_policies.py " in line or " bench/policy_profile.py " in line]
    assert len(policies) == 6 and all(line.startswith("triton 1 ") for line in policies), lines  # changed, triton, b8, 16k, profile, tuned
    # The kernels' tests, then the five that failed on stop 60's H200 for the machine (by node id: one renamed fails the
    # collection, and the stage).
    assert any(" -m pytest " in line and " --collect-only tests/test_kernels.py tests/test_seed_policies.py tests/test_runtime_on_kernels.py "
               "tests/test_gates.py::test_a_hub_id_is_refused_at_once_when_the_hub_cannot_be_reached " in line
               and line.endswith("::test_generate_with_chunked_prefill_compiles_only_the_decode_steps_of_a_static_cache") for line in lines), lines
    # The limits, a GPU's seconds, doubled: the interpreter runs those kernels (prefill-b8 took 66 s of its 90 on the CPU).
    log = (tmp_path / "out" / "session.log").read_text()
    assert ", limit 180 s): env KVGATES_KERNELS=triton KVGATES_LAUNCH_BOUND=1 " in log[log.index("=== prefill-b8 (") :].splitlines()[0]


def test_gpu_session_without_a_stage_says_how_to_call_it_and_without_a_gpu_refuses_to_measure(tmp_path):
    """With no stage the script printed only its summary and exited 0; without a GPU (and not a smoke run) the decode
    stage started building the 32-layer 8B random model on the host in float32 (32 GB), which died out of memory."""
    result = _gpu_session(tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("usage: bash bench/gpu_session.sh STAGE... (stages: issue27 env")
    assert subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "--help"], capture_output=True, text=True).returncode == 0
    if torch.cuda.is_available():
        return
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_SESSION_SMOKE": "0"}
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_session.sh"), "env", "cpu-threads", "decode"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 2 and result.stderr.strip() == (  # (cpu-threads measures the machine's CPU: not listed)
        "no CUDA device here, and these stages measure a GPU: decode (GPU_SESSION_SMOKE=1 runs every stage at toy sizes, to check this script)"
    )
    assert list(tmp_path.iterdir()) == []  # no stage ran, env neither


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")
def test_gpu_session_stages_run_at_toy_sizes(tmp_path):
    """Every measuring stage of the GPU session script runs at toy sizes (GPU_SESSION_SMOKE=1), so that a lent GPU's
    few minutes are not spent on a broken script; whatever the stages, a call leaves three files, within the 8 a
    device call brings back."""
    stages = ("decode-sweep", "prefill-sweep", "profile", "prefill-b1", "decode", "captured", "captured-evict", "captured-merge", "prefill",
              "prefill-rest", "kernels", "train", "train-dms", "cpu-threads")
    result = _gpu_session(tmp_path, *stages, "issue27")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefill-best.json", "session.log", "tests.xml", "traces.tar.gz"]
    log = (tmp_path / "session.log").read_text()
    summary = log[log.rindex("=== summary") :].splitlines()[1:]
    # prefill-tuned ran under the sweep's fastest pair (as the bench prints it, not the stage's header)
    assert f"; KVGATES_PREFILL_CONFIG={(tmp_path / 'prefill-best.json').read_text().strip()}\n" in log
    for stage in (*stages, "copies", "prefill-b8", "tests", "prefill-changed", "prefill-triton", "prefill-16k", "kernels-8k", "prefill-tuned"):
        assert f"=== {stage} done, exit status 0" in log, stage
        assert any(line.startswith(f"{stage}: exit status 0, ") for line in summary), stage
    assert "exit status 1" not in log and "exit status 124" not in log, log[-3000:]
    with tarfile.open(tmp_path / "traces.tar.gz") as archive:  # both profiles' traces, neither over the other
        traces = [name for name in archive.getnames() if name.endswith(".json")]
    # a prefill and a decode trace of each arm: DynamicCache's and six policies', then DynamicCache's and two
    assert len(traces) == 2 * (1 + 6) + 2 * (1 + 2) and len({name.rpartition("/")[0] for name in traces}) == 2


def test_the_fused_prefill_kernel_compiles_for_an_a100_and_an_h100():
    """The prefill kernel's GPU block sizes fit both GPUs' shared memory in every dtype (float32 at head dim 128
    needed 225 KiB, more than an A100's 163, before its config was split by row width); compiled down to a cubin
    by Triton without a GPU (``bench/triton_compile.py``)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "triton_compile.py"), "--arch", "80", "90", "--only", "causal_attention_stats"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sm_80 causal_attention_stats: ok" in result.stdout and "sm_90 causal_attention_stats: ok" in result.stdout


def test_launch_count_bench_runs_on_a_small_random_model():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "launches.py"), "--model", "random", "--layers", "2", "--context", "160",
         "--budget", "64", "--slack", "4", "--policies", "full", "h2o", "--ops", "3"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ")}
    assert rows["DynamicCache + sdpa"][2] == "1.00x" and rows["h2o slack=4"][-1].strip(" |") == "0.00"
    assert "h2o, decode step per layer:" in result.stdout


def test_launch_count_bench_counts_the_gpus_paths_on_the_cpu():
    # --launch-bound: KVMerger's scan as a GPU runs it (no read to stop its doublings early, one read per four walk
    # steps), counted on the CPU: fewer host reads in its prefill than the CPU's own path. ``--device cpu``: on a GPU
    # machine the bench would take the GPU, where both runs take the launch-bound path (stop 48's H100 run).
    syncs = {}
    for flag in ([], ["--launch-bound"]):
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "launches.py"), "--model", "random", "--layers", "1", "--context", "600",
             "--budget", "64", "--slack", "0", "--policies", "kvmerger", "--device", "cpu", *flag],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stderr
        row = next(line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| kvmerger "))
        syncs[bool(flag)] = float(row[3])
    assert syncs[True] < syncs[False]


def test_policy_profile_bench_runs_on_a_small_random_model(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "policy_profile.py"), "--model", "random", "--layers", "2", "--context", "160",
         "--budget", "64", "--steps", "2", "--policies", "h2o", "--top", "3", "--trace", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    tables = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0].strip("| ") for row in tables] == ["arm", "DynamicCache + sdpa", "h2o"] * 2
    assert tables[1][2] == tables[4][2] == "1.00x"
    for part in ("prefill", "decode step (2 profiled)"):
        assert f"h2o, {part}: operators by own time over the reference's" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "DynamicCache_plus_sdpa-decode.json", "DynamicCache_plus_sdpa-prefill.json", "h2o-decode.json", "h2o-prefill.json"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "random:llama-8b"], "--model random:llama-8b: unknown random model shape; known: random:smollm2-135m"),  # exit 1
        (["--model", "random", "--layers", "0"], "--layers must be at least 1, got 0"),  # an UnsupportedModelError traceback
        (["--model", "random", "--layers", "1", "--steps", "0"], "--steps must be at least 1, got 0"),  # a ZeroDivisionError
        (["--model", "random", "--layers", "1", "--batch", "1", "0"], "--batch must be at least 1, got 0"),
        (["--model", "random", "--layers", "1", "--slack", "-1"], "--slack must be at least 0, got -1"),  # 0: no amortised rows
    ],
)
def test_a_bench_refuses_a_count_below_what_it_counts_in_one_sentence_before_its_model(args, message):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_speed.py"), *args], capture_output=True, text=True, timeout=600)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"decode_speed.py: {message}"), result.stderr
    assert "device:" not in result.stdout  # the header line printed once the model is loaded


def test_a_bench_refuses_a_model_it_cannot_load_in_one_sentence(tmp_path):
    """``--model foo/bar`` (not in the cache, the Hub out of reach) or a folder without a model was an 18-line
    traceback ending in ``UnsupportedModelError``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for model, message in ((str(tmp_path), "is not a model folder (no config.json there)"),
                           ("foo/bar", "foo/bar is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")):
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "policy_overhead.py"), "--model", model], capture_output=True, text=True, timeout=600, env=env
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"policy_overhead.py: --model {model}: "), result.stderr
        assert message in lines[0] and result.stdout == ""


def test_the_kvpress_peer_check_says_which_sides_to_run_first(tmp_path):
    """``compare --out EMPTY_DIR`` was a FileNotFoundError traceback for kvpress.pt."""
    for side, message in (("compare", "holds no kvpress.pt: run the prompts and kvpress sides first"),
                          ("kvpress", "holds no prompts.pt: run the prompts side first")):
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "kvpress_peer_check.py"), side, "--out", str(tmp_path / "peer")],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last == f"kvpress_peer_check.py: --out {tmp_path / 'peer'} {message} (see kvpress_peer_check.py --help)"
    assert list(tmp_path.iterdir()) == []  # no --out folder made for nothing


def test_the_bench_output_options_read_a_leading_tilde_as_the_home_folder(tmp_path, bench_kernels, monkeypatch):
    """``--trace=~/traces``, ``--out=~/peer``, ``--plot=~/kv.png`` and ``--best-json=~/best.json`` (a shell leaves ``~``
    as it is after ``=``) made a folder named '~' in the current folder and wrote there (checked there too), where
    ``load_model`` and ``python -m eval ab --out`` read ``~`` as the home folder."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {**os.environ, "HOME": str(home)}

    def bench(script: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)

    result = bench("policy_profile.py", "--model", "random", "--layers", "1", "--context", "80", "--budget", "64", "--steps", "1",
                   "--policies", "h2o", "--trace=~/traces")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (home / "traces").iterdir())[0] == "DynamicCache_plus_sdpa-decode.json"
    result = bench("kv_memory.py", "--model", "random", "--layers", "1", "--prompt", "48", "--tokens", "2", "--every", "2",
                   "--budget", "48", "--policies", "full", "--plot=~/kv.png")
    assert result.returncode == 0 and f"plot: {home / 'kv.png'}" in result.stdout and (home / "kv.png").is_file(), result.stderr
    result = bench("kvpress_peer_check.py", "kvpress", "--out=~/peer")  # read there too
    assert f"--out {home / 'peer'} holds no prompts.pt: run the prompts side first (see" in result.stderr, result.stderr
    bench("kvpress_peer_check.py", "prompts", "--out=~/peer")  # (it then stops: HOME holds no converted model)
    assert (home / "peer").is_dir()
    result = bench("kernels.py", "--smoke", "--sweep-prefill", "--best-json=~/no/best.json")  # checked there, before any sweep
    assert f"--best-json {home / 'no' / 'best.json'}: its folder {home / 'no'} does not exist" in result.stderr.strip().splitlines()[-1]
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    bench_kernels.write_best("~/best.json", {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                             {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
    assert (home / "best.json").is_file()
    assert list(cwd.iterdir()) == []


def test_the_kvpress_peer_check_refuses_an_out_folder_it_cannot_make_in_one_sentence(tmp_path):
    """``prompts --out FILE`` (or a folder in one, or in /proc) was a traceback from making the folder."""
    (tmp_path / "file").write_text("")
    for out, message in ((tmp_path / "file", f"--out {tmp_path / 'file'} is a file, not a folder"),
                         (tmp_path / "file" / "peer", f"--out {tmp_path / 'file' / 'peer'} cannot be made: {tmp_path / 'file'} is a file"),
                         (Path("/proc/peer"), "--out /proc/peer cannot be made: /proc takes no new files (")):
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "kvpress_peer_check.py"), "prompts", "--out", str(out)],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"kvpress_peer_check.py: {message}"), result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_policy_overhead_bench_takes_policies_with_parameters():
    """``--policies h2o:recent=8`` (the form setup() takes) was 'unknown policy 'h2o:recent=8'' once the model was built."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "policy_overhead.py"), "--model", "random", "--layers", "1", "--prompt", "64",
         "--budget", "32", "--steps", "2", "--policies", "h2o:recent=8", "trimkv"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[-2:]] == ["h2o:recent=8", "trimkv"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "h2o", "snapkv", "--budget", "16"], "--policies snapkv: snapkv: budget 16 must be larger than the observation window (32)"),
        (["--policies", "snapkv:windw=3"], "--policies snapkv:windw=3: policy 'snapkv' has no parameter windw"),
        # Learned policies (and a wrapper's learned base) are checked on placeholder gates.
        (["--policies", "trimkv:window=99", "--budget", "64"],
         "--policies trimkv:window=99: trimkv: budget 64 must be larger than the recent window (99)"),
        (["--policies", "adakv:base=trimkv-snap,base_params=window=99", "--budget", "64"],
         "--policies adakv:base=trimkv-snap,base_params=window=99: adakv's base trimkv-snap: budget 64 must be larger than the "
         "observation window (99)"),
    ],
)
def test_a_bench_refuses_bad_policy_parameters_in_one_sentence_before_its_model(args, message):
    """Both were make_policy's ValueError traceback once the model was built (and the policies before measured)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "launches.py"), "--model", "random", "--layers", "1", *args],
        capture_output=True, text=True, timeout=600,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"launches.py: {message}"), result.stderr
    assert "device:" not in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", "bench"], "--plot bench is a folder; name the plot file to write"),  # a traceback after the whole run
        (["--plot", "no/such/folder/kv.png"], "--plot no/such/folder/kv.png: its folder no/such/folder does not exist"),
        # a traceback (FileNotFoundError; PermissionError in a read-only folder) after the whole run
        (["--plot", "/proc/kv.png"], "--plot /proc/kv.png: its folder /proc takes no new files ("),
        (["--plot", "README.md/kv.png"], "--plot README.md/kv.png: its folder README.md is a file, not a folder"),
    ],
)
def test_kv_memory_bench_refuses_options_it_cannot_honour_before_its_model(args, message):
    """``bench/kv_memory.py``'s own checks (``setup(check=...)``) run before the model loads, like the shared ones."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_memory.py"), "--model", "random", "--layers", "1", *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"kv_memory.py: {message}"), result.stderr
    assert "device:" not in result.stdout


def test_a_bench_batch_holds_a_different_passage_in_every_row(monkeypatch):
    """A batch of one prompt repeated let every sequence keep as many tokens in every head, which the host then knows:
    policies whose budgets follow the scores read back less than for a real batch. Rows now start ``ROW_STRIDE``
    tokens apart, the essays repeated past their end."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(5000))}

    ids = common.essay_ids(Tokenizer(), 300, "cpu", batch=3)
    assert ids.shape == (3, 300) and ids[0].tolist() == list(range(300))
    assert ids[1, 0] == common.ROW_STRIDE and ids[2].tolist() == [(2 * common.ROW_STRIDE + i) % 5000 for i in range(300)]
    random = common.essay_ids(None, 50, "cpu", batch=2)
    assert random.shape == (2, 50) and not torch.equal(random[0], random[1])
    assert torch.equal(common.essay_ids(None, 50, "cpu")[0], random[0])


def test_a_bench_times_and_names_the_gpu_it_was_given(monkeypatch):
    """``--device cuda:1`` timed with ``torch.cuda.synchronize()``, which waits for the current GPU (cuda:0), not the
    one the work was queued on: its steps were timed as they were launched. The header named cuda:0 as well."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {device}")
    common.sync("cuda:1")
    common.sync("cpu")
    assert seen == ["cuda:1"] and common.device_name("cuda:1") == "GPU cuda:1"


def test_the_training_bench_measures_the_memory_of_the_gpu_it_was_given(monkeypatch):
    """``bench/train_step.py --device cuda:1`` read the peaks of the current GPU (cuda:0), where nothing of the run was
    allocated: its memory columns were about 0 MiB whatever the step cost."""
    train_step = _bench(monkeypatch, "train_step")
    seen = []

    def record(name: str, value: int = 0):
        return lambda device=None: seen.append((name, device)) or value

    for name in ("synchronize", "memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, record(name, 5 if name == "max_memory_allocated" else 2))
    assert train_step.peak_bytes(lambda: None, "cuda:1") == 3
    assert {device for _, device in seen} == {"cuda:1"} and len(seen) == 5


def test_a_bench_refuses_a_gpu_the_machine_lacks_in_one_sentence(monkeypatch, capsys):
    """``--device cuda:3`` on a machine of one GPU was a traceback ('invalid device ordinal') from building the model."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", "random", "--layers", "1", "--device", "cuda:3"])
    with pytest.raises(SystemExit) as exit:
        common.setup("doc")
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().endswith("--device cuda:3: this machine has 1 CUDA GPU (cuda:0) (see bench.py --help)")


def test_prefill_memory_refuses_a_gpu_before_its_model(monkeypatch, capsys):
    """On a machine with a GPU (``--device`` defaults to cuda there) the bench built the model on the GPU, printed its
    header, then exited 1 with a bare 'pass --device cpu'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    prefill_memory = _bench(monkeypatch, "prefill_memory", "--tokens", "64", "--budget", "32")
    import common

    monkeypatch.setattr(common, "_load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit:
        prefill_memory.main()
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("prefill_memory.py: --device cuda: this bench measures CPU memory"), err


@pytest.mark.parametrize(
    "script, args, message",
    [
        # a ValueError from crop() once the model had prefilled; an unpacking error; a reshape of 0 elements in the forward
        ("decode_speed", ["--configs", "128:256"], "--configs 128:256: the budget is more than the context, so nothing is evicted"),
        ("decode_speed", ["--configs", "256"], "--configs 256: each entry is CONTEXT:BUDGET, two whole numbers of at least 1"),
        ("decode_speed", ["--configs", "256:0"], "--configs 256:0: each entry is CONTEXT:BUDGET"),
        # policies built at each entry's budget (setup builds them at --budget, which decode_speed has not): a ValueError
        # traceback from make_policy once the model had loaded
        ("decode_speed", ["--configs", "160:32", "--policies", "h2o", "snapkv"],
         "--policies snapkv at --configs 160:32: snapkv: budget 32 must be larger than the observation window (32)"),
        ("decode_speed", ["--configs", "160:32", "--policies", "h2o:bogus=1"],
         "--policies h2o:bogus=1 at --configs 160:32: policy 'h2o' has no parameter bogus"),
        # the caches are repeated in place: the table titled batch 1 was measured at batch 4
        # ran every row uncompiled, with no compiled row and no word of why
        ("decode_speed", ["--compile-mode", "max-autotune-no-cudagraphs"],
         "--compile-mode max-autotune-no-cudagraphs applies to compiled steps only; add --compile inductor (or aot_eager)"),
        ("gpu_policies", ["--contexts", "96", "--budget", "128"], "--contexts 96 is less than --budget 128: nothing would be evicted"),
        # ran every row uncompiled, with no captured row and no word of why
        ("gpu_policies", ["--compile-mode", "reduce-overhead"],
         "--compile-mode reduce-overhead applies to compiled steps only; add --compile inductor (or aot_eager)"),
        # a RuntimeError traceback from building the model on it
        ("gpu_policies", ["--device", "gpu"], "--device: 'gpu' is not a device; use cpu, cuda or cuda:N"),
        # a table of policies that evicted nothing
        ("prefill_speed", ["--context", "256", "96", "--budget", "128"], "--context 96 is less than --budget 128: nothing would be evicted"),
        # a prompt of exactly the budget fills the cache and evicts nothing: the prefill rows of every bench that times the
        # prompt's compression were policies that scored and compressed nothing (gpu_policies' decode table named two rows
        # DynamicCache 128); a decode bench's per-step evictions still run at that length (kv_memory below takes it)
        ("prefill_speed", ["--context", "256", "128", "--budget", "128"],
         "--context 128 is the same as --budget 128: nothing would be evicted from the prompt; give contexts of more than the budget"),
        ("gpu_policies", ["--contexts", "128", "--budget", "128"], "--contexts 128 is the same as --budget 128: nothing would be evicted"),
        ("launches", ["--context", "256", "--budget", "256"], "--context 256 is the same as --budget 256: nothing would be evicted"),
        ("policy_profile", ["--context", "512", "--budget", "512"], "--context 512 is the same as --budget 512: nothing would be evicted"),
        ("prefill_memory", ["--device", "cpu", "--tokens", "512", "1024", "--budget", "512"],
         "--tokens 512 is the same as --budget 512: nothing would be evicted"),
        # one row of both entries' rounds, its ratio's range paired with the wrong reference rounds (1.29x, range 1.47-1.49x)
        ("prefill_speed", ["--policies", "h2o", "snapkv", "h2o"], "--policies h2o is given twice; give each entry once"),
        # rows measured, then a ConfigError traceback at the kind or length that did not fit
        ("train_step", ["--lengths", "128", "--kinds", "trimkv", "locret", "--budget", "32"],
         "--kinds locret, --lengths 128, --budget 32, --attention auto: config: policy: locret: budget 32 must be larger than"),
        ("train_step", ["--lengths", "48", "--completion", "16", "--budget", "64"], "--kinds trimkv, --lengths 48, --budget 64, --attention auto:"),
        # a ValueError traceback from the DMS student's attention after the table's header
        ("train_step", ["--lengths", "128", "--kinds", "dms", "--attention", "flex", "--budget", "64"],
         "--kinds dms, --lengths 128, --budget 64, --attention flex: config: DMS students attend through dms_attention_fused"),
        # torch inductor's traceback from compiling FlexAttention's backward on the CPU, after the table's header
        ("train_step", ["--device", "cpu", "--lengths", "128", "--kinds", "locret", "trimkv", "--attention", "flex", "--budget", "64"],
         "--attention flex (compiled FlexAttention) has no backward on the CPU, where --kinds trimkv would train (--device cpu)"),
        ("train_step", ["--lengths", "128", "--completion", "128"], "--completion 128 must be less than every length"),
        # a locret row, trained soft, with no word of the hard eviction asked for
        ("train_step", ["--kinds", "locret", "--eviction", "hard"],
         "--eviction hard applies to the TRIM-KV kinds (trimkv, trimkv-global) only, and --kinds locret has none"),
        ("gate_overhead", ["--budget", "16"], "--budget 16: locret: budget 16 must be larger than"),
        # tables of policies (or gates beside decode steps) of a cache that evicted nothing: policy_overhead's
        # h2o at 0.00 ms of evictions; kv_memory's caches growing to the budget read 'NOT flat'
        ("gate_overhead", ["--prompt", "64", "--budget", "512"], "--prompt 64 is less than --budget 512: nothing would be evicted from the prompt"),
        ("policy_overhead", ["--prompt", "64", "--budget", "512"], "--prompt 64 is less than --budget 512: nothing would be evicted"),
        ("kv_memory", ["--prompt", "64", "--budget", "100"], "--prompt 64 is less than --budget 100: nothing would be evicted"),
        ("policy_profile", ["--context", "128", "--budget", "512"], "--context 128 is less than --budget 512: nothing would be evicted"),
        # counts of caches that held the whole prompt and never evicted, printed as the policies' (an eviction's launches absent)
        ("launches", ["--context", "128", "--budget", "512"], "--context 128 is less than --budget 512: nothing would be evicted"),
        # (--device cpu: on a machine with a GPU, its default there, prefill_memory refuses the GPU first)
        ("prefill_memory", ["--device", "cpu", "--tokens", "256", "8192", "--budget", "512"],
         "--tokens 256 is less than --budget 512: nothing would be evicted"),
        # a ValueError traceback from building D2O's cache once the model had loaded
        ("prefill_memory", ["--device", "cpu", "--tokens", "64", "--budget", "2"], "--budget 2: d2o: budget 2 must be larger than sinks=4"),
        ("ab_batching", ["--context", "256", "--budget", "512"], "--context 256 is less than --budget 512: nothing would be evicted"),
        ("gate_overhead", ["--gate-dtypes", "fp8"], "argument --gate-dtypes: invalid choice: 'fp8'"),
        ("policy_profile", ["--trace", "README.md"], "--trace README.md is a file; name the folder to write the traces in"),
        # a NotADirectoryError traceback from making the folder, once the model had loaded
        ("policy_profile", ["--trace", "README.md/traces"], "--trace README.md/traces: README.md is a file, so no folder can be made in it"),
        # a PermissionError (FileNotFoundError in /proc) traceback from making the folder, once the model had loaded
        ("policy_profile", ["--trace", "/proc/traces"], "--trace /proc/traces cannot be made: /proc takes no new files ("),
        # the traces written in the current folder
        ("policy_profile", ["--trace", ""], "--trace is empty; name a folder for the run's outputs"),
        ("ab_batching", ["--context", "20"], "--context 20: a needle prompt needs at least 64 tokens"),
        # a batch of one prompt holds no padding
        ("ab_batching", ["--rows", "1"], "--rows 1: a padded batch needs at least 2 prompts"),
        ("ab_batching", ["--context", "66", "--rows", "4", "--budget", "32", "--policies", "h2o"],
         "--context 66, --rows 4: the last prompt asks for 63 tokens (one fewer a row), and a needle prompt needs at least 64"),
    ],
)
def test_a_bench_refuses_what_it_cannot_measure_in_one_sentence_before_its_model(script, args, message):
    """Each was a traceback (or a table under the wrong label) once the model had loaded and some rows had run."""
    model = [] if script == "ab_batching" else ["--model", "random", "--layers", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), *model, *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith(f"{script}.py: {message}"), result.stderr
    assert "Traceback" not in result.stderr and "device:" not in result.stdout


def test_layers_of_a_real_model_and_random_weights_for_a_text_bench_are_refused():
    """``--layers 2`` with the embedded model ran all 30 layers under a header saying so; ``ab_batching --model
    random`` built the model before refusing it."""
    for script, args, message in (
        ("policy_overhead", ["--layers", "2"], "--layers applies to --model random[:SHAPE] only; smollm2-135m runs with its own layers"),
        ("ab_batching", ["--model", "random"], "--model random: the prompts are text, so this bench needs a model with a tokenizer"),
    ):
        result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *args], capture_output=True, text=True, timeout=600)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and lines[-1].startswith(f"{script}.py: {message}"), result.stderr


def test_kv_memory_bench_takes_learned_policies_parameters_and_full():
    """``--policies trimkv`` ('gates are required'), ``adakv:ragged=false`` ('unknown policy') and ``full`` ('takes no
    budget') were accepted by the shared checks, then failed once the model had run; one sample showed 'flat'."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_memory.py"), "--model", "random", "--layers", "1", "--prompt", "48", "--tokens", "20",
         "--every", "20", "--budget", "48", "--policies", "trimkv", "adakv:ragged=false", "full"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    verdicts = [line.split(":")[0] for line in result.stdout.splitlines() if "x DynamicCache at the end" in line]
    assert verdicts == ["trimkv@48", "adakv", "full"]  # (adakv:ragged=false@48: split at its colon)
    assert result.stdout.count("one sample: no trend") == 3 and "(KV MiB allocated)" in result.stdout


def test_a_misspelt_kernel_is_refused_by_the_compile_check_and_full_is_one_prefill_row():
    """``triton_compile.py --only nosuch`` checked nothing and exited 0 (a pass); ``prefill_speed.py --policies full``
    added a 'full@BUDGET' row, the 'full (kvgates)' arm again under a budget it does not take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "triton_compile.py"), "--only", "nosuch"], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 2 and "--only nosuch: no such kernel; choose from causal_attention_stats" in result.stderr
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefill_speed.py"), "--model", "random", "--layers", "1", "--context", "96", "--budget",
         "64", "--rounds", "1", "--policies", "full", "h2o"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("| full") == 1 and "| h2o@64 |" in result.stdout


def test_the_benches_usage_examples_keep_their_line_breaks():
    """A backslash ending an example line of a docstring (a shell continuation) joined it with the next in the help
    text: ``decode_speed.py --help`` showed ``--rounds 2         --policies ...``. A docstring with one is raw."""
    for script in sorted((ROOT / "bench").glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text()), clean=False) or ""
        joined = [line for line in doc.splitlines() if re.search(r"\S {3,}--", line)]
        assert joined == [], script.name


def test_a_policies_entry_s_parameters_are_not_called_base_parameters(monkeypatch):
    """``--policies snapkv:window`` said "expected key=value in base parameters": the wording of a wrapper's
    base_params, which the entry's parameters are not."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import common

    assert common.policy_problem("snapkv:window", 64) == "--policies snapkv:window: expected key=value in parameters, got 'window'"
    assert common.policy_problem("snapkv:window=[1", 64) == "--policies snapkv:window=[1: parameter window: '[1' opens a bracket it never closes"
    assert "base parameter window:" in common.policy_problem("adakv:base_params='window=[1'", 64)


def test_kv_memory_samples_the_last_token_where_every_does_not_divide_tokens(tiny, monkeypatch):
    """``--tokens 5 --every 2`` took its last size at token 4, which the table gave as "at the end"; ``--every``
    past ``--tokens`` (refused: no size was taken) now takes the end alone."""
    from transformers import DynamicCache

    from kvgates import dynamic_cache_bytes

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import kv_memory

    _, model = tiny
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    assert kv_memory.sampled_steps(5, 2) == [2, 4, 5] and kv_memory.sampled_steps(4, 2) == [2, 4] and kv_memory.sampled_steps(3, 9) == [3]
    cache = DynamicCache(config=model.config)
    sizes, _ = kv_memory.trace(model, cache, ids, 5, 2, dynamic_cache_bytes)
    assert len(sizes) == 3 and sizes[-1] == dynamic_cache_bytes(cache) and sizes[0] < sizes[1] < sizes[2]
