"""Stand-ins for the CUDA kernels behind packed rows, with the real functions' signatures, for `stand_in_kernels`
(trl_padfree/modeling/check/stand_ins.py): the packed forward takes its CUDA branches on the CPU and calls these instead.

Each stand-in computes the result per segment (one sequence at a time, from its boundary argument) and records what
it was given (`CALLS`): the boundary tensors and their dtype, the window, grouped heads, the backend a torch release
would pick. Signatures are the real ones, quoted from the releases:

    varlen_attn                          torch 2.10 (is_causal), 2.11 (scale, window_size), 2.13-2.15 (enable_gqa, ...):
                                         the wrapper's, the op schema's and the backend kernel's checks, each; FA2's
                                         half-precision rounding; `return_aux` (the log-sum-exp); the output in the
                                         query's layout; the backward op of 2.13-2.15 (`VarlenKernel.backward`;
                                         2.15's takes the forward's `backend`); the backend each release picks
    causal_conv1d_fn                     causal-conv1d (seq_idx; widths 2 to 4)
    chunk_gated_delta_rule               flash-linear-attention (cu_seqlens; batch 1)
    mamba_chunk_scan_combined            mamba-ssm (seq_idx)
    mamba_split_conv1d_scan_combined     mamba-ssm (seq_idx; conv, scan, gated grouped RMSNorm, out projection)

The mixer stand-ins compute each segment with the model module's own PyTorch fallbacks (what padded training runs),
so a stand-in and the fallback differ only in how the row is cut. A faulty variant reproduces a real failure: a
`causal_conv1d_fn` that swallows extra keywords (transformers 5.23's LFM3 function).

What the stand-ins cannot show (compilation, the real allocations' memory, cuDNN's routing and numbers) is said beside
each, with the test that covers it instead.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trl_padfree.modeling.kernels.attention import VarlenKernel

# What the stand-ins were given, in call order (tests clear it)
CALLS: list[KernelCall] = []


@dataclass
class KernelCall:
    kernel: str
    boundaries: torch.Tensor | None  # seq_idx / cu_seqlens / cu_seq_q
    details: dict[str, Any] = field(default_factory=dict)


def calls_of(kernel: str) -> list[KernelCall]:
    return [call for call in CALLS if call.kernel == kernel]


# ---- torch's varlen_attn ----
#
# Each stand-in refuses what the real call refuses, in the order it checks, with its message: the Python wrapper of
# the release (torch/nn/attention/varlen.py), the custom op's schema (`torch_attn::_varlen_attn`), then the backend's
# kernel: ATen's Flash kernel (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, `mha_varlen_fwd`), or
# on torch 2.14 and 2.15 cuDNN's. The backward is the op torch's autograd calls, `torch_attn::_varlen_attn_backward`
# (2.13-2.15; `_flash_attention_backward` in attention_backward.cu, then `mha_varlen_bwd`). None of them casts or
# pads: docs/concepts/kernels.md lists every check with its source.
#
# Checks marked "stand-in:" are mistakes the GPU makes silently, refused here: a `max_q`/`max_k` below the longest
# segment, boundaries that leave rows unwritten, a log-sum-exp the backward would misread.
#
# The numbers are FA2's in half precision (flash_fwd_kernel.h `compute_attn_1rowblock`, flash_bwd_kernel.h
# `compute_dq_dk_dv_1colblock`), one segment at a time, every product summed in float32:
#
#   forward   S = scale Q K^T, P = exp(S - rowmax), O = half(P) V / rowsum(P), rounded once; lse = rowmax + log rowsum
#   backward  P = exp(S - lse), dP = dO V^T, D = rowsum(dO * out) of the `out` given, dS = P (dP - D);
#             dV = half(P)^T dO, dK = scale half(dS)^T Q, dQ = scale half(dS) K, each rounded once; grouped heads:
#             dK and dV per query head, rounded, then summed over the group (mha_varlen_bwd's dk_expanded/dv_expanded)
#
# half(): rounded to the input dtype. The GPU rounds P against a running maximum over key blocks rather than the row's:
# rounding of the same size. A query that sees no key gets 0 and a log-sum-exp of +inf, as the kernel writes them
# (softmax.h, `normalize_softmax_lse`). The cuDNN branch is given the same numbers.

# The GPU a stand-in plays: SM90 (H100), where torch 2.15 prefers cuDNN
PLAYED_CAPABILITY = (9, 0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
# cuDNN's varlen graph on SM90 (sdp_utils.cpp, `check_cudnn_tensor_shapes`: 128 unless cuDNN > 9.22 with a frontend
# that takes 256; torch 2.15's varlen.py, `_cudnn_supports_head_dims`, keeps 128 on SM90)
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MAX_HEADS = 65535
FORWARD_OP, BACKWARD_OP = "torch_attn::_varlen_attn", "torch_attn::_varlen_attn_backward"


def _schema_int(op: str, name: str, value) -> int:
    """The custom op's schema types `max_q`/`max_k` as int: it takes an int (a bool too), anything with `__index__`,
    and a one-element tensor (truncated to an int); a float, None or a longer tensor is refused."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return int(value)
    elif not isinstance(value, float):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RuntimeError(
        f"{op}() Expected a value of type 'int' for argument '{name}' but instead found type '{type(value).__name__}'."
    )


def _max_lengths(op: str, max_q, max_k) -> tuple[int, int]:
    return _schema_int(op, "max_q", max_q), _schema_int(op, "max_k", max_k)


def _window_schema(window_size, op: str = FORWARD_OP) -> list[int]:
    # The schema's `Optional[List[int]]`, then varlen.py's `_normalize_window_size`
    window = list(window_size)
    if not all(isinstance(each, int) and not isinstance(each, bool) for each in window):
        raise RuntimeError(
            f"{op}() Expected a value of type 'Optional[List[int]]' for argument 'window_size' but instead found "
            "type 'list'."
        )
    if len(window) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window)}")
    return window


