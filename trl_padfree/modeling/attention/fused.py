"""The fused kernels for the layers torch's varlen kernel cannot compute (plan.py chooses): one call over the whole
packed row each, no loop over its segments and no score matrix kept. Inputs `(1, heads, T, dim)`, fitted to the
kernel as the plan says (cast, padded); each returns `(1, T_q, heads, dim)`.

    sinks       `varlen_attn` returns each query's log-sum-exp `lse` of its scores. A sink is one more logit `s` per
                head that every query attends to and whose value is zero, so the sink's softmax is the kernel's
                scaled by `w = sigmoid(lse - s)`: out' = w * out. Backward: with dO = w * dout given to the kernel's
                backward op together with out' (not out), its `D = rowsum(dO * out')` equals the kernel's own term
                minus the gradient that reaches the scores through `lse`, so dQ, dK, dV come out exact; the sink's
                gradient is -sum over queries of rowsum(dout * out') * (1 - w).
    softcap     flash-attn's `flash_attn_varlen_func(softcap=)`, or FlexAttention with a score_mod `c * tanh(s / c)`
                over the row's document mask (built once per forward from the host boundaries).
    wide heads  ATen's memory-efficient kernel with `cu_seqlens`: grouped keys and values expanded to the query heads
                first (it takes equal head counts); causal from each segment's bottom-right corner.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    # The correction's arithmetic in float32 at least, whatever the kernel's dtype
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class _SinkCorrectedVarlen(torch.autograd.Function):
    """`varlen_attn` with attention sinks: one forward call, one backward call (see the module docstring)."""

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


def flash_attn_softcap(query, key, value, boundaries, max_lengths, function, options) -> torch.Tensor:
    """flash-attn's varlen kernel, `(T, heads, dim)` in and out; grouped heads shared by the kernel."""
    return function(query, key, value, *boundaries, *max_lengths, dropout_p=0.0, **options)


def efficient_wide_heads(query, key, value, boundaries, max_lengths, function, options) -> torch.Tensor:
    """ATen's memory-efficient kernel on `(T, heads, dim)` inputs (keys and values expanded to the query heads
    first); returns `(T, heads, dim)`."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = function(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        None,  # no bias
        *boundaries,
        *max_lengths,
        0.0,  # no dropout
        options["custom_mask_type"],
        torch.is_grad_enabled(),  # the log-sum-exp its backward needs
        scale=options["scale"],
    )[0]
    return output[0]


# ---- FlexAttention: the row's document mask, once per forward ----


def token_segments(bounds: Sequence[int], length: int) -> tuple[list[int], list[int]]:
    """Each token's segment and offset in it, for `length` tokens cut at `bounds` (the last segment reaching
    `length`)."""
    segment, offset = [], []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        segment += [index] * (end - start)
        offset += range(end - start)
    return segment, offset


def document_block_mask(create_block_mask, bounds_q, bounds_k, sliding_window, causal, device):
    """The block mask of a packed row for FlexAttention: query and key in the same segment, causal from its
    bottom-right corner (a segment with more keys than queries reads them first), within the sliding window;
    built from host integers, moved to the device in one copy per index tensor."""
    segment_q, offset_q = token_segments(bounds_q, bounds_q[-1])
    segment_k, offset_k = token_segments(bounds_k, bounds_k[-1])
    shift = [end_k - start_k - (end_q - start_q) for start_q, end_q, start_k, end_k in _pairs(bounds_q, bounds_k)]
    position_q = [offset + shift[segment] for segment, offset in zip(segment_q, offset_q, strict=True)]
    doc_q, pos_q, doc_k, pos_k = (
        torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
        for values in (segment_q, position_q, segment_k, offset_k)
    )

    def mask_mod(batch, head, q_index, k_index):
        allowed = doc_q[q_index] == doc_k[k_index]
        if causal:
            allowed = allowed & (pos_k[k_index] <= pos_q[q_index])
        if sliding_window is not None:
            allowed = allowed & (pos_k[k_index] > pos_q[q_index] - sliding_window)
        return allowed

    return create_block_mask(mask_mod, None, None, len(segment_q), len(segment_k), device=device)


def _pairs(bounds_q, bounds_k):
    return zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True)


@functools.cache  # one function per cap: a compiled FlexAttention is not compiled again for each layer
def softcap_score_mod(softcap: float):
    def score_mod(score, batch, head, q_index, k_index):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_softcap(query, key, value, block_mask, score_mod, attention, options) -> torch.Tensor:
    """FlexAttention on `(1, heads, T, dim)` inputs; returns `(1, T_q, heads, dim)`."""
    output = attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=options["scale"],
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2)
