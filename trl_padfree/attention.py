"""`padfree_varlen`: a packing-aware attention registered with transformers' `AttentionInterface`.

Each sequence of a packed row attends only to itself, causally, read from `cu_seq_lens_q`:
- CUDA, fp16/bf16: PyTorch's own varlen flash attention (`torch.nn.attention.varlen.varlen_attn`), so no
  flash-attn package is needed.
- Elsewhere (CPU, or fp32 on CUDA): one `scaled_dot_product_attention` per segment. Its cost grows with the sum of
  the squared sequence lengths, not with the square of the row as the dense block-diagonal sdpa/eager mask does.

Its mask function builds no mask (segments come from `cu_seq_lens` or `position_ids`) and refuses a padding mask,
which this attention could not honour: a padded batch must use `sdpa` or `eager`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .packing import cu_seq_lens_from_position_ids

ATTN_IMPLEMENTATION = "padfree_varlen"


def _sliding_causal_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    # transformers' sliding window: query q sees keys k with q - window < k <= q
    query = torch.arange(length, device=device).unsqueeze(1)
    key = torch.arange(length, device=device).unsqueeze(0)
    return (key <= query) & (key > query - window)


def per_sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    dropout: float,
) -> torch.Tensor:
    """Exact causal attention per segment. Inputs `(1, heads, T, dim)`; returns `(1, T, heads, dim)`."""
    outputs = []
    bounds = cu_seq_lens.tolist()
    enable_gqa = query.shape[1] != key.shape[1]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        length = end - start
        if length == 0:
            continue
        mask, is_causal = None, True
        if sliding_window is not None and length > sliding_window:
            mask, is_causal = _sliding_causal_mask(length, sliding_window, query.device), False
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
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
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """PyTorch's varlen flash attention (CUDA). Inputs `(1, heads, T, dim)`; returns `(1, T, heads, dim)`."""
    from torch.nn.attention.varlen import varlen_attn

    # (-1, 0) is plain causal; (W - 1, 0) keeps the query and the W - 1 keys before it, like transformers' window
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    cu_seq_lens = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    output = varlen_attn(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seq_lens,
        cu_seq_lens,
        max_length,
        max_length,
        scale=scaling,
        window_size=window,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.unsqueeze(0)


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

    use_kernel = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
    if use_kernel:
        max_length = max_length_q if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        output = torch_varlen_attention(query, key, value, cu_seq_lens_q, max_length, scaling, sliding_window)
    else:
        output = per_sequence_attention(query, key, value, cu_seq_lens_q, scaling, sliding_window, dropout)
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