def _wrapper_heads(query, key, enable_gqa: bool) -> None:
    """varlen.py `varlen_attn` (2.12 and later) before it calls the op."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if not enable_gqa and heads != kv_heads:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={heads} and Hkv={kv_heads}. "
            "Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and heads % kv_heads != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={heads} and Hkv={kv_heads}."
        )


def _no_kv_cache(seqused_k, block_table) -> None:
    # varlen.py `_setup_context`: "seqused_k is an inference-only parameter." under autograd; the stand-in computes
    # packed training rows only, with or without grad
    if seqused_k is not None or block_table is not None:
        raise NotImplementedError("the stand-in computes packed training rows only (no seqused_k, no block_table)")


def _boundary_and_layout_checks(query, key, value, cu_seq_q, cu_seq_k, more: dict) -> None:
    """What `mha_varlen_fwd` and `mha_varlen_bwd` both check after their dtypes, in their order: int32 boundaries,
    every tensor (`more`: the backward's out, dout and softmax_lse) on the query's device, a contiguous last dimension
    of q, k and v, contiguous boundaries."""
    for name, boundaries in (("cu_seqlens_q", cu_seq_q), ("cu_seqlens_k", cu_seq_k)):
        if boundaries.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    tensors = {"q": query, "k": key, "v": value, **more, "cu_seqlens_q": cu_seq_q, "cu_seqlens_k": cu_seq_k}
    for name, tensor in tensors.items():
        if tensor.device != query.device:
            raise RuntimeError(f"{name} must be on CUDA")
    if any(tensor.stride(-1) != 1 for tensor in (query, key, value)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    for name, boundaries in (("cu_seqlens_q", cu_seq_q), ("cu_seqlens_k", cu_seq_k)):
        if not boundaries.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")


def _batch_check(cu_seq_q) -> None:
    if cu_seq_q.numel() - 1 <= 0:
        raise RuntimeError("batch size must be positive")


def flash_varlen_checks(query, key, value, cu_seq_q, cu_seq_k, capability) -> None:
    """ATen's `mha_varlen_fwd` (flash_api.cpp), in its order; the first failure wins. CUDA tensors are played by
    tensors on the query's device."""
    if cu_seq_k is None or cu_seq_q is None:
        raise RuntimeError(
            "cumulative_sequence_length_q and cumulative_sequence_length_k must be both set or both not set"
        )
    if tuple(capability) < (8, 0):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if query.dtype not in FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if key.dtype != query.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if value.dtype != query.dtype:
        raise RuntimeError("query and value must have the same dtype")
    _boundary_and_layout_checks(query, key, value, cu_seq_q, cu_seq_k, {})
    if query.dim() != 3:
        raise RuntimeError("temp_q must have shape (total_q, num_heads, head_size_og)")
    _batch_check(cu_seq_q)
    head_dim, heads, kv_heads = query.shape[-1], query.shape[1], key.shape[1]
    if head_dim > FLASH_MAX_HEAD_DIM:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if heads % kv_heads:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if head_dim % 8:
        raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!")
    if tuple(key.shape) != (key.shape[0], kv_heads, head_dim):
        raise RuntimeError("k must have shape (total_k, num_heads_k, head_size_og)")
    if tuple(value.shape) != (key.shape[0], kv_heads, head_dim):
        raise RuntimeError("v must have shape (total_k, num_heads_k, head_size_og)")
    if cu_seq_q.dim() != 1:
        raise RuntimeError("cu_seqlens_q must have shape (batch_size + 1)")
    if tuple(cu_seq_k.shape) != tuple(cu_seq_q.shape):
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")


def takes_cudnn_2_14(query, key, value, max_q: int, window, enable_gqa: bool, num_splits, capability) -> bool:
    """torch 2.14.1's `_can_use_cudnn` (varlen.py), which its op and its backward op each ask (the backward without
    `enable_gqa`; unequal head counts refuse all the same): cuDNN >= 9.18 (the wheel's: 9.24) on SM90 or SM100, a row
    whose longest sequence exceeds 128 queries, half precision, head dims divisible by 8, no window at all (causal
    attention runs Flash), equal head counts, no `num_splits`. It reads no `sdpa_kernel` flag."""
    return (
        capability[0] in (9, 10)
        and max_q > 128
        and query.dtype in FLASH_DTYPES
        and not (query.shape[-1] % 8 or value.shape[-1] % 8)
        and list(window) == [-1, -1]
        and not enable_gqa
        and query.shape[1] == key.shape[1]
        and num_splits is None
    )


def cudnn_varlen_checks(query, key, value, cu_seq_q, cu_seq_k) -> None:
    """What `_cudnn_attention_forward`'s varlen graph takes (aten/src/ATen/native/cudnn/MHA.cpp,
    `run_cudnn_SDP_fprop_nestedtensor`: half-precision tensors of one dtype in (T, heads, dim) with a unit last
    stride, int32 ragged offsets), with the limits and messages of sdp_utils.cpp's `check_cudnn_tensor_shapes` for
    SM90. On a GPU the refusal is cudnn_frontend's graph error, whose text differs."""
    if query.dtype not in FLASH_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise RuntimeError("cuDNN varlen attention takes query, key and value of one dtype, fp16 or bf16")
    for name, boundaries in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if boundaries.dtype != torch.int32 or boundaries.device != query.device:
            raise RuntimeError(f"cuDNN varlen attention takes {name} as int32 on the query's device")
    if any(tensor.stride(-1) != 1 for tensor in (query, key, value)):
        raise RuntimeError("cuDNN varlen attention takes tensors with contiguous last dimension")
    if query.shape[1] > CUDNN_MAX_HEADS or cu_seq_q.numel() - 1 > CUDNN_MAX_HEADS:
        raise RuntimeError(
            f"cuDNN SDPA does not support batch size or num_heads greater than {CUDNN_MAX_HEADS}. Got batch size: "
            f"{cu_seq_q.numel() - 1}, num_heads: {query.shape[1]}"
        )
    if query.shape[-1] > CUDNN_MAX_HEAD_DIM or value.shape[-1] > CUDNN_MAX_HEAD_DIM:
        raise RuntimeError(f"head_dim should be no more than {CUDNN_MAX_HEAD_DIM}")
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        raise RuntimeError("head_dim should be a multiple of 8")


def flash_varlen_backward_checks(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, capability) -> None:
    """ATen's `mha_varlen_bwd` (flash_api.cpp), in its order, on `grad_out` and `out` made contiguous first
    (`_flash_attention_backward`: "CUDA code assumes that dout is contiguous")."""
    if tuple(capability) < (8, 0):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if query.dtype not in FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for name, tensor in (("key", key), ("value", value), ("out", out), ("dout", grad_out)):
        if tensor.dtype != query.dtype:
            raise RuntimeError(f"query and {name} must have the same dtype")
    _boundary_and_layout_checks(
        query, key, value, cu_seq_q, cu_seq_k, {"out": out, "dout": grad_out, "softmax_lse": lse}
    )
    _batch_check(cu_seq_q)
    head_dim, head_dim_og, heads, kv_heads = query.shape[-1], grad_out.shape[-1], query.shape[1], key.shape[1]
    if head_dim % 8:
        raise RuntimeError("head_size should be a multiple of 8")
    if head_dim_og % 8:
        raise RuntimeError("head_size_og should be a multiple of 8, this is ensured by padding!")
    if head_dim > FLASH_MAX_HEAD_DIM:
        raise RuntimeError("FlashAttention backward only supports head dimension at most 256")
    if heads % kv_heads:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if head_dim != head_dim_og:  # both multiples of 8 by now
        raise RuntimeError("head_size must be head_size_og rounded to a multiple of 8")
    total_q, total_k = query.shape[0], key.shape[0]
    for name, tensor, shape in (
        ("k", key, "(total_k, num_heads_k, head_size)"),
        ("v", value, "(total_k, num_heads_k, head_size)"),
        ("out", out, "(total_q, num_heads, head_size)"),
        ("dout", grad_out, "(total_q, num_heads, head_size_og)"),
    ):
        expected = (total_k, kv_heads, head_dim) if name in "kv" else (total_q, heads, head_dim)
        if tuple(tensor.shape) != expected:
            raise RuntimeError(f"{name} must have shape {shape}")
    for name, boundaries in (("cu_seqlens_q", cu_seq_q), ("cu_seqlens_k", cu_seq_k)):
        if tuple(boundaries.shape) != (cu_seq_q.numel(),):
            raise RuntimeError(f"{name} must have shape (batch_size + 1)")
    # stand-in: the kernel reads `softmax_lse` unpadded as float32 (num_heads, total_q), with no check
    if lse.dtype != torch.float32 or tuple(lse.shape) != (heads, total_q) or not lse.is_contiguous():
        raise RuntimeError(
            f"stand-in: lse must be the forward's contiguous float32 (num_heads, total_q) = {(heads, total_q)} "
            f"log-sum-exp, got {lse.dtype} {tuple(lse.shape)}: mha_varlen_bwd reads it without a check"
        )


def boundary_checks(query, key, cu_seq_q, cu_seq_k, max_q: int, max_k: int) -> tuple[list[int], list[int]]:
    """stand-in: what the kernel takes on trust, read from the boundaries as the kernel reads them on the device.
    It sizes its grids from the maxima: ceil(max_q / kBlockM) query blocks per sequence (flash_fwd_launch_template.h
    `run_flash_fwd`; the backward's D and dQ, flash_bwd_launch_template.h `run_flash_bwd_seqk_parallel`) and
    ceil(max_k / kBlockN) key blocks (the backward's dK, dV), so a maximum below the longest segment leaves rows of the
    output or the gradients unwritten; and it writes only rows inside the boundaries (`at::empty_like` memory
    elsewhere). Returns the boundaries."""
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for name, bounds, rows in (("cu_seq_q", bounds_q, query.shape[0]), ("cu_seq_k", bounds_k, key.shape[0])):
        if bounds[0] != 0 or bounds[-1] != rows or any(end < start for start, end in itertools.pairwise(bounds)):
            raise RuntimeError(
                f"stand-in: {name} {bounds} must rise from 0 to the {rows} rows it cuts: the kernel leaves the rows "
                "outside its segments unwritten, without an error"
            )
    for name, bounds, maximum in (("max_q", bounds_q, max_q), ("max_k", bounds_k, max_k)):
        longest = max(end - start for start, end in itertools.pairwise(bounds))
        if maximum < longest:
            raise RuntimeError(
                f"stand-in: {name}={maximum} is below the longest segment ({longest} rows): the kernel sizes its grid "
                f"from {name} and would leave the rows past it unwritten, without an error"
            )
    return bounds_q, bounds_k


def _visible(queries: int, keys: int, window) -> torch.Tensor:
    """Which keys each query of one segment sees, the causal window aligned to the bottom-right corner as flash
    attention aligns it: query i stands at key position i + keys - queries and sees the keys in
    [position - left, position + right] (-1: no limit)."""
    left, right = window
    position = torch.arange(queries).unsqueeze(1) + (keys - queries)
    key_position = torch.arange(keys).unsqueeze(0)
    visible = torch.ones(queries, keys, dtype=torch.bool)
    if right >= 0:
        visible &= key_position <= position + right
    if left >= 0:
        visible &= key_position >= position - left
    return visible


def _per_query_head(tensor, heads: int) -> torch.Tensor:
    """A key or value `(T, kv heads, dim)` in float32, each head repeated for the query heads that share it
    (consecutive ones): the kernel reads the shared head for each query head, so grouped and expanded inputs give the
    same numbers."""
    return tensor.float().repeat_interleave(heads // tensor.shape[1], dim=1)


def _scores(query, key, scale, window) -> torch.Tensor:
    """One segment's float32 scores `(heads, T_q, T_k)`, -inf where a query does not see a key."""
    scores = torch.einsum("qhd,khd->hqk", query.float(), _per_query_head(key, query.shape[1])) * scale
    return scores.masked_fill(~_visible(query.shape[0], key.shape[0], window), float("-inf"))


def _segment_forward(query, key, value, scale, window) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment `(T, heads, dim)`: its output in the input dtype and its log-sum-exp `(heads, T)`."""
    scores = _scores(query, key, scale, window)
    row_max = scores.amax(-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # a query that sees no key
    weights = torch.exp(scores - row_max)  # unnormalised, float32
    row_sum = weights.sum(-1, keepdim=True)
    output = torch.einsum("hqk,khd->qhd", weights.to(query.dtype).float(), _per_query_head(value, query.shape[1]))
    unseen = row_sum == 0
    output = output / row_sum.masked_fill(unseen, 1.0).transpose(0, 1)
    lse = (row_max + row_sum.log()).masked_fill(unseen, float("inf"))
    return output.to(query.dtype), lse.squeeze(-1)


def _segment_backward(grad_out, query, key, value, out, lse, scale, window):
    """One segment's dQ, dK, dV in the input dtype, from the `out` and `lse` given."""
    heads, kv_heads, dtype = query.shape[1], key.shape[1], query.dtype
    weights = torch.exp(_scores(query, key, scale, window) - lse.unsqueeze(-1))
    grad_weights = torch.einsum("qhd,khd->hqk", grad_out.float(), _per_query_head(value, heads))
    delta = (grad_out.float() * out.float()).sum(-1).t().unsqueeze(-1)  # D, from the `out` given
    grad_scores = weights * (grad_weights - delta)
    weights, grad_scores = weights.to(dtype).float(), grad_scores.to(dtype).float()
    grad_query = torch.einsum("hqk,khd->qhd", grad_scores, _per_query_head(key, heads)) * scale
    grad_key = torch.einsum("hqk,qhd->khd", grad_scores, query.float()) * scale
    grad_value = torch.einsum("hqk,qhd->khd", weights, grad_out.float())
    # Per query head in the input dtype, then summed over each group (`at::sum_out` of dk_expanded, dv_expanded)
    grad_key, grad_value = (
        grad.to(dtype).float().unflatten(1, (kv_heads, -1)).sum(2).to(dtype) for grad in (grad_key, grad_value)
    )
    return grad_query.to(dtype), grad_key, grad_value


def _segments(bounds_q, bounds_k):
    return zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k), strict=True)


