"""The CUDA kernels that keep a packed row's sequences apart, each chosen explicitly and logged, and how tests run
those branches on a machine without CUDA.

Two kinds of kernels run a whole packed row on CUDA:

- attention: torch's `varlen_attn` (`padfree_varlen`, attention.py). torch 2.15 picks its backend itself, cuDNN
  before Flash for causal self-attention (SM90+, bf16/fp16, head dim <= 128, grouped heads too), and honours
  `sdpa_kernel`'s backend flags ("No viable backend" when the one it picks is disabled). Every call here runs on the
  Flash backend, chosen with `sdpa_kernel`: the one the GPU tests cover, whatever backends the user disabled. Flash
  needs SM80 or newer; older GPUs run the exact per-segment attention instead.
- stateful mixers of hybrid models (mixers.py): the functions transformers resolves when it imports a model's module
  (causal-conv1d, flash-linear-attention, mamba-ssm, or its own PyTorch fallbacks). A mixer runs its whole row through
  them only when every such function its forward calls takes the argument that keeps sequences apart (`seq_idx`,
  `cu_seqlens`), read from the resolved function itself: a function that swallows keywords (`**kwargs`), or
  transformers' PyTorch fallback, runs the mixer once per sequence instead.

Both choices are logged once per process (INFO, `trl_padfree.modeling.kernels`).

`stand_in_kernels(...)` makes the packed forward take its CUDA branches on CPU tensors, with stand-in functions of the
kernels' real signatures in place of the real ones, refusing what they refuse (tests/stand_in_kernels.py): so the
branches that only run on a GPU are exercised by the CPU test suite against the kernels' real limits. The architecture
check's twin runs on the CPU path even then, as beside a real GPU (`cpu_twin_kernels`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .._compat import moved_seam_warning
from ..integrations.torch import varlen_attn_backward_op
from ..integrations.transformers import (
    KernelWrapper,
    kernel_names_called,
    kernel_wrappers_called,
    kernel_wrappers_replaced,
)

logger = logging.getLogger(__name__)


@functools.cache
def log_once(message: str, level: int = logging.INFO) -> None:
    # Kernels run in every layer of every step: say which one runs once per process, not per call
    logger.log(level, message)


# ---- attention: torch's varlen kernel ----


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
    stand_ins = _STAND_INS.get()
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


# ---- attention: the fused kernels for what torch's varlen kernel cannot compute ----


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

    from ..integrations.torch import compiled_flex_attention, efficient_attention_op, flash_attn_varlen_with_softcap

    return FusedKernels(
        efficient=efficient_attention_op(),
        flash_attn_varlen=flash_attn_varlen_with_softcap(),
        flex=FlexKernel(compiled_flex_attention(), BlockMask.from_kv_blocks),
    )


def fused_kernels() -> FusedKernels:
    """The fused kernels packed attention calls on its CUDA branch: this machine's, or the stand-ins in force (read
    once per forward, by its `KernelSession`); counted inside `varlen_calls_counted`."""
    stand_ins = _STAND_INS.get()
    kernels = stand_ins.fused if stand_ins is not None else installed_fused_kernels()
    counter = _VARLEN_CALLS.get()
    if counter is None:
        return kernels
    flex = kernels.flex and dataclasses.replace(kernels.flex, attention=_counted(kernels.flex.attention, counter))
    return FusedKernels(_counted(kernels.efficient, counter), _counted(kernels.flash_attn_varlen, counter), flex)


def sdpa_function() -> Callable:
    """The `scaled_dot_product_attention` a segment runs on the CUDA branch: torch's, or the stand-in in force (which
    records the backend ATen would pick)."""
    stand_ins = _STAND_INS.get()
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


# ---- which branch a tensor takes ----


def takes_cuda_branch(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor` takes the CUDA branch (kernels): on CUDA, or on CPU under `stand_in_kernels`."""
    return tensor.is_cuda or _STAND_INS.get() is not None


# ---- stateful mixers: the whole-row kernels transformers resolved ----

# The mixer kernels that run a whole row, by the name transformers' kernel hub gives them, and the argument each needs
# to keep the row's sequences apart. Kernels that only decode with a cache are not listed: a packed forward has none.
BOUNDARY_ARGUMENTS = {
    "causal_conv1d_fn": "seq_idx",
    "chunk_gated_delta_rule": "cu_seqlens",
    "mamba_chunk_scan_combined": "seq_idx",
    "mamba_split_conv1d_scan_combined": "seq_idx",
}
DECODE_ONLY_KERNELS = frozenset({"causal_conv1d_update", "fused_recurrent_gated_delta_rule", "selective_state_update"})
# pip distributions of the kernels' import packages, for advice
DISTRIBUTIONS = {"causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm"}


