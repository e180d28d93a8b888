"""The ranks that share a packed row, and the differentiable gather of their chunks.

One type for every group of ranks a split row uses (DeepSpeed Ulysses', context parallelism's, both together): its
chunk of a `(1, T, ...)` row, and the whole row from every rank's chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


class _GatherChunks(torch.autograd.Function):
    """All-gather along a dimension whose backward sums each chunk's gradient over the group. Not
    `torch.distributed.nn.functional.all_gather`: on gloo its backward scatters from group ranks as if they were
    global ranks, which fails in any group that is not ranks 0..N-1."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        chunks = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, tensor, group=group)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunks = [chunk.contiguous() for chunk in grad.chunk(size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "gloo":
            # gloo has no reduce-scatter: each rank's chunk from every rank (the same bytes), then their sum
            received = [torch.empty_like(chunks[rank]) for _ in range(size)]
            dist.all_to_all(received, chunks, group=ctx.group)
            return torch.stack(received).sum(0), None, None
        mine = torch.empty_like(chunks[rank])
        dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine, None, None


def gather_uneven(tensor: torch.Tensor, group: RowGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's `tensor`, of `sizes[rank]` entries along dim 0, concatenated in rank order, differentiably: the
    backward hands each rank the gradient of its own entries, summed over the group."""
    return _GatherUneven.apply(tensor.contiguous(), group, sizes)


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: RowGroup, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        received = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(received, padded, group=group.group)
        return torch.cat([part[:size] for part, size in zip(received, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: not autograd's own buffer
        dist.all_reduce(grad, group=ctx.group.group)
        start = sum(ctx.sizes[: ctx.group.rank])
        return grad[start : start + ctx.sizes[ctx.group.rank]], None, None
