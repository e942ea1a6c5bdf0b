"""Every Triton kernel of kvgates compiles for a CUDA GPU, checked on a machine without one.

    python bench/triton_compile.py                      # sm_90 (H100, H200) and sm_80 (A100)
    python bench/triton_compile.py --arch 90 --only decode_attention_flat

Triton compiles a kernel the first time it is launched on a GPU, so a kernel the compiler refuses (a type error the
CPU interpreter lets through, a block size whose shared memory overflows the GPU) would only show on a GPU. This
script makes Triton's active driver a compile-only one for a CUDA architecture (``triton.runtime.driver
.set_active``): every launch goes through Triton's whole pipeline down to a cubin (ptxas included), its shared
memory is checked against the architecture's limit, and nothing runs. It calls every public kernel of
``kvgates.kernels.triton_ops`` with the block sizes it picks on a GPU over the shapes kvgates targets (head dims 64
and 128, GQA groups of 3 and 4, ragged heads, float32/float16/bfloat16), prints one line per kernel, its
specialisations and their largest shared memory, and exits with status 1 if any failed. Run it without
``TRITON_INTERPRET`` (the interpreter replaces the compiler); the CPU inputs' values are never read.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgates.cli import OneLineParser, plain, quiet_exits  # noqa: E402

#: Shared memory a block may use (bytes) and streaming multiprocessors, by CUDA architecture.
ARCHS = {90: {"max_shared_mem": 232448, "multiprocessor_count": 132}, 80: {"max_shared_mem": 166912, "multiprocessor_count": 108}}


class CompileOnlyDriver:
    """A Triton driver for a CUDA GPU that is not there: kernels compile for ``arch`` and launch nothing.

    It provides what Triton's JIT asks of a driver on the way to a launch (target, device, stream, device
    properties, loading the binary, the launcher); ``compiled`` records ``(kernel name, shared bytes)`` per
    compiled specialisation."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.properties = {"max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0,
                           "mem_bus_width": 0, **ARCHS[arch]}
        self.compiled: list[tuple[str, int]] = []
        self.utils = self

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_properties(self, device: int) -> dict[str, int]:
        return self.properties

    def load_binary(self, name: str, binary: bytes, shared: int, device: int) -> tuple[None, None, int, int, int]:
        self.compiled.append((name, shared))
        return None, None, 0, 0, 1024  # module, function, registers, spills, most threads a block may have

    def launcher_cls(self, src, metadata) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextmanager
def compile_only(arch: int) -> Iterator[CompileOnlyDriver]:
    """Triton's launches compile for ``arch`` and run nothing, and ``triton_ops`` picks the launch configurations it
    picks on such a GPU (its CPU inputs would otherwise get the interpreter's small blocks)."""
    from triton.runtime import driver

    from kvgates.kernels import triton_ops

    fake = CompileOnlyDriver(arch)
    gpu = torch.device("cuda")
    config = triton_ops._prefill_config
    driver.set_active(fake)
    try:
        with (
            mock.patch.object(triton_ops, "_prefill_config", lambda d, dtype, device: config(d, dtype, gpu)),
            mock.patch.object(triton_ops, "_multiprocessors", lambda device: ARCHS[arch]["multiprocessor_count"]),
        ):
            yield fake
    finally:
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU here: there is no default driver to go back to
            pass


def _flat_layer(b: int, caps: list[int], d: int, dtype: torch.dtype):
    s, cmax = sum(caps), max(caps)
    pos = torch.arange(cmax).expand(b, len(caps), cmax).contiguous()
    return torch.zeros(b, s, d, dtype=dtype), torch.zeros(b, s, d, dtype=dtype), pos


