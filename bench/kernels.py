"""Triton kernels vs their torch references (and decode attention vs sdpa without score output), same run.

    python bench/kernels.py                      # on a CUDA GPU: the full grid
    python bench/kernels.py --budgets 2048 8192 --batch 1 32 --head-dim 128 --dtype bf16
    python bench/kernels.py --sweep-decode --budgets 4096 16384 32768 --batch 1 --head-dim 128 --dtype bf16
    python bench/kernels.py --sweep-prefill --budgets 8192 --batch 1 --head-dim 128 --dtype bf16 --best-json best.json
    TRITON_INTERPRET=1 python bench/kernels.py --smoke   # tiny grid on CPU: checks the script, not speed

For each kernel and shape it prints the Triton time, the reference time, their ratio, the achieved memory
bandwidth and its fraction of the GPU's peak (HBM3 H100 SXM 3.35 TB/s, H200 4.8 TB/s; ``--peak-gbps``
overrides). For decode attention (split over the slots: batch 1 fills the GPU too) it also prints the ratio to
torch sdpa computing the same attention without per-slot probabilities (target: within 1.3x and >= 50% of peak
bandwidth at batch 1, 16K). The fused scoring prefill (a prompt as long as the budget; column sums and window
scores) is compute-bound: it prints TFLOP/s, their fraction of the GPU's bf16/fp16 peak (989 TFLOP/s on H100 SXM
and H200) and its ratio to sdpa's causal attention without statistics; its torch reference is timed up to one 8K
sequence's work (``REFERENCE_PREFILL_WORK``) and skipped above.

``--sweep-decode`` measures decode attention alone under every launch configuration of a small grid (slots a loop
iteration loads, programs a multiprocessor, warps, pipeline stages) and prints the five fastest and the kernel's
default (``triton_ops._decode_config``) for each shape: the evidence a new default is chosen on. On a GPU it then
measures the fastest and the default, and sdpa, inside a CUDA graph over buffers the L2 cache cannot hold: the GPU
time a captured decode step spends (the eager figures include what the host's launches leave idle).

``--sweep-prefill`` does the same for the fused scoring prefill (``--budgets`` as prompt lengths): its forward
(attention and each row's logsumexp) and its column pass (the recomputed probabilities summed per key) under each
configuration of their grids, the column pass's time as the whole call's less the default forward's. Where the
prefill's ratio to sdpa goes (2.8-3.2x on an H100 at stop 43) and which blocks bring it down. ``--best-json PATH``
writes the fastest pair there (after each pass, so a sweep cut short leaves the forward's) in the form
``KVGATES_PREFILL_CONFIG`` takes: a whole model's prefill can then run under it without a code edit. Both sweeps
given run one after the other, the decode sweep first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hardware import peak_gbps, peak_tflops  # noqa: E402

from kvgates.cli import OneLineParser, plain, quiet_exits  # noqa: E402
from kvgates.config import ConfigError, check_output_file, output_path  # noqa: E402
from kvgates.kernels import reference  # noqa: E402
from kvgates.kernels.host import PREFILL_CONFIG_ENV  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def bench(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn``."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=reps * 5, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(max(reps // 10, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def captured(make, nbytes: int, reps: int = 20) -> float:
    """Seconds a call of the GPU work ``make(i)()`` takes inside a CUDA graph (no host launch cost, as in a captured
    decode step), over enough distinct buffers ``i`` (each ``nbytes``) that the L2 cache holds none of them."""
    count = max(2, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes))
    fns = [make(i) for i in range(count)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()  # compiles and caches layouts outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * count)


def sdpa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor):
    """A call of torch sdpa computing decode attention over a flat layer of equal heads (its evicted slots masked),
    without per-slot probabilities: the baseline decode attention is held to."""
    b, h, d = q.shape
    hkv, cap = pos.shape[1], pos.shape[2]
    k4, v4 = keys.view(b, hkv, cap, d), values.view(b, hkv, cap, d)
    mask = (pos >= 0)[:, :, None, None, :].expand(b, hkv, h // hkv, 1, cap).reshape(b, h, 1, cap)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k4, v4, attn_mask=mask, enable_gqa=True)


def layer(b: int, hkv: int, cap: int, d: int, dtype: torch.dtype, device: str):
    keys = torch.randn(b, hkv * cap, d, device=device, dtype=dtype)
    values = torch.randn(b, hkv * cap, d, device=device, dtype=dtype)
    pos = torch.arange(cap, device=device).expand(b, hkv, cap).contiguous()
    pos[:, :, ::7] = -1  # some evicted slots
    return keys, values, pos


#: The torch reference of the scoring prefill materialises every query's row of probabilities: it is timed up to one
#: 8K sequence's causal work (batch x prompt length squared; 2.9 s a call at batch 1, 32K on an H200, 8.7 s at batch 4,
#: and about seven calls a shape, which ran the GPU session's `kernels` stage past its limit) and skipped above.
REFERENCE_PREFILL_WORK = 8192**2


def times_reference_prefill(batch: int, length: int) -> bool:
    """Whether the scoring prefill's torch reference is timed at this batch and prompt length."""
    return batch * length * length <= REFERENCE_PREFILL_WORK


