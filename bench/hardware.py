"""The hardware limits the benches print ratios against (no kvgates or transformers import: bench/kernels.py
loads this without the model stack)."""

from __future__ import annotations

import torch

#: Peak HBM bandwidth (GB/s) by device name, for rooflines (first match wins: "H100 PCIe" before "H100").
PEAK_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}


def peak_gbps(device: str | torch.device, override: float | None = None) -> float | None:
    """Peak memory bandwidth of ``device`` in GB/s: ``override`` when given, else from ``PEAK_GBPS`` by the GPU's
    name; None on CPU or an unknown GPU (no roofline then)."""
    if override:
        return override
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)