#: ``(query heads, KV heads, head dim)`` of the models kvgates targets: SmolLM2-135M and the 8B shapes.
HEADS = [(9, 3, 64), (32, 8, 128)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """``(public kernel, call)`` over the shapes and dtypes above (each call launches its kernels once)."""
    from kvgates.kernels import triton_ops as ops

    for (h, hkv, d), dtype in ((heads, dtype) for heads in HEADS for dtype in DTYPES):
        for caps in ([300] * hkv, [300 - 40 * i for i in range(hkv)]):  # uniform and ragged (Ada-KV) heads
            keys, values, pos = _flat_layer(2, caps, d, dtype)
            q = torch.zeros(2, h, d, dtype=dtype)
            for reduce in ("sum", "none"):
                yield "decode_attention_flat", lambda q=q, k=keys, v=values, p=pos, c=caps, r=reduce: (
                    ops.decode_attention_flat(q, k, v, p, c, d**-0.5, r)
                )
            qw = torch.zeros(2, h, 32, d, dtype=dtype)
            q_pos, q_valid = torch.arange(300, 332).expand(2, 32), torch.ones(2, 32, dtype=torch.bool)
            for reduce in ("sum", "mean"):
                yield "window_scores_flat", lambda k=keys, v=values, p=pos, c=caps, r=reduce: (
                    ops.window_scores_flat(qw, k, v, p, c, q_pos, q_valid, d**-0.5, r)
                )
        q = torch.zeros(1, 200, h, d, dtype=dtype).transpose(1, 2)  # the runtime's [B, H, n, D] view
        k = torch.zeros(1, hkv, 200, d, dtype=dtype)
        for colsum, window in ((True, 32), (True, 0), (False, 32)):
            yield "causal_attention_stats", lambda q=q, k=k, c=colsum, w=window: ops.causal_attention_stats(q, k, k, d**-0.5, c, w)
        kc = torch.zeros(1, hkv, 900, d, dtype=dtype)  # a chunk of 200 after 700 older tokens (KVzip's reconstruction)
        slots, rows, valid = torch.arange(900).expand(1, hkv, 900), torch.arange(700, 900)[None], torch.ones(1, 200, dtype=torch.bool)
        for weights in ((None, None), (torch.ones(1, 200), torch.ones(1, h, 900))):
            yield "masked_attention_colmax", lambda q=q, k=kc, w=weights: (
                ops.masked_attention_colmax(q, k, k, slots, rows, valid, d**-0.5, *w)
            )
        yield "masked_attention_colsum", lambda q=q, k=kc: ops.masked_attention_colsum(q, k, k, slots, rows, valid, d**-0.5)
        keys, values, pos = _flat_layer(2, [300] * hkv, d, dtype)
        state, init = torch.zeros(2, hkv, 300, 2), torch.zeros(2)
        index = torch.arange(200).expand(2, hkv, 200).contiguous()
        yield "compact_slots", lambda k=keys, v=values, p=pos, s=state, i=index, n=hkv: ops.compact_slots(k, v, p, s, i, [300] * n, [200] * n, init)
    for _, hkv, d in HEADS:  # KVMerger's keys are float32 whatever the model's dtype
        kn, stop = torch.zeros(2, hkv, 300, d), torch.full((2, hkv, 300), 300)
        first, ends = torch.zeros(2, hkv, 301, dtype=torch.long), torch.full((16, 2, hkv, 300), 300)
        for e, window in ((16, 256), (5, 256), (16, 1)):  # KVMerger's grid on a GPU, a group of it; a window of 1
            yield "merging_set_ends", lambda kn=kn, s=stop, e=e, w=window: ops.merging_set_ends(kn, s, torch.zeros(e, 2), w)
        for window in (256, 1):  # (Triton compiles an integer argument equal to 1 apart)
            yield "merging_chain", lambda kn=kn, s=stop, f=first, x=ends, n=hkv, w=window: (
                ops.merging_chain(kn, s, f, x, torch.zeros(16, 2), torch.zeros(16, 2, n, dtype=torch.long), w)
            )
        for n, dtype, sigma, scale in ((300, torch.float32, None, False), (300, torch.bfloat16, 0.5, True), (1, torch.float32, None, False)):
            keys, values = torch.zeros(2, hkv, n, d), torch.zeros(2, hkv, n, d, dtype=dtype)  # keys float32, values the model's
            flags = torch.zeros(2, hkv, n, dtype=torch.bool)  # (one token: a length of 1, compiled apart)
            yield "merge_sets", lambda k=keys, v=values, f=flags, s=sigma, c=scale: ops.merge_sets(k, v, f, f, torch.zeros(f.shape), s, c)
        rows, cols = torch.zeros(2, hkv, 300, d), torch.zeros(2, hkv, 100, d)
        yield "max_similarity", lambda r=rows, c=cols: ops.max_similarity(r, c, torch.ones(c.shape[:3], dtype=torch.bool))
    scores, pos = torch.zeros(2, 3, 300), torch.arange(300).expand(2, 3, 300).contiguous()
    for mode in ("max", "avg"):
        yield "pool_by_position", lambda m=mode: ops.pool_by_position(scores, pos, 7, m)
    yield "retention_scores", lambda: ops.retention_scores(torch.zeros(2, 3, 300), pos, torch.tensor([300, 310]))
    log_beta = torch.zeros(2, 3, 300, requires_grad=True)
    yield "retention_sum", lambda: ops.retention_sum(log_beta).sum().backward()


def main() -> int:
    parser = OneLineParser(description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(ARCHS), help="CUDA architectures")
    parser.add_argument("--only", nargs="+", default=None, help="public kernels to check (default: all)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1: the interpreter replaces the compiler this script checks")
    known = sorted({name for name, _ in cases()})
    unknown = [name for name in args.only or [] if name not in known]
    if unknown:
        parser.error(f"--only {unknown[0]}: no such kernel; choose from {', '.join(known)}")
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}")
    failed = 0
    for arch in args.arch:
        results: dict[str, list[str]] = defaultdict(list)
        with compile_only(arch) as fake:
            for name, call in cases():
                if args.only and name not in args.only:
                    continue
                before = len(fake.compiled)
                try:
                    call()
                except Exception as error:  # noqa: BLE001 - every refusal is reported, the run goes on
                    results[name].append(f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
                    continue
                results[name] += [f"{kernel} {shared}" for kernel, shared in fake.compiled[before:]]
        for name, lines in results.items():
            errors = [line for line in lines if line.startswith("FAILED")]
            shared = [int(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("FAILED")]
            kernels = sorted({line.split(" ")[0] for line in lines if not line.startswith("FAILED")})
            status = f"{len(errors)} FAILED" if errors else "ok"
            print(f"sm_{arch} {name}: {status}; {len(shared)} specialisations compiled ({', '.join(kernels)}), "
                  f"shared memory up to {max(shared, default=0) // 1024} KiB of {ARCHS[arch]['max_shared_mem'] // 1024}")
            for line in dict.fromkeys(errors):
                print(f"    {line}")
            failed += len(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
