"""`padfree_varlen`: a packing-aware attention registered with transformers' `AttentionInterface`.

Each sequence of a packed row attends only to itself, causally, read from `cu_seq_lens_q`:
- CUDA, fp16/bf16, SM80+: PyTorch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`) on its Flash
  backend, chosen explicitly (kernels.py), so no flash-attn package is needed. Its keyword arguments differ between
  torch releases: `varlen_kernel_plan` reads what the installed one accepts. A layer the kernel cannot compute (logit
  softcapping, attention sinks, dropout, or a sliding window or custom scale the installed torch cannot pass) runs
  the per-segment path instead, and says so once in an INFO line on the `trl_padfree.attention` logger.
- Elsewhere (CPU, or fp32 on CUDA): one `scaled_dot_product_attention` per segment, or the same softmax attention
  written out (`explicit_attention`) for layers that softcap their logits or have attention sinks. Its cost grows with
  the sum of the squared sequence lengths, not with the square of the row as the dense block-diagonal sdpa/eager mask
  does.

Both run with flash attention's varlen semantics (query and key segments, causal aligned to the bottom-right corner),
so a prefix-sharing row (prefix_sharing.py) is two calls of the same kernel: the row's segments, then each rejected
branch against its gathered prefix and branch keys, whose outputs replace the first call's for those tokens.

Chunked attention layers (llama4's local layers) let a token see only the keys of its own chunk of
`attention_chunk_size` tokens, counted from the start of its sequence: as transformers counts them for a sequence
alone, or from the restarting `position_ids` of a packed row. Each chunk is then a segment of its own (chunk size 4):

    offset in sequence | 0 1 2 3 4 | 0 | 0 1 2 3 4 5 6 7 8 |
    cu_seq_lens        0           5   6                   15
    chunked            0       4   5   6       10      14  15

A prefix-sharing row is refused in such layers: a rejected branch's chunks start in its prompt, outside its segment.

Its mask function builds no mask (segments come from `cu_seq_lens` or `position_ids`) and refuses a padding mask,
which this attention could not honour: a padded batch must use `sdpa` or `eager`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .context_parallel import ContextParallelRow, context_parallel_forward_active
from .context_parallel import attend as context_parallel_attention
from .kernels import (
    FLASH_MIN_CAPABILITY,
    VARLEN_DTYPES,
    VarlenKernel,
    flash_backend,
    log_varlen_backend,
    takes_cuda_branch,
    varlen_kernel,
)
from .layout_expected import expected_by_attention
from .packing import cu_seq_lens_from_position_ids, ranges_index
from .prefix_sharing import SharedPrefixAttention

ATTN_IMPLEMENTATION = "padfree_varlen"
CHUNKED_LAYER_TYPE = "chunked_attention"  # transformers' layer type of llama4's local attention layers

logger = logging.getLogger(__name__)


@functools.cache
def _log_path_once(message: str) -> None:
    # Attention runs in every layer of every step: say which path runs once per process, not per call
    logger.info(message)


def _causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    # Causal aligned to the bottom-right corner: query q stands at key position q + keys - queries. With transformers'
    # sliding window, it sees keys k with q' - window < k <= q'
    query = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    key = torch.arange(keys, device=device).unsqueeze(0)
    mask = key <= query
    return mask if window is None else mask & (key > query - window)


# ---- chunked attention layers ----


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """`attention_chunk_size` if `module` is a chunked attention layer, else None.

    A layer is chunked when its config's `layer_types` says "chunked_attention" at its `layer_idx` (llama4, the one
    transformers model with such layers), or, in a config without `layer_types`, when `attention_chunk_size` is set:
    transformers then builds the chunked mask for every layer.
    """
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is None:
        chunked = getattr(config, "attention_chunk_size", None) is not None
    elif layer_idx is None:
        if CHUNKED_LAYER_TYPE in layer_types:
            raise ValueError(
                f"`{ATTN_IMPLEMENTATION}` attention cannot tell whether this {type(module).__name__} is a chunked "
                "attention layer: its config has chunked layers but the module has no `layer_idx`."
            )
        chunked = False
    else:
        chunked = layer_types[layer_idx] == CHUNKED_LAYER_TYPE
    if not chunked:
        return None
    chunk_size = getattr(config, "attention_chunk_size", None)
    if not chunk_size:
        raise ValueError(
            f"Layer {layer_idx} is a chunked attention layer, but its config sets no attention_chunk_size."
        )
    return int(chunk_size)


def chunked_cu_seq_lens(cu_seq_lens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Segment boundaries that also cut each segment every `chunk_size` tokens from its start, as int32.

    >>> chunked_cu_seq_lens(torch.tensor([0, 5, 6, 15]), chunk_size=4).tolist()
    [0, 4, 5, 6, 10, 14, 15]
    """
    boundaries = cu_seq_lens.cpu().long()  # on the host: one device sync, not one per op below
    starts, ends = boundaries[:-1], boundaries[1:]
    chunks = (ends - starts + chunk_size - 1) // chunk_size  # per segment, none if it is empty
    chunk_in_segment = ranges_index(torch.zeros_like(chunks), chunks)  # 0, 1, ... for each segment's chunks
    chunk_starts = torch.repeat_interleave(starts, chunks) + chunk_in_segment * chunk_size
    return torch.cat([chunk_starts, ends[-1:]]).to(device=cu_seq_lens.device, dtype=torch.int32)


