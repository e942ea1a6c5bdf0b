"""The hardware limits the benches print ratios against (no kvgates or transformers import: bench/kernels.py
loads this without the model stack)."""

from __future__ import annotations

import torch

#: Peak HBM bandwidth (GB/s) by device name, for rooflines (first match wins: "H100 PCIe" before "H100").
PEAK_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}


#: Peak dense bf16/fp16 tensor-core throughput (TFLOP/s) by device name, for compute-bound kernels.
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}


def _by_name(table: dict[str, float], device: str | torch.device, override: float | None) -> float | None:
    if override:
        return override
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in table.items() if k in name), None)


def peak_gbps(device: str | torch.device, override: float | None = None) -> float | None:
    """Peak memory bandwidth of ``device`` in GB/s: ``override`` when given, else from ``PEAK_GBPS`` by the GPU's
    name; None on CPU or an unknown GPU (no roofline then)."""
    return _by_name(PEAK_GBPS, device, override)


def peak_tflops(device: str | torch.device, override: float | None = None) -> float | None:
    """Peak bf16/fp16 tensor throughput of ``device`` in TFLOP/s (``PEAK_TFLOPS``), like ``peak_gbps``."""
    return _by_name(PEAK_TFLOPS, device, override)