def _kernel_precision(tensor):
    """The kernel keeps its own precision under the autocast around the call (torch's op has no autocast rule): its
    float32 products must not become autocast's bf16 matmuls."""
    return torch.autocast(tensor.device.type, enabled=False)


def _flash_forward(query, key, value, bounds_q, bounds_k, scale, window) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output, allocated as `mha_varlen_fwd` allocates it (`at::empty_like(q)`: the query's strides), and
    its log-sum-exp, float32 `(num_heads, total_q)` (`softmax_lse`, unpadded)."""
    output = torch.empty_like(query)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    with _kernel_precision(query):
        for (start_q, end_q), (start_k, end_k) in _segments(bounds_q, bounds_k):
            if end_q > start_q:
                output[start_q:end_q], lse[:, start_q:end_q] = _segment_forward(
                    query[start_q:end_q], key[start_k:end_k], value[start_k:end_k], scale, window
                )
    return output, lse


def _flash_backward(grad_out, query, key, value, out, lse, bounds_q, bounds_k, scale, window):
    grads = [torch.empty_like(tensor) for tensor in (query, key, value)]  # `mha_varlen_bwd`: at::empty_like
    with _kernel_precision(query):
        for (start_q, end_q), (start_k, end_k) in _segments(bounds_q, bounds_k):
            if end_q == start_q:  # keys no query reads: the kernel writes zeros
                grads[1][start_k:end_k], grads[2][start_k:end_k] = 0, 0
                continue
            rows, keys = slice(start_q, end_q), slice(start_k, end_k)
            grads[0][rows], grads[1][keys], grads[2][keys] = _segment_backward(
                grad_out[rows], query[rows], key[keys], value[keys], out[rows], lse[:, rows], scale, window
            )
    return tuple(grads)


# torch 2.15's backend numbers (`torch._C._SDPBackend`), which its op and backward op take as `backend: int`
FLASH_BACKEND, CUDNN_BACKEND = 1, 3
BACKEND_NAMES = {FLASH_BACKEND: "flash", CUDNN_BACKEND: "cudnn"}


def _backward_checks(backend: str, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, capability) -> None:
    """The backend's own checks, and one of the stand-in's: the log-sum-exp the backward is given comes from a
    forward on the same backend (the op takes it on trust)."""
    forward_backend = getattr(lse, "stand_in_backend", backend)
    if forward_backend != backend:
        raise RuntimeError(
            f"stand-in: the log-sum-exp of a {forward_backend} forward given to the {backend} backward, which reads it "
            "without a check"
        )
    if backend == "flash":
        flash_varlen_backward_checks(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, capability)
    else:
        cudnn_varlen_checks(query, key, value, cu_seq_q, cu_seq_k)


def _backward_op(version: str, capability, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                 is_causal, scale, window_size, backend: str | None):  # fmt: skip
    max_q, max_k = _max_lengths(BACKWARD_OP, max_q, max_k)
    window = [-1, -1] if window_size is None else _window_schema(window_size, BACKWARD_OP)
    if backend is None:  # 2.13 runs Flash; 2.14 asks `_can_use_cudnn` again, from the backward's own arguments
        cudnn = version == "2.14" and takes_cudnn_2_14(query, key, value, max_q, window, False, None, capability)
        backend = "cudnn" if cudnn else "flash"
    # `_flash_attention_backward` (attention_backward.cu): both made contiguous, `out` passed on as given, so D
    # = rowsum(dO * out) comes from this `out`
    grad_out, out = grad_out.contiguous(), out.contiguous()
    _backward_checks(backend, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, capability)
    bounds = boundary_checks(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
    if is_causal:  # mha_varlen_bwd
        window = [window[0], 0]
    CALLS.append(
        KernelCall(
            "varlen_attn_backward",
            cu_seq_q,
            dict(
                window_size=tuple(window), heads=(query.shape[1], key.shape[1]), input_dtype=query.dtype,
                torch=version, backend=backend,
            ),
        )
    )  # fmt: skip
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _flash_backward(grad_out, query, key, value, out, lse, *bounds, scale, window)


def varlen_backward_stand_in(capability, version: str = "2.15"):
    """`torch_attn::_varlen_attn_backward` of torch `version` (2.13-2.15, varlen.py), with that release's schema: 2.15
    adds `backend` (Flash unless given), the backend its forward chose."""
    if version == "2.15":

        def _varlen_attn_backward(
            grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
            scale=None, window_size=None, backend=FLASH_BACKEND,
        ):  # fmt: skip
            return _backward_op(
                version, capability, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                is_causal, scale, window_size, BACKEND_NAMES[backend],
            )  # fmt: skip

    else:

        def _varlen_attn_backward(
            grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
            scale=None, window_size=None,
        ):  # fmt: skip
            return _backward_op(
                version, capability, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                is_causal, scale, window_size, None,
            )  # fmt: skip

    return _varlen_attn_backward


class _VarlenAttn(torch.autograd.Function):
    """torch's op with its autograd (varlen.py `_setup_context`, `_backward`): it saves its inputs as given (grouped
    key/value heads grouped), the output, the log-sum-exp and the generator state, and its backward calls the
    backward op with them (on 2.15 with the backend its forward chose). The log-sum-exp comes out as an output that
    requires grad, whose gradient torch's `_backward` drops: so does this one."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seq_q, cu_seq_k, bounds, max_lengths, scale, window, backward, backend):
        output, lse = _flash_forward(query, key, value, *bounds, scale, window)
        lse.stand_in_backend = backend  # the backend whose log-sum-exp this is (`_backward_checks`)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)  # no dropout: varlen.py's fixed state
        ctx.save_for_backward(query, key, value, cu_seq_q, cu_seq_k, output, lse, rng_state)
        ctx.max_lengths, ctx.scale, ctx.window, ctx.backward, ctx.backend = (
            max_lengths,
            scale,
            window,
            backward,
            backend,
        )
        return output, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, cu_seq_q, cu_seq_k, output, lse, rng_state = ctx.saved_tensors
        lse.stand_in_backend = ctx.backend
        is_causal = ctx.window == [-1, 0]
        arguments = (grad_out, query, key, value, output, lse, cu_seq_q, cu_seq_k, *ctx.max_lengths, is_causal,
                     rng_state, ctx.scale, ctx.window)  # fmt: skip
        if "backend" in inspect.signature(ctx.backward).parameters:  # 2.15
            arguments += ({name: number for number, name in BACKEND_NAMES.items()}[ctx.backend],)
        grads = ctx.backward(*arguments)
        return (*grads, None, None, None, None, None, None, None, None)


