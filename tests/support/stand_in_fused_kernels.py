"""Stand-ins for the fused CUDA kernels of the layers torch's varlen kernel cannot compute (`FusedKernels`,
trl_padfree/modeling/check/stand_ins.py), and for sdpa's choice of backend on a segment: each with the real function's
signature, the checks the real one makes (source named beside each), the result it computes and its half-precision
rounding, recording what it was given in `stand_in_kernels.CALLS`:

    _efficient_attention_forward   ATen's memory-efficient kernel, varlen (`cu_seqlens`), any head dim (a multiple
    _efficient_attention_backward  of 8 in half precision); equal head counts; behind the op trl-padfree wraps the
                                   real pair in (`EFFICIENT_ATTENTION`)
    flash_attn_varlen_func         flash-attn 2.6+ (softcap, window, grouped heads; head dim <= 256)
    flex_attention                 torch's FlexAttention (score_mod, block mask; head dims >= 16; one dtype for the
    BlockMask.from_kv_blocks       backward), the block mask read tile by tile as the compiled kernel reads it
    scaled_dot_product_attention   sdpa, recording the backend ATen's sdp_utils.cpp would pick on an SM90 GPU

The reference is computed densely per call (test rows are short): scores in float32, then, as the kernels do in half
precision, the unnormalised softmax rounded to the input dtype before it multiplies the values, the output rounded
once; in the backward, the gradient reaching the probabilities rounded as the kernels round theirs, and grouped
keys' and values' gradients rounded per query head before the group's sum (flash's `dk_expanded`).

What no stand-in models, and what covers it instead: the kernels' own numerics and speed (`pytest -m gpu`,
tools/gpu_report.py on a GPU); the memory they allocate (each computes densely: the block mask's building is measured
on its own, tests/modeling/attention/test_fused_compile.py); and how the real kernel compiles (each is plain Python, a graph break
under dynamo: tests/modeling/attention/test_fused_compile.py compiles the real FlexAttention and the wide-head op instead). Each
stand-in below names its own gaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from stand_in_kernels import CALLS, PLAYED_CAPABILITY, KernelCall

from trl_padfree.integrations.torch import wide_head_attention_op
from trl_padfree.modeling.kernels.attention import FlexKernel, FusedKernels

HALF = (torch.float16, torch.bfloat16)


class _Rounded(torch.autograd.Function):
    """`tensor` rounded to `dtype` (kept in float32), and its gradient rounded alike: what a kernel does to an operand
    it hands a half-precision GEMM, both ways. (`setup_context` apart: torch.func.vjp runs it in the memory-efficient
    kernel's backward stand-in.)"""

    @staticmethod
    def forward(tensor, dtype):
        return tensor.to(dtype).float()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtype = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).float(), None


class _GradientRounded(torch.autograd.Function):
    @staticmethod
    def forward(tensor, dtype):
        return tensor.view_as(tensor)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtype = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).float(), None


def dense_reference(query, key, value, allowed, scale, softcap=None, score_mod=None, lse=False):
    """Attention of `(heads, T_q, dim)` queries over `(kv_heads, T_k, dim)` keys and values where `allowed`
    `(T_q, T_k)` (or `(heads, T_q, T_k)`) says so, rounded as a half-precision kernel rounds; returns `(heads, T_q,
    dim)` in the query's dtype (and with `lse`, each query's float32 log-sum-exp `(heads, T_q)`)."""
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
    output_rounded = unnormalised if not half else _Rounded.apply(unnormalised, dtype)
    output = ((output_rounded @ value) / total).to(dtype)
    return (output, (maximum + total.log()).squeeze(-1).detach()) if lse else output


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
    `_efficient_attention_forward`, and the kernel's alignment, sdp_utils.cpp `check_head_dim_size_mem_efficient`).

    Cannot model: ATen's meta function and how the op compiles (the real op is compiled on meta tensors:
    test_fused_compile.py, `..._on_meta_tensors`); the kernel's memory (it computes the scores densely)."""
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
    output, lse = _efficient_reference(query, key, value, bounds_q, bounds_k, custom_mask_type, scale, lse=True)
    rows = math.ceil(max_seqlen_q / 32) * 32 if compute_log_sumexp else 0
    logsumexp = torch.zeros(len(bounds_q) - 1, query.size(2), rows)  # ATen's layout: per segment, head, query
    for index, (start, end) in enumerate(zip(bounds_q, bounds_q[1:], strict=False)):
        logsumexp[index, :, : min(end - start, rows)] = lse[:, start : start + min(end - start, rows)]
    seed = offset = torch.zeros((), dtype=torch.long)
    return output, logsumexp, seed, offset, max_seqlen_q, max_seqlen_k


