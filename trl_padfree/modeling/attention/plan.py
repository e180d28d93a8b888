"""How one attention layer runs on torch's varlen kernel, or why it cannot: decided from what the layer hands the
attention function (dtypes, head dims, heads, scale, window, softcap, sinks, dropout), the kernel's limits
(`kernels.FlashLimits`) and the keywords the installed torch's `varlen_attn` takes. Pure: training (once per layer
signature and forward, varlen.KernelSession) and the architecture check's kernel coverage (packability) call the same
function, so what `trl-padfree models` says is what training runs.

    on the kernel as is    fp16/bf16 inputs of one dtype, query and value head dims equal, a multiple of 8, <= 256
    cast first             float32 queries and keys with bf16 values: TRL's default (float32 weights under bf16
                           autocast, where RoPE multiplies by float32 cos/sin), or float32 norms of a PEFT model;
                           cast to the autocast dtype, else the layer's weights' dtype, as transformers' flash
                           integration does (`get_target_dtype`)
    padded first           a value head dim below the query's (multi-head latent attention: 128 against 192), or
                           a head dim that is not a multiple of 8: zeros appended, the scale passed, output cropped
    per segment            softcapping, sinks, dropout, a head dim above 256 (Gemma 4's global layers), float32
                           without autocast, a GPU older than SM80 (segments.py: sdpa per segment, which on CUDA
                           runs a kernel that keeps no score matrix)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import FLASH_LIMITS, FlashLimits

# What a user changes for a float32 layer to reach the kernel
FLOAT32_WAY_OUT = "set bf16=True (TRL's default) or load the model with dtype=bfloat16"


@dataclass(frozen=True)
class VarlenKernelPlan:
    """How to call `varlen_attn` for a layer, or why it cannot (`fallback`: the layer runs per segment instead)."""

    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments after `max_k`
    cast_to: torch.dtype | None = None  # the query, key and value are cast to this dtype first
    padded_head_dim: int | None = None  # query, key and value padded with zeros to this head dim first
    value_head_dim: int | None = None  # the output cropped back to the value's head dim (after padding)
    fallback: str | None = None
    padding: str | None = None  # what was padded, said for people ("the value from 128 to 192")

    @property
    def on_kernel(self) -> bool:
        return self.fallback is None


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
) -> VarlenKernelPlan:
    """The call of a `varlen_attn` that takes the keyword `parameters`, for a layer computing in `dtype` (its inputs
    `input_dtypes`, cast first when they differ) with these head counts, head dims and needs, on a GPU of compute
    `capability`; `causal=False`: every query sees every key of its segment (within the window before it), as an
    image's tokens see the whole image.

    By name, as torch releases differ: 2.10 takes `is_causal` only; 2.11 `scale` and `window_size`; 2.12 adds
    `enable_gqa` (2.13 to 2.15 take the same). Without `enable_gqa`, grouped key/value heads go in grouped all the
    same (the wrapper hands them to ATen's Flash kernel unchecked, which shares divisible heads); without
    `scale`, only the default `1/sqrt(head_dim)` of an unpadded query runs; without `window_size`, no sliding window.
    """
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    padded = math.ceil(max(head_dim, value_head_dim) / limits.head_dim_multiple) * limits.head_dim_multiple
    fallback = _refusal(
        dtype, heads, kv_heads, head_dim, value_head_dim, padded, softcap, sinks, dropout, capability, limits
    )
    if fallback is not None:
        return VarlenKernelPlan(fallback=fallback)
    options = _mask_options(parameters, sliding_window, causal)
    if isinstance(options, str):
        return VarlenKernelPlan(fallback=options)
    default_scale = head_dim**-0.5
    if "scale" in parameters:
        if scaling is not None or padded != head_dim:  # a padded query would change the default
            options["scale"] = default_scale if scaling is None else scaling
    elif padded != head_dim:
        return VarlenKernelPlan(
            fallback=f"head dim {head_dim}, which the kernel takes only padded to {padded} (this torch's varlen_attn "
            "takes no `scale` to keep the unpadded one)"
        )
    elif scaling is not None and not math.isclose(scaling, default_scale):
        return VarlenKernelPlan(fallback=f"attention scale {scaling:g} (this torch's varlen_attn takes no `scale`)")
    grouped = heads != kv_heads
    if grouped and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    padding = _padding(head_dim, value_head_dim, padded)
    return VarlenKernelPlan(
        options,
        cast_to=dtype if input_dtypes is not None and any(each != dtype for each in input_dtypes) else None,
        padded_head_dim=None if padding is None else padded,
        value_head_dim=value_head_dim if padded != value_head_dim else None,
        padding=padding,
    )


def _padding(head_dim: int, value_head_dim: int, padded: int) -> str | None:
    """What the call pads first, said for people; None when the head dims fit the kernel as they are."""
    if padded != head_dim:
        return f"head dims padded from {head_dim} to {padded}"
    if padded != value_head_dim:
        return f"the value padded from {value_head_dim} to the query's {padded}"
    return None


def _refusal(dtype, heads, kv_heads, head_dim, value_head_dim, padded, softcap, sinks, dropout, capability, limits):
    """Why no call of the kernel can compute this layer, whatever torch release; None when one can."""
    if tuple(capability) < limits.min_capability:
        major, minor = capability
        needed = ".".join(map(str, limits.min_capability))
        return f"a GPU of compute capability {major}.{minor} (the Flash kernel needs {needed} or newer)"
    if dtype not in limits.dtypes:
        takes = "/".join(str(each).removeprefix("torch.") for each in limits.dtypes)
        return f"{dtype} inputs (the kernel takes {takes}: {FLOAT32_WAY_OUT})"
    if softcap is not None:
        return "attention logit softcapping"
    if sinks:
        return "attention sinks"
    if dropout > 0:
        return "attention dropout"
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key/value heads (the kernel needs a multiple)"
    if padded > limits.max_head_dim:
        return f"head dim {max(head_dim, value_head_dim)} (the Flash kernel takes at most {limits.max_head_dim})"
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