@dataclass(frozen=True)
class ResolvedKernel:
    """One kernel function a mixer's forward calls, as transformers resolved it when it imported the model."""

    wrapper: KernelWrapper

    @property
    def name(self) -> str:
        return self.wrapper.name  # transformers' kernel-hub name (`causal_conv1d_fn`, ...)

    @property
    def boundary(self) -> str | None:
        return BOUNDARY_ARGUMENTS.get(self.name)

    @property
    def takes_boundary(self) -> bool:
        """Whether the implementation names its boundary argument: a function that only swallows extra keywords
        (`**kwargs`) would get it and ignore it, and transformers filters keywords by the implementation's names."""
        if self.boundary is None:
            return False
        try:
            return self.boundary in inspect.signature(self.wrapper.implementation).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            return False

    @property
    def described(self) -> str:
        implementation = self.wrapper.implementation
        where = getattr(implementation, "__module__", None) or self.wrapper.package
        return f"`{self.name}` ({where}.{getattr(implementation, '__qualname__', '?')})"

    @property
    def distribution(self) -> str:
        return DISTRIBUTIONS.get(self.wrapper.package, self.wrapper.package)


@dataclass(frozen=True)
class MixerKernels:
    """Whether a mixer class runs its whole packed row through its kernels, decided from what they accept."""

    mixer_class: str
    kernels: tuple[ResolvedKernel, ...]
    whole_row: bool
    reason: str
    # Set where a transformers release moved what trl-padfree reads of the kernels: the run is exact, only slower,
    # and says so at WARNING level
    moved_seam: bool = False

    def describe(self) -> str:
        if self.moved_seam:
            return self.reason
        if self.whole_row:
            return f"{self.mixer_class} layers run the whole packed row through their kernels ({self.reason})."
        return (
            f"{self.mixer_class} layers run once per sequence of the packed row, state starting fresh ({self.reason})."
        )

    def log(self) -> None:
        log_once(self.describe(), logging.WARNING if self.moved_seam else logging.INFO)


def mixer_kernels(mixer_class: type) -> MixerKernels:
    """The kernels `mixer_class.forward` calls and whether they can run a whole packed row, read from the functions
    transformers resolved (so from the stand-ins under `stand_in_kernels`)."""
    kernels = kernel_functions_called(mixer_class)
    unread = sorted(set(BOUNDARY_ARGUMENTS) & kernel_names_called(mixer_class) - {kernel.name for kernel in kernels})
    # The forward reaches a kernel that takes boundaries, but not through a wrapper laid out as the tested releases did
    if unread:
        names = ", ".join(f"`{name}`" for name in unread)
        lost = (
            f"{mixer_class.__name__} layers run once per sequence of the packed row (exact, but slower than one "
            "kernel call on the whole row)."
        )
        return MixerKernels(
            mixer_class.__name__, kernels, False, moved_seam_warning(f"the kernels {names} are wrapped", lost), True
        )
    return _decide(mixer_class.__name__, kernels)


def _decide(mixer_class: str, kernels: tuple[ResolvedKernel, ...]) -> MixerKernels:
    row_kernels = [kernel for kernel in kernels if kernel.name not in DECODE_ONLY_KERNELS]

    def per_segment(reason: str) -> MixerKernels:
        return MixerKernels(mixer_class, kernels, False, reason)

    if not row_kernels:
        return per_segment("its forward calls no kernel that takes sequence boundaries")
    unknown = [kernel.name for kernel in row_kernels if kernel.boundary is None]
    if unknown:
        return per_segment(f"trl-padfree does not know how {', '.join(unknown)} keeps sequences apart")
    fallbacks = [kernel for kernel in row_kernels if not kernel.wrapper.runs_on("cuda")]
    if fallbacks:
        missing = sorted({kernel.distribution for kernel in fallbacks})
        return per_segment(f"transformers runs its PyTorch fallbacks; install {', '.join(missing)} for the kernels")
    refusing = [kernel for kernel in row_kernels if not kernel.takes_boundary]
    if refusing:
        return per_segment("; ".join(f"{kernel.described} takes no `{kernel.boundary}`" for kernel in refusing))
    taken = ", ".join(f"{kernel.described} given `{kernel.boundary}`" for kernel in row_kernels)
    return MixerKernels(mixer_class, kernels, True, taken)