@torch.autocast("cpu", enabled=False)  # one kernel on the GPU, in its inputs' dtype, whatever autocast says
def _efficient_reference(query, key, value, bounds_q, bounds_k, custom_mask_type, scale, lse=False):
    """`(1, T, heads, dim)` in and out (contiguous, as ATen allocates it)."""
    scale = query.size(3) ** -0.5 if scale is None else scale
    allowed = segment_mask(bounds_q, bounds_k, causal=custom_mask_type != 0)
    heads_first = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    result = dense_reference(*heads_first, allowed, scale, lse=lse)
    output = (result[0] if lse else result).transpose(0, 1).unsqueeze(0).contiguous()
    return (output, result[1]) if lse else output


def efficient_attention_backward(
    grad_out_,
    query,
    key,
    value,
    bias,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    dropout_p,
    philox_seed,
    philox_offset,
    custom_mask_type,
    bias_requires_grad,
    *,
    scale=None,
    num_splits_key=None,
    window_size=None,
    shared_storage_dqdkdv=False,
):
    """`aten::_efficient_attention_backward`'s checks (aten/src/ATen/native/transformers/cuda/attention_backward.cu)
    and the gradients autograd takes through the forward's reference, written out (it runs inside an op, below
    autograd).

    Cannot model: the kernel's own gradient arithmetic (it recomputes from the log-sum-exp; `pytest -m gpu`)."""
    if grad_out_.shape != out.shape or out.shape[:-1] != query.shape[:-1] or value.size(3) != grad_out_.size(3):
        raise RuntimeError("Expected query.size(2) == grad_out_.size(2) to be true, but got false.")
    if any(tensor.stride(-1) != 1 for tensor in (query, key, value)):
        raise RuntimeError("Expected query.stride(-1) == 1 to be true, but got false.")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("Expected cu_seqlens_q->scalar_type() == at::ScalarType::Int to be true, but got false.")
    if bias is not None or bias_requires_grad or dropout_p != 0.0 or window_size is not None:
        raise NotImplementedError("the stand-in computes what packed rows use: no bias, dropout or window")
    if max_seqlen_q <= 0 or max_seqlen_q > query.size(1) or max_seqlen_k > key.size(1):
        raise RuntimeError(f"Invalid max_seqlen_q: {max_seqlen_q}")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    # Stand-in only: the kernel reads the forward's log-sum-exp unchecked (a forward without `compute_log_sumexp`
    # leaves none, and its backward reads past it)
    if logsumexp.dtype != torch.float32 or logsumexp.shape != (
        len(bounds_q) - 1, query.size(2), math.ceil(max_seqlen_q / 32) * 32
    ):  # fmt: skip
        raise RuntimeError(f"a log-sum-exp of shape {tuple(logsumexp.shape)} is not the forward's")
    CALLS.append(KernelCall("efficient_attention_backward", cu_seqlens_q, dict(head_dim=query.size(3))))
    scale = query.size(3) ** -0.5 if scale is None else scale
    allowed = segment_mask(bounds_q, bounds_k, causal=custom_mask_type != 0)
    grads = _dense_reference_backward(*(t[0].transpose(0, 1) for t in (grad_out_, query, key, value)), allowed, scale)
    return (*(grad.transpose(0, 1).unsqueeze(0).contiguous() for grad in grads), None)  # ATen's layout


