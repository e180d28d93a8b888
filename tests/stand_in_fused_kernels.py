"""Stand-ins for the fused CUDA kernels of the layers torch's varlen kernel cannot compute (`FusedKernels`,
trl_padfree/modeling/kernels.py), and for sdpa's choice of backend on a segment: each with the real function's
signature, the checks the real one makes (source named beside each), the result it computes and its half-precision
rounding, recording what it was given in `stand_in_kernels.CALLS`:

    _efficient_attention_forward   ATen's memory-efficient kernel, varlen (`cu_seqlens`), any head dim (a multiple
                                   of 8 in half precision); equal head counts
    flash_attn_varlen_func         flash-attn 2.6+ (softcap, window, grouped heads; head dim <= 256)
    flex_attention                 torch's FlexAttention (score_mod, block mask; head dims >= 16; one dtype for the
    create_block_mask              backward), the block mask evaluated densely
    scaled_dot_product_attention   sdpa, recording the backend ATen's sdp_utils.cpp would pick on an SM90 GPU

The reference is computed densely per call (test rows are short): scores in float32, then, as the kernels do in half
precision, the unnormalised softmax rounded to the input dtype before it multiplies the values, the output rounded
once; in the backward, the gradient reaching the probabilities rounded as the kernels round theirs, and grouped
keys' and values' gradients rounded per query head before the group's sum (flash's `dk_expanded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from stand_in_kernels import CALLS, PLAYED_CAPABILITY, KernelCall

from trl_padfree.modeling.kernels import FlexKernel, FusedKernels

HALF = (torch.float16, torch.bfloat16)


class _Rounded(torch.autograd.Function):
    """`tensor` rounded to `dtype` (kept in float32), and its gradient rounded alike: what a kernel does to an operand
    it hands a half-precision GEMM, both ways."""

    @staticmethod
    def forward(ctx, tensor, dtype):
        ctx.dtype = dtype
        return tensor.to(dtype).float()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).float(), None


class _GradientRounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dtype):
        ctx.dtype = dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).float(), None


def dense_reference(query, key, value, allowed, scale, softcap=None, score_mod=None):
    """Attention of `(heads, T_q, dim)` queries over `(kv_heads, T_k, dim)` keys and values where `allowed`
    `(T_q, T_k)` (or `(heads, T_q, T_k)`) says so, rounded as a half-precision kernel rounds; returns `(heads, T_q,
    dim)` in the query's dtype."""
    dtype, groups = query.dtype, query.shape[0] // key.shape[0]
    half = dtype in HALF
    key, value = key.float(), value.float()
    if groups > 1:  # each query head's own copy, its gradient rounded before the group's sum
        key, value = key.repeat_interleave(groups, 0), value.repeat_interleave(groups, 0)
        if half:
            key, value = _GradientRounded.apply(key, dtype), _GradientRounded.apply(value, dtype)
    scores = (query.float() @ key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if score_mod is not None:
        scores = score_mod(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))
    maximum = scores.amax(-1, keepdim=True).detach().clamp_min(-1e30)
    unnormalised = torch.exp(scores - maximum)
    total = unnormalised.sum(-1, keepdim=True)
    if half:
        unnormalised = _Rounded.apply(unnormalised, dtype)
    return ((unnormalised @ value) / total).to(dtype)


def segment_mask(bounds_q, bounds_k, causal: bool, left: int = -1, right: int = -1) -> torch.Tensor:
    """Which keys each query of a packed row sees: its own segment's, causal (or windowed) from the segment's
    bottom-right corner, as flash and the memory-efficient kernel align it."""
    total_q, total_k = bounds_q[-1], bounds_k[-1]
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool)
    for start_q, end_q, start_k, end_k in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
        position = torch.arange(end_q - start_q).unsqueeze(1) + (end_k - start_k) - (end_q - start_q)
        key = torch.arange(end_k - start_k).unsqueeze(0)
        block = torch.ones(end_q - start_q, end_k - start_k, dtype=torch.bool)
        if causal:
            block &= key <= position
        if right >= 0:
            block &= key <= position + right
        if left >= 0:
            block &= key >= position - left
        allowed[start_q:end_q, start_k:end_k] = block
    return allowed


def _check_max(name: str, maximum: int, bounds) -> None:
    # Each kernel sizes its grid from the maximum it is given: an understated one leaves rows uncomputed, silently
    longest = max((end - start for start, end in zip(bounds, bounds[1:], strict=False)), default=0)
    if maximum < longest:
        raise RuntimeError(f"{name}={maximum} is below the longest segment ({longest}): rows would go uncomputed")


# ---- ATen's memory-efficient kernel ----


