"""Which kernel computes one attention layer of a packed row on CUDA, and how it is called, or why none can: decided
from what the layer hands the attention function (`LayerCall`: dtypes, head dims, heads, scale, window, softcap, sinks,
dropout) and what the kernels and the GPU take (`KernelTarget`: the kernels' limits, the keywords the installed torch's
`varlen_attn` takes, the fused kernels this machine has). Pure: training (once per `LayerCall` and forward,
varlen.KernelSession) and the architecture check's kernel coverage (kernel_coverage.py) call the same function, so what
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

from ..kernels.attention import FLASH_LIMITS, FlashLimits, FusedKernels, VarlenKernel

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


@dataclass(frozen=True)
class LayerCall:
    """What one attention call hands the kernel, read from its tensors' dtypes and shapes and its options (no tensor
    value): the plan's input, and the key under which a forward keeps its plan (`varlen.KernelSession`)."""

    input_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # of the query, key and value
    dtype: torch.dtype  # the dtype it computes in (`kernel_dtype`); inputs of another dtype are cast to it first
    heads: int
    kv_heads: int
    head_dim: int  # of the query and key
    value_head_dim: int
    scaling: float | None  # None: the default 1/sqrt(head_dim)
    sliding_window: int | None = None
    softcap: float | None = None
    # The sink logits' count (one per query head, as `refusals.forward.check_attention_call` requires), None without
    # sinks: the count is what the refusal reads, and a shape, so reading it never waits on the device
    sinks: int | None = None
    dropout: float = 0.0
    causal: bool = True  # False: every query sees every key of its segment (within the window), as an image's tokens

    @property
    def scale(self) -> float:
        """The scale of the unpadded query's scores."""
        return self.head_dim**-0.5 if self.scaling is None else self.scaling

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        module: torch.nn.Module | None,
        options: dict[str, Any],
        *,
        autocast: torch.dtype | None,
        limits: FlashLimits = FLASH_LIMITS,
    ) -> LayerCall:
        """The call of a layer `module` with inputs `(1, heads, T, dim)` and `options` (`scaling`, `sliding_window`,
        `dropout`, and optionally `softcap`, `sinks`, `causal`), under `autocast` (its dtype, None when off)."""
        input_dtypes = (query.dtype, key.dtype, value.dtype)
        return cls(
            input_dtypes,
            kernel_dtype(input_dtypes, autocast, lambda: weights_dtype(module), limits),
            heads=query.shape[1],
            kv_heads=key.shape[1],
            head_dim=query.shape[-1],
            value_head_dim=value.shape[-1],
            scaling=options["scaling"],
            sliding_window=options["sliding_window"],
            softcap=options.get("softcap"),
            sinks=sink_count(options.get("sinks")),
            dropout=options["dropout"],
            causal=options.get("causal", True),
        )


def sink_count(sinks: torch.Tensor | None) -> int | None:
    """How many sink logits a layer hands attention (its `s_aux`), None without sinks."""
    return None if sinks is None else sinks.numel()


