"""`padfree_varlen`: a packing-aware attention registered with transformers' `AttentionInterface`.

Each sequence of a packed row attends only to itself, causally, read from its row (rows.py: the `packed_row` keyword
the packed forward passes, or `cu_seq_lens_q` / the `position_ids` of one row for a direct call). A call is three
steps, whatever the row: validate it, cut the row's segments as this layer needs them, let the row attend:

- CUDA, SM80+, half precision (bf16/fp16 weights, or float32 weights under autocast: cast first): one fused kernel
  call over the row, chosen explicitly per layer (plan.py, varlen.py, fused.py): torch's varlen attention on its
  Flash backend, with a log-sum-exp correction for attention sinks; flash-attn or FlexAttention for softcapping; the
  memory-efficient kernel for head dims above 256;
- elsewhere (CPU, float32 without autocast, dropout, or a kernel this machine lacks): exact attention per segment
  (segments.py).

Chunked attention layers (llama4's local layers) let a token see only the keys of its own chunk of
`attention_chunk_size` tokens, counted from the start of its sequence: as transformers counts them for a sequence
alone, or from the restarting `position_ids` of a packed row. Each chunk is then a segment of its own (chunk size 4):

    offset in sequence | 0 1 2 3 4 | 0 | 0 1 2 3 4 5 6 7 8 |
    cu_seq_lens        0           5   6                   15
    chunked            0       4   5   6       10      14  15

Its mask function builds no mask (segments come from the row) and refuses a padding mask, which this attention could
not honour: a padded batch must use `sdpa` or `eager`.
"""

from __future__ import annotations

import torch

from ...packing.layout import cu_seq_lens_from_position_ids
from ...refusals.forward import check_attention_call, check_chunked_layer, check_no_padding_mask
from .plan import sink_count
from .rows import PackedRow, check_row_received

CHUNKED_LAYER_TYPE = "chunked_attention"  # transformers' layer type of llama4's local attention layers


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """`attention_chunk_size` if `module` is a chunked attention layer, else None.

    A layer is chunked when its config's `layer_types` says "chunked_attention" at its `layer_idx` (llama4, the one
    transformers model with such layers), or, in a config without `layer_types`, when `attention_chunk_size` is set:
    transformers then builds the chunked mask for every layer.
    """
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    chunk_size = getattr(config, "attention_chunk_size", None)
    if layer_types is None:
        return None if chunk_size is None else int(chunk_size)
    if CHUNKED_LAYER_TYPE not in (layer_types if layer_idx is None else [layer_types[layer_idx]]):
        return None
    check_chunked_layer(type(module).__name__, layer_idx, chunk_size)
    return int(chunk_size)


def _row_of_call(query: torch.Tensor, cu_seq_lens_q, max_length_q, position_ids) -> PackedRow | None:
    """The row of a call without the packed forward's `packed_row`: from the collator's boundaries, else read from
    the positions of one row with transformers' own rule; None when neither is there."""
    if cu_seq_lens_q is not None:
        return PackedRow(cu_seq_lens_q, max_length_q)
    if query.shape[0] == 1 and position_ids is not None:
        return PackedRow(cu_seq_lens_from_position_ids(position_ids), None)
    return None


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
    s_aux: torch.Tensor | None = None,  # attention sinks, one logit per query head (gpt_oss)
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    packed_row: PackedRow | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' `AttentionInterface` signature; see the module docstring."""
    row = (
        packed_row
        if packed_row is not None
        else _row_of_call(query, cu_seq_lens_q, max_length_q, kwargs.get("position_ids"))
    )
    check_attention_call(
        has_mask=attention_mask is not None,
        rows=query.shape[0],
        queries=query.shape[2],
        keys=key.shape[2],
        boundaries_known=row is not None,
        causal=getattr(module, "is_causal", True),
        sinks=sink_count(s_aux),
        heads=query.shape[1],
    )
    if packed_row is None:  # a call without the row: refused if one that must be read is in flight
        check_row_received(packed_row)
    cu_seq_lens, max_length = row.segments(attention_chunk_size(module))
    options = dict(scaling=scaling, sliding_window=sliding_window, dropout=dropout, softcap=softcap, sinks=s_aux)
    options["module"] = module  # whose weights' dtype the kernel computes in, for float32 inputs outside autocast
    return row.attend(query, key, value, cu_seq_lens, max_length, options).contiguous(), None


def padfree_varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """Mask function for transformers' `AttentionMaskInterface`: no mask, and no padding allowed."""
    check_no_padding_mask(attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()))
    return None