def _varlen_result(query, key, value, cu_seq_q, cu_seq_k, max_lengths, scale, window, return_aux, capability,
                   version, backend):  # fmt: skip
    """The kernel's result once its checks passed: the output, and with `return_aux=AuxRequest(lse=True)` (every
    release from 2.10) the log-sum-exp too."""
    bounds = boundary_checks(query, key, cu_seq_q, cu_seq_k, *max_lengths)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    backward = varlen_backward_stand_in(capability, version if version in VARLEN_BACKWARD_OP_RELEASES else "2.13")
    output, lse = _VarlenAttn.apply(
        query, key, value, cu_seq_q, cu_seq_k, bounds, max_lengths, scale, window, backward, backend
    )
    return (output, lse) if return_aux is not None and return_aux.lse else output


def _record_varlen(version, query, key, cu_seq_q, cu_seq_k, return_aux, **details) -> None:
    CALLS.append(
        KernelCall(
            "varlen_attn",
            cu_seq_q,
            dict(
                torch=version,
                dtype=cu_seq_q.dtype,
                same_boundaries=cu_seq_q is cu_seq_k,
                heads=(query.shape[1], key.shape[1]),
                head_dim=query.shape[-1],
                input_dtype=query.dtype,
                return_lse=return_aux is not None and return_aux.lse,
                **details,
            ),
        )
    )


