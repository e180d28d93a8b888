"""A row's attention on its segments: on CUDA, one fused kernel call over the whole row where a kernel can compute
the layer (plan.py chooses: torch's varlen kernel, with the sink correction for attention sinks; flash-attn or
FlexAttention for softcapping; the memory-efficient kernel for head dims above 256; fused.py), else the exact
per-segment attention (segments.py).

How each layer calls its kernel is planned once per forward and `LayerCall` (plan.py: the installed torch's keywords,
the kernels' limits, the dtype the layer computes in, value padding for multi-head latent attention). A layer
no kernel can compute (float32 without autocast, dropout, a GPU older than SM80, a fused kernel this machine lacks)
runs per segment, and says so once in an INFO line on this module's logger; the kernel a layer takes is logged once
too.

An attention call does its kernel and the reshapes around it, nothing more: what depends only on the forward (which
kernels are in force, each layer call's plan, the GPU's capability, the Flash backend's flags, FlexAttention's
block masks) is decided once per forward by its `KernelSession`, which the row carries (rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backends import ATTN_IMPLEMENTATION
from ..kernels import log_once
from ..kernels.attention import (
    FusedKernels,
    VarlenKernel,
    flash_backend,
    fused_kernels,
    log_varlen_backend,
    sdpa_function,
    takes_cuda_branch,
    user_backends,
    varlen_kernel,
)
from . import fused
from .plan import (
    EFFICIENT,
    FLASH_ATTN,
    FLEX,
    KERNEL_NAMES,
    VARLEN,
    VARLEN_SINKS,
    KernelTarget,
    LayerCall,
    VarlenKernelPlan,
    autocast_dtype,
    varlen_kernel_plan,
)
from .segments import per_segment_attention
from .sinks import varlen_with_sinks

logger = logging.getLogger(__name__)


@functools.cache
def _log_fallback_once(message: str) -> None:
    # Attention runs in every layer of every step: say once per process which layers run per segment, and why
    logger.info(message)


class KernelSession:
    """What the attention calls of one forward share, decided at its first call: whether the CUDA branch runs, the
    kernels in force and the GPU (`target`), the plan of each layer call, and whether the Flash backend is already
    chosen around the forward (`flash_chosen`, with the user's backends to restore for layers that run per segment)."""

    def __init__(self):
        self.cuda_branch: bool | None = None
        self.kernel: VarlenKernel | None = None
        self.fused: FusedKernels | None = None
        self.target: KernelTarget | None = None
        self.plans: dict[LayerCall, VarlenKernelPlan] = {}
        self.block_masks: dict[tuple, object] = {}  # FlexAttention's, per row boundaries, window and causality
        self.flash_chosen = False
        self.user_backends: tuple | None = None

    def takes_kernel(self, query: torch.Tensor) -> bool:
        if self.cuda_branch is None:
            self.cuda_branch = takes_cuda_branch(query)
        return self.cuda_branch

    def kernel_in_force(self) -> VarlenKernel:
        if self.kernel is None:
            self.kernel = varlen_kernel()
        return self.kernel

    def fused_in_force(self) -> FusedKernels:
        if self.fused is None:
            self.fused = fused_kernels()
        return self.fused

    def block_mask(self, bounds, sliding_window, causal, device):
        """FlexAttention's block mask of this row (its query and key boundaries as host integers), made once per
        forward for each window and causality."""
        key = (id(bounds[0]), id(bounds[1]), sliding_window, causal)
        if key not in self.block_masks:
            build = self.fused_in_force().flex.block_mask
            self.block_masks[key] = fused.document_block_mask(build, *bounds, sliding_window, causal, device)
        return self.block_masks[key]

    def plan(self, query, key, value, module=None, **options) -> VarlenKernelPlan:
        """This layer's plan (plan.py), made at the first call of its `LayerCall` in this forward."""
        kernel = self.kernel_in_force()
        layer = LayerCall.of(
            query, key, value, module, options, autocast=autocast_dtype(query.device), limits=kernel.limits
        )
        plan = self.plans.get(layer)
        if plan is None:
            if self.target is None:
                self.target = KernelTarget.of(kernel, kernel.device_capability(query.device), self.fused_in_force())
            plan = self.plans[layer] = varlen_kernel_plan(layer, self.target)
            if plan.kernel in (VARLEN, VARLEN_SINKS):
                log_varlen_backend()
            if plan.kernel is not None:
                log_once(f"`{ATTN_IMPLEMENTATION}` attention runs layers on {KERNEL_NAMES[plan.kernel]}.")
            else:
                _log_fallback_once(
                    f"`{ATTN_IMPLEMENTATION}` attention runs exact per-segment attention on CUDA, not torch's varlen "
                    f"kernel, for layers with {plan.fallback}."
                )
        return plan

    @contextlib.contextmanager
    def flash_around_forward(self, query_like: torch.Tensor):
        """Around a text row's forward: the Flash backend chosen once, not per call (flags restored after)."""
        if not self.takes_kernel(query_like):
            yield
            return
        self.user_backends = user_backends()
        with flash_backend():
            self.flash_chosen = True
            try:
                yield
            finally:
                self.flash_chosen = False

    def kernel_backend(self):
        return contextlib.nullcontext() if self.flash_chosen else flash_backend()

    def segment_backends(self):
        """For per-segment attention inside a forward that chose Flash: the user's own backends back."""
        if not self.flash_chosen:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(list(self.user_backends))


def _int32_on(boundaries: torch.Tensor, device: torch.device) -> torch.Tensor:
    # The rows' boundaries are int32 on the device already: no copy, no kernel
    if boundaries.dtype == torch.int32 and boundaries.device == device:
        return boundaries
    return boundaries.to(device=device, dtype=torch.int32)


def _fitted(tensor: torch.Tensor, plan: VarlenKernelPlan) -> torch.Tensor:
    """`(1, heads, T, dim)` -> `(T, heads, dim)` as the plan has the kernel take it: cast, padded."""
    if plan.cast_to is not None:
        tensor = tensor.to(plan.cast_to)
    if plan.padded_head_dim is not None and tensor.shape[-1] != plan.padded_head_dim:
        tensor = F.pad(tensor, (0, plan.padded_head_dim - tensor.shape[-1]))
    return tensor[0].transpose(0, 1)


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: tuple[torch.Tensor, torch.Tensor],
    max_lengths: tuple[int, int],
    plan: VarlenKernelPlan,
    session: KernelSession,
    bounds: tuple[Sequence[int], Sequence[int]] | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The row's attention in one call of the kernel `plan` chose (plan.py). Inputs `(1, heads, T, dim)`; returns
    `(1, T_q, heads, value dim)` in the dtype the kernel computed in."""
    if plan.kernel == FLEX:
        bounds = bounds or (boundaries[0].tolist(), boundaries[1].tolist())
        options = plan.options
        mask = session.block_mask(bounds, options["sliding_window"], options["causal"], query.device)
        cast = (lambda tensor: tensor) if plan.cast_to is None else (lambda tensor: tensor.to(plan.cast_to))
        score_mod = fused.softcap_score_mod(options["softcap"], query.device)
        flex = session.fused_in_force().flex.attention
        return fused.flex_softcap(cast(query), cast(key), cast(value), mask, score_mod, flex, options)
    query_in, key_in, value_in = (_fitted(tensor, plan) for tensor in (query, key, value))
    if plan.kernel == VARLEN:
        with session.kernel_backend():
            function = session.kernel_in_force().function
            output = function(query_in, key_in, value_in, *boundaries, *max_lengths, **plan.options)
    elif plan.kernel == VARLEN_SINKS:
        with session.kernel_backend():
            kernel = session.kernel_in_force()
            output = varlen_with_sinks(
                query_in, key_in, value_in, sinks, boundaries, max_lengths, kernel, plan.options
            )
    elif plan.kernel == FLASH_ATTN:
        function = session.fused_in_force().flash_attn_varlen
        output = fused.flash_attn_softcap(query_in, key_in, value_in, boundaries, max_lengths, function, plan.options)
    else:
        assert plan.kernel == EFFICIENT, plan.kernel
        function = session.fused_in_force().efficient
        output = fused.efficient_wide_heads(
            query_in, key_in, value_in, boundaries, max_lengths, function, plan.options
        )
    if plan.value_head_dim is not None:  # the value was padded: its zeros' output cropped
        output = output[..., : plan.value_head_dim]
    return output.unsqueeze(0)


def varlen_attention(
    query,
    key,
    value,
    cu_seq_lens_q,
    cu_seq_lens_k,
    max_length_q,
    max_length_k,
    *,
    session: KernelSession | None = None,
    bounds: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    module: torch.nn.Module | None = None,
    **options,
):
    """A fused kernel where one can compute this layer's attention on the whole row, else the per-segment reference
    with the same semantics.

    `session`: the forward's (a call on its own gets one of its own); `bounds`: the query and key boundaries as host
    integers, when known (the per-segment path and FlexAttention's mask read them from the tensors otherwise);
    `module`: the attention layer, whose weights' dtype the kernel computes in when its inputs are float32 outside
    autocast. `options`: `scaling`, `sliding_window`, `dropout`, and optionally `softcap`, `sinks`, `causal`
    (default True).
    """
    session = session or KernelSession()
    if session.takes_kernel(query):
        plan = session.plan(query, key, value, module, **options)
        if plan.fallback is None:
            if max_length_q is None:  # a direct call without the row's lengths: read them
                max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
                max_length_k = int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max())
            boundaries_q = _int32_on(cu_seq_lens_q, query.device)
            # Self-attention passes one tensor for both, as torch's kernels expect of it
            boundaries_k = boundaries_q if cu_seq_lens_k is cu_seq_lens_q else _int32_on(cu_seq_lens_k, query.device)
            return fused_attention(
                query, key, value, (boundaries_q, boundaries_k), (max_length_q, max_length_k), plan, session, bounds,
                options.get("sinks"),
            )  # fmt: skip
        with session.segment_backends():
            return per_segment_attention(
                query, key, value, cu_seq_lens_q, cu_seq_lens_k, bounds=bounds, sdpa=sdpa_function(), **options
            )
    return per_segment_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, bounds=bounds, **options)