def kernel_functions_called(mixer_class: type) -> tuple[ResolvedKernel, ...]:
    """The transformers kernel functions (module-level names wrapped by its kernel hub) that `mixer_class.forward`
    calls, resolved."""
    return tuple(ResolvedKernel(wrapper) for wrapper in kernel_wrappers_called(mixer_class))


@contextlib.contextmanager
def cpu_twin_kernels() -> Iterator[None]:
    """What work on CPU tensors runs on a GPU machine (the architecture check's twin): transformers' own PyTorch
    fallbacks in place of every mixer kernel a package provides (a kernel installed for the GPU would be handed CPU
    tensors), and no CUDA branch. Under `stand_in_kernels` too: the stand-ins play a GPU's kernels, which refuse what
    a float64 twin hands them, so the twin runs there as it runs beside a real GPU."""

    def fallback(wrapper: KernelWrapper, fallbacks: dict[str, Callable]) -> Callable | None:
        return None if wrapper.is_fallback else fallbacks[wrapper.name]

    token = _STAND_INS.set(None)
    try:
        with kernel_wrappers_replaced(fallback):
            yield
    finally:
        _STAND_INS.reset(token)


# causal-conv1d's widths (csrc/causal_conv1d.cpp, `causal_conv1d_fwd`: "causal_conv1d only supports width between 2
# and 4"), which mamba-ssm's fused split-conv-scan inherits
CONV_KERNEL_WIDTHS = (2, 4)
CONV_KERNELS = ("causal_conv1d_fn", "mamba_split_conv1d_scan_combined")


def conv_kernel_refusing(mixer_class: type, width: int) -> ResolvedKernel | None:
    """The convolution kernel `mixer_class.forward` calls, as resolved, when it refuses a convolution of `width`
    (transformers' PyTorch fallbacks take any width)."""
    low, high = CONV_KERNEL_WIDTHS
    if low <= width <= high:
        return None
    return next(
        (
            kernel
            for kernel in kernel_functions_called(mixer_class)
            if kernel.name in CONV_KERNELS and kernel.wrapper.runs_on("cuda")
        ),
        None,
    )


# ---- stand-ins ----


# Makes a mixer kernel's stand-in from one model module's PyTorch fallbacks (by hub name), which compute the reference
StandInFactory = Callable[[dict[str, Callable]], Callable]


@dataclass(frozen=True)
class StandIns:
    varlen: VarlenKernel | None = None
    mixer_kernels: tuple[tuple[str, StandInFactory], ...] = ()
    fused: FusedKernels = FusedKernels()  # none unless given: the layers they would compute run per segment
    sdpa: Callable | None = None


_STAND_INS: contextvars.ContextVar[StandIns | None] = contextvars.ContextVar("trl_padfree_stand_ins", default=None)


def branch_key() -> object:
    """What the kernels in force are, for caches of decisions that depend on them (the architecture check)."""
    return _STAND_INS.get()


@contextlib.contextmanager
def stand_in_kernels(
    varlen: VarlenKernel | None = None,
    mixer_kernels: dict[str, StandInFactory] | None = None,
    fused: FusedKernels | None = None,
    sdpa: Callable | None = None,
):
    """Run the packed forward's CUDA branches on CPU tensors, with stand-ins in place of the CUDA kernels: `varlen`
    for torch's `varlen_attn`, `fused` for the kernels of the layers it cannot compute (none given: those layers run
    per segment), `sdpa` for `scaled_dot_product_attention` on a segment, and for each mixer kernel named in
    `mixer_kernels` (by transformers' kernel-hub name, e.g. `causal_conv1d_fn`), the function its factory makes from
    each imported transformers model module's PyTorch fallbacks, which that module's kernel wrapper then resolves to.
    Build the models (import their modules) before entering. For tests: the stand-ins compute the reference result
    and record what they were given."""
    mixer_kernels = mixer_kernels or {}
    unknown = set(mixer_kernels) - set(BOUNDARY_ARGUMENTS) - DECODE_ONLY_KERNELS
    if unknown:
        raise ValueError(f"No transformers mixer kernel is named {sorted(unknown)}.")
    token = _STAND_INS.set(StandIns(varlen, tuple(sorted(mixer_kernels.items())), fused or FusedKernels(), sdpa))

    def stand_in(wrapper: KernelWrapper, fallbacks: dict[str, Callable]) -> Callable | None:
        factory = mixer_kernels.get(wrapper.name)
        return None if factory is None else factory(fallbacks)

    try:
        with kernel_wrappers_replaced(stand_in):
            yield
    finally:
        _STAND_INS.reset(token)