def _select_backend_2_15(query, value, cu_seq_q, cu_seq_k, max_q, window, num_splits, capability) -> str:
    """torch 2.15.0's choice (varlen.py `_select_backend`, `_cudnn_rejection_reasons`) on a GPU of `capability` with
    its wheel's cuDNN (9.26): cuDNN when nothing rejects it, then Flash, in SDPA's default priority order, among the
    backends `sdpa_kernel` leaves enabled. Not modelled: cuDNN's decode switch for `max_q == 1`, read from the GPU."""
    reasons = []
    if capability[0] not in (9, 10):
        reasons.append("cuDNN >= 9.18 on SM90 or SM100 is required")
    if query.dtype not in FLASH_DTYPES:
        reasons.append("query dtype must be float16 or bfloat16")
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        reasons.append("query and value head dimensions must be divisible by 8")
    needs_backward = torch.is_grad_enabled() and query.requires_grad
    if query.shape[-1] > CUDNN_MAX_HEAD_DIM or value.shape[-1] > CUDNN_MAX_HEAD_DIM:
        reasons.append(
            f"query/value head dimensions {(query.shape[-1], value.shape[-1])} are unsupported for cuDNN varlen "
            f"{'backward' if needs_backward else 'forward'}"
        )
    if window == [-1, 0]:
        if cu_seq_q is not cu_seq_k:
            reasons.append("causal attention requires seqused_k or the same cu_seq tensor for Q and K")
    elif window != [-1, -1]:
        reasons.append("window_size must be (-1, -1) or causal (-1, 0)")
    if num_splits is not None:
        reasons.append("num_splits is not supported")
    cudnn_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    if cudnn_enabled and not reasons:
        return "cudnn"
    if torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    if cudnn_enabled:
        raise RuntimeError(
            "SDPBackend.CUDNN_ATTENTION was requested for varlen_attn, but its constraints are not satisfied:\n"
            + "\n".join(f"  - {reason}" for reason in reasons)
        )
    raise RuntimeError(
        "No viable backend for varlen_attn. Enable SDPBackend.FLASH_ATTENTION or SDPBackend.CUDNN_ATTENTION with "
        "sdpa_kernel()."
    )


