"""A row's attention on its segments: torch's varlen kernel (`torch.nn.attention.varlen.varlen_attn`) on CUDA where it
can compute the layer, else the exact per-segment attention (segments.py).

How each layer calls the kernel is planned once per forward and layer signature (plan.py: the installed torch's
keywords, the kernel's limits, the dtype the layer computes in, value padding for multi-head latent attention). A layer
the kernel cannot compute (logit softcapping, attention sinks, dropout, a head dim above 256, float32 without autocast,
a GPU older than SM80) runs per segment, and says so once in an INFO line on this module's logger.

An attention call does its kernel and the reshapes around it, nothing more: what depends only on the forward (which
kernel is in force, each layer signature's plan, the GPU's capability, the Flash backend's flags) is decided once per
forward by its `KernelSession`, which the row carries (rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from ..backends import ATTN_IMPLEMENTATION
from ..kernels import VarlenKernel, flash_backend, log_varlen_backend, takes_cuda_branch, user_backends, varlen_kernel
from .plan import VarlenKernelPlan, kernel_dtype, varlen_kernel_plan
from .segments import per_segment_attention

logger = logging.getLogger(__name__)


@functools.cache
def _log_fallback_once(message: str) -> None:
    # Attention runs in every layer of every step: say once per process which layers run per segment, and why
    logger.info(message)


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

    def plan(self, query, key, value, module=None, **options) -> VarlenKernelPlan:
        """This layer's plan (plan.py), made at the first call of its signature in this forward."""
        signature = (query.dtype, key.dtype, value.dtype, query.shape[1], key.shape[1], query.shape[-1])
        signature += (value.shape[-1], options["scaling"], options["sliding_window"], options["dropout"])
        signature += (options.get("softcap"), options.get("sinks") is not None, options.get("causal", True))
        plan = self.plans.get(signature)
        if plan is None:
            kernel = self.kernel_in_force()
            if self.capability is None:
                self.capability = kernel.device_capability(query.device)
            plan = self.plans[signature] = layer_plan(kernel, self.capability, query, key, value, module, **options)
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


def layer_plan(
    kernel: VarlenKernel,
    capability: tuple[int, int],
    query,
    key,
    value,
    module=None,
    *,
    scaling,
    sliding_window,
    dropout,
    softcap=None,
    sinks=None,
    causal: bool = True,
    autocast: torch.dtype | None = None,
) -> VarlenKernelPlan:
    """The plan of an attention call with these inputs (`(1, heads, T, dim)`) and options, for `kernel` on a GPU of
    `capability`: what training runs (through `KernelSession`), and what the kernel coverage reports. `autocast`: the
    autocast dtype to plan for (default: the one in force on the query's device)."""
    dtypes = (query.dtype, key.dtype, value.dtype)
    autocast = autocast or autocast_dtype(query.device)
    return varlen_kernel_plan(
        kernel.parameters,
        dtype=kernel_dtype(dtypes, autocast, lambda: weights_dtype(module), kernel.limits),
        input_dtypes=dtypes,
        heads=query.shape[1],
        kv_heads=key.shape[1],
        head_dim=query.shape[-1],
        value_head_dim=value.shape[-1],
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks is not None,
        dropout=dropout,
        causal=causal,
        capability=capability,
        limits=kernel.limits,
    )


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


def torch_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    plan: VarlenKernelPlan,
    session: KernelSession,
) -> torch.Tensor:
    """PyTorch's varlen attention (CUDA) on its Flash backend, called as `plan` says. Inputs `(1, heads, T, dim)`;
    returns `(1, T_q, heads, value dim)` in the dtype the kernel computed in."""
    # Grouped key/value heads go in as they are on every release: 2.12+ takes `enable_gqa`, and 2.10-2.11's wrapper
    # hands them straight to ATen's Flash kernel, which shares divisible heads in its forward and sums their
    # gradients in its backward. Expanding them first would have the kernel save the expanded copies for the backward
    boundaries_q = _int32_on(cu_seq_lens_q, query.device)
    # Self-attention passes one tensor for both, as torch's kernels expect of it
    boundaries_k = boundaries_q if cu_seq_lens_k is cu_seq_lens_q else _int32_on(cu_seq_lens_k, query.device)
    with session.kernel_backend():
        output = session.kernel_in_force().function(
            _fitted(query, plan),
            _fitted(key, plan),
            _fitted(value, plan),
            boundaries_q,
            boundaries_k,
            max_length_q,
            max_length_k,
            **plan.options,
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
    """The CUDA kernel where it can compute this layer's attention, else the per-segment reference with the same
    semantics.

    `session`: the forward's (a call on its own gets one of its own); `bounds`: the query and key boundaries as host
    integers, when known (the per-segment path reads them from the tensors otherwise); `module`: the attention layer,
    whose weights' dtype the kernel computes in when its inputs are float32 outside autocast. `options`: `scaling`,
    `sliding_window`, `dropout`, and optionally `softcap`, `sinks`, `causal` (default True).
    """
    session = session or KernelSession()
    if session.takes_kernel(query):
        plan = session.plan(query, key, value, module, **options)
        if plan.fallback is None:
            if max_length_q is None:  # a direct call without the row's lengths: read them
                max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
                max_length_k = int((cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).max())
            return torch_varlen_attention(
                query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, plan, session
            )
    with session.segment_backends():
        return per_segment_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, bounds=bounds, **options)