def efficient_attention_forward(
    query,
    key,
    value,
    bias,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    custom_mask_type,
    compute_log_sumexp=False,
    *,
    scale=None,
    seqlen_k=None,
    window_size=None,
):
    """`aten::_efficient_attention_forward`'s checks (aten/src/ATen/native/transformers/cuda/attention.cu,
    `_efficient_attention_forward`, and the kernel's alignment, sdp_utils.cpp `check_head_dim_size_mem_efficient`)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise RuntimeError("Expected query.dim() == 4 to be true, but got false.")
    if not query.size(0) == key.size(0) == value.size(0):
        raise RuntimeError("Expected query.size(0) == key.size(0) to be true, but got false.")
    if key.size(1) != value.size(1):
        raise RuntimeError("Expected key.size(1) == value.size(1) to be true, but got false.")
    if not query.size(2) == key.size(2) == value.size(2):
        raise RuntimeError("Expected query.size(2) == key.size(2) to be true, but got false.")
    if query.size(3) != key.size(3):
        raise RuntimeError("Expected query.size(3) == key.size(3) to be true, but got false.")
    if query.dtype not in (torch.float32, *HALF) or not query.dtype == key.dtype == value.dtype:
        raise RuntimeError("Expected query, key and value to have one dtype among float32, float16, bfloat16.")
    if any(tensor.stride(-1) != 1 for tensor in (query, key, value)):
        raise RuntimeError("Expected query.stride(-1) == 1 to be true, but got false.")
    alignment = 8 if query.dtype in HALF else 4  # minimum_gemm_alignment on SM80+
    if query.size(3) % alignment or value.size(3) % alignment:
        raise RuntimeError(f"head dims must be multiples of {alignment} (the kernel's alignment)")
    if cu_seqlens_q is not None:
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
            raise RuntimeError("Expected seqstart_q->scalar_type() == at::ScalarType::Int to be true, but got false.")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_k.dim() != 1 or cu_seqlens_q.size(0) != cu_seqlens_k.size(0):
            raise RuntimeError("Expected seqstart_q->size(0) == seqstart_k->size(0) to be true, but got false.")
        if query.size(0) != 1:
            raise RuntimeError("cu_seqlen only supports batch_size=1")
        if max_seqlen_q is None:
            raise RuntimeError("Expected max_seqlen_q_.has_value() to be true, but got false.")
    if dropout_p != 0.0 or bias is not None or seqlen_k is not None or window_size is not None:
        raise NotImplementedError("the stand-in computes what padded rows use: no dropout, bias, seqlen_k, window")
    if custom_mask_type not in (0, 1, 2):
        raise RuntimeError("custom_mask_type not supported")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check_max("max_seqlen_q", max_seqlen_q, bounds_q)
    _check_max("max_seqlen_k", max_seqlen_k, bounds_k)
    if custom_mask_type == 1 and bounds_q != bounds_k:
        raise NotImplementedError("causal from the top-left of segments with more keys: not a layout rows use")
    CALLS.append(
        KernelCall(
            "efficient_attention",
            cu_seqlens_q,
            dict(head_dim=query.size(3), heads=query.size(2), input_dtype=query.dtype, mask=custom_mask_type),
        )
    )
    scale = query.size(3) ** -0.5 if scale is None else scale
    allowed = segment_mask(bounds_q, bounds_k, causal=custom_mask_type != 0)
    output = dense_reference(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), allowed, scale
    )
    output = output.transpose(0, 1).unsqueeze(0)
    rows = max(len(bounds_q) - 1, 1)
    lse = query.new_zeros(rows, query.size(2), math.ceil(max_seqlen_q / 32) * 32 if compute_log_sumexp else 0)
    seed = offset = torch.zeros((), dtype=torch.long)
    return output, lse.float(), seed, offset, max_seqlen_q, max_seqlen_k


# ---- flash-attn 2.6+ ----


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's `flash_attn_varlen_func` (flash_attn/flash_attn_interface.py) and `mha_varlen_fwd`'s checks
    (csrc/flash_attn/flash_api.cpp)."""
    if tuple(PLAYED_CAPABILITY) < (8, 0):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if q.dtype not in HALF:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if any(tensor.stride(-1) != 1 for tensor in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if v.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
        raise RuntimeError("k must have shape (total_k, num_heads_k, head_size_og)")
    if softcap > 0.0 and dropout_p > 0.0:
        raise RuntimeError("Softcapping does not support dropout for now")
    if dropout_p or alibi_slopes is not None or block_table is not None or return_attn_probs:
        raise NotImplementedError("the stand-in computes what packed rows use")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check_max("max_seqlen_q", max_seqlen_q, bounds_q)
    _check_max("max_seqlen_k", max_seqlen_k, bounds_k)
    CALLS.append(
        KernelCall(
            "flash_attn_varlen_func",
            cu_seqlens_q,
            dict(head_dim=q.shape[-1], heads=(q.shape[1], k.shape[1]), softcap=softcap, window=tuple(window_size)),
        )
    )
    left, right = window_size
    allowed = segment_mask(bounds_q, bounds_k, causal, left, 0 if causal else right)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    output = dense_reference(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed, scale, softcap=softcap or None
    )
    return output.transpose(0, 1)


# ---- FlexAttention ----


@dataclass
class DenseBlockMask:
    """The stand-in's block mask: the mask evaluated at every query and key (test rows are short)."""

    allowed: torch.Tensor
    shape: tuple[int, int]


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
    """torch's `create_block_mask` (torch/nn/attention/flex_attention.py), evaluated densely."""
    q_index = torch.arange(Q_LEN, device=device).unsqueeze(1)
    k_index = torch.arange(KV_LEN, device=device).unsqueeze(0)
    allowed = mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q_index, k_index)
    CALLS.append(KernelCall("create_block_mask", None, dict(shape=(Q_LEN, KV_LEN))))
    return DenseBlockMask(allowed.expand(Q_LEN, KV_LEN), (Q_LEN, KV_LEN))


def flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):
    """`flex_attention`'s checks (torch/nn/attention/flex_attention.py), and its compiled kernel's
    (torch/_inductor/kernel/flex/flex_attention.py: head dims of at least 16, one dtype for the backward)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
    if query.size(-1) != key.size(-1):
        raise ValueError("Expect query and key/value to have the same embedding dimension")
    if not enable_gqa and query.size(-3) != key.size(-3):
        raise ValueError("Expect query and key/value to have the same number of heads. Try setting enable_gqa=True.")
    if enable_gqa and query.size(1) % key.size(1):
        raise ValueError("Expect number of query heads to be a multiple of kv heads for GQA")
    if block_mask is not None and tuple(block_mask.shape) != (query.size(-2), key.size(-2)):
        raise ValueError(f"block_mask was created for block_mask.shape={block_mask.shape} but got other lengths")
    if query.size(-1) < 16 or value.size(-1) < 16:
        raise NotImplementedError("NYI: embedding dimension of the query, key, and value must be at least 16")
    needs_grad = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
    if needs_grad and not query.dtype == key.dtype == value.dtype:
        raise ValueError("Backward pass with mixed query, key, and value dtype is not supported")
    if return_lse or return_aux is not None:
        raise NotImplementedError("the stand-in computes what packed rows use")
    CALLS.append(
        KernelCall(
            "flex_attention",
            None,
            dict(head_dim=query.size(-1), heads=(query.size(1), key.size(1)), input_dtype=query.dtype),
        )
    )
    scale = query.size(-1) ** -0.5 if scale is None else scale
    allowed = block_mask.allowed if block_mask is not None else torch.ones(query.size(-2), key.size(-2), dtype=bool)
    modified = None
    if score_mod is not None:
        zero = torch.zeros((), dtype=torch.long)
        q_index = torch.arange(query.size(-2)).unsqueeze(1)
        k_index = torch.arange(key.size(-2)).unsqueeze(0)

        def modified(scores):
            return score_mod(scores, zero, zero, q_index, k_index)

    output = dense_reference(query[0], key[0], value[0], allowed, scale, score_mod=modified)
    return output.unsqueeze(0)


def fused_stand_ins(flash_attn: bool = True) -> FusedKernels:
    """Every fused kernel a GPU machine has (flash-attn installed, or not: FlexAttention then takes softcapping)."""
    return FusedKernels(
        efficient=efficient_attention_forward,
        flash_attn_varlen=flash_attn_varlen_func if flash_attn else None,
        flex=FlexKernel(flex_attention, create_block_mask),
    )


# ---- sdpa's backend on a segment ----


def sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa) -> str:
    """The backend ATen's sdp_utils.cpp (`select_sdp_backend`, CUDA, SM90) picks, in its priority order (flash,
    memory-efficient, math; cuDNN only when asked for): flash takes fp16/bf16, head dims <= 256 (equal, a multiple of
    8), no mask, grouped heads; memory-efficient takes float32 too and masks, not grouped heads (`enable_gqa` with
    unequal head counts); math takes everything, upcasting and keeping the score matrix."""
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    grouped = enable_gqa and query.shape[-3] != key.shape[-3]
    half = query.dtype in HALF and query.dtype == key.dtype == value.dtype
    if half and attn_mask is None and head_dim == value_dim and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    alignment = 8 if query.dtype in HALF else 4
    if not grouped and query.dtype == key.dtype == value.dtype and head_dim % alignment == 0:
        if value_dim % alignment == 0:
            return "efficient"
    return "math"


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    CALLS.append(
        KernelCall(
            "sdpa",
            None,
            dict(backend=sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa), head_dim=query.shape[-1]),
        )
    )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