def _varlen_attn_2_10(capability):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        # No check of its own: straight to the op, then the kernel, which shares grouped heads natively
        max_lengths = _max_lengths(FORWARD_OP, max_q, max_k)
        flash_varlen_checks(query, key, value, cu_seq_q, cu_seq_k, capability)
        _record_varlen("2.10", query, key, cu_seq_q, cu_seq_k, return_aux, is_causal=is_causal, backend="flash")
        window = [-1, 0 if is_causal else -1]
        return _varlen_result(
            query, key, value, cu_seq_q, cu_seq_k, max_lengths, None, window, return_aux, capability, "2.10", "flash"
        )

    return varlen_attn


def _varlen_attn_2_11(capability):
    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        max_lengths = _max_lengths(FORWARD_OP, max_q, max_k)
        window = _window_schema(window_size)
        flash_varlen_checks(query, key, value, cu_seq_q, cu_seq_k, capability)
        _record_varlen(
            "2.11", query, key, cu_seq_q, cu_seq_k, return_aux, window_size=tuple(window), scale=scale, backend="flash"
        )
        return _varlen_result(
            query, key, value, cu_seq_q, cu_seq_k, max_lengths, scale, window, return_aux, capability, "2.11", "flash"
        )

    return varlen_attn


def _varlen_attn_2_13_to_2_15(version: str, capability):
    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        _wrapper_heads(query, key, enable_gqa)
        if version == "2.15":  # the wrapper validates the scale and picks the backend before it calls the op
            if scale is not None and not scale > 0:
                raise ValueError(f"scale must be greater than 0, got {scale}")
            window = list(window_size)
            backend = _select_backend_2_15(query, value, cu_seq_q, cu_seq_k, max_q, window, num_splits, capability)
        max_lengths = _max_lengths(FORWARD_OP, max_q, max_k)
        window = _window_schema(window_size)
        _no_kv_cache(seqused_k, block_table)
        if version == "2.13":  # its cuDNN branch is unreachable (`_should_use_cudnn` returns False)
            backend = "flash"
        elif version == "2.14":  # the op picks, reading no flag
            cudnn = takes_cudnn_2_14(query, key, value, max_lengths[0], window, enable_gqa, num_splits, capability)
            backend = "cudnn" if cudnn else "flash"
        if backend == "flash":
            flash_varlen_checks(query, key, value, cu_seq_q, cu_seq_k, capability)
        else:
            cudnn_varlen_checks(query, key, value, cu_seq_q, cu_seq_k)
        _record_varlen(
            version,
            query,
            key,
            cu_seq_q,
            cu_seq_k,
            return_aux,
            window_size=tuple(window),
            scale=scale,
            enable_gqa=enable_gqa,
            backend=backend,
        )
        return _varlen_result(
            query, key, value, cu_seq_q, cu_seq_k, max_lengths, scale, window, return_aux, capability, version, backend
        )

    varlen_attn.__qualname__ = f"varlen_attn_{version.replace('.', '_')}"
    return varlen_attn


# Each torch release's `varlen_attn`, made for the GPU it plays. Read from the 2.13.0, 2.14.1 and 2.15.0 wheels
# (torch/nn/attention/varlen.py, torch/_meta_registrations.py, torchgen/packaged/ATen/native/native_functions.yaml):
#   varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
#               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)  all three
#   AuxRequest(NamedTuple): lse: bool = False; the lse float32 (heads, T_q)                                all three
#   torch_attn::_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
#               window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)
#               -> (out, lse, rng_state); 2.15 adds `backend: int = 1` (SDPBackend.FLASH_ATTENTION; 3 is cuDNN)
#   torch_attn::_varlen_attn_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
#               is_causal, rng_state, scale=None, window_size=None) -> (dq, dk, dv); 2.15 adds `backend: int = 1`
#   aten::_efficient_attention_forward / _backward: the same schema in all three (window_size keyword-only); the
#               backward's meta function lacks `out` and `window_size` in 2.13 and 2.14, takes them in 2.15
VARLEN_SIGNATURES = {
    "2.10": _varlen_attn_2_10,
    "2.11": _varlen_attn_2_11,
    "2.13": functools.partial(_varlen_attn_2_13_to_2_15, "2.13"),
    "2.14": functools.partial(_varlen_attn_2_13_to_2_15, "2.14"),
    "2.15": functools.partial(_varlen_attn_2_13_to_2_15, "2.15"),
}
# Releases with `torch_attn::_varlen_attn_backward`, the op the sink correction calls (2.15's with `backend`)
VARLEN_BACKWARD_OP_RELEASES = ("2.13", "2.14", "2.15")


def varlen_stand_in(version: str = "2.15", capability: tuple[int, int] = PLAYED_CAPABILITY) -> VarlenKernel:
    """torch `version`'s `varlen_attn` on a GPU of `capability`, as strict as the real one, with its backward op
    where the release has one.

    What it cannot show, and what covers it instead:
    - compilation: it is Python that reads the boundaries and the `sdpa_kernel` flags on the host, so dynamo breaks
      its graph there; torch's op is a custom op with a registered fake that traces whole. Covered by
      test_sink_correction.py: torch's own op and backward op compiled in one graph on meta tensors, and the
      correction compiled around this stand-in equal to eager;
    - memory: it keeps each segment's float32 scores (heads x L x L) while the kernel keeps none, so a peak measured
      through it is not the kernel's. What autograd saves is counted instead (tools/measure/measure_attention_memory.py,
      docs/concepts/kernels.md "Memory"); the kernel's own, by `pytest -m gpu` (test_gpu.py, test_fused_kernels.py)
      on a GPU;
    - cuDNN: torch 2.15's routing is read from its varlen.py for the wheel's cuDNN (9.26) on SM90, but not cuDNN's
      decode switch (`max_q == 1`, read from the GPU), another cuDNN's limits, cudnn_frontend's own refusals (their
      messages), nor cuDNN's numbers and log-sum-exp layout (the cuDNN branch computes Flash's). packed attention
      never takes it (test_kernels.py: Flash chosen explicitly; test_gpu.py: whatever the user disabled);
    - numbers: FA2's rounding against the row's maximum where the GPU rounds against a running one over key blocks
      (rounding of the same size, test_kernels.py), and no nondeterminism of atomics in dQ."""
    backward = varlen_backward_stand_in(capability, version) if version in VARLEN_BACKWARD_OP_RELEASES else None
    return VarlenKernel(VARLEN_SIGNATURES[version](capability), capability=capability, backward=backward)


