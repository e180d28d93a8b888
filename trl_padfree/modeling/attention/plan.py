"""Which kernel computes one attention layer of a packed row on CUDA, and how it is called, or why none can: decided
from what the layer hands the attention function (dtypes, head dims, heads, scale, window, softcap, sinks, dropout),
the kernels' limits (`kernels.FlashLimits`), the keywords the installed torch's `varlen_attn` takes and the fused
kernels this machine has (`kernels.FusedKernels`). Pure: training (once per layer signature and forward,
varlen.KernelSession) and the architecture check's kernel coverage (packability) call the same function, so what
`trl-padfree models` says is what training runs.

    kernel             layers                                          called
    varlen             the rest: fp16/bf16, head dims <= 256           torch's `varlen_attn` on its Flash backend
    varlen_sinks       attention sinks (GPT-OSS)                       the same, then each output scaled by the share
                                                                       its sink leaves (from the kernel's
                                                                       log-sum-exp); the backward op given the
                                                                       scaled output (attention/sinks.py)
    flash_attn         logit softcapping (Gemma 2), flash-attn >= 2.6  `flash_attn_varlen_func(softcap=)`
    flex               softcapping without flash-attn                  FlexAttention, the row's document mask and a
                                                                       softcap score_mod
    efficient          head dims above 256 (Gemma 4's global layers)   ATen's memory-efficient kernel with
                                                                       `cu_seqlens`, keys and values expanded to
                                                                       the query heads (it takes no grouped heads)
    (per segment)      float32 without autocast, dropout, a GPU older than SM80, or a fused kernel this machine
                       lacks (segments.py: sdpa per segment; softcap and sinks as eager computes them)

Every kernel call first casts float32 queries and keys with bf16 values (TRL's default: float32 weights under bf16
autocast, where RoPE multiplies by float32 cos/sin; or float32 norms of a PEFT model) to the autocast dtype, else the
layer's weights' dtype, as transformers' flash integration does (`get_target_dtype`); and pads a value head dim below
the query's (multi-head latent attention: 128 against 192) or a head dim that is not a multiple of 8 with zeros, the
scale passed and the output cropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import FLASH_LIMITS, FlashLimits, FusedKernels

# What a user changes for a float32 layer to reach the kernel
FLOAT32_WAY_OUT = "set bf16=True (TRL's default) or load the model with dtype=bfloat16"

# The kernels a plan chooses among (the table in the module docstring)
VARLEN, VARLEN_SINKS, FLASH_ATTN, FLEX, EFFICIENT = "varlen", "varlen_sinks", "flash_attn", "flex", "efficient"
# Each, said for people (`trl-padfree models`, the logs)
KERNEL_NAMES = {
    VARLEN: "torch's varlen kernel",
    VARLEN_SINKS: "torch's varlen kernel with the sink correction",
    FLASH_ATTN: "flash-attn's varlen kernel (softcap)",
    FLEX: "FlexAttention (softcap score_mod)",
    EFFICIENT: "torch's memory-efficient kernel",
}
# What installs the kernel a layer would take, where this machine lacks it
SOFTCAP_WAY_OUT = "pip install 'flash-attn>=2.6', or a torch with FlexAttention"


@dataclass(frozen=True)
class VarlenKernelPlan:
    """Which kernel computes a layer and how to call it, or why none can (`fallback`: the layer runs per segment)."""

    options: dict[str, Any] = field(default_factory=dict)  # the kernel's keyword arguments (after `max_k`)
    cast_to: torch.dtype | None = None  # the query, key and value are cast to this dtype first
    padded_head_dim: int | None = None  # query, key and value padded with zeros to this head dim first
    value_head_dim: int | None = None  # the output cropped back to the value's head dim (after padding)
    fallback: str | None = None
    padding: str | None = None  # what was padded, said for people ("the value from 128 to 192")
    kernel: str | None = VARLEN  # one of KERNEL_NAMES; None when the layer runs per segment

    @property
    def on_kernel(self) -> bool:
        return self.fallback is None


def per_segment(reason: str) -> VarlenKernelPlan:
    return VarlenKernelPlan(fallback=reason, kernel=None)


def kernel_dtype(
    input_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    autocast_dtype: torch.dtype | None,
    weights_dtype: Callable[[], torch.dtype | None],
    limits: FlashLimits = FLASH_LIMITS,
) -> torch.dtype:
    """The dtype a layer's attention computes in on the kernel: its inputs' when they are one dtype the kernel takes;
    else autocast's when autocast is on; else the layer's weights' (`weights_dtype()`, read only then)."""
    query = input_dtypes[0]
    if len(set(input_dtypes)) == 1 and query in limits.dtypes:
        return query
    if autocast_dtype is not None:
        return autocast_dtype
    return weights_dtype() or query


