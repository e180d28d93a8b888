"""The fused kernels for the layers torch's varlen kernel cannot compute (plan.py chooses): one call over the whole
packed row each, no loop over its segments and no score matrix kept. Inputs `(1, heads, T, dim)`, fitted to the
kernel as the plan says (cast, padded); each returns `(1, T_q, heads, dim)`.

    sinks       torch's varlen kernel with the sink correction: sinks.py.
    softcap     flash-attn's `flash_attn_varlen_func(softcap=)`, or FlexAttention with a score_mod `c * tanh(s / c)`
                over the row's document mask (built once per forward from the host boundaries).
    wide heads  ATen's memory-efficient kernel with `cu_seqlens`: grouped keys and values expanded to the query heads
                first (it takes equal head counts); causal from each segment's bottom-right corner.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


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
