"""`padfree_varlen`: a packing-aware attention registered with transformers' `AttentionInterface`.

Each sequence of a packed row attends only to itself, causally, read from `cu_seq_lens_q`:
- CUDA, fp16/bf16: PyTorch's own varlen flash attention (`torch.nn.attention.varlen.varlen_attn`), so no
  flash-attn package is needed.
- Elsewhere (CPU, or fp32 on CUDA): one `scaled_dot_product_attention` per segment. Its cost grows with the sum of
  the squared sequence lengths, not with the square of the row as the dense block-diagonal sdpa/eager mask does.

Both run with flash attention's varlen semantics (query and key segments, causal aligned to the bottom-right corner),
so a prefix-sharing row (prefix_sharing.py) is two calls of the same kernel: the row's segments, then each rejected
branch against its gathered prefix and branch keys, whose outputs replace the first call's for those tokens.

Its mask function builds no mask (segments come from `cu_seq_lens` or `position_ids`) and refuses a padding mask,
which this attention could not honour: a padded batch must use `sdpa` or `eager`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .packing import cu_seq_lens_from_position_ids
from .prefix_sharing import SharedPrefixAttention

ATTN_IMPLEMENTATION = "padfree_varlen"


def _causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    # Causal aligned to the bottom-right corner: query q stands at key position q + keys - queries. With transformers'
    # sliding window, it sees keys k with q' - window < k <= q'
    query = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    key = torch.arange(keys, device=device).unsqueeze(0)
    mask = key <= query
    return mask if window is None else mask & (key > query - window)


def per_segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    dropout: float,
    skip_segments: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Exact causal attention per segment, one `scaled_dot_product_attention` each. Inputs `(1, heads, T, dim)`;
    returns `(1, T_q, heads, dim)`.

    Same semantics as flash attention's varlen kernel: segment i has queries `cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]`
    and keys `cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]`, causal aligned to the bottom-right corner when it has more keys.
    Segments in `skip_segments` are not computed (zeros): their outputs are about to be replaced.
    """
    outputs = []
    bounds_q = cu_seq_lens_q.tolist()
    bounds_k = bounds_q if cu_seq_lens_k is cu_seq_lens_q else cu_seq_lens_k.tolist()  # one host sync for both
    enable_gqa = query.shape[1] != key.shape[1]
    segments = zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True)
    for segment, (start_q, end_q, start_k, end_k) in enumerate(segments):
        queries, keys = end_q - start_q, end_k - start_k
        if queries == 0:
            continue
        if segment in skip_segments:
            outputs.append(query.new_zeros(1, query.shape[1], queries, value.shape[-1]))
            continue
        mask, is_causal = None, True
        if keys != queries or (sliding_window is not None and keys > sliding_window):
            mask, is_causal = _causal_mask(queries, keys, sliding_window, query.device), False
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start_q:end_q],
                key[:, :, start_k:end_k],
                value[:, :, start_k:end_k],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=is_causal,
                scale=scaling,
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2)


def torch_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """PyTorch's varlen flash attention (CUDA). Inputs `(1, heads, T, dim)`; returns `(1, T_q, heads, dim)`."""
    from torch.nn.attention.varlen import varlen_attn

    # (-1, 0) is plain causal; (W - 1, 0) keeps the query and the W - 1 keys before it, like transformers' window.
    # Both align to the bottom-right corner when a segment has more keys than queries.
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    output = varlen_attn(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seq_lens_q.to(device=query.device, dtype=torch.int32),
        cu_seq_lens_k.to(device=query.device, dtype=torch.int32),
        max_length_q,
        max_length_k,
        scale=scaling,
        window_size=window,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.unsqueeze(0)


def varlen_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **options):
    """The CUDA kernel in fp16/bf16 without dropout, else the per-segment reference with the same semantics (which
    skips `skip_segments`; one kernel call computes them at little extra cost)."""
    dropout = options.pop("dropout")
    skip_segments = options.pop("skip_segments", frozenset())
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0:
        if max_length_q is None:
            max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
            max_length_k = int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max())
        return torch_varlen_attention(
            query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **options
        )
    return per_segment_attention(
        query, key, value, cu_seq_lens_q, cu_seq_lens_k, dropout=dropout, skip_segments=skip_segments, **options
    )


@dataclass
class SharedForward:
    """A prefix-sharing forward in progress: its layout, and how many attention calls read it."""

    shared_prefix: SharedPrefixAttention
    attention_calls: int = 0