def row(name: str, shape: str, t_tri: float, t_ref: float | None, nbytes: int, peak: float | None, extra: str = "") -> None:
    """One kernel's line; ``t_ref`` None where its reference was not timed (printed as skipped)."""
    gbps = nbytes / t_tri / 1e9
    frac = f"{gbps / peak:6.1%}" if peak else "   n/a"
    ref = f"{t_ref * 1e6:10.1f} us {t_ref / t_tri:7.2f}x" if t_ref is not None else f"{'skipped':>13s} {'':>8s}"
    print(f"{name:16s} {shape:34s} {t_tri * 1e6:9.1f} us {ref} {gbps:8.0f} GB/s {frac} {extra}")


def check(args: argparse.Namespace, device: str) -> str | None:
    """What is wrong with the options, in one sentence, before anything is measured (else None): a count below 1, a
    negative ``--peak-gbps`` (0 is the GPU's own, ``hardware.PEAK_GBPS``), query heads that the GQA group does not
    divide, a ``--best-json`` that cannot be written (``check_output_file``: a folder, or in a folder that does not
    exist or takes no new files; found only once the forward's sweep had run), a ``KVGATES_PREFILL_CONFIG`` that is
    malformed or makes no configuration for a head dim and dtype measured."""
    for name in ("budgets", "batch", "head_dim", "heads", "group", "window", "reps"):
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value < 1:
                return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    if args.peak_gbps is not None and args.peak_gbps < 0:
        return f"--peak-gbps must be at least 0, got {args.peak_gbps}"
    if args.heads % args.group:
        return f"--heads {args.heads} is not a multiple of --group {args.group} (KV heads = heads / group)"
    if args.best_json is not None:
        try:
            check_output_file(args.best_json, "--best-json", "JSON file")
        except ConfigError as err:
            return str(err)
    if os.environ.get(PREFILL_CONFIG_ENV):
        from kvgates.kernels.triton_ops import _prefill_config, _prefill_override

        try:
            _prefill_override(os.environ[PREFILL_CONFIG_ENV])
            for d, dname in itertools.product(args.head_dim, args.dtype):
                _prefill_config(d, DTYPES[dname], torch.device(device))
        except ValueError as err:
            return str(err)
    return None