# Every layer of a forward gets the same `cu_seq_lens` tensor: cut it into chunks (a host sync) once, not per layer
_last_chunked: tuple[weakref.ref, int, torch.Tensor] | None = None


def _chunked_once_per_forward(cu_seq_lens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    global _last_chunked
    if _last_chunked is not None:
        source, size, chunked = _last_chunked
        if source() is cu_seq_lens and size == chunk_size:
            return chunked
    chunked = chunked_cu_seq_lens(cu_seq_lens, chunk_size)
    _last_chunked = (weakref.ref(cu_seq_lens), chunk_size, chunked)
    return chunked


# ---- the exact per-segment path ----


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


def _segment_attention(query, key, value, scaling, sliding_window, dropout, softcap, sinks) -> torch.Tensor:
    """Causal attention of one segment `(1, heads, T, dim)`, aligned to the bottom-right corner: sdpa, unless the
    layer softcaps or has sinks."""
    queries, keys = query.shape[2], key.shape[2]
    if softcap is not None or sinks is not None:
        mask = _causal_mask(queries, keys, sliding_window, query.device)
        return explicit_attention(query, key, value, mask, scaling, dropout, softcap, sinks)
    mask, is_causal = None, True
    if keys != queries or (sliding_window is not None and keys > sliding_window):
        mask, is_causal = _causal_mask(queries, keys, sliding_window, query.device), False
    return F.scaled_dot_product_attention(
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
    skip_segments: frozenset[int] = frozenset(),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention per segment, one `scaled_dot_product_attention` each (or `explicit_attention` with
    `softcap` or `sinks`). Inputs `(1, heads, T, dim)`; returns `(1, T_q, heads, dim)`.

    Same semantics as flash attention's varlen kernel: segment i has queries `cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]`
    and keys `cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]`, causal aligned to the bottom-right corner when it has more keys.
    Segments in `skip_segments` are not computed (zeros): their outputs are about to be replaced.
    """
    outputs = []
    bounds_q = cu_seq_lens_q.tolist()
    bounds_k = bounds_q if cu_seq_lens_k is cu_seq_lens_q else cu_seq_lens_k.tolist()  # one host sync for both
    segments = zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True)
    for segment, (start_q, end_q, start_k, end_k) in enumerate(segments):
        if end_q == start_q:
            continue
        if segment in skip_segments:
            outputs.append(query.new_zeros(1, query.shape[1], end_q - start_q, value.shape[-1]))
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
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2)


# ---- the CUDA kernel ----


@dataclass(frozen=True)
class VarlenKernelPlan:
    """How to call `varlen_attn` for a layer, or why it cannot (`fallback`: the layer runs per segment instead)."""

    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments after `max_k`
    expand_heads: bool = False  # repeat key/value heads to the query heads: this kernel has no `enable_gqa`
    fallback: str | None = None


def varlen_kernel_plan(
    parameters: Collection[str],
    *,
    dtype: torch.dtype,
    grouped: bool,
    head_dim: int,
    scaling: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    dropout: float = 0.0,
    dtypes: Collection[torch.dtype] = VARLEN_DTYPES,
    capability: tuple[int, int] = FLASH_MIN_CAPABILITY,
) -> VarlenKernelPlan:
    """The call of a `varlen_attn` that takes the keyword `parameters` for a layer with these needs, on a GPU of
    compute `capability`; `dtypes`: the inputs the kernel computes in.

    By name, as torch releases differ: 2.10 takes `is_causal` only; 2.11 `scale` and `window_size`; 2.12 adds
    `enable_gqa` (2.13 to 2.15 take the same). Without `enable_gqa`, grouped key/value heads are expanded; without
    `scale`, only the default `1/sqrt(head_dim)` runs; without `window_size`, no sliding window.
    """

    def fall_back(reason: str) -> VarlenKernelPlan:
        return VarlenKernelPlan(fallback=reason)

    if tuple(capability) < FLASH_MIN_CAPABILITY:
        major, minor = capability
        return fall_back(f"a GPU of compute capability {major}.{minor} (the Flash kernel needs 8.0 or newer)")
    if dtype not in dtypes:
        takes = "/".join(str(each).removeprefix("torch.") for each in dtypes)
        return fall_back(f"{dtype} inputs (the kernel takes {takes})")
    if softcap is not None:
        return fall_back("attention logit softcapping")
    if sinks:
        return fall_back("attention sinks")
    if dropout > 0:
        return fall_back("attention dropout")
    options = {}
    if "window_size" in parameters:
        # (-1, 0) is plain causal; (W - 1, 0) keeps the query and the W - 1 keys before it, like transformers' window.
        # Both align to the bottom-right corner when a segment has more keys than queries.
        options["window_size"] = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    elif sliding_window is not None:
        return fall_back("a sliding window (this torch's varlen_attn takes no `window_size`)")
    elif "is_causal" in parameters:
        options["is_causal"] = True
    else:
        return fall_back("causal masking (this torch's varlen_attn takes neither `window_size` nor `is_causal`)")
    if "scale" in parameters:
        if scaling is not None:
            options["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, head_dim**-0.5):
        return fall_back(f"attention scale {scaling:g} (this torch's varlen_attn takes no `scale`)")
    if grouped and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return VarlenKernelPlan(options, expand_heads=grouped and "enable_gqa" not in parameters)


def _kernel_plan(kernel: VarlenKernel, query, key, scaling, sliding_window, dropout, softcap=None, sinks=None):
    return varlen_kernel_plan(
        kernel.parameters,
        dtype=query.dtype,
        grouped=query.shape[1] != key.shape[1],
        head_dim=query.shape[-1],
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks is not None,
        dropout=dropout,
        dtypes=kernel.dtypes,
        capability=kernel.device_capability(query.device),
    )


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
    """PyTorch's varlen attention (CUDA) on its Flash backend, called as the installed torch accepts. Inputs
    `(1, heads, T, dim)`; returns `(1, T_q, heads, dim)`."""
    kernel = varlen_kernel()
    plan = _kernel_plan(kernel, query, key, scaling, sliding_window, dropout=0.0)
    if plan.fallback is not None:
        raise ValueError(f"torch's varlen_attn cannot compute this attention: {plan.fallback}.")
    if plan.expand_heads:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    boundaries_q = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    # Self-attention passes one tensor for both, as torch's kernels expect of it
    same = cu_seq_lens_k is cu_seq_lens_q
    boundaries_k = boundaries_q if same else cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
    with flash_backend():
        output = kernel.function(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            boundaries_q,
            boundaries_k,
            max_length_q,
            max_length_k,
            **plan.options,
        )
    return output.unsqueeze(0)


def varlen_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **options):
    """The CUDA kernel where it can compute this layer's attention, else the per-segment reference with the same
    semantics (which skips `skip_segments`; one kernel call computes them at little extra cost).

    `options`: `scaling`, `sliding_window`, `dropout`, and optionally `softcap`, `sinks`, `skip_segments`.
    """
    skip_segments = options.pop("skip_segments", frozenset())
    if takes_cuda_branch(query):
        plan = _kernel_plan(varlen_kernel(), query, key, **options)
        if plan.fallback is None:
            log_varlen_backend()
            if max_length_q is None:
                max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
                max_length_k = int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max())
            return torch_varlen_attention(
                query,
                key,
                value,
                cu_seq_lens_q,
                cu_seq_lens_k,
                max_length_q,
                max_length_k,
                scaling=options["scaling"],
                sliding_window=options["sliding_window"],
            )
        _log_path_once(
            f"`{ATTN_IMPLEMENTATION}` attention runs exact per-segment attention on CUDA, not torch's varlen kernel, "
            f"for layers with {plan.fallback}."
        )
    return per_segment_attention(
        query, key, value, cu_seq_lens_q, cu_seq_lens_k, skip_segments=skip_segments, **options
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


def shared_prefix_expected(shared_prefix: SharedPrefixAttention | None):
    """Around a forward on a prefix-sharing row: attention calls without the layout raise, and so does a forward in
    which no attention call read it (a model whose layers mix tokens without the attention interface)."""
    if shared_prefix is None:
        return contextlib.nullcontext()
    unread = (
        "No attention layer of this model read the prefix-sharing layout, so rejected tokens did not see their "
        f"prompt. The model does not run its attention through `{ATTN_IMPLEMENTATION}`; set prefix_sharing=False."
    )
    return expected_by_attention(_SHARED_FORWARD, SharedForward(shared_prefix), unread)


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
    s_aux: torch.Tensor | None = None,  # attention sinks, one logit per query head (gpt_oss)
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,  # self-attention: the same boundaries as the queries
    max_length_q: int | None = None,
    shared_prefix: SharedPrefixAttention | None = None,
    context_parallel: ContextParallelRow | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' `AttentionInterface` signature; see the module docstring. Under context
    parallelism (context_parallel.py) the queries are this rank's chunk of the row, attending to the whole row."""
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
    if s_aux is not None and s_aux.numel() != query.shape[1]:
        raise ValueError(
            f"`{ATTN_IMPLEMENTATION}` attention needs one attention sink per query head: got {s_aux.numel()} sinks "
            f"for {query.shape[1]} heads."
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"`{ATTN_IMPLEMENTATION}` attention only supports causal (decoder) self-attention.")
    chunk_size = attention_chunk_size(module)
    if chunk_size is not None:
        if shared_prefix is not None:
            # A rejected branch's chunks are counted from the start of its prompt, which its row segment does not hold
            raise ValueError(
                "prefix sharing with chunked attention layers is not supported; set prefix_sharing=False."
            )
        cu_seq_lens_q = _chunked_once_per_forward(cu_seq_lens_q, chunk_size)
        # Still the longest segment: a segment longer than a chunk leaves a whole chunk
        max_length_q = None if max_length_q is None else min(max_length_q, chunk_size)

    options = dict(scaling=scaling, sliding_window=sliding_window, dropout=dropout, softcap=softcap, sinks=s_aux)
    if context_parallel is not None:
        output = context_parallel_attention(
            context_parallel, query, key, value, cu_seq_lens_q, varlen_attention, options
        )
        return output.contiguous(), None
    if context_parallel_forward_active():
        raise ValueError(
            "This model's attention layers did not receive the context-parallel row (`context_parallel`), so each "
            "rank would attend within its own chunk. Its model type does not pass keyword arguments down to "
            "attention; set context_parallel_size=1 for it."
        )
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