def varlen_kernel_plan(
    parameters: Collection[str],
    *,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float | None,
    value_head_dim: int | None = None,
    input_dtypes: tuple[torch.dtype, ...] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    dropout: float = 0.0,
    causal: bool = True,
    capability: tuple[int, int] = FLASH_LIMITS.min_capability,
    limits: FlashLimits = FLASH_LIMITS,
    fused: FusedKernels | None = None,
    sink_backward: bool = False,
) -> VarlenKernelPlan:
    """The kernel and call for a layer computing in `dtype` (its inputs `input_dtypes`, cast first when they differ)
    with these head counts, head dims and needs, on a GPU of compute `capability`, given a `varlen_attn` that takes
    the keyword `parameters`, whether its backward op can be called with a corrected output (`sink_backward`), and
    the `fused` kernels this machine has; `causal=False`: every query sees every key of its segment (within the
    window before it), as an image's tokens see the whole image.

    torch's `varlen_attn` by keyword name, as releases differ: 2.10 takes `is_causal` only; 2.11 `scale` and
    `window_size`; 2.12 adds `enable_gqa` (2.13 to 2.15 take the same). Without `enable_gqa`, grouped key/value heads
    go in grouped all the same (the wrapper hands them to ATen's Flash kernel unchecked, which shares divisible
    heads); without `scale`, only the default `1/sqrt(head_dim)` of an unpadded query runs; without `window_size`,
    no sliding window.
    """
    fused = fused or FusedKernels()
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    padded = math.ceil(max(head_dim, value_head_dim) / limits.head_dim_multiple) * limits.head_dim_multiple
    refusal = _refusal(dtype, heads, kv_heads, dropout, capability, limits)
    if refusal is not None:
        return per_segment(refusal)
    cast_to = dtype if input_dtypes is not None and any(each != dtype for each in input_dtypes) else None
    padding = dict(
        cast_to=cast_to,
        padded_head_dim=None if _padding(head_dim, value_head_dim, padded) is None else padded,
        value_head_dim=value_head_dim if padded != value_head_dim else None,
        padding=_padding(head_dim, value_head_dim, padded),
    )
    scale = head_dim**-0.5 if scaling is None else scaling  # of the unpadded query
    if softcap is not None:
        return _softcap_plan(fused, softcap, sinks, scale, sliding_window, causal, padded, limits, cast_to, padding)
    if padded > limits.max_head_dim:
        return _wide_head_plan(fused, sinks, scale, sliding_window, causal, head_dim, value_head_dim, padding)
    plan = _varlen_plan(parameters, heads, kv_heads, head_dim, scaling, padded, sliding_window, causal, padding)
    if not sinks or not plan.on_kernel:
        return plan
    if "return_aux" not in parameters or not sink_backward:
        return per_segment(
            "attention sinks (this torch's varlen kernel returns no log-sum-exp, or has no backward op that takes "
            "the corrected output: torch 2.13 or newer has both)"
        )
    return VarlenKernelPlan(**{**plan.__dict__, "kernel": VARLEN_SINKS})


def _varlen_plan(parameters, heads, kv_heads, head_dim, scaling, padded, sliding_window, causal, padding):
    """torch's `varlen_attn`: its keywords for this layer, or why this release's cannot take it."""
    options = _mask_options(parameters, sliding_window, causal)
    if isinstance(options, str):
        return per_segment(options)
    default_scale = head_dim**-0.5
    if "scale" in parameters:
        if scaling is not None or padded != head_dim:  # a padded query would change the default
            options["scale"] = default_scale if scaling is None else scaling
    elif padded != head_dim:
        return per_segment(
            f"head dim {head_dim}, which the kernel takes only padded to {padded} (this torch's varlen_attn takes no "
            "`scale` to keep the unpadded one)"
        )
    elif scaling is not None and not math.isclose(scaling, default_scale):
        return per_segment(f"attention scale {scaling:g} (this torch's varlen_attn takes no `scale`)")
    if heads != kv_heads and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return VarlenKernelPlan(options, **padding)