@dataclass(frozen=True)
class KernelTarget:
    """What the plan reads of the kernels and the GPU: the keywords the `varlen_attn` called takes (`parameters`), the
    GPU's compute `capability`, the Flash kernel's `limits`, the `fused` kernels this machine has, and whether the
    varlen kernel's backward op can be called with a corrected output (`sink_backward`)."""

    parameters: Collection[str]
    capability: tuple[int, int] = FLASH_LIMITS.min_capability
    limits: FlashLimits = FLASH_LIMITS
    fused: FusedKernels = field(default_factory=FusedKernels)
    sink_backward: bool = False

    @classmethod
    def of(cls, kernel: VarlenKernel, capability: tuple[int, int], fused: FusedKernels) -> KernelTarget:
        """For the varlen `kernel` and the `fused` kernels on a GPU of `capability`."""
        return cls(kernel.parameters, capability, kernel.limits, fused, sink_backward=kernel.backward is not None)


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


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on `device`'s type, when it is on."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def weights_dtype(module: torch.nn.Module | None) -> torch.dtype | None:
    """The dtype a layer's weights compute in, as transformers' flash integration reads it: a quantized model's
    config dtype, else its first linear layer's weight."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):
        return getattr(config, "dtype", None)
    linear = next(
        (layer for layer in (module.modules() if module is not None else ()) if isinstance(layer, torch.nn.Linear)),
        None,
    )
    return None if linear is None else linear.weight.dtype


def varlen_kernel_plan(layer: LayerCall, target: KernelTarget) -> VarlenKernelPlan:
    """The kernel and call for `layer` (its inputs cast first to the dtype it computes in where they differ) on
    `target`: a `varlen_attn` that takes the keyword `target.parameters`, whether its backward op can be called with a
    corrected output, the fused kernels this machine has, a GPU of `target.capability`.

    torch's `varlen_attn` by keyword name, as releases differ: 2.10 takes `is_causal` only; 2.11 `scale` and
    `window_size`; 2.12 adds `enable_gqa` (2.13 to 2.15 take the same). Without `enable_gqa`, grouped key/value heads
    go in grouped all the same (the wrapper hands them to ATen's Flash kernel unchecked, which shares divisible
    heads); without `scale`, only the default `1/sqrt(head_dim)` of an unpadded query runs; without `window_size`,
    no sliding window.
    """
    limits = target.limits
    padded = math.ceil(max(layer.head_dim, layer.value_head_dim) / limits.head_dim_multiple) * limits.head_dim_multiple
    refusal = _refusal(layer, target)
    if refusal is not None:
        return per_segment(refusal)
    cast_to = layer.dtype if any(each != layer.dtype for each in layer.input_dtypes) else None
    padding = _padding(layer.head_dim, layer.value_head_dim, padded)
    fitted = dict(
        cast_to=cast_to,
        padded_head_dim=None if padding is None else padded,
        value_head_dim=layer.value_head_dim if padded != layer.value_head_dim else None,
        padding=padding,
    )
    if layer.softcap is not None:
        return _softcap_plan(layer, target, padded, fitted)
    if padded > limits.max_head_dim:
        return _wide_head_plan(layer, target, fitted)
    plan = _varlen_plan(layer, target, padded, fitted)
    if layer.sinks is None or not plan.on_kernel:
        return plan
    if "return_aux" not in target.parameters or not target.sink_backward:
        return per_segment(
            "attention sinks (this torch's varlen kernel returns no log-sum-exp, or has no backward op that takes "
            "the corrected output: torch 2.13 or newer has both)"
        )
    return VarlenKernelPlan(**{**plan.__dict__, "kernel": VARLEN_SINKS})


def _varlen_plan(layer: LayerCall, target: KernelTarget, padded: int, fitted: dict) -> VarlenKernelPlan:
    """torch's `varlen_attn`: its keywords for this layer, or why this release's cannot take it."""
    parameters = target.parameters
    options = _mask_options(parameters, layer.sliding_window, layer.causal)
    if isinstance(options, str):
        return per_segment(options)
    head_dim, scaling = layer.head_dim, layer.scaling
    default_scale = head_dim**-0.5
    if "scale" in parameters:
        if scaling is not None or padded != head_dim:  # a padded query would change the default
            options["scale"] = layer.scale
    elif padded != head_dim:
        return per_segment(
            f"head dim {head_dim}, which the kernel takes only padded to {padded} (this torch's varlen_attn takes no "
            "`scale` to keep the unpadded one)"
        )
    elif scaling is not None and not math.isclose(scaling, default_scale):
        return per_segment(f"attention scale {scaling:g} (this torch's varlen_attn takes no `scale`)")
    if layer.heads != layer.kv_heads and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return VarlenKernelPlan(options, **fitted)


def _softcap_plan(layer: LayerCall, target: KernelTarget, padded: int, fitted: dict) -> VarlenKernelPlan:
    """Logit softcapping: flash-attn's varlen kernel where installed, else FlexAttention with a score_mod."""
    if layer.sinks is not None:
        return per_segment("attention sinks with logit softcapping (no fused kernel takes both)")
    window, causal = layer.sliding_window, layer.causal
    left = -1 if window is None else window - 1
    if target.fused.flash_attn_varlen is not None and padded <= target.limits.max_head_dim:
        window_size = (left, 0 if causal else -1)
        options = dict(softmax_scale=layer.scale, causal=causal, window_size=window_size, softcap=layer.softcap)
        return VarlenKernelPlan(options, kernel=FLASH_ATTN, **fitted)
    if target.fused.flex is not None:
        # FlexAttention takes any head dim and grouped heads; it needs one dtype, so only the cast applies
        options = dict(scale=layer.scale, causal=causal, sliding_window=window, softcap=layer.softcap)
        return VarlenKernelPlan(options, cast_to=fitted["cast_to"], kernel=FLEX)
    return per_segment(f"attention logit softcapping (no fused kernel here takes it: {SOFTCAP_WAY_OUT})")


def _wide_head_plan(layer: LayerCall, target: KernelTarget, fitted: dict) -> VarlenKernelPlan:
    """Head dims above Flash's 256: ATen's memory-efficient kernel, which takes any head dim (a multiple of 8)."""
    wide = f"head dim {max(layer.head_dim, layer.value_head_dim)}"
    if target.fused.efficient is None:
        return per_segment(f"{wide} (the Flash kernel takes at most 256, and this torch has no memory-efficient one)")
    if layer.sinks is not None:
        return per_segment(f"{wide} with attention sinks (no fused kernel takes both)")
    if layer.sliding_window is not None:
        return per_segment(f"{wide} with a sliding window (the memory-efficient kernel is called without one)")
    # custom_mask_type 2: causal from the bottom-right corner of each segment (aten/src/ATen/native/transformers/cuda/
    # mem_eff_attention/kernel_forward.h, `CausalFromBottomRight`), as flash aligns it; 0: no mask
    options = dict(custom_mask_type=2 if layer.causal else 0, scale=layer.scale)
    return VarlenKernelPlan(options, kernel=EFFICIENT, **fitted)


def _padding(head_dim: int, value_head_dim: int, padded: int) -> str | None:
    """What the call pads first, said for people; None when the head dims fit the kernel as they are."""
    if padded != head_dim:
        return f"head dims padded from {head_dim} to {padded}"
    if padded != value_head_dim:
        return f"the value padded from {value_head_dim} to the query's {padded}"
    return None


def _refusal(layer: LayerCall, target: KernelTarget) -> str | None:
    """Why no fused kernel computes this layer on this GPU, whatever torch release; None when one may."""
    limits = target.limits
    if tuple(target.capability) < limits.min_capability:
        major, minor = target.capability
        needed = ".".join(map(str, limits.min_capability))
        return f"a GPU of compute capability {major}.{minor} (the Flash kernel needs {needed} or newer)"
    if layer.dtype not in limits.dtypes:
        takes = "/".join(str(each).removeprefix("torch.") for each in limits.dtypes)
        return f"{layer.dtype} inputs (the kernel takes {takes}: {FLOAT32_WAY_OUT})"
    if layer.dropout > 0:
        return "attention dropout"
    if layer.heads % layer.kv_heads:
        return f"{layer.heads} query heads over {layer.kv_heads} key/value heads (the kernel needs a multiple)"
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
