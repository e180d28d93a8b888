"""accelerate, adapted where trl-padfree needs it to do otherwise for a while: gathers of per-pair tensors whose
length differs between processes (token-budget micro-batches hold different numbers of pairs)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from . import swapped


def gather_uneven(gather, pad_across_processes, tensor: torch.Tensor, counted: bool = True) -> torch.Tensor:
    """`accelerator.gather` for per-pair tensors whose length differs between processes: pad to the longest, gather,
    drop the padding. A process whose values are not `counted` (another rank counts the same row) gives none: no
    entries of a per-pair tensor, zero for a count or a sum."""
    if tensor.dim() == 0:
        return gather(tensor if counted else torch.zeros_like(tensor))
    if not counted:
        tensor = tensor[:0]
    sizes = gather(tensor.new_tensor([tensor.shape[0]], dtype=torch.long)).tolist()
    padded = pad_across_processes(tensor, dim=0)
    gathered = gather(padded)
    width = padded.shape[0]
    return torch.cat([gathered[rank * width : rank * width + size] for rank, size in enumerate(sizes)])


@contextlib.contextmanager
def uneven_gathers(accelerator, counted: bool = True) -> Iterator[None]:
    """Within the block, `accelerator.gather` and `gather_for_metrics` accept per-process lengths that differ, so
    TRL's metric code (which gathers per-pair rewards and log-probs) works on token-budget micro-batches; `counted`
    False: this process's values are left out (`gather_uneven`)."""
    uneven = functools.partial(gather_uneven, accelerator.gather, accelerator.pad_across_processes, counted=counted)
    with swapped(accelerator, "gather", uneven), swapped(accelerator, "gather_for_metrics", uneven):
        yield
