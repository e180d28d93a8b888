"""Attention's kernels: torch's `varlen_attn` on its Flash backend, the fused kernels of the layers it cannot take
(ATen's memory-efficient kernel, flash-attn, FlexAttention), and which of them are in force (`STAND_INS_IN_FORCE`: the
real ones unless the architecture check's stand-in context, modeling/check/stand_ins.py, sets others)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ...integrations.torch import varlen_attn_backward_op
from . import log_once


@dataclass(frozen=True)
class FlashLimits:
    """What ATen's Flash kernel behind torch's `varlen_attn` refuses, which every call the plan makes stays within
    (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, `mha_varlen_fwd`; docs/concepts/kernels.md lists each
    check with its message). `varlen_attn` pads nothing: a head dim the kernel refuses is the caller's to pad."""

    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)  # and query, key, value of one dtype
    max_head_dim: int = 256  # of the query, key and value alike: the value's head dim must equal the query's
    head_dim_multiple: int = 8
    min_capability: tuple[int, int] = (8, 0)  # Ampere or newer


FLASH_LIMITS = FlashLimits()


@dataclass(frozen=True)
class VarlenKernel:
    """A `varlen_attn` to call: torch's, or a stand-in with the signature of some torch release, which refuses what the
    real one refuses (`limits`)."""

    function: Callable
    capability: tuple[int, int] | None = None  # of the GPU a stand-in plays; None: ask the device
    limits: FlashLimits = FLASH_LIMITS
    # `torch_attn::_varlen_attn_backward` (its schema), called by the sink correction (attention/sinks.py) with the
    # corrected output; None where this torch has none
    backward: Callable | None = None

    @functools.cached_property
    def parameters(self) -> frozenset[str]:
        # By name: torch releases differ in what `varlen_attn` takes (attention.plan.varlen_kernel_plan)
        return frozenset(inspect.signature(self.function).parameters)

    def device_capability(self, device: torch.device) -> tuple[int, int]:
        return self.capability if self.capability is not None else torch.cuda.get_device_capability(device)


@functools.cache
def torch_varlen_kernel() -> VarlenKernel:
    """torch's own `varlen_attn` (CUDA; its signature and limits are known on any machine)."""
    from torch.nn.attention.varlen import varlen_attn

    return VarlenKernel(varlen_attn, backward=varlen_attn_backward_op())


def varlen_kernel() -> VarlenKernel:
    """The `varlen_attn` packed attention calls on its CUDA branch: torch's, or the stand-in in force (read once per
    forward, by its `KernelSession`); counted inside `varlen_calls_counted`."""
    stand_ins = STAND_INS_IN_FORCE.get()
    kernel = stand_ins.varlen if stand_ins is not None and stand_ins.varlen is not None else torch_varlen_kernel()
    counter = _VARLEN_CALLS.get()
    return kernel if counter is None else dataclasses.replace(kernel, function=_counted(kernel.function, counter))


def _counted(function: Callable | None, counter: KernelCalls) -> Callable | None:
    if function is None:
        return None

    @functools.wraps(function)
    def counted(*args, **kwargs):
        counter.calls += 1
        return function(*args, **kwargs)

    return counted


@dataclass
class KernelCalls:
    calls: int = 0


_VARLEN_CALLS: contextvars.ContextVar[KernelCalls | None] = contextvars.ContextVar(
    "trl_padfree_varlen_calls", default=None
)


@contextlib.contextmanager
def varlen_calls_counted() -> Iterator[KernelCalls]:
    """Count the fused kernel calls (torch's varlen kernel and the others, `FusedKernels`) of the forwards that start
    inside the block (benchmarks and reports: a row that fell back says so). Each forward reads the kernels once, so
    counting adds no work per attention call."""
    counter = KernelCalls()
    token = _VARLEN_CALLS.set(counter)
    try:
        yield counter
    finally:
        _VARLEN_CALLS.reset(token)


@dataclass(frozen=True)
class FlexKernel:
    """torch's FlexAttention: `attention` (compiled, as its kernel needs) and `block_mask`
    (`BlockMask.from_kv_blocks`, which takes the tiles the row's boundaries give: attention.fused.DocumentTiles)."""

    attention: Callable
    block_mask: Callable


