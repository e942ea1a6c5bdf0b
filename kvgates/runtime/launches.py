"""Count what a piece of work would cost a GPU in kernel launches and host syncs, on any device.

On a GPU a decode step of a small model is bound by launches and syncs more than by bandwidth: every aten operator
that is not a view launches at least one kernel, and reading a value back (``.item()``, ``bool()``, ``.tolist()``,
``.cpu()``, ``nonzero``...) makes the host wait until the device has run everything queued before it. So does a
tensor made from host numbers on the device (``torch.tensor(values, device=...)``): it copies from pageable memory,
and such a copy waits for the stream to drain (``kvgates.kernels.host.on_device`` copies from pinned memory
instead, queued like a kernel). All are visible without a GPU (but a host tensor moved with ``.to(device)``, which
on the CPU looks like any move), so a policy can be checked on the CPU (``bench/launches.py``,
``tests/test_packed_decode.py``)::

    with Launches() as counted:
        model(token, past_key_values=cache)
    counted.launches, counted.syncs, counted.ops.most_common(5)

Under the Triton interpreter (``TRITON_INTERPRET=1``, how the CPU runs the GPU's path) each kernel call counts as
one launch, ``triton:<kernel>``, and the interpreter's copies of its arguments count for nothing. On a GPU a Triton
launch is not an aten operator: it is not counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import ExitStack
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operators whose result the host needs before it can go on.
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "equal", "masked_select", "is_nonzero", "unique", "_unique2"})
#: Tensor methods that copy to the host without an aten operator the dispatcher sees, and ``upload``: a tensor made
#: from host numbers straight on a device (``torch.tensor``/``torch.as_tensor`` with ``device=``), which on a GPU
#: waits for the stream like a read back.
SYNC_METHODS = frozenset({"tolist", "cpu", "numpy", "upload"})
_FROM_HOST = frozenset({"tensor", "as_tensor"})


def _interpreted_launch() -> Any:
    """The frame of the Triton interpreter's kernel call (``TRITON_INTERPRET=1``) the current operator runs under, if
    any: the interpreter copies a kernel's arguments with aten operators that a GPU's launch does not run."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:
        return None
    code, frame = interpreter.GridExecutor.__call__.__code__, sys._getframe(2)
    while frame is not None and frame.f_code is not code:  # (the whole stack: counting modes may nest)
        frame = frame.f_back
    return frame


class _Ops(TorchDispatchMode):
    def __init__(self, ops: Counter[str]) -> None:
        super().__init__()
        self.ops = ops
        self.launch = None  # the interpreter's latest kernel call (kept: a new call's frame may reuse a freed one's id)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            launch = _interpreted_launch()
            if launch is None:
                self.ops[func.overloadpacket.__name__] += 1
            elif launch is not self.launch:  # one launch a kernel call, named after its kernel; its copies are not
                self.launch = launch
                self.ops[f"triton:{launch.f_locals['self'].fn.__name__}"] += 1
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, ops: Counter[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.ops[name] += 1
        elif name in _FROM_HOST and (kwargs or {}).get("device") is not None:
            if not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor):
                self.ops["upload"] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """Context manager counting the non-view aten operators run inside it (``ops``, by name; ``launches``, their
    sum) and the reads back to the host among them (``syncs``; ``sync_ops`` by name)."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self._stack = ExitStack()

    def __enter__(self) -> Launches:
        self._stack.enter_context(_Methods(self.ops))
        self._stack.enter_context(_Ops(self.ops))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def sync_ops(self) -> Counter[str]:
        """The reads back to the host, by operator or method."""
        return Counter({name: n for name, n in self.ops.items() if name in SYNC_OPS or name in SYNC_METHODS})

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def launches(self) -> int:
        """Kernel launches on a GPU, at least (the non-view aten operators; a method that copies to the host is
        not one)."""
        return sum(n for name, n in self.ops.items() if name not in SYNC_METHODS)


__all__ = ["Launches", "SYNC_METHODS", "SYNC_OPS"]