# ---- mixer kernels ----


def _runs(seq_idx: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal values in a (seqlen,) row of segment indices."""
    change = torch.nonzero(seq_idx[1:] != seq_idx[:-1]).reshape(-1) + 1
    bounds = [0, *change.tolist(), seq_idx.numel()]
    return list(zip(bounds, bounds[1:], strict=False))


def _per_run(function, seq_idx: torch.Tensor | None, length: int, dim: int, *tensors):
    """`function(*slices)` on each run of `seq_idx` (one batch row), slices along `dim`, outputs concatenated."""
    runs = [(0, length)] if seq_idx is None else _runs(seq_idx[0])
    outputs = [function(*(tensor.narrow(dim, start, end - start) for tensor in tensors)) for start, end in runs]
    return torch.cat(outputs, dim=dim)


def _conv(fallbacks):
    """The module's own PyTorch causal convolution (what padded training runs), without its packing guard."""
    return fallbacks["causal_conv1d_fn"]


CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def conv1d_checks(x, weight, bias, seq_idx, initial_states, return_final_states, activation) -> None:
    """causal-conv1d's refusals, in order: its Python function (causal_conv1d_interface.py, `CausalConv1dFn.forward`,
    as the kernel hub's mamba-ssm bundles it), then `causal_conv1d_fwd` (csrc/causal_conv1d.cpp). A channel-last input
    whose strides are not multiples of 8 is laid out again by the hub's Python, not refused."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    if seq_idx is not None:
        assert initial_states is None, "initial_states must be None if seq_idx is not None"
        assert not return_final_states, "If seq_idx is not None, we don't return final_states_out"
    if x.stride(2) != 1 and x.stride(1) != 1:  # the Python side makes such an input contiguous
        x = x.contiguous()
    if x.dtype not in CONV_DTYPES:
        raise RuntimeError("Expected input_type == at::ScalarType::Float || ... to be true, but got false.")
    if weight.dtype not in CONV_DTYPES:
        raise RuntimeError("Expected weight_type == at::ScalarType::Float || ... to be true, but got false.")
    if x.dim() != 3:
        raise RuntimeError("x must have shape (batch_size, dim, seqlen)")
    batch, dim, length = x.shape
    width = weight.shape[-1]
    if tuple(weight.shape) != (dim, width):
        raise RuntimeError("weight must have shape (dim, width)")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last and dim % 8:
        raise RuntimeError("causal_conv1d only supports channel dimension divisible by 8 for now")
    if not 2 <= width <= 4:
        raise RuntimeError("causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        if bias.dtype != weight.dtype:
            raise RuntimeError("Expected bias.scalar_type() == weight_type to be true, but got false.")
        if tuple(bias.shape) != (dim,):
            raise RuntimeError("bias must have shape (dim)")
    if seq_idx is not None:
        if not channel_last:
            raise RuntimeError("seq_idx is only supported for channel last layout")
        if seq_idx.dtype != torch.int32:
            raise RuntimeError("Expected seq_idx.scalar_type() == torch::kInt32 to be true, but got false.")
        if not seq_idx.is_contiguous():
            raise RuntimeError("Expected seq_idx.is_contiguous() to be true, but got false.")
        if tuple(seq_idx.shape) != (batch, length):
            raise RuntimeError("seq_idx must have shape (batch_size, seqlen)")


# What the mixer stand-ins cannot show, and what covers it instead: compilation (each runs a Python loop over the runs
# of `seq_idx`/`cu_seqlens` read on the host, a graph break where the real kernel is one opaque op: no CPU test
# compiles a hybrid model through them); memory (they allocate per segment through the model's
# fallbacks; the kernels' chunked state is not modelled); numbers (the fallbacks' arithmetic in the input dtype, not
# the kernels' chunked float32 accumulation: test_hybrid_models.py bounds packed against per-sequence runs, and its
# CUDA test runs the real kernels when a GPU and the packages are there).


def causal_conv1d_stand_in(fallbacks: dict):
    reference = _conv(fallbacks)

    def causal_conv1d_fn(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        conv1d_checks(x, weight, bias, seq_idx, initial_states, return_final_states, activation)
        if initial_states is not None or return_final_states:
            raise NotImplementedError("the stand-in computes packed training rows only (no conv state)")
        width = weight.shape[-1]
        CALLS.append(KernelCall("causal_conv1d_fn", seq_idx, dict(width=width)))
        activation = "silu" if activation == "swish" else activation
        return _per_run(
            lambda part: reference(part, weight, bias, activation=activation),
            seq_idx,
            x.shape[-1],
            -1,
            x,
        )

    return causal_conv1d_fn


def keyword_swallowing_causal_conv1d_stand_in(fallbacks: dict):
    """transformers 5.23's LFM3 `causal_conv1d_fn`: no `seq_idx` parameter, extra keywords swallowed."""
    reference = _conv(fallbacks)

    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        CALLS.append(KernelCall("causal_conv1d_fn", None, dict(swallowed=sorted(kwargs))))
        return reference(x, weight, bias, activation=activation)

    return causal_conv1d_fn


def chunk_gated_delta_rule_stand_in(fallbacks: dict):
    reference = fallbacks["chunk_gated_delta_rule"]

    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        **kwargs,
    ):
        # fla/ops/gated_delta_rule/chunk.py `chunk_gated_delta_rule` (the kernel hub's fla, version 2), then the
        # chunked forward's head-dim assert (fla/ops/common/chunk_delta_h.py)
        if "head_first" in kwargs:
            raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
                f"k.shape[2]={k.shape[2]}"
            )
        if v.shape[2] % q.shape[2]:
            raise ValueError(
                f"For GVA, num_v_heads (HV={v.shape[2]}) must be evenly divisible by num_heads (H={q.shape[2]}), but "
                f"got HV % H = {v.shape[2] % q.shape[2]}"
            )
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.Please flatten "
                "variable-length inputs before processing."
            )
        assert k.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."
        if initial_state is not None or output_final_state:
            raise NotImplementedError("the stand-in computes packed training rows only (no recurrent state)")
        if scale is not None and not math.isclose(scale, k.shape[-1] ** -0.5):
            raise NotImplementedError("the PyTorch reference takes the default scale only")
        CALLS.append(KernelCall("chunk_gated_delta_rule", cu_seqlens, {}))
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outputs = [
            reference(
                *(tensor[:, start:end] for tensor in (q, k, v, g, beta)),
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )[0]
            for start, end in zip(bounds, bounds[1:], strict=False)
            if end > start
        ]
        return torch.cat(outputs, dim=1), None

    return chunk_gated_delta_rule