@dataclass(frozen=True)
class FusedKernels:
    """The kernels that compute a whole packed row for the layers torch's `varlen_attn` cannot (attention/plan.py
    chooses among them per layer); each None where this machine has none.

    efficient          ATen's memory-efficient kernel with `cu_seqlens` (`aten::_efficient_attention_forward`, the
                       varlen call under sdpa's nested tensors) as an op of our own with its backward
                       (integrations.torch.wide_head_attention_op): head dims above 256 (Gemma 4's global layers)
    flash_attn_varlen  flash-attn's `flash_attn_varlen_func` (2.6 or newer): logit softcapping (Gemma 2)
    flex               torch's FlexAttention over the row's document mask: softcapping where flash-attn is not
                       installed
    """

    efficient: Callable | None = None
    flash_attn_varlen: Callable | None = None
    flex: FlexKernel | None = None


@functools.cache
def installed_fused_kernels() -> FusedKernels:
    """The fused kernels this machine has: torch's own, and flash-attn's when a release that takes `softcap` is
    installed."""
    from torch.nn.attention.flex_attention import BlockMask

    from ...integrations.torch import compiled_flex_attention, efficient_attention_op, flash_attn_varlen_with_softcap

    return FusedKernels(
        efficient=efficient_attention_op(),
        flash_attn_varlen=flash_attn_varlen_with_softcap(),
        flex=FlexKernel(compiled_flex_attention(), BlockMask.from_kv_blocks),
    )


def fused_kernels() -> FusedKernels:
    """The fused kernels packed attention calls on its CUDA branch: this machine's, or the stand-ins in force (read
    once per forward, by its `KernelSession`); counted inside `varlen_calls_counted`."""
    stand_ins = STAND_INS_IN_FORCE.get()
    kernels = stand_ins.fused if stand_ins is not None else installed_fused_kernels()
    counter = _VARLEN_CALLS.get()
    if counter is None:
        return kernels
    flex = kernels.flex and dataclasses.replace(kernels.flex, attention=_counted(kernels.flex.attention, counter))
    return FusedKernels(_counted(kernels.efficient, counter), _counted(kernels.flash_attn_varlen, counter), flex)


def sdpa_function() -> Callable:
    """The `scaled_dot_product_attention` a segment runs on the CUDA branch: torch's, or the stand-in in force (which
    records the backend ATen would pick)."""
    stand_ins = STAND_INS_IN_FORCE.get()
    if stand_ins is not None and stand_ins.sdpa is not None:
        return stand_ins.sdpa
    return torch.nn.functional.scaled_dot_product_attention


@contextlib.contextmanager
def flash_backend() -> Iterator[None]:
    """Around a `varlen_attn` call: its Flash backend, chosen explicitly. torch >= 2.15 reads these flags (and would
    pick cuDNN first); earlier releases run Flash for causal attention whatever the flags say."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def user_backends() -> tuple:
    """The SDPA backends enabled now (the user's choice), to restore inside a forward that chose Flash."""
    from torch.nn.attention import SDPBackend

    enabled = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled(),
    }
    return tuple(backend for backend, on in enabled.items() if on)


VARLEN_BACKEND_MESSAGE = (
    f"`padfree_varlen` attention runs torch {torch.__version__}'s varlen attention kernel on its Flash backend, "
    "chosen explicitly (torch >= 2.15 would pick cuDNN for causal bf16/fp16 layers on SM90+; Flash is the backend the "
    "GPU tests cover)."
)


def log_varlen_backend() -> None:
    log_once(VARLEN_BACKEND_MESSAGE)  # formatted once, at import


def takes_cuda_branch(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor` takes the CUDA branch (kernels): on CUDA, or on CPU under `stand_in_kernels`."""
    return tensor.is_cuda or STAND_INS_IN_FORCE.get() is not None


# Makes a mixer kernel's stand-in from one model module's PyTorch fallbacks (by hub name), which compute the reference
StandInFactory = Callable[[dict[str, Callable]], Callable]


@dataclass(frozen=True)
class StandIns:
    varlen: VarlenKernel | None = None
    mixer_kernels: tuple[tuple[str, StandInFactory], ...] = ()
    fused: FusedKernels = FusedKernels()  # none unless given: the layers they would compute run per segment
    sdpa: Callable | None = None


STAND_INS_IN_FORCE: contextvars.ContextVar[StandIns | None] = contextvars.ContextVar(
    "trl_padfree_stand_ins", default=None
)


def branch_key() -> object:
    """What the kernels in force are, for caches of decisions that depend on them (the architecture check)."""
    return STAND_INS_IN_FORCE.get()
