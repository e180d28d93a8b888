"""accelerate, adapted where trl-padfree needs it to do otherwise for a while: gathers of per-pair tensors whose
length differs between processes (token-budget micro-batches hold different numbers of pairs)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from . import swapped


def gather_uneven(gather, pad_across_processes, tensor: torch.Tensor) -> torch.Tensor:
    """`accelerator.gather` for per-pair tensors whose length differs between processes: pad to the longest, gather,
    drop the padding."""
    if tensor.dim() == 0:
        return gather(tensor)
    sizes = gather(tensor.new_tensor([tensor.shape[0]], dtype=torch.long)).tolist()
    padded = pad_across_processes(tensor, dim=0)
    gathered = gather(padded)
    width = padded.shape[0]
    return torch.cat([gathered[rank * width : rank * width + size] for rank, size in enumerate(sizes)])


@contextlib.contextmanager
def uneven_gathers(accelerator) -> Iterator[None]:
    """Within the block, `accelerator.gather` and `gather_for_metrics` accept per-process lengths that differ, so
    TRL's metric code (which gathers per-pair rewards and log-probs) works on token-budget micro-batches."""
    uneven = functools.partial(gather_uneven, accelerator.gather, accelerator.pad_across_processes)
    with swapped(accelerator, "gather", uneven), swapped(accelerator, "gather_for_metrics", uneven):
        yield
