"""Exact causal attention, one segment at a time: the CPU path of `padfree_varlen`, and its CUDA path where the varlen
kernel cannot compute a layer. Pure torch.

Segments follow flash attention's varlen convention: segment i has queries `cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]` and
keys `cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]`, causal aligned to the bottom-right corner when it has more keys than
queries (a prefix-sharing branch reading its prompt, a context-parallel chunk reading the row before it). Its cost grows
with the sum of the squared segment lengths, not with the square of the row as a dense block-diagonal mask does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def _segment_mask(queries: int, keys: int, window: int | None, causal: bool, device: torch.device) -> torch.Tensor:
    # Aligned to the bottom-right corner: query q stands at key position q + keys - queries. Causal, it sees keys k
    # with k <= q'; with transformers' sliding window, also q' - window < k; not causal (an image's tokens), every key
    # of the segment within that window
    query = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    key = torch.arange(keys, device=device).unsqueeze(0)
    mask = key <= query if causal else torch.ones(queries, keys, dtype=torch.bool, device=device)
    return mask if window is None else mask & (key > query - window)


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    dropout: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one segment written out as transformers' eager attention computes it, for what sdpa cannot
    do: logit softcapping (gemma2) and attention sinks (gpt_oss). Inputs `(1, heads, T, dim)` and a boolean `mask`
    `(T_q, T_k)` of the keys each query sees; returns `(1, heads, T_q, dim)`. Differentiable in all tensors."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # Softmax in at least fp32, as eager upcasts
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = scores.softmax(-1)
    else:
        # One more logit per head that every query attends to; its share of the softmax is dropped, not renormalised
        sink_logits = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.cat([scores, sink_logits], dim=-1).softmax(-1)[..., :-1]
    weights = F.dropout(weights.to(value.dtype), p=dropout, training=dropout > 0)
    return weights @ value


def _segment_attention(query, key, value, scaling, sliding_window, dropout, softcap, sinks, causal, sdpa):
    """Attention of one segment `(1, heads, T, dim)`, causal (or not) aligned to the bottom-right corner: `sdpa`,
    unless the layer softcaps or has sinks."""
    queries, keys = query.shape[2], key.shape[2]
    if softcap is not None or sinks is not None:
        mask = _segment_mask(queries, keys, sliding_window, causal, query.device)
        return explicit_attention(query, key, value, mask, scaling, dropout, softcap, sinks)
    mask, is_causal = None, causal
    windowed = sliding_window is not None and keys > sliding_window  # else the window bounds no query
    if (causal and keys != queries) or windowed:
        mask, is_causal = _segment_mask(queries, keys, sliding_window, causal, query.device), False
    return sdpa(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def per_segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    dropout: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    bounds: tuple[Sequence[int], Sequence[int]] | None = None,
    sdpa: Callable = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """Exact attention per segment, one `scaled_dot_product_attention` each (or `explicit_attention` with `softcap`
    or `sinks`). Inputs `(1, heads, T, dim)`; returns `(1, T_q, heads, dim)`.

    Same semantics as flash attention's varlen kernel: segment i has queries `cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]`
    and keys `cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]`, causal (or, `causal=False`, every key within the window before
    it) aligned to the bottom-right corner when it has more keys. `bounds`: the same boundaries as host integers,
    when the caller has them (else read from the tensors). `sdpa`: torch's `scaled_dot_product_attention`, or a
    stand-in that records the backend a GPU would pick.
    """
    outputs = []
    if bounds is not None:
        bounds_q, bounds_k = bounds
    else:
        bounds_q = cu_seq_lens_q.tolist()
        bounds_k = bounds_q if cu_seq_lens_k is cu_seq_lens_q else cu_seq_lens_k.tolist()  # one read for both
    segments = zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True)
    for start_q, end_q, start_k, end_k in segments:
        if end_q == start_q:
            continue
        outputs.append(
            _segment_attention(
                query[:, :, start_q:end_q],
                key[:, :, start_k:end_k],
                value[:, :, start_k:end_k],
                scaling,
                sliding_window,
                dropout,
                softcap,
                sinks,
                causal,
                sdpa,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2)
