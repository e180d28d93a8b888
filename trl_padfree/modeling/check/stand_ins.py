"""The stand-in context: the packed forward's CUDA branches run on CPU tensors with stand-in kernels
(`stand_in_kernels`, for tests), and the architecture check's twin on the CPU path whatever is in force
(`cpu_twin_kernels`). It sets which kernels are in force (`kernels.attention.STAND_INS_IN_FORCE`) and which functions
transformers' mixer kernel wrappers resolve to."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ...integrations.transformers import KernelWrapper, kernel_wrappers_replaced
from ..kernels.attention import STAND_INS_IN_FORCE, FusedKernels, StandInFactory, StandIns, VarlenKernel
from ..kernels.mixers import BOUNDARY_ARGUMENTS, DECODE_ONLY_KERNELS


@contextlib.contextmanager
def cpu_twin_kernels() -> Iterator[None]:
    """What work on CPU tensors runs on a GPU machine (the architecture check's twin): transformers' own PyTorch
    fallbacks in place of every mixer kernel a package provides (a kernel installed for the GPU would be handed CPU
    tensors), and no CUDA branch. Under `stand_in_kernels` too: the stand-ins play a GPU's kernels, which refuse what
    a float64 twin hands them, so the twin runs there as it runs beside a real GPU."""

    def fallback(wrapper: KernelWrapper, fallbacks: dict[str, Callable]) -> Callable | None:
        return None if wrapper.is_fallback else fallbacks[wrapper.name]

    token = STAND_INS_IN_FORCE.set(None)
    try:
        with kernel_wrappers_replaced(fallback):
            yield
    finally:
        STAND_INS_IN_FORCE.reset(token)


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
    token = STAND_INS_IN_FORCE.set(
        StandIns(varlen, tuple(sorted(mixer_kernels.items())), fused or FusedKernels(), sdpa)
    )

    def stand_in(wrapper: KernelWrapper, fallbacks: dict[str, Callable]) -> Callable | None:
        factory = mixer_kernels.get(wrapper.name)
        return None if factory is None else factory(fallbacks)

    try:
        with kernel_wrappers_replaced(stand_in):
            yield
    finally:
        STAND_INS_IN_FORCE.reset(token)
