"""Host numbers onto a device without making the host wait (the runtime's and the kernels' small index tensors)."""

from __future__ import annotations

from typing import Any

import torch


def on_device(values: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (host numbers: a scalar or nested lists; or a tensor, moved) as a tensor on ``device``, without
    a host sync.

    ``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA makes the host wait until
    the stream has run everything queued before such a copy: in a prefill that is once a layer, and the host's
    launches after it are no longer hidden behind the device's work. From pinned memory the copy is queued like a
    kernel (the pinned buffer is kept until the copy has run). On the CPU this is ``torch.tensor``.
    """
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        return values.to(device, dtype)
    pinned = device.type == "cuda"  # (elsewhere a non-blocking copy from a temporary is not safe: MPS)
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


__all__ = ["on_device"]