def _chunk_scan(reference, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, seq_idx):
    def scan(x, dt, B, C):
        out = reference(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        return out.to(x.dtype)

    out = _per_run(scan, seq_idx, x.shape[1], 1, x, dt, B, C)
    return out if z is None else out * F.silu(z)


def scan_checks(x, dt, A, B, C, D, z, seq_idx) -> None:
    """mamba-ssm's `_mamba_chunk_scan_combined_fwd` (ops/triton/ssd_combined.py): bare shape asserts."""
    batch, length, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0
    assert B.shape == (batch, length, ngroups, dstate)
    assert dt.shape == (batch, length, nheads)
    assert A.shape == (nheads,)
    assert C.shape == B.shape
    assert z is None or z.shape == x.shape
    assert D is None or D.shape in ((nheads, headdim), (nheads,))
    assert seq_idx is None or seq_idx.shape == (batch, length)


def mamba_chunk_scan_stand_in(fallbacks: dict):
    reference = fallbacks["mamba_chunk_scan_combined"]

    def mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        return_varlen_states=False,
    ):
        scan_checks(x, dt, A, B, C, D, z, seq_idx)
        if initial_states is not None or return_final_states or return_varlen_states:
            raise NotImplementedError("the stand-in computes packed training rows only (no SSM state)")
        CALLS.append(KernelCall("mamba_chunk_scan_combined", seq_idx, {}))
        return _chunk_scan(reference, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, seq_idx)

    return mamba_chunk_scan_combined


def _gated_group_rms_norm(y, z, weight, eps, group_size, norm_before_gate):
    """mamba-ssm's gated RMSNorm, one group per SSM group, in fp32."""
    dtype = y.dtype
    y, z = y.float(), z.float()
    if not norm_before_gate:
        y = y * F.silu(z)
    groups = y.view(*y.shape[:-1], -1, group_size)
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(y.shape) * weight.float()
    if norm_before_gate:
        y = y * F.silu(z)
    return y.to(dtype)


def mamba_split_conv1d_scan_stand_in(fallbacks: dict):
    """mamba-ssm's fused training path: split, causal conv, chunk scan, gated grouped RMSNorm, out projection."""
    conv, scan_reference = _conv(fallbacks), fallbacks["mamba_chunk_scan_combined"]

    def mamba_split_conv1d_scan_combined(
        zxbcdt,
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        chunk_size,
        initial_states=None,
        seq_idx=None,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        activation="silu",
        rmsnorm_weight=None,
        rmsnorm_eps=1e-6,
        outproj_weight=None,
        outproj_bias=None,
        headdim=None,
        ngroups=1,
        norm_before_gate=True,
    ):
        if initial_states is not None or return_final_states:
            raise NotImplementedError("the stand-in computes packed training rows only (no SSM state)")
        # `MambaSplitConv1dScanCombinedFn.forward` (ops/triton/ssd_combined.py): its asserts, then causal-conv1d's
        # checks on the channel-last conv input it hands the kernel, then the scan's
        assert activation in (None, "silu", "swish")
        assert D.dim() != 1 or headdim is not None
        batch, length, _ = zxbcdt.shape
        nheads = A.shape[0]
        assert nheads % ngroups == 0
        headdim = D.shape[1] if D.dim() == 2 else headdim
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        assert d_nonssm >= 0
        assert zxbcdt.shape == (batch, length, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads)
        assert dt_bias.shape == (nheads,) and A.shape == (nheads,)
        assert outproj_weight is not None or outproj_bias is None
        zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        conv_input = xBC.contiguous().transpose(1, 2)  # (batch, channels, length), channel-last
        conv1d_checks(conv_input, conv1d_weight, conv1d_bias, seq_idx, None, False, activation)
        CALLS.append(KernelCall("mamba_split_conv1d_scan_combined", seq_idx, dict(ngroups=ngroups)))
        activation = "silu" if activation in ("silu", "swish") else None
        xBC = _per_run(
            lambda part: conv(part, conv1d_weight, conv1d_bias, activation=activation),
            seq_idx,
            length,
            -1,
            xBC.transpose(1, 2),
        ).transpose(1, 2)
        x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        y = _chunk_scan(
            scan_reference,
            x.reshape(batch, length, nheads, headdim),
            dt,
            A,
            B.reshape(batch, length, ngroups, dstate),
            C.reshape(batch, length, ngroups, dstate),
            chunk_size,
            D,
            None if rmsnorm_weight is not None else z.reshape(batch, length, nheads, headdim),
            dt_bias,
            True,
            dt_limit,
            seq_idx,
        ).reshape(batch, length, dim)
        if rmsnorm_weight is not None:
            y = _gated_group_rms_norm(y, z, rmsnorm_weight, rmsnorm_eps, dim // ngroups, norm_before_gate)
        if d_nonssm:
            x0, y0 = zx0.chunk(2, dim=-1)
            y = torch.cat([F.silu(x0) * y0, y], dim=-1)
        return y if outproj_weight is None else F.linear(y, outproj_weight, outproj_bias)

    return mamba_split_conv1d_scan_combined


# Every mixer kernel, correct
MIXER_STAND_INS = {
    "causal_conv1d_fn": causal_conv1d_stand_in,
    "chunk_gated_delta_rule": chunk_gated_delta_rule_stand_in,
    "mamba_chunk_scan_combined": mamba_chunk_scan_stand_in,
    "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_stand_in,
}
