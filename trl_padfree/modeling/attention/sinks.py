"""Attention sinks (GPT-OSS) on torch's varlen kernel: one kernel call forward, one backward op call.

`varlen_attn` returns each query's log-sum-exp `lse` of its scores. A sink is one more logit `s` per head that every
query attends to and whose value is zero, so the sink's softmax is the kernel's scaled by `w = sigmoid(lse - s)`:
out' = w * out. Backward: with dO = w * dout given to the kernel's backward op together with out' (not out), its
`D = rowsum(dO * out')` equals the kernel's own term minus the gradient that reaches the scores through `lse`, so dQ,
dK, dV come out exact; the sink's gradient is -sum over queries of rowsum(dout * out') * (1 - w).

The correction's own work, per output element (docs/concepts/kernels.md, "Sinks"):

    forward    out' = out * w            one op: the kernel's dtype in and out, the product in float32, rounded once
    backward   dO = dout * w             one op, likewise
               rowsum(dout * out')       the product in the kernel's dtype, summed in float32 (only the sink's
                                         gradient reads it)

`w` and `1 - w` are per query and head (1/head_dim of the elements), in float32 from the float32 `lse`. The products
in float32 rounded once make out' and dO bit-equal to computing all of it in float32.
"""

from __future__ import annotations

import torch

from ...integrations.torch import UntestedVarlenBackward


def _wide(dtype: torch.dtype) -> torch.dtype:
    # The per-row terms and the row sums in float32 at least (float64 stays float64)
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SinkCorrectedVarlen(torch.autograd.Function):
    """`varlen_attn` with attention sinks: one forward call, one backward call (the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, boundaries, max_lengths, kernel, options):
        from torch.nn.attention.varlen import AuxRequest

        if isinstance(kernel.backward, UntestedVarlenBackward):  # before any work: the backward could not run
            raise RuntimeError(kernel.backward.refusal)
        cu_seq_q, cu_seq_k = boundaries
        output, lse = kernel.function(
            query, key, value, cu_seq_q, cu_seq_k, *max_lengths, return_aux=AuxRequest(lse=True), **options
        )
        if lse.shape != (query.shape[1], query.shape[0]):  # the layout the correction reads: (heads, tokens)
            raise RuntimeError(f"varlen_attn returned a log-sum-exp of shape {tuple(lse.shape)}, not (heads, tokens)")
        sinks_wide = sinks.to(_wide(lse.dtype))
        kept = torch.sigmoid(lse - sinks_wide.unsqueeze(1))  # (heads, T): the share no sink takes
        # Written contiguous (the kernel's output has the query's strides): the backward op and the reshape after
        # attention take it without a copy
        corrected = torch.empty(output.shape, dtype=output.dtype, device=output.device)
        torch.mul(output, kept.t().unsqueeze(-1), out=corrected)
        ctx.save_for_backward(query, key, value, cu_seq_q, cu_seq_k, corrected, lse, kept, sinks_wide)
        ctx.kernel, ctx.options, ctx.max_lengths, ctx.sinks_dtype = kernel, options, max_lengths, sinks.dtype
        return corrected

    @staticmethod
    def backward(ctx, grad):
        query, key, value, cu_seq_q, cu_seq_k, corrected, lse, kept, sinks_wide = ctx.saved_tensors
        window = list(ctx.options.get("window_size", (-1, -1)))
        grad_scaled = torch.empty(grad.shape, dtype=query.dtype, device=grad.device)  # contiguous, as the op wants
        torch.mul(grad, kept.t().unsqueeze(-1), out=grad_scaled)
        grad_query, grad_key, grad_value = ctx.kernel.backward(
            grad_scaled,
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
        rows = (grad * corrected).sum(-1, dtype=_wide(grad.dtype))  # (T, heads): rowsum(dout * out')
        sunk = torch.sigmoid(sinks_wide.unsqueeze(1) - lse)  # 1 - w, without the cancellation of 1 - w near 1
        grad_sinks = -torch.linalg.vecdot(sunk, rows.t())
        return grad_query, grad_key, grad_value, grad_sinks.to(ctx.sinks_dtype), None, None, None, None


def varlen_with_sinks(query, key, value, sinks, boundaries, max_lengths, kernel, options) -> torch.Tensor:
    """`(T, heads, dim)` inputs fitted to the kernel, `sinks` one logit per query head; returns `(T, heads, dim)`."""
    return _SinkCorrectedVarlen.apply(query, key, value, sinks, boundaries, max_lengths, kernel, options)
