"""The ranks that share a packed row: their groups, made once per process, and the collectives between them.

One type for every group of ranks a split row uses (DeepSpeed Ulysses', context parallelism's, both together): its
chunk of a `(1, T, ...)` row, and the whole row from every rank's chunk. DeepSpeed makes Ulysses' groups; this module
makes context parallelism's (`context_parallel_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..refusals.parallel import check_processes_share_rows


@dataclass(frozen=True)
class RowGroup:
    """Ranks that share a packed row (or a part of it), and this rank's place among them: a Ulysses group, a
    context-parallel group, or every rank of a row split both ways."""

    group: Any
    rank: int
    size: int

    def chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a `(1, T, ...)` row (T a multiple of `size`)."""
        length = tensor.shape[1] // self.size
        return tensor[:, self.rank * length : (self.rank + 1) * length]

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole row from every rank's chunk along `dim`, differentiable: the backward hands each rank its
        chunk's gradient summed over the group."""
        return _GatherChunks.apply(tensor.contiguous(), self.group, dim)


# In place: each rank's part written straight into one buffer (no list of parts, no `cat` copy). torch 2.13 names
# them `*_single` and deprecates the `*_tensor` names that torch 2.10-2.12 have; gloo runs both on CPU. Looked up at
# each call, as torch.distributed's other functions are (tests count them)
def all_gather_in_place():
    """torch's in-place all-gather under this release's name (called where it is used, so tests count its caller)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    all_gather_in_place()(output, tensor, group=group)


def _reduce_scatter_from(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, tensor, group=group)


def all_gather_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each) stacked along dim 0 in rank order, written in place."""
    gathered = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
    _all_gather_into(gathered, tensor.contiguous(), group=group)
    return gathered


class _GatherChunks(torch.autograd.Function):
    """All-gather along a dimension whose backward sums each chunk's gradient over the group (a reduce-scatter).
    Not `torch.distributed.nn.functional.all_gather`: on gloo its backward scatters from group ranks as if they were
    global ranks, which fails in any group that is not ranks 0..N-1. The collectives run on dim 0, each writing its
    buffer in place; gathering a `(1, T, ...)` row on T, that is the row itself (other layouts take one copy)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        gathered = all_gather_dim0(tensor.movedim(dim, 0), group).movedim(0, dim)  # rank r's chunk r-th
        # A view where the dims before `dim` are 1 (a `(1, T, ...)` row gathered on T): no copy
        return gathered if gathered.is_contiguous() else gathered.contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        grad = grad.movedim(ctx.dim, 0).contiguous()
        mine = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter_from(mine, grad, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


def gather_uneven(tensor: torch.Tensor, group: RowGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's `tensor`, of `sizes[rank]` entries along dim 0, concatenated in rank order, differentiably: the
    backward hands each rank the gradient of its own entries, summed over the group."""
    return _GatherUneven.apply(tensor.contiguous(), group, sizes)


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: RowGroup, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        longest = max(sizes)
        padded = tensor
        if tensor.shape[0] != longest:
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
        received = all_gather_dim0(padded, group.group)
        if all(size == longest for size in sizes):
            return received
        return torch.cat([received[rank * longest : rank * longest + size] for rank, size in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: not autograd's own buffer
        dist.all_reduce(grad, group=ctx.group.group)
        start = sum(ctx.sizes[: ctx.group.rank])
        return grad[start : start + ctx.sizes[ctx.group.rank]], None, None


# ---- the groups ----

# torch.distributed makes a group once, with every rank taking part: the groups made, by (context, Ulysses) size,
# for the process's lifetime
_GROUPS: dict[tuple[int, int], tuple[RowGroup, RowGroup]] = {}


def context_parallel_groups(size: int, ulysses_size: int = 1) -> tuple[RowGroup, RowGroup]:
    """This rank's context-parallel group, and the group of every rank that shares its row.

    A row is shared by `size x ulysses_size` consecutive ranks, each feeding the model one chunk of it. Alone
    (`ulysses_size` 1) those ranks are the context-parallel group. With Ulysses, whose groups DeepSpeed makes of
    `ulysses_size` consecutive ranks, a Ulysses group gathers its ranks' adjacent chunks into one context-parallel
    chunk for `ulysses_size`-th of the heads; the context-parallel group is then the ranks at the same place in each
    Ulysses group of the row, which hold the same heads (row of 4 ranks, ulysses 2: context-parallel groups {0, 2} and
    {1, 3}). Created once per process: every rank creates every group, as `torch.distributed.new_group` requires.
    """
    if (size, ulysses_size) in _GROUPS:
        return _GROUPS[size, ulysses_size]
    world, rank = dist.get_world_size(), dist.get_rank()
    row_size = size * ulysses_size
    check_processes_share_rows(row_size, world)
    mine = {}
    for first in range(0, world, row_size):
        row_ranks = list(range(first, first + row_size))
        row_group = dist.new_group(row_ranks) if ulysses_size > 1 else None
        for place in range(ulysses_size):
            ranks = row_ranks[place::ulysses_size]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["context"] = RowGroup(group, ranks.index(rank), size)
                mine["row"] = RowGroup(row_group, rank - first, row_size) if row_group else mine["context"]
    _GROUPS[size, ulysses_size] = mine["context"], mine["row"]
    return _GROUPS[size, ulysses_size]


# The nested blocks of dynamic context parallelism, by context-parallel size: this rank's block of each size
_BLOCKS: dict[int, dict[int, RowGroup]] = {}


def context_parallel_blocks(size: int) -> dict[int, RowGroup]:
    """This rank's block of each size 2, 4 ... `size` (a power of two) inside its context-parallel group of `size`
    consecutive ranks: the ranks a row split over that many shares (packing/rank_shares.py). Blocks are aligned: the
    block of size s holding rank r is ranks s x (r // s) to s x (r // s) + s - 1. Made once per process, every rank
    creating every block (`torch.distributed.new_group`); the block of `size` is the context-parallel group."""
    if size in _BLOCKS:
        return _BLOCKS[size]
    world, rank = dist.get_world_size(), dist.get_rank()
    check_processes_share_rows(size, world)
    mine = {size: context_parallel_groups(size)[0]}
    block = 2
    while block < size:
        for first in range(0, world, block):
            ranks = list(range(first, first + block))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[block] = RowGroup(group, rank - first, block)
        block *= 2
    _BLOCKS[size] = mine
    return mine
