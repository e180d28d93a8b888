"""Live bytes of one context-parallel attention call (trl_padfree.parallel.context.ContextParallelRow.attend), forward
and backward, in row buffers (the whole row's keys and values, 2 T kv b): what trl_padfree/plan/context_parallel.py
counts.

One process, on CPU. The collective and the kernel are stand-ins that allocate what the real ones do: the all-gather
fills C chunk-sized buffers and its backward copies the row gradient's chunks for a reduce-scatter
(torch.distributed.nn.functional on NCCL); the kernel saves q, k, v, its output and log-sum-exp, as flash attention
does, and its backward makes dq, dk, dv. Every tensor an op creates is counted until its storage is freed.
"""

import weakref

import torch
import torch.distributed.nn.functional
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trl_padfree.modeling.attention import gathered
from trl_padfree.parallel.context import ContextParallelRow
from trl_padfree.parallel.groups import RowGroup

C, ROW, HEADS, KV_HEADS, HEAD_DIM = 8, 4096, 32, 8, 16  # Llama-3.1-8B's 4 query heads per KV head
CHUNK = ROW // C


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.seen:
                    self.seen.add(storage.data_ptr())
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.free, storage.data_ptr(), storage.nbytes())
        return output

    def free(self, pointer, nbytes):
        self.seen.discard(pointer)
        self.live -= nbytes


class AllGather(torch.autograd.Function):
    """Stands in for trl-padfree's all-gather (parallel.groups._GatherChunks), allocating what it allocates."""

    @staticmethod
    def forward(ctx, tensor, dim):
        ctx.dim = dim
        chunks = [tensor.clone() for _ in range(C)]  # C buffers the collective fills
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, gradient):
        chunks = [chunk.contiguous() for chunk in gradient.chunk(C, dim=ctx.dim)]  # the reduce-scatter's input
        return torch.empty_like(chunks[0]).copy_(chunks[-1]), None  # its output


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(1, query.shape[2], HEADS, HEAD_DIM)
        ctx.save_for_backward(query, key, value, output, query.new_empty(HEADS, query.shape[2]))
        return output

    @staticmethod
    def backward(ctx, gradient):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def main():
    RowGroup.gather = lambda self, tensor, dim=1: AllGather.apply(tensor, dim)
    gathered.varlen_attention = lambda q, k, v, *_, **__: FlashAttention.apply(q, k, v)  # the kernel
    cu_seq_lens = torch.tensor([0, ROW], dtype=torch.int32)
    row = ContextParallelRow(cu_seq_lens, ROW, group=RowGroup(None, C - 1, C), row_length=ROW)
    query = torch.randn(1, HEADS, CHUNK, HEAD_DIM, requires_grad=True)  # the last rank, one sequence filling the row
    key, value = (torch.randn(1, KV_HEADS, CHUNK, HEAD_DIM, requires_grad=True) for _ in range(2))
    row_buffer = 2 * ROW * KV_HEADS * HEAD_DIM * 4
    query_sized = CHUNK * HEADS * HEAD_DIM * 4
    with LiveBytes() as memory:
        output = row.attend(query, key, value, row.cu_seq_lens, ROW, {})
        forward_peak, kept = memory.peak, memory.live
        memory.peak = 0
        output.backward(torch.ones_like(output))
    # Less the chunk's own tensors, which the activation estimate counts: the output and log-sum-exp, then the
    # output, its gradient and dq
    forward_local = query_sized + HEADS * CHUNK * 4
    print(f"forward peak:          {(forward_peak - forward_local) / row_buffer:.2f} row buffers")
    print(f"kept for the backward: {(kept - forward_local) / row_buffer:.2f}")
    print(f"backward peak:         {(memory.peak - 3 * query_sized) / row_buffer:.2f}")


if __name__ == "__main__":
    main()