def main() -> None:
    parser = OneLineParser(description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=32, help="query heads (KV heads = heads / --group)")
    parser.add_argument("--group", type=int, default=4, help="GQA group size")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float)
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny shapes on CPU, in place of --budgets, --batch, --head-dim, --dtype, --heads and --reps (needs TRITON_INTERPRET=1)",
    )
    parser.add_argument("--sweep-decode", action="store_true", help="decode attention under every launch configuration of a grid")
    parser.add_argument("--sweep-prefill", action="store_true", help="the scoring prefill under every launch configuration of a grid")
    parser.add_argument(
        "--best-json", metavar="PATH",
        help="with --sweep-prefill: write the fastest pair of the last shape there, as KVGATES_PREFILL_CONFIG takes it",
    )
    args = parser.parse_args()
    if args.best_json is not None and not args.sweep_prefill:
        parser.error("--best-json is the prefill sweep's: add --sweep-prefill")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.budgets, args.batch, args.head_dim, args.dtype, args.heads, args.reps = [64], [1], [16], ["fp32"], 4, 10
    elif device == "cpu":
        sys.exit("bench/kernels.py measures GPU kernels: no CUDA device here (use --smoke with TRITON_INTERPRET=1 to check it)")
    problem = check(args, device)
    if problem:
        parser.error(problem)
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU the Triton kernels need TRITON_INTERPRET=1")
    from kvgates.kernels import triton_ops

    peak = peak_gbps(device, args.peak_gbps)
    peak_tf = peak_tflops(device)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (Triton interpreter)'}; peak {peak} GB/s")
    h, g = args.heads, args.group
    hkv = h // g
    if args.sweep_decode:
        sweep_decode(args, h, hkv, device, peak)
    if args.sweep_prefill:
        sweep_prefill(args, h, hkv, device)
    if args.sweep_decode or args.sweep_prefill:
        return
    print(f"{'kernel':16s} {'shape':34s} {'triton':>12s} {'reference':>13s} {'speedup':>8s} {'bandwidth':>13s} {'of peak':>6s}")
    for dname, d, b, cap in itertools.product(args.dtype, args.head_dim, args.batch, args.budgets):
        dtype = DTYPES[dname]
        keys, values, pos = layer(b, hkv, cap, d, dtype, device)
        caps = [cap] * hkv
        shape = f"{dname} D={d} B={b} C={cap} H={h}/{hkv}"
        scale = d**-0.5
        elem = keys.element_size()
        kv_bytes = 2 * keys.numel() * elem + pos.numel() * 8

        # decode attention with per-slot probabilities vs reference, and vs sdpa without probabilities
        q = torch.randn(b, h, d, device=device, dtype=dtype)
        t_tri = bench(lambda: triton_ops.decode_attention_flat(q, keys, values, pos, caps, scale), device, args.reps)
        t_ref = bench(lambda: reference.decode_attention_flat(q, keys, values, pos, caps, scale), device, args.reps)
        t_sdpa = bench(sdpa_decode(q, keys, values, pos), device, args.reps)
        extra_bytes = 2 * b * h * cap * 4 + b * hkv * cap * 4  # logits written + read, probabilities written
        row("decode+probs", shape, t_tri, t_ref, kv_bytes + extra_bytes, peak, f"vs sdpa (no probs) {t_tri / t_sdpa:.2f}x")

        # prefill attention with column sums and window scores (the prompt is as long as the budget) vs sdpa's
        # causal attention without them; compute-bound: TFLOP/s (QK^T and PV, then QK^T again for the columns)
        qp = torch.randn(b, h, cap, d, device=device, dtype=dtype)
        kp, vp = keys.view(b, hkv, cap, d), values.view(b, hkv, cap, d)
        t_tri = bench(lambda: triton_ops.causal_attention_stats(qp, kp, vp, scale, True, args.window), device, args.reps)
        t_ref = None
        if times_reference_prefill(b, cap):
            t_ref = bench(lambda: reference.causal_attention_stats(qp, kp, vp, scale, True, args.window), device, args.reps)
        t_sdpa = bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True), device, args.reps
        )
        tflops = 3 * b * h * cap * cap * d / t_tri / 1e12  # 2 FLOPs x (2 + 1) matmuls x half the n x n tile (causal)
        of_peak = f" ({tflops / peak_tf:.0%} of peak)" if peak_tf and dtype != torch.float32 else ""
        extra = f"{tflops:.0f} TFLOP/s{of_peak}, vs sdpa (no stats) {t_tri / t_sdpa:.2f}x"
        row("prefill+stats", shape, t_tri, t_ref, 4 * qp.numel() * elem, None, extra)

        # observation-window scoring
        w = args.window
        qw = torch.randn(b, h, w, d, device=device, dtype=dtype)
        q_pos = torch.arange(cap - w, cap, device=device).expand(b, w).contiguous()
        q_valid = torch.ones(b, w, dtype=torch.bool, device=device)
        t_tri = bench(lambda: triton_ops.window_scores_flat(qw, keys, values, pos, caps, q_pos, q_valid, scale), device, args.reps)
        t_ref = bench(lambda: reference.window_scores_flat(qw, keys, values, pos, caps, q_pos, q_valid, scale), device, args.reps)
        row("window scores", shape, t_tri, t_ref, keys.numel() * elem * 2 + pos.numel() * 16, peak, f"w={w}")

        # compaction to half the slots, with 2 floats of policy state per slot
        state = torch.zeros(b, hkv, cap, 2, device=device)
        init = torch.zeros(2, device=device)
        index = torch.argsort(torch.rand(b, hkv, cap, device=device), -1)[..., : cap // 2].contiguous()
        new_caps = [cap // 2] * hkv
        t_tri = bench(lambda: triton_ops.compact_slots(keys, values, pos, state, index, caps, new_caps, init), device, args.reps)
        t_ref = bench(lambda: reference.compact_slots(keys, values, pos, state, index, caps, new_caps, init), device, args.reps)
        row("compaction", shape, t_tri, t_ref, kv_bytes, peak, "keep 50%")

        # decayed retention scores
        log_beta = -torch.rand(b, hkv, cap, device=device)
        t_now = torch.full((b,), cap + 10, device=device)
        t_tri = bench(lambda: triton_ops.retention_scores(log_beta, pos, t_now), device, args.reps)
        t_ref = bench(lambda: reference.retention_scores(log_beta, pos, t_now), device, args.reps)
        row("retention", shape, t_tri, t_ref, log_beta.numel() * 4 * 2 + pos.numel() * 8, peak)

    # training-time retention sum (compute-bound, O(T^2) without a T x T matrix), forward + backward
    for t in [s for s in args.budgets if s <= 8192]:
        lb = (-torch.rand(hkv * max(args.batch[0], 1), t, device=device) * 0.1).requires_grad_()

        def fwd_bwd(fn):
            lb.grad = None
            fn(lb).sum().backward()

        t_tri = bench(lambda: fwd_bwd(triton_ops.retention_sum), device, args.reps)
        t_ref = bench(lambda: fwd_bwd(reference.retention_sum), device, args.reps)
        row("retention sum", f"T={t} rows={lb.shape[0]} fwd+bwd", t_tri, t_ref, lb.numel() * 12, None, "(compute-bound)")


def configurations(grid: dict[str, list[int]]) -> list[dict[str, int]]:
    """Every launch configuration of a grid of launch parameters."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def ranked(configs: list[dict[str, int]], seconds) -> list[tuple[float, dict[str, int]]]:
    """(``seconds(config)``, config) of each configuration, fastest first, each printed as it is measured (a sweep
    cut short by its time limit still leaves what it measured). One that this GPU cannot run (its tiles need more
    shared memory than a multiprocessor has) is named and left out."""
    from triton.runtime.errors import OutOfResources

    times = []
    for i, cfg in enumerate(configs):
        try:
            times.append((seconds(cfg), cfg))
            print(f"  [{i + 1}/{len(configs)}] {times[-1][0] * 1e6:8.1f} us  {cfg}", flush=True)
        except OutOfResources as err:
            print(f"  left out {cfg}: {err}", flush=True)
    return sorted(times, key=lambda tc: tc[0])


def print_ranked(times: list[tuple[float, dict[str, int]]], default: dict[str, int], describe) -> None:
    """The five fastest configurations and the default, each with ``describe(seconds)``."""
    for rank, (t, cfg) in enumerate(times):
        if rank < 5 or cfg == default:
            mark = " (default)" if cfg == default else ""
            print(f"  #{rank + 1:<3d} {t * 1e6:8.1f} us {describe(t)}  {cfg}{mark}")


def sweep_decode(args: argparse.Namespace, h: int, hkv: int, device: str, peak: float | None) -> None:
    """Decode attention under each launch configuration of a grid, per shape: the five fastest and the default."""
    from kvgates.kernels import triton_ops

    grid = {"BLOCK_N": [32, 64, 128], "programs_per_sm": [2, 4, 8, 16], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
    if args.smoke:
        grid = {"BLOCK_N": [16, 32], "programs_per_sm": [1, 4], "num_warps": [4], "num_stages": [1]}
    configs = configurations(grid)
    for dname, d, b, cap in itertools.product(args.dtype, args.head_dim, args.batch, args.budgets):
        dtype = DTYPES[dname]
        keys, values, pos = layer(b, hkv, cap, d, dtype, device)
        caps, scale = [cap] * hkv, d**-0.5
        q = torch.randn(b, h, d, device=device, dtype=dtype)
        nbytes = 2 * keys.numel() * keys.element_size() + pos.numel() * 8 + 2 * b * h * cap * 4 + b * hkv * cap * 4
        t_sdpa = bench(sdpa_decode(q, keys, values, pos), device, args.reps)
        default = triton_ops._decode_config(d, dtype, torch.device(device))
        shape = f"{dname} D={d} B={b} C={cap} H={h}/{hkv}"
        print(f"decode sweep {shape}: sdpa (no probs) {t_sdpa * 1e6:.1f} us; {len(configs)} configurations")
        times = ranked(
            configs,
            lambda cfg: bench(lambda: triton_ops.decode_attention_flat(q, keys, values, pos, caps, scale, "sum", cfg), device, args.reps),
        )
        of_peak = (lambda t: f"{nbytes / t / 1e9 / peak:6.1%} of peak") if peak else (lambda t: "")
        print_ranked(times, default, lambda t: f"{of_peak(t)} vs sdpa {t / t_sdpa:5.2f}x")
        if device.startswith("cuda"):  # the same, captured: GPU time alone, the L2 cache cold

            def kv(i: int) -> tuple[torch.Tensor, ...]:
                return (keys, values, pos) if i == 0 else layer(b, hkv, cap, d, dtype, device)

            def ours(i: int, cfg: dict):
                k, v, p = kv(i)
                return lambda: triton_ops.decode_attention_flat(q, k, v, p, caps, scale, "sum", cfg)

            t_graph_sdpa = captured(lambda i: sdpa_decode(q, *kv(i)), nbytes)
            fastest = times[0][1] if times else default  # every configuration left out: the default alone
            for label, cfg in (("fastest", fastest), ("default", default)):
                t = captured(lambda i, c=cfg: ours(i, c), nbytes)
                vs = f"vs sdpa captured ({t_graph_sdpa * 1e6:.1f} us) {t / t_graph_sdpa:5.2f}x"
                print(f"  captured {label}: {t * 1e6:8.1f} us {of_peak(t)} {vs}  {cfg}")


#: The prefill sweep's grids: 18 forward and 36 column configurations (the forward's ``BLOCK_M`` a multiple of its
#: ``BLOCK_N``; a forward's 32 keys a step and a column pass's 4 stages left out). Compiling them for sm_90 took 62 s
#: on a 2-core CPU (1.65 s a forward, 0.9 s a column pass; ``bench/triton_compile.py``'s driver), and each is timed
#: for about 0.1 s: within the 170 s ``bench/gpu_session.sh prefill-sweep`` gives the sweep.
PREFILL_FORWARD_GRID = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
PREFILL_COLUMN_GRID = {"BLOCK_N": [32, 64, 128], "BLOCK_M": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}


def write_best(path: str | Path | None, forward: dict[str, int], columns: dict[str, int]) -> None:
    """The prefill sweep's fastest pair so far, as ``KVGATES_PREFILL_CONFIG`` takes it (checked by its parser), to
    ``path`` if given: written beside it and moved over it, so a sweep killed at its limit leaves a whole file."""
    if path:
        from kvgates.kernels.triton_ops import _prefill_override

        path = output_path(path)  # the file check() checked (a leading ~ is the home folder)
        text = json.dumps({"forward": forward, "columns": columns})
        _prefill_override(text)
        partial = Path(f"{path}.partial")
        partial.write_text(text + "\n")
        os.replace(partial, path)
        print(f" fastest so far written to {path}", flush=True)


def sweep_prefill(args: argparse.Namespace, h: int, hkv: int, device: str) -> None:
    """The fused scoring prefill (a prompt as long as the budget) under each launch configuration of its two passes,
    per shape, against sdpa's causal attention without statistics: the forward alone (attention and each row's
    logsumexp) under each forward configuration, then the whole call (column sums and window scores) under each
    column-pass configuration with the default forward, whose time less the default forward's is the column pass's;
    the five fastest and the default of each, then the fastest pair against the default pair."""
    from kvgates.kernels import triton_ops

    forward_grid, column_grid = PREFILL_FORWARD_GRID, PREFILL_COLUMN_GRID
    if os.environ.get(PREFILL_CONFIG_ENV):
        print(f" {PREFILL_CONFIG_ENV} is set: the rows marked (default) are its configuration, not the built-in one")
    if args.smoke:
        forward_grid = {"BLOCK_M": [32], "BLOCK_N": [16, 32], "num_warps": [4], "num_stages": [1]}
        column_grid = {"BLOCK_N": [16, 32], "BLOCK_M": [16], "num_warps": [4], "num_stages": [1]}
    forwards = [c for c in configurations(forward_grid) if c["BLOCK_M"] % c["BLOCK_N"] == 0]
    columns = configurations(column_grid)
    for dname, d, b, n in itertools.product(args.dtype, args.head_dim, args.batch, args.budgets):
        dtype = DTYPES[dname]
        q = torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)  # the runtime's [B, H, n, D] view
        k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype) for _ in range(2))
        scale = d**-0.5
        default = triton_ops._prefill_config(d, dtype, torch.device(device))

        def run(forward: dict[str, int], column: dict[str, int], stats: bool) -> float:
            cfg = {"forward": forward, "columns": column}
            window = args.window if stats else 0
            return bench(lambda: triton_ops.causal_attention_stats(q, k, v, scale, stats, window, cfg), device, args.reps)

        t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device, args.reps)
        shape = f"{dname} D={d} B={b} N={n} H={h}/{hkv}"
        print(f"prefill sweep {shape}: sdpa (causal, no statistics) {t_sdpa * 1e6:.1f} us")
        print(f" forward alone (attention and logsumexp), {len(forwards)} configurations:")
        times = ranked(forwards, lambda c: run(c, default["columns"], False))
        print_ranked(times, default["forward"], lambda t: f"vs sdpa {t / t_sdpa:5.2f}x")
        best_forward = times[0][1] if times else default["forward"]
        write_best(args.best_json, best_forward, default["columns"])  # a sweep cut short still leaves the forward's
        t_forward = run(default["forward"], default["columns"], False)
        print(f" forward and column pass (column sums, window {args.window}), {len(columns)} column configurations, the default forward:")
        times = ranked(columns, lambda c: run(default["forward"], c, True))
        print_ranked(times, default["columns"], lambda t: f"vs sdpa {t / t_sdpa:5.2f}x, column pass {(t - t_forward) * 1e6:8.1f} us")
        best_columns = times[0][1] if times else default["columns"]
        write_best(args.best_json, best_forward, best_columns)
        best = run(best_forward, best_columns, True)
        ours = run(default["forward"], default["columns"], True)
        print(f" fastest pair {best * 1e6:.1f} us, vs sdpa {best / t_sdpa:.2f}x; default pair {ours * 1e6:.1f} us, vs sdpa {ours / t_sdpa:.2f}x")


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
