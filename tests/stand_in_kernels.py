"""Stand-ins for the CUDA kernels behind packed rows, with the real functions' signatures, for `stand_in_kernels`
(trl_padfree/kernels.py): the packed forward takes its CUDA branches on the CPU and calls these instead.

Each stand-in computes the reference result per segment (one sequence at a time, from its boundary argument) and
records what it was given (`CALLS`): the boundary tensors and their dtype, the window, grouped heads, the backend a
torch release would pick. Signatures are the real ones, quoted from the releases:

    varlen_attn                          torch 2.10 (is_causal), 2.11 (scale, window_size), 2.13-2.15 (enable_gqa, ...)
    causal_conv1d_fn                     causal-conv1d (seq_idx; widths 2 to 4)
    chunk_gated_delta_rule               flash-linear-attention (cu_seqlens; batch 1)
    mamba_chunk_scan_combined            mamba-ssm (seq_idx)
    mamba_split_conv1d_scan_combined     mamba-ssm (seq_idx; conv, scan, gated grouped RMSNorm, out projection)

The mixer stand-ins compute each segment with the model module's own PyTorch fallbacks (what padded training runs),
so a stand-in and the fallback differ only in how the row is cut. Faulty variants reproduce real failures: a
`causal_conv1d_fn` that names `seq_idx` and ignores it, and one that swallows extra keywords (transformers 5.23's
LFM3 function).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trl_padfree.modeling.kernels import VarlenKernel

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

# The GPU a stand-in plays: SM90 (H100), where torch 2.15 prefers cuDNN
PLAYED_CAPABILITY = (9, 0)
# Besides half precision, the stand-ins compute fp32 and fp64, so the fp32 equivalence tests and the float64 twins of
# the architecture check run the kernel branch
STAND_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _segment_attention(query, key, value, scale, left: int, right: int) -> torch.Tensor:
    """One segment `(T, heads, dim)`, causal window aligned to the bottom-right corner as flash attention aligns it:
    query i stands at key position i + T_k - T_q and sees keys in [position - left, position + right] (-1: no
    limit)."""
    queries, keys = query.shape[0], key.shape[0]
    position = torch.arange(queries).unsqueeze(1) + (keys - queries)
    key_position = torch.arange(keys).unsqueeze(0)
    allowed = torch.ones(queries, keys, dtype=torch.bool)
    if right >= 0:
        allowed &= key_position <= position + right
    if left >= 0:
        allowed &= key_position >= position - left
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, value.float()).to(query.dtype)


def _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale, window, enable_gqa) -> torch.Tensor:
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"Expect query and key/value to have the same number of heads but got Hq={heads} and Hkv={kv_heads}. "
                "Try setting enable_gqa=True for GQA."
            )
        key, value = (tensor.repeat_interleave(heads // kv_heads, dim=1) for tensor in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    outputs = [
        _segment_attention(query[start_q:end_q], key[start_k:end_k], value[start_k:end_k], scale, *window)
        for start_q, end_q, start_k, end_k in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False)
        if end_q > start_q
    ]
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def _record_varlen(version, query, key, cu_seq_q, cu_seq_k, **details) -> None:
    CALLS.append(
        KernelCall(
            "varlen_attn",
            cu_seq_q,
            dict(
                torch=version,
                dtype=cu_seq_q.dtype,
                same_boundaries=cu_seq_q is cu_seq_k,
                heads=(query.shape[1], key.shape[1]),
                **details,
            ),
        )
    )


def _select_backend_2_15(query, value, cu_seq_q, cu_seq_k, window) -> str:
    """torch 2.15's choice for an SM90 GPU with its wheel's cuDNN (9.26): cuDNN when eligible, then Flash, among the
    backends `sdpa_kernel` leaves enabled."""
    reasons = []
    if query.dtype not in (torch.float16, torch.bfloat16):
        reasons.append("query dtype must be float16 or bfloat16")
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        reasons.append("head dimensions must be divisible by 8")
    if query.shape[-1] > 128 or value.shape[-1] > 128:
        reasons.append("head dimensions above 128")
    if window == [-1, 0]:
        if cu_seq_q is not cu_seq_k:
            reasons.append("causal attention requires the same cu_seq tensor for Q and K")
    elif window != [-1, -1]:
        reasons.append("window_size must be (-1, -1) or causal (-1, 0)")
    cudnn_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    if cudnn_enabled and not reasons:
        return "cudnn"
    if torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    raise RuntimeError(
        "No viable backend for varlen_attn. Enable SDPBackend.FLASH_ATTENTION or SDPBackend.CUDNN_ATTENTION with "
        "sdpa_kernel()."
    )


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    _record_varlen("2.10", query, key, cu_seq_q, cu_seq_k, is_causal=is_causal, backend="flash")
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, None, (-1, 0 if is_causal else -1), False)


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    _record_varlen(
        "2.11", query, key, cu_seq_q, cu_seq_k, window_size=tuple(window_size), scale=scale, backend="flash"
    )
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size), False)


def _varlen_attn_2_13_to_2_15(version: str):
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
        window = list(window_size)
        if version == "2.15":
            if scale is not None and not scale > 0:
                raise ValueError(f"scale must be greater than 0, got {scale}")
            backend = _select_backend_2_15(query, value, cu_seq_q, cu_seq_k, window)
        else:  # 2.13 runs Flash; 2.14.1 takes cuDNN only for non-causal attention without grouped heads
            cudnn = version == "2.14" and window == [-1, -1] and not enable_gqa and query.dtype in STAND_IN_DTYPES[:2]
            backend = "cudnn" if cudnn else "flash"
        _record_varlen(
            version,
            query,
            key,
            cu_seq_q,
            cu_seq_k,
            window_size=tuple(window),
            scale=scale,
            enable_gqa=enable_gqa,
            backend=backend,
        )
        return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window), enable_gqa)

    varlen_attn.__qualname__ = f"varlen_attn_{version.replace('.', '_')}"
    return varlen_attn


VARLEN_SIGNATURES = {
    "2.10": varlen_attn_2_10,
    "2.11": varlen_attn_2_11,
    "2.13": _varlen_attn_2_13_to_2_15("2.13"),
    "2.14": _varlen_attn_2_13_to_2_15("2.14"),
    "2.15": _varlen_attn_2_13_to_2_15("2.15"),
}


def varlen_stand_in(version: str = "2.15") -> VarlenKernel:
    return VarlenKernel(VARLEN_SIGNATURES[version], dtypes=STAND_IN_DTYPES, capability=PLAYED_CAPABILITY)


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


def causal_conv1d_stand_in(fallbacks: dict, ignore_seq_idx: bool = False):
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
        width = weight.shape[-1]
        if not 2 <= width <= 4:
            raise RuntimeError("causal_conv1d only supports width between 2 and 4")
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        if initial_states is not None or return_final_states:
            raise NotImplementedError("the stand-in computes packed training rows only (no conv state)")
        if seq_idx is not None:
            if seq_idx.dtype != torch.int32:
                raise RuntimeError("seq_idx must have dtype int32")
            if not (x.stride(1) == 1 and x.stride(2) > 1):
                raise RuntimeError("seq_idx is only supported for channel last layout")
            if x.shape[1] % 8:
                raise RuntimeError("causal_conv1d only supports channel dimension divisible by 8 for now")
        CALLS.append(KernelCall("causal_conv1d_fn", seq_idx, dict(width=width, ignored=ignore_seq_idx)))
        activation = "silu" if activation == "swish" else activation
        return _per_run(
            lambda part: reference(part, weight, bias, activation=activation),
            None if ignore_seq_idx else seq_idx,
            x.shape[-1],
            -1,
            x,
        )

    return causal_conv1d_fn


def leaky_causal_conv1d_stand_in(fallbacks: dict):
    """Names `seq_idx` but convolves across it: a kernel that carries one sequence into the next."""
    return causal_conv1d_stand_in(fallbacks, ignore_seq_idx=True)


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
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
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
        if seq_idx is not None and seq_idx.dtype != torch.int32:
            raise RuntimeError("seq_idx must have dtype int32")
        CALLS.append(KernelCall("mamba_split_conv1d_scan_combined", seq_idx, dict(ngroups=ngroups)))
        batch, length, _ = zxbcdt.shape
        nheads = A.shape[0]
        headdim = D.shape[1] if D.dim() == 2 else headdim
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
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
