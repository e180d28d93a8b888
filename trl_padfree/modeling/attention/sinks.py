"""Attention sinks (GPT-OSS) on torch's varlen kernel: one kernel call forward, one backward op call.

`varlen_attn` returns each query's log-sum-exp `lse` of its scores. A sink is one more logit `s` per head that every
query attends to and whose value is zero, so the sink's softmax is the kernel's scaled by `w = sigmoid(lse - s)`:
out' = w * out. Backward: with dO = w * dout given to the kernel's backward op together with out' (not out), its
`D = rowsum(dO * out')` equals the kernel's own term minus the gradient that reaches the scores through `lse`, so dQ,
dK, dV come out exact; the sink's gradient is -sum over queries of rowsum(dout * out') * (1 - w).
"""

from __future__ import annotations

import torch


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    # The correction's arithmetic in float32 at least, whatever the kernel's dtype
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class _SinkCorrectedVarlen(torch.autograd.Function):
    """`varlen_attn` with attention sinks: one forward call, one backward call (the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, boundaries, max_lengths, kernel, options):
        from torch.nn.attention.varlen import AuxRequest

        cu_seq_q, cu_seq_k = boundaries
        output, lse = kernel.function(
            query, key, value, cu_seq_q, cu_seq_k, *max_lengths, return_aux=AuxRequest(lse=True), **options
        )
        if lse.shape != (query.shape[1], query.shape[0]):  # the layout the correction reads: (heads, tokens)
            raise RuntimeError(f"varlen_attn returned a log-sum-exp of shape {tuple(lse.shape)}, not (heads, tokens)")
        kept = torch.sigmoid(lse - _wide(sinks).unsqueeze(1)).t().unsqueeze(-1)  # (T, heads, 1): the share not sunk
        corrected = (_wide(output) * kept).to(output.dtype)
        ctx.save_for_backward(query, key, value, cu_seq_q, cu_seq_k, corrected, lse, kept)
        ctx.kernel, ctx.options, ctx.max_lengths, ctx.sinks_dtype = kernel, options, max_lengths, sinks.dtype
        return corrected

    @staticmethod
    def backward(ctx, grad):
        query, key, value, cu_seq_q, cu_seq_k, corrected, lse, kept = ctx.saved_tensors
        window = list(ctx.options.get("window_size", (-1, -1)))
        grad = _wide(grad)
        grad_query, grad_key, grad_value = ctx.kernel.backward(
            (grad * kept).to(query.dtype),
            query,
            key,
            value,
            corrected,
            lse,
            cu_seq_q,
            cu_seq_k,
            *ctx.max_lengths,
            window == [-1, 0],  # as `varlen_attn` derives `is_causal` for its op
            torch.zeros(2, dtype=torch.uint64, device=query.device),  # no dropout: the op's unused generator state
            ctx.options.get("scale"),
            window,
        )
        grad_sinks = -((grad * _wide(corrected)).sum(-1, keepdim=True) * (1 - kept)).sum((0, 2))
        return grad_query, grad_key, grad_value, grad_sinks.to(ctx.sinks_dtype), None, None, None, None


def varlen_with_sinks(query, key, value, sinks, boundaries, max_lengths, kernel, options) -> torch.Tensor:
    """`(T, heads, dim)` inputs fitted to the kernel, `sinks` one logit per query head; returns `(T, heads, dim)`."""
    return _SinkCorrectedVarlen.apply(query, key, value, sinks, boundaries, max_lengths, kernel, options)
