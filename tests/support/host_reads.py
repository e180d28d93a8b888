"""Count what a training step asks of the device on the host: reads of a tensor's value (`.item()`, `int(...)`,
`bool(...)`, `.tolist()`) and ops whose output size depends on values (`nonzero`, boolean-mask indexing, ...). On CUDA
each one waits for every kernel queued before it (a host sync); on the CPU tests they are counted instead, under the
stand-in kernels so the packed forward takes its CUDA branches.

The stand-in kernels read their boundary tensors to compute the reference result; a real kernel reads them on the
device, so reads inside a stand-in are not counted (`kernel_call`). Every read is recorded with the innermost frame
of this project or TRL that made it, to say where a count comes from.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for: a scalar read, or an output shape that depends on the values
HOST_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
}
_IN_KERNEL = [0]


@contextlib.contextmanager
def kernel_call() -> Iterator[None]:
    """Around a stand-in kernel: its reads are the kernel's own work on the device."""
    _IN_KERNEL[0] += 1
    try:
        yield
    finally:
        _IN_KERNEL[0] -= 1


def _reader() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if ("trl_padfree" in frame.filename or "/trl/" in frame.filename) and "host_reads" not in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "elsewhere"


class HostReads(TorchDispatchMode):
    """Counts host reads while active; `where` says which line made each."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops = 0  # every op dispatched outside a kernel stand-in
        self.where: Counter[str] = Counter()
        self._tolist = None

    def record(self) -> None:
        if _IN_KERNEL[0]:
            return
        self.count += 1
        self.where[_reader()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_KERNEL[0]:
            self.ops += 1
        if func._schema.name in HOST_READ_OPS:
            self.record()
        elif func._schema.name == "aten::index" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1] if index is not None
        ):
            self.record()  # boolean-mask indexing: a nonzero inside
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # `.tolist()` reads the data without dispatching an op
        original = self._tolist = torch.Tensor.tolist
        reads = self

        def tolist(tensor):
            reads.record()
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
