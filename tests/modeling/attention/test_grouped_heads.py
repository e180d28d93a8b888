"""Grouped key/value heads on torch releases whose `varlen_attn` takes no `enable_gqa` (2.10, 2.11): they go to the
kernel grouped, so what it keeps for the backward is the grouped keys and values, not copies expanded to the query
heads (docs/concepts/kernels.md gives the bytes). The stand-ins (tests/support/stand_in_kernels.py) save what torch's op
saves: its inputs as given, the output, the log-sum-exp and the generator state."""

import pytest
import torch
from stand_in_kernels import calls_of, varlen_stand_in

from trl_padfree.modeling.attention.varlen import KernelSession, varlen_attention
from trl_padfree.modeling.check.stand_ins import stand_in_kernels

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
BOUNDS = (0, 5, 6, 17, 19)  # odd lengths, a one-token sequence


def saved_while(function):
    """`function()`'s result and the shapes of the tensors autograd kept for its backward (`saved_while.bytes`: their
    bytes, the last call's)."""
    shapes = []
    saved_while.bytes = 0

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        saved_while.bytes += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, shapes


def attend(query, key, value, version):
    cu_seq_lens = torch.tensor(BOUNDS, dtype=torch.int32)
    longest = max(end - start for start, end in zip(BOUNDS, BOUNDS[1:], strict=False))
    with stand_in_kernels(varlen=varlen_stand_in(version)):
        return varlen_attention(
            query, key, value, cu_seq_lens, cu_seq_lens, longest, longest,
            session=KernelSession(), scaling=HEAD_DIM**-0.5, sliding_window=None, dropout=0.0,
        )  # fmt: skip


@pytest.mark.parametrize("version", ["2.10", "2.11"])
def test_grouped_heads_reach_the_kernel_grouped_and_equal_the_expanded_heads(version):
    generator = torch.Generator().manual_seed(0)
    length = BOUNDS[-1]
    query, key, value = (
        torch.randn(1, heads, length, HEAD_DIM, generator=generator, dtype=torch.bfloat16).requires_grad_()
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    output, saved = saved_while(lambda: attend(query, key, value, version))

    (call,) = calls_of("varlen_attn")[-1:]
    assert call.details["heads"] == (HEADS, KV_HEADS), "the kernel was handed expanded heads"
    expanded_shape = (length, HEADS, HEAD_DIM)
    assert saved.count((length, KV_HEADS, HEAD_DIM)) == 2, saved  # the grouped key and value
    assert saved.count(expanded_shape) == 2, "an expanded key or value saved for the backward"  # query, output

    # The reference: the same kernel with the heads expanded first (what ran before)
    groups = HEADS // KV_HEADS
    copies = [tensor.detach().clone().requires_grad_() for tensor in (query, key, value)]
    expected = attend(
        copies[0], copies[1].repeat_interleave(groups, 1), copies[2].repeat_interleave(groups, 1), version
    )
    torch.testing.assert_close(output, expected, atol=0, rtol=0)
    gradient = torch.randn(output.shape, generator=generator, dtype=output.dtype)
    output.backward(gradient)
    expected.backward(gradient)
    # The kernel computes grouped key and value gradients per query head, rounds them to bf16 and sums each group
    # (flash_api.cpp `mha_varlen_bwd`, dk_expanded): what autograd does with the expanded copies, to the bit
    for tensor, reference in zip((query, key, value), copies, strict=True):
        torch.testing.assert_close(tensor.grad, reference.grad, atol=0, rtol=0)
