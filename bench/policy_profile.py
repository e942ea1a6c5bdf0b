"""Where a policy's prefill and decode steps spend the time DynamicCache + sdpa does not, under torch.profiler.

    python bench/policy_profile.py --model random:llama-3.1-8b --layers 4 --context 8192 --policies streaming_llm h2o adakv

On an H100 (2026-11-27; docs/results.md, "On an H100") every policy's batch-1 prefill at the 8B shape and 8K
tokens cost at least 1.7 ms a layer more than a plain one (2.3 ms for StreamingLLM, which scores nothing), more than
the launch counts of ``bench/launches.py`` account for, and a decode step right after one warm-up step took 0.6-7 s
for AdaKV, PyramidKV and DynamicKV (16 layers). Neither was profiled there. For each arm (DynamicCache + sdpa, then
each policy at ``--budget``) this runs a warm-up prefill and one decode step on a fresh cache, then on
another fresh cache one profiled prefill and, after one more step, ``--steps`` profiled decode steps (at lengths not
decoded before, as in generation), and prints per layer (and step): the
wall time, the time the device was busy (CUDA kernels; on the CPU the operators' own time), the kernel launches and
host syncs the profiler saw, and the ``--top`` operators whose own time grew most over the reference's. With
``--trace DIR`` it writes a Chrome trace of each profiled part there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from common import attached, bench_policy, essay_ids, setup, short_context, sync
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import kvgates
from kvgates.cli import quiet_exits
from kvgates.config import ConfigError, check_output_folder, output_path
from kvgates.gates.adapter import atomic_write

#: Profiler events that make the host wait for the device (a read back, ``.item()``, is a copy and one of these: the
#: copy alone, ``cudaMemcpyAsync``, is not counted, as host-to-device copies do not wait).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
#: Profiler events that launch a kernel.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


class Profiled(NamedTuple):
    """One profiled part: wall seconds, each operator's own microseconds, the device's busy microseconds (its kernels,
    copies and fills; on the CPU the operators' own time), launches and host syncs."""

    wall: float
    own: dict[str, float]
    busy: float
    launches: int
    syncs: int


def run_profiled(fn, device: str, trace: Path | None) -> Profiled:
    """Profile ``fn()`` (device time on CUDA, operators' own CPU time elsewhere), optionally writing ``trace`` (through
    a temporary file: a trace stopped mid-write, Ctrl-C, leaves none half-written)."""
    cuda = str(device).startswith("cuda")
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        start = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - start
    if trace is not None:
        atomic_write(trace, prof.export_chrome_trace)
    own: dict[str, float] = {}
    launches = syncs = 0
    busy = 0.0
    for event in prof.key_averages():
        launches += event.count if event.key in LAUNCH_EVENTS else 0
        syncs += event.count if event.key in SYNC_EVENTS else 0
        value = event.self_device_time_total if cuda else event.self_cpu_time_total
        if value and not event.key.startswith("cuda"):
            own[event.key] = own.get(event.key, 0.0) + value
            # On CUDA an operator's own device time is its kernels', which are events too: the kernels alone count.
            busy += value if not cuda or event.device_type == DeviceType.CUDA else 0.0
    return Profiled(wall, own, busy, launches, syncs)


def parts(model, cache, ids: torch.Tensor):
    """(prefill, decode): ``ids`` into ``cache``; ``decode(n)``: ``n`` greedy decode steps after what it holds."""
    token = [ids[:, -1:]]

    def prefill() -> None:
        token[0] = model(ids, past_key_values=cache, logits_to_keep=1).logits.argmax(-1)

    def decode(n: int) -> None:
        for _ in range(n):
            token[0] = model(token[0], past_key_values=cache).logits[:, -1:].argmax(-1)

    return prefill, decode


def profile_arm(model, make_cache, ids: torch.Tensor, steps: int, device: str, trace: Path | None, label: str) -> tuple[Profiled, Profiled]:
    """(prefill, decode steps) profiled: a prefill of ``ids`` into a fresh ``make_cache()`` after the same prefill
    and one decode step on another (its warm-up), then, after one more step, ``steps`` decode steps at cache lengths
    this process has not decoded at before (as in generation: a cost paid per new length shows)."""
    name = label.replace(" ", "_").replace("+", "plus")
    cache = make_cache()
    with attached(model, cache), torch.no_grad():
        prefill, decode = parts(model, cache, ids)
        prefill()
        decode(1)
    cache = make_cache()
    with attached(model, cache), torch.no_grad():
        prefill, decode = parts(model, cache, ids)
        first = run_profiled(prefill, device, None if trace is None else trace / f"{name}-prefill.json")
        decode(1)
        return first, run_profiled(lambda: decode(steps), device, None if trace is None else trace / f"{name}-decode.json")


def check(args) -> str | None:
    """A context not over the budget, or a ``--trace`` that names a file, a folder within one, or one that cannot be made
    or written in (``check_output_folder``; a leading ``~`` is the home folder), in one sentence before the model loads
    (else None)."""
    short = short_context("--context", [args.context], args.budget, prefill=True)
    if short:
        return short
    if args.trace is not None:
        trace = output_path(args.trace)
        made = next(path for path in (trace, *trace.parents) if path.exists())  # where the traces' folders start
        if made == trace and not trace.is_dir():
            return f"--trace {args.trace} is a file; name the folder to write the traces in"
        if not made.is_dir():
            return f"--trace {args.trace}: {made} is a file, so no folder can be made in it; name the folder to write the traces in"
        try:  # an empty name (the current folder), or a folder that takes no new files
            check_output_folder(args.trace, "--trace")
        except ConfigError as err:
            return str(err)
    return None


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, check=check, context=8192, budget=1024, batch=1, steps=3, top=8, trace=None, policies=["streaming_llm", "h2o", "adakv"]
    )
    layers = model.config.num_hidden_layers
    ids = essay_ids(tokenizer, args.context, args.device, args.batch)
    arms = {"DynamicCache + sdpa": lambda: DynamicCache(config=model.config)}
    for name in args.policies:
        arms[name] = lambda name=name: kvgates.BudgetCache(model.config, bench_policy(model, name, args.budget))
    trace = None if args.trace is None else output_path(args.trace)  # the folder check() checked
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
    results = {label: profile_arm(model, make, ids, args.steps, args.device, trace, label) for label, make in arms.items()}
    busy = "device busy" if str(args.device).startswith("cuda") else "operators' own CPU time"
    for part, (index, per) in {"prefill": (0, layers), f"decode step ({args.steps} profiled)": (1, layers * args.steps)}.items():
        unit = "a layer" if index == 0 else "a layer and step"
        print(f"\n{part}, {unit}: {layers} layers, context {args.context}, budget {args.budget}, batch {args.batch}")
        print(f"| arm | wall ms | vs reference | {busy} ms | launches | host syncs |\n|---|---:|---:|---:|---:|---:|")
        base = results["DynamicCache + sdpa"][index]
        for label, parts in results.items():
            p = parts[index]
            print(
                f"| {label} | {1e3 * p.wall / per:.3f} | {p.wall / base.wall:.2f}x | {p.busy / 1e3 / per:.3f} "
                f"| {p.launches / per:.1f} | {p.syncs / per:.1f} |"
            )
        for label, parts in list(results.items())[1:]:
            own = parts[index].own
            grown = sorted(((t - base.own.get(op, 0.0), op) for op, t in own.items()), reverse=True)[: args.top]
            print(f"\n{label}, {part}: operators by own time over the reference's, ms {unit}")
            for t, op in grown:
                print(f"  {t / 1e3 / per:8.3f}  {op}")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