@torch.autocast("cpu", enabled=False)
def _dense_reference_backward(grad, query, key, value, allowed, scale):
    """Autograd's backward of `dense_reference` (equal head counts, no softcap), op by op in its order:
    `(heads, T, dim)` in, the query's, key's and value's gradients out."""
    dtype, half = query.dtype, query.dtype in HALF
    query, key, value = query.float(), key.float(), value.float()
    scores = ((query @ key.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    unnormalised = torch.exp(scores - scores.amax(-1, keepdim=True).clamp_min(-1e30))
    total = unnormalised.sum(-1, keepdim=True)
    rounded = unnormalised.to(dtype).float() if half else unnormalised
    weighted = rounded @ value
    grad = grad.float()  # through `.to(dtype)`
    grad_weighted, grad_total = grad / total, (-grad * ((weighted / total) / total)).sum(-1, keepdim=True)
    grad_rounded = grad_weighted.bmm(value.transpose(1, 2))
    grad_value = rounded.transpose(1, 2).bmm(grad_weighted)
    grad_unnormalised = (grad_rounded.to(dtype).float() if half else grad_rounded) + grad_total
    grad_scores = (grad_unnormalised * unnormalised).masked_fill(~allowed, 0) * scale
    grad_query = grad_scores.bmm(key)
    grad_key = query.transpose(1, 2).bmm(grad_scores).transpose(1, 2)
    return grad_query.to(dtype), grad_key.to(dtype), grad_value.to(dtype)


# ATen's forward and backward stand-ins behind the op trl-padfree wraps the real ones in (registered once per process)
EFFICIENT_ATTENTION = wide_head_attention_op(
    "trl_padfree_stand_ins::efficient_attention", efficient_attention_forward, efficient_attention_backward
)


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
    (csrc/flash_attn/flash_api.cpp).

    Cannot model: how flash-attn's own ops (`torch.ops.flash_attn.*`, their fake implementations) compile: here a
    graph break (test_fused_compile.py compiles trl-padfree's code around it; the real one compiles only where
    flash-attn is installed, `pytest -m gpu`); its memory (dense scores)."""
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
    """The stand-in's block mask: which query reads which key, as FlexAttention's kernel reads its tiles (test rows
    are short)."""

    allowed: torch.Tensor
    shape: tuple[int, int]


def from_kv_blocks(
    kv_num_blocks,
    kv_indices,
    full_kv_num_blocks=None,
    full_kv_indices=None,
    BLOCK_SIZE=128,
    mask_mod=None,
    seq_lengths=None,
    compute_q_blocks=True,
    *,
    dq_write_order=None,
    dq_write_order_full=None,
    dq_kv_order=None,
):
    """torch's `BlockMask.from_kv_blocks` (torch/nn/attention/flex_attention.py) and what the compiled kernel makes
    of it (torch/_inductor/kernel/flex/templates): a query reads a key when the key's tile is among its row's first
    `full_kv_num_blocks` full tiles (every pair, the mask_mod not called), or among the first `kv_num_blocks`
    partial tiles where the mask_mod allows the pair; every other tile is skipped. So a tile listed wrongly computes
    wrongly here as on the GPU, against the per-segment reference.

    Cannot model: the real `BlockMask` (its index layout and transposed tiles: test_fused_compile.py checks the tiles
    trl-padfree builds against `create_block_mask`'s and runs the real FlexAttention over them); memory (dense)."""
    if kv_indices.dim() < 2:
        raise RuntimeError("BlockMask must have at least 2 dimensions")
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise AssertionError("full_kv_num_blocks and full_kv_indices must be both provided or omitted")
    block_q, block_k = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    total_q, total_k = seq_lengths
    if total_q > kv_indices.shape[-2] * block_q or total_k > kv_indices.shape[-1] * block_k:
        raise AssertionError("the tiles do not cover the sequence lengths")  # flex_cpu.py's check, on every device
    q_index = torch.arange(total_q).unsqueeze(1)
    k_index = torch.arange(total_k).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long)
    by_mask = (
        mask_mod(zero, zero, q_index, k_index) if mask_mod is not None else torch.ones(total_q, total_k, dtype=bool)
    )
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool)
    tile_lists = [(kv_num_blocks, kv_indices, by_mask)]
    if full_kv_num_blocks is not None:
        tile_lists.append((full_kv_num_blocks, full_kv_indices, torch.ones_like(by_mask)))
    for counts, indices, reads in tile_lists:
        for row in range(-(-total_q // block_q)):
            rows = slice(row * block_q, (row + 1) * block_q)
            for column in indices[0, 0, row, : counts[0, 0, row]].tolist():
                columns = slice(column * block_k, (column + 1) * block_k)
                allowed[rows, columns] |= reads[rows, columns]
    CALLS.append(KernelCall("block_mask", None, dict(shape=(total_q, total_k))))
    return DenseBlockMask(allowed, (total_q, total_k))


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
    (torch/_inductor/kernel/flex/flex_attention.py: head dims of at least 16, one dtype for the backward).

    Cannot model: compilation, its graphs and recompile limit (the real FlexAttention is compiled and its graphs
    counted: test_fused_compile.py); the fused kernel's memory (dense scores here)."""
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
        efficient=EFFICIENT_ATTENTION,
        flash_attn_varlen=flash_attn_varlen_func if flash_attn else None,
        flex=FlexKernel(flex_attention, from_kv_blocks),
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
    """CPU sdpa, recording the backend a GPU would pick (`sdpa_backend`). Cannot model: that backend's numerics or
    memory (the math backend's float32 scores: measured in docs/concepts/kernels.md's memory table, on a GPU by
    `pytest -m gpu`)."""
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
