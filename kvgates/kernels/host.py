"""Host numbers onto a device without making the host wait (the runtime's and the kernels' small index tensors),
device values back without draining the stream, and which devices are bound by launches and host reads."""

from __future__ import annotations

import os
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


#: Set to 1, every device takes the paths of a launch-bound one (``launch_bound``): their launches and host reads can
#: then be counted on the CPU (``bench/launches.py --launch-bound``).
LAUNCH_BOUND_ENV = "KVGATES_LAUNCH_BOUND"


#: A JSON object that overrides the prefill kernels' launch configurations (``triton_ops._prefill_config``) on any
#: device: ``{"forward": {...}, "columns": {...}}``, either or both, each with any of ``BLOCK_M``, ``BLOCK_N`` (powers of
#: two from 16), ``num_warps`` (powers of two up to 32) and ``num_stages``; the rest stay the defaults, and the forward's
#: ``BLOCK_M`` must be a multiple of its ``BLOCK_N``. The defaults were chosen on an H100 and
#: an H200; ``bench/kernels.py --sweep-prefill --best-json`` writes the fastest pair of another GPU in this form, and
#: ``bench/gpu_session.sh prefill-sweep`` measures the policies' prefill under it in the same call.
PREFILL_CONFIG_ENV = "KVGATES_PREFILL_CONFIG"


def launch_bound(device: torch.device) -> bool:
    """Whether work on ``device`` is bound by kernel launches and host reads rather than by arithmetic and caches:
    on a GPU (or anywhere with ``KVGATES_LAUNCH_BOUND=1``). Such work takes fewer, larger tiles and reads back less
    (D2O's merge tiles, KVMerger's scan)."""
    return device.type == "cuda" or os.environ.get(LAUNCH_BOUND_ENV) == "1"


class HostRead:
    """A device tensor's values, read back to the host later: the copy is queued now, and ``tolist`` waits for it
    alone, not for whatever the host has queued since.

    ``tensor.tolist()`` makes the host wait until the device has run everything queued before it, and then the
    device waits for the host's next launches. Read later (a layer on, say), the values are long there, and the
    device still has the work queued in between to run while the host goes on. On the CPU this is ``tolist``.
    """

    def __init__(self, values: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(values.device))
        else:
            self._host = values

    def tolist(self) -> Any:
        """The values as nested lists (waiting for their copy, on a GPU)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


__all__ = ["HostRead", "LAUNCH_BOUND_ENV", "launch_bound", "on_device"]
