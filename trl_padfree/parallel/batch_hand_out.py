"""Every rank of a split row gets the same micro-batches: each round, every rank's collated micro-batch reaches every
rank of the row, in rank order, as tensors (no pickling, no object collective).

One round, two all-gathers on the row's group:

    1. lengths   int64 (header words, bytes) of each rank's batch                                     -> host read 1
    2. batches   one byte buffer per rank, padded to the longest: its header, then every tensor's bytes
                 | header: keys, kinds, dtypes, shapes, host integers | tensor | tensor | ... | pad |  -> host read 2
                                                                                 (the headers only, not the tensors)

The header is a list of int64 words that describes the batch as the collators build it: dicts of tensors, Python
ints and the frozen dataclasses of host integers they carry (`HostRow`, `ImageUnitSizes`). A value of another type
is refused with its key, never sent some other way. The received tensors are views of the gathered buffer (each
tensor's bytes start 64-byte aligned), bit for bit the sender's.

Why tensors and not each rank collating every rank's micro-batch from the same dataset indices: accelerate's
dataloader yields collated batches, not indices, and collating costs CPU time on every rank for each other rank's
batch, in the training loop. Measured on CPU over 2 gloo processes (tools/measure/measure_batch_hand_out.py,
docs/concepts/kernels.md) the two are close (a 19 MB vision batch: 0.16 s sent, 0.18 s collated again; a text batch:
2.4 ms vs 1.4 ms); on GPUs the bytes travel over NVLink or InfiniBand, while collating stays on the host.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..packing.layout import HostRow
from ..packing.vision import ImageUnitSizes
from .groups import RowGroup, all_gather_in_place

# Frozen dataclasses of host integers a collated batch carries, rebuilt on the receiving ranks from their fields
HOST_VALUES = (HostRow, ImageUnitSizes)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)  # fmt: skip
ALIGN = 64  # bytes: every tensor starts aligned for any dtype's view (and vectorized kernels)
NONE, BOOL, INT, FLOAT, STR, TUPLE, LIST, DICT, TENSOR, HOST_VALUE = range(10)


class SameBatchOnEveryRank:
    """Hands every rank of a row the same whole micro-batches, in place of DeepSpeed's `UlyssesSPDataLoaderAdapter`,
    which slices every tensor on dim 1 (the packed batch has 1-D `cu_seq_lens`).

    Like DeepSpeed's adapter, each round collects one batch from every rank of the group and yields them one after
    the other, so the group goes through all of its ranks' data: N times as many micro-batches, each of them whole.
    """

    def __init__(self, dataloader, group: RowGroup, device: torch.device):
        self.dataloader = dataloader
        self.group = group
        self.device = device

    def __len__(self) -> int:
        return len(self.dataloader) * self.group.size

    def __getattr__(self, name):
        # set_epoch, sampler, batch_size...: the wrapped dataloader's
        return getattr(self.dataloader, name)

    def __iter__(self):
        for batch in self.dataloader:
            yield from exchanged_batches(batch, self.group, self.device)


def exchanged_batches(batch: dict, group: RowGroup, device: torch.device) -> list[dict]:
    """Every rank's `batch` in rank order, this rank's its own, the others rebuilt from the gathered buffer; every
    tensor on `device`."""
    header, tensors = encoded(batch)
    # gloo gathers host tensors; NCCL (and others) the device's
    wire = torch.device("cpu") if dist.get_backend(group.group) == "gloo" else device
    lengths = torch.tensor([len(header), _tensor_layout(len(header), tensors)[-1]], dtype=torch.int64, device=wire)
    gathered_lengths = torch.empty(2 * group.size, dtype=torch.int64, device=wire)
    all_gather_in_place()(gathered_lengths, lengths, group=group.group)
    words, sizes = gathered_lengths.view(group.size, 2).T.tolist()  # host read 1
    received = torch.empty(group.size * max(sizes), dtype=torch.uint8, device=wire)
    all_gather_in_place()(received, buffer_of(header, tensors, max(sizes), wire), group=group.group)
    received = received.view(group.size, max(sizes))
    headers = received[:, : 8 * max(words)].view(torch.int64).tolist()  # host read 2
    return [
        _on(batch if rank == group.rank else batch_of(received[rank], headers[rank][: words[rank]]), device)
        for rank in range(group.size)
    ]


def buffer_of(header: list[int], tensors: list[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    """One rank's bytes: `header`, then each tensor's bytes from an `ALIGN`ed start, zeros up to `length`."""
    buffer = torch.zeros(length, dtype=torch.uint8, device=device)
    buffer[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64, device=device).view(torch.uint8)
    for tensor, start in zip(tensors, _tensor_layout(len(header), tensors), strict=False):
        buffer[start : start + tensor.nbytes] = tensor.detach().reshape(-1).view(torch.uint8)
    return buffer


def batch_of(buffer: torch.Tensor, header: list[int]) -> dict:
    """The batch `header` describes, its tensors views of `buffer` (as `buffer_of` laid them out)."""
    return decoded(iter(header), _TensorsOf(buffer, _header_bytes(len(header))))


def _header_bytes(words: int) -> int:
    return -(-8 * words // ALIGN) * ALIGN


def _tensor_layout(words: int, tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's first byte in the buffer, then the buffer's length (a multiple of `ALIGN`)."""
    starts = [_header_bytes(words)]
    for tensor in tensors:
        starts.append(starts[-1] + -(-tensor.nbytes // ALIGN) * ALIGN)
    return starts


class _TensorsOf:
    """The tensors of one rank's buffer, in order, as views."""

    def __init__(self, buffer: torch.Tensor, start: int):
        self.buffer, self.start = buffer, start

    def next(self, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        tensor = self.buffer[self.start : self.start + nbytes].view(dtype).view(shape)
        self.start += -(-nbytes // ALIGN) * ALIGN
        return tensor


def encoded(batch: dict) -> tuple[list[int], list[torch.Tensor]]:
    """`batch` as header words and its tensors, in the order the words name them."""
    if not isinstance(batch, dict):
        raise TypeError(f"a split row's micro-batch is a dict of the collator's outputs, not a {type(batch).__name__}")
    header: list[int] = []
    tensors: list[torch.Tensor] = []
    _encode(batch, header, tensors, "batch")
    return header, tensors


def _encode(value: Any, header: list[int], tensors: list[torch.Tensor], where: str) -> None:
    if value is None:
        header.append(NONE)
    elif isinstance(value, bool):
        header += [BOOL, int(value)]
    elif isinstance(value, int):
        header += [INT, value]
    elif isinstance(value, float):  # its bits, exactly
        header += [FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]
    elif isinstance(value, str):
        data = value.encode()
        header += [STR, len(data), *data]
    elif isinstance(value, (tuple, list)):
        header += [TUPLE if isinstance(value, tuple) else LIST, len(value)]
        for index, part in enumerate(value):
            _encode(part, header, tensors, f"{where}[{index}]")
    elif isinstance(value, dict):
        header += [DICT, len(value)]
        for key, part in value.items():
            _encode(key, header, tensors, where)
            _encode(part, header, tensors, f"{where}[{key!r}]")
    elif isinstance(value, torch.Tensor):
        if value.dtype not in DTYPES or value.layout != torch.strided:
            raise TypeError(f"{where}: a {value.dtype} {value.layout} tensor cannot be handed to a row's ranks")
        header += [TENSOR, DTYPES.index(value.dtype), value.dim(), *value.shape]
        tensors.append(value)
    elif type(value) in HOST_VALUES:
        header += [HOST_VALUE, HOST_VALUES.index(type(value))]
        _encode(tuple(getattr(value, field.name) for field in dataclasses.fields(value)), header, tensors, where)
    else:
        raise TypeError(
            f"{where} is a {type(value).__name__}: trl-padfree hands a split row's micro-batches to its ranks as "
            f"tensors, ints and {', '.join(kind.__name__ for kind in HOST_VALUES)}, nothing else."
        )


def decoded(words: Iterator[int], tensors: _TensorsOf) -> Any:
    kind = next(words)
    if kind == NONE:
        return None
    if kind == BOOL:
        return bool(next(words))
    if kind == INT:
        return next(words)
    if kind == FLOAT:
        return struct.unpack("<d", struct.pack("<q", next(words)))[0]
    if kind == STR:
        return bytes(next(words) for _ in range(next(words))).decode()
    if kind in (TUPLE, LIST):
        parts = [decoded(words, tensors) for _ in range(next(words))]
        return tuple(parts) if kind == TUPLE else parts
    if kind == DICT:
        return {decoded(words, tensors): decoded(words, tensors) for _ in range(next(words))}
    if kind == TENSOR:
        dtype = DTYPES[next(words)]
        return tensors.next(dtype, [next(words) for _ in range(next(words))])
    if kind == HOST_VALUE:
        cls = HOST_VALUES[next(words)]
        return cls(*decoded(words, tensors))
    raise ValueError(f"not a batch header word: {kind}")


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _on(part, device) for key, part in value.items()}
    return value
