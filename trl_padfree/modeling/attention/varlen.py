"""A row's attention on its segments: torch's varlen kernel (`torch.nn.attention.varlen.varlen_attn`) on CUDA where it
can compute the layer, else the exact per-segment attention (segments.py).

The kernel's keyword arguments differ between torch releases: `varlen_kernel_plan` reads what the installed one (or a
stand-in, modeling/kernels.py) accepts. A layer it cannot compute (logit softcapping, attention sinks, dropout, a
sliding window or custom scale the installed torch cannot pass, fp32, a GPU older than SM80) runs per segment, and
says so once in an INFO line on this module's logger.

An attention call does its kernel and the reshapes around it, nothing more: what depends only on the forward (which
kernel is in force, each layer signature's plan, the GPU's capability, the Flash backend's flags) is decided once per
forward by its `KernelSession`, which the row carries (rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends import ATTN_IMPLEMENTATION
from ..kernels import (
    FLASH_MIN_CAPABILITY,
    VARLEN_DTYPES,
    VarlenKernel,
    flash_backend,
    log_varlen_backend,
    takes_cuda_branch,
    user_backends,
    varlen_kernel,
)
from .segments import per_segment_attention

logger = logging.getLogger(__name__)


@functools.cache
def _log_fallback_once(message: str) -> None:
    # Attention runs in every layer of every step: say once per process which layers run per segment, and why
    logger.info(message)


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


class KernelSession:
    """What the attention calls of one forward share, decided at its first call: whether the CUDA branch runs, the
    kernel in force, its plan for each layer signature, and whether the Flash backend is already chosen around the
    forward (`flash_chosen`, with the user's backends to restore for layers that run per segment)."""

    def __init__(self):
        self.cuda_branch: bool | None = None
        self.kernel: VarlenKernel | None = None
        self.capability: tuple[int, int] | None = None
        self.plans: dict[tuple, VarlenKernelPlan] = {}
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

    def plan(self, query, key, scaling, sliding_window, dropout, softcap=None, sinks=None) -> VarlenKernelPlan:
        signature = (query.dtype, query.shape[1], key.shape[1], query.shape[-1], scaling, sliding_window, dropout)
        signature += (softcap, sinks is not None)
        plan = self.plans.get(signature)
        if plan is None:
            if self.capability is None:
                self.capability = self.kernel_in_force().device_capability(query.device)
            plan = self.plans[signature] = varlen_kernel_plan(
                self.kernel.parameters,
                dtype=query.dtype,
                grouped=query.shape[1] != key.shape[1],
                head_dim=query.shape[-1],
                scaling=scaling,
                sliding_window=sliding_window,
                softcap=softcap,
                sinks=sinks is not None,
                dropout=dropout,
                dtypes=self.kernel.dtypes,
                capability=self.capability,
            )
            if plan.fallback is None:
                log_varlen_backend()
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
    session: KernelSession | None = None,
) -> torch.Tensor:
    """PyTorch's varlen attention (CUDA) on its Flash backend, called as the installed torch accepts. Inputs
    `(1, heads, T, dim)`; returns `(1, T_q, heads, dim)`."""
    session = session or KernelSession()
    plan = session.plan(query, key, scaling, sliding_window, dropout=0.0)
    if plan.fallback is not None:
        raise ValueError(f"torch's varlen_attn cannot compute this attention: {plan.fallback}.")
    if plan.expand_heads:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    boundaries_q = _int32_on(cu_seq_lens_q, query.device)
    # Self-attention passes one tensor for both, as torch's kernels expect of it
    boundaries_k = boundaries_q if cu_seq_lens_k is cu_seq_lens_q else _int32_on(cu_seq_lens_k, query.device)
    with session.kernel_backend():
        output = session.kernel_in_force().function(
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
    **options,
):
    """The CUDA kernel where it can compute this layer's attention, else the per-segment reference with the same
    semantics (which skips `skip_segments`; one kernel call computes them at little extra cost).

    `session`: the forward's (a call on its own gets one of its own); `bounds`: the query and key boundaries as host
    integers, when known (the per-segment path reads them from the tensors otherwise). `options`: `scaling`,
    `sliding_window`, `dropout`, and optionally `softcap`, `sinks`, `skip_segments`.
    """
    skip_segments = options.pop("skip_segments", frozenset())
    session = session or KernelSession()
    if session.takes_kernel(query):
        plan = session.plan(query, key, **options)
        if plan.fallback is None:
            if max_length_q is None:  # a direct call without the row's lengths: read them
                max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
                max_length_k = int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max())
            return torch_varlen_attention(
                query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                scaling=options["scaling"], sliding_window=options["sliding_window"], session=session,
            )  # fmt: skip
    with session.segment_backends():
        return per_segment_attention(
            query, key, value, cu_seq_lens_q, cu_seq_lens_k, skip_segments=skip_segments, bounds=bounds, **options
        )