def _softcap_plan(fused, softcap, sinks, scale, sliding_window, causal, padded, limits, cast_to, padding):
    """Logit softcapping: flash-attn's varlen kernel where installed, else FlexAttention with a score_mod."""
    if sinks:
        return per_segment("attention sinks with logit softcapping (no fused kernel takes both)")
    left = -1 if sliding_window is None else sliding_window - 1
    if fused.flash_attn_varlen is not None and padded <= limits.max_head_dim:
        options = dict(softmax_scale=scale, causal=causal, window_size=(left, 0 if causal else -1), softcap=softcap)
        return VarlenKernelPlan(options, kernel=FLASH_ATTN, **padding)
    if fused.flex is not None:
        # FlexAttention takes any head dim and grouped heads; it needs one dtype, so only the cast applies
        options = dict(scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap)
        return VarlenKernelPlan(options, cast_to=cast_to, kernel=FLEX)
    return per_segment(f"attention logit softcapping (no fused kernel here takes it: {SOFTCAP_WAY_OUT})")


def _wide_head_plan(fused, sinks, scale, sliding_window, causal, head_dim, value_head_dim, padding):
    """Head dims above Flash's 256: ATen's memory-efficient kernel, which takes any head dim (a multiple of 8)."""
    wide = f"head dim {max(head_dim, value_head_dim)}"
    if fused.efficient is None:
        return per_segment(f"{wide} (the Flash kernel takes at most 256, and this torch has no memory-efficient one)")
    if sinks:
        return per_segment(f"{wide} with attention sinks (no fused kernel takes both)")
    if sliding_window is not None:
        return per_segment(f"{wide} with a sliding window (the memory-efficient kernel is called without one)")
    # custom_mask_type 2: causal from the bottom-right corner of each segment (aten/src/ATen/native/transformers/cuda/
    # mem_eff_attention/kernel_forward.h, `CausalFromBottomRight`), as flash aligns it; 0: no mask
    options = dict(custom_mask_type=2 if causal else 0, scale=scale)
    return VarlenKernelPlan(options, kernel=EFFICIENT, **padding)


def _padding(head_dim: int, value_head_dim: int, padded: int) -> str | None:
    """What the call pads first, said for people; None when the head dims fit the kernel as they are."""
    if padded != head_dim:
        return f"head dims padded from {head_dim} to {padded}"
    if padded != value_head_dim:
        return f"the value padded from {value_head_dim} to the query's {padded}"
    return None


def _refusal(dtype, heads, kv_heads, dropout, capability, limits):
    """Why no fused kernel computes this layer on this GPU, whatever torch release; None when one may."""
    if tuple(capability) < limits.min_capability:
        major, minor = capability
        needed = ".".join(map(str, limits.min_capability))
        return f"a GPU of compute capability {major}.{minor} (the Flash kernel needs {needed} or newer)"
    if dtype not in limits.dtypes:
        takes = "/".join(str(each).removeprefix("torch.") for each in limits.dtypes)
        return f"{dtype} inputs (the kernel takes {takes}: {FLOAT32_WAY_OUT})"
    if dropout > 0:
        return "attention dropout"
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key/value heads (the kernel needs a multiple)"
    return None


def _mask_options(parameters: Collection[str], sliding_window: int | None, causal: bool) -> dict[str, Any] | str:
    """The keywords that mask the call as the layer masks (causal or not, within its window), or why this torch's
    cannot."""
    if "window_size" in parameters:
        # (-1, 0) is plain causal; (W - 1, 0) keeps the query and the W - 1 keys before it, like transformers' window;
        # a right bound of -1 keeps every later key of the segment. Windows align to the bottom-right corner when a
        # segment has more keys than queries.
        left = -1 if sliding_window is None else sliding_window - 1
        return {"window_size": (left, 0 if causal else -1)}
    if sliding_window is not None:
        return "a sliding window (this torch's varlen_attn takes no `window_size`)"
    if "is_causal" in parameters:
        return {"is_causal": causal}
    return "causal masking (this torch's varlen_attn takes neither `window_size` nor `is_causal`)"