# Set while a prefix-sharing row runs forward, so an attention call that did not receive its layout fails loudly
_SHARED_FORWARD: contextvars.ContextVar[SharedForward | None] = contextvars.ContextVar(
    "trl_padfree_shared_forward", default=None
)


@contextlib.contextmanager
def shared_prefix_expected(shared_prefix: SharedPrefixAttention | None):
    """Around a forward on a prefix-sharing row: attention calls without the layout raise, and so does a forward in
    which no attention call read it (a model whose layers mix tokens without the attention interface)."""
    if shared_prefix is None:
        yield
        return
    forward = SharedForward(shared_prefix)
    token = _SHARED_FORWARD.set(forward)
    try:
        yield
    finally:
        _SHARED_FORWARD.reset(token)
    if forward.attention_calls == 0:
        raise ValueError(
            "No attention layer of this model read the prefix-sharing layout, so rejected tokens did not see their "
            f"prompt. The model does not run its attention through `{ATTN_IMPLEMENTATION}`; set prefix_sharing=False."
        )


def shared_prefix_attention(query, key, value, shared_prefix: SharedPrefixAttention, **options) -> torch.Tensor:
    """The second call of a prefix-sharing row: each rejected branch against its prefix and itself.

    Returns `(1, Q, heads, dim)` for the branch tokens `shared_prefix.query_index`, in that order.
    """
    keys = shared_prefix.key_index
    return varlen_attention(
        query[:, :, shared_prefix.query_index],
        key[:, :, keys],
        value[:, :, keys],
        shared_prefix.cu_seq_lens_q,
        shared_prefix.cu_seq_lens_k,
        shared_prefix.max_length_q,
        shared_prefix.max_length_k,
        **options,
    )


def padfree_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,  # self-attention: the same boundaries as the queries
    max_length_q: int | None = None,
    shared_prefix: SharedPrefixAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' `AttentionInterface` signature; see the module docstring."""
    if attention_mask is not None:
        raise ValueError(
            f"`{ATTN_IMPLEMENTATION}` attention is for packed rows and takes no attention mask; this batch is padded. "
            "Use the padding-free collator, or `sdpa` for padded batches."
        )
    if cu_seq_lens_q is None:
        # A call without the collator's boundaries: read them from the positions, as transformers does
        position_ids = kwargs.get("position_ids")
        if query.shape[0] != 1 or position_ids is None:
            raise ValueError(
                f"`{ATTN_IMPLEMENTATION}` attention needs `cu_seq_lens_q` or the `position_ids` of one packed row; "
                "pass the batch of `PaddingFreePreferenceCollator` to the model."
            )
        cu_seq_lens_q = cu_seq_lens_from_position_ids(position_ids)
        max_length_q = None
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"`{ATTN_IMPLEMENTATION}` attention expects one packed row of self-attention (no cache); got "
            f"{query.shape[0]} rows, {query.shape[2]} queries and {key.shape[2]} keys."
        )
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            f"`{ATTN_IMPLEMENTATION}` attention does not support attention logit softcapping or attention sinks. Use "
            "`packed_attn_implementation='eager'` for this model."
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"`{ATTN_IMPLEMENTATION}` attention only supports causal (decoder) self-attention.")

    options = dict(scaling=scaling, sliding_window=sliding_window, dropout=dropout)
    replaced = shared_prefix.branch_segments if shared_prefix is not None else frozenset()
    output = varlen_attention(
        query, key, value, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, skip_segments=replaced, **options
    )
    shared_forward = _SHARED_FORWARD.get()
    if shared_prefix is not None:
        # The first call let each rejected branch attend to itself only: replace those rows
        branches = shared_prefix_attention(query, key, value, shared_prefix, **options)
        output = output.index_copy(1, shared_prefix.query_index, branches)
        if shared_forward is not None:
            shared_forward.attention_calls += 1
    elif shared_forward is not None:
        raise ValueError(
            "This model's attention layers did not receive the prefix-sharing layout (`shared_prefix`), so rejected "
            "tokens would not see their prompt. Its model type does not pass keyword arguments down to attention; "
            "set prefix_sharing=False for it."
        )
    return output.contiguous(), None


def padfree_varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """Mask function for transformers' `AttentionMaskInterface`: no mask, and no padding allowed."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            f"`{ATTN_IMPLEMENTATION}` attention got a padded batch (an attention mask with zeros), which it cannot "
            "honour. Pass packed rows without a mask, or switch the model back for padded inputs, e.g. "
            "`model.set_attn_implementation('sdpa')` before `generate`."
        )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, padfree_varlen_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padfree_varlen_mask)
