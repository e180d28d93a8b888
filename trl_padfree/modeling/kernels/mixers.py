"""Stateful mixers' kernels: the whole-row functions transformers resolved for a hybrid model's mixers, and whether
each keeps a packed row's sequences apart (the argument it takes for their boundaries)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

from ..._compat import moved_seam_warning
from ...integrations.transformers import KernelWrapper, kernel_names_called, kernel_wrappers_called
from . import log_once

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
