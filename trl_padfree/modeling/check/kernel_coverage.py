"""Which fused kernel computes each attention layer of an architecture on a GPU, and why the rest cannot.

The architecture check's twin (twin.py) shrinks every head dim to 8, which every kernel takes; the kernels' limits
depend on the real ones: Gemma 4's 512-wide global layers exceed the Flash kernel's 256 (the memory-efficient kernel
takes them), and multi-head latent attention hands it a value narrower than its query (128 against 192). So the
coverage builds a second twin at the real head dims (`real_head_dims`), runs one packed forward of the check's row,
and plans every attention call as training plans it (`attention.plan.varlen_kernel_plan`) in TRL's default precision
(float32 weights under bf16 autocast) for the installed torch's `varlen_attn` and this machine's fused kernels on an
SM80+ GPU. The forward itself runs the CPU path in float32 (bf16 matmuls are slow on most CPUs); the plan is what a GPU
runs. The test suite runs the same twins under bf16 autocast through strict stand-ins of the kernels
(tests/modeling/test_kernel_coverage.py, tests/modeling/attention/test_fused_kernels.py), so a layer planned onto a kernel is one it takes.

    Gemma 4 (30 layers)   30 of 30 attention layers on a fused kernel in bf16 (25 torch's varlen kernel;
                          5 torch's memory-efficient kernel)
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from ...integrations.transformers import attention_calls_observed
from ..attention.interface import padfree_varlen_attention
from ..attention.plan import KERNEL_NAMES, KernelTarget, LayerCall, VarlenKernelPlan, varlen_kernel_plan
from ..backends import ATTN_IMPLEMENTATION
from ..kernels.attention import FusedKernels, VarlenKernel, installed_fused_kernels, torch_varlen_kernel
from .packability import CHECK_PAIRS, check_row
from .stand_ins import cpu_twin_kernels
from .twin import architecture_signature, build_twin, one_thread

# TRL's default precision: float32 weights (its model loading default) under its `bf16=True` autocast
COVERAGE_WEIGHTS = torch.float32
COVERAGE_AUTOCAST = torch.bfloat16
# The GPU planned for: any of SM80 or newer plans alike (an H100 here)
COVERAGE_CAPABILITY = (9, 0)
_ATTENTION_SIGNATURE = inspect.signature(padfree_varlen_attention)


@dataclass(frozen=True)
class KernelCoverage:
    """How one forward's attention calls (one per attention layer) run on a GPU."""

    layers: int
    on_kernel: int
    padded: tuple[tuple[str, int], ...] = ()  # of those on a kernel, (what was padded first, layers)
    per_segment: tuple[tuple[str, int], ...] = ()  # (why, layers), most first
    error: str | None = None
    kernels: tuple[tuple[str, int], ...] = ()  # (kernel, layers) of those on one, most first

    @classmethod
    def of_plans(cls, plans: list[VarlenKernelPlan]) -> KernelCoverage:
        on_kernel = [plan for plan in plans if plan.on_kernel]
        padded = Counter(plan.padding for plan in on_kernel if plan.padding is not None)
        fallbacks = Counter(plan.fallback for plan in plans if not plan.on_kernel)
        kernels = Counter(plan.kernel for plan in on_kernel)
        return cls(
            len(plans),
            len(on_kernel),
            tuple(padded.most_common()),
            tuple(fallbacks.most_common()),
            kernels=tuple(kernels.most_common()),
        )

    @property
    def cell(self) -> str:
        """The models table's cell: layers on a fused kernel of all attention layers."""
        if self.error is not None:
            return "?"
        return f"{self.on_kernel}/{self.layers}" if self.layers else "-"

    def describe(self) -> str:
        if self.error is not None:
            return f"not planned: its twin at the real head dims failed ({self.error})"
        if not self.layers:
            return "no attention layer runs through padfree_varlen"
        text = f"{self.on_kernel} of {self.layers} attention layers on a fused kernel in bf16"
        if self.kernels:
            text += " (" + "; ".join(f"{count} {KERNEL_NAMES[kernel]}" for kernel, count in self.kernels) + ")"
        if self.padded:
            text += "; " + "; ".join(f"{count} with {what}" for what, count in self.padded)
        if self.per_segment:
            text += "; per segment: " + "; ".join(f"{count} with {why}" for why, count in self.per_segment)
        return text


_COVERAGE: dict[str, KernelCoverage] = {}


def kernel_coverage(
    model_class: type,
    config: PretrainedConfig,
    kernel: VarlenKernel | None = None,
    fused: FusedKernels | None = None,
) -> KernelCoverage:
    """The kernel coverage of `model_class` built from `config` on `padfree_varlen` (see module docstring), for
    `kernel` and the `fused` kernels (default: the installed torch's `varlen_attn` and this machine's); cached per
    architecture for those."""
    installed = kernel is None and fused is None
    kernel = kernel or torch_varlen_kernel()
    fused = fused or installed_fused_kernels()
    try:
        key = architecture_signature(model_class, config, ATTN_IMPLEMENTATION, real_head_dims=True)
    except Exception as error:
        return KernelCoverage(0, 0, error=f"{type(error).__name__}: {' '.join(str(error).split())}")
    if installed and key in _COVERAGE:
        return _COVERAGE[key]
    try:
        with one_thread(), cpu_twin_kernels():
            plans = planned_forward(model_class, config, kernel, fused)
        coverage = KernelCoverage.of_plans(plans)
    except Exception as error:  # a twin that cannot run at its real head dims says so, not a verdict
        coverage = KernelCoverage(0, 0, error=f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
    if installed:
        _COVERAGE[key] = coverage
    return coverage


def planned_forward(
    model_class: type, config: PretrainedConfig, kernel: VarlenKernel, fused: FusedKernels | None = None
) -> list[VarlenKernelPlan]:
    """One packed forward of the real-head-dim twin, each attention call planned for `kernel` and the `fused` kernels
    (default: this machine's) in TRL's default precision (in call order: one per attention layer)."""
    fused = fused or installed_fused_kernels()
    twin = build_twin(model_class, config, ATTN_IMPLEMENTATION, real_head_dims=True, dtype=COVERAGE_WEIGHTS)
    _, packed = check_row(twin, CHECK_PAIRS, prefix_sharing=False, seed=1)
    target = KernelTarget.of(kernel, COVERAGE_CAPABILITY, fused)
    plans = []

    def plan(*args, **kwargs) -> None:
        bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        call = bound.arguments
        options = {name: call[name] for name in ("scaling", "sliding_window", "softcap", "dropout")}
        options["sinks"] = call["s_aux"]
        layer = LayerCall.of(
            call["query"], call["key"], call["value"], call["module"], options,
            autocast=COVERAGE_AUTOCAST, limits=kernel.limits,
        )  # fmt: skip
        plans.append(varlen_kernel_plan(layer, target))

    with attention_calls_observed(ATTN_IMPLEMENTATION, plan), torch.no_grad():
        twin(packed_batch=packed, use_cache=False)
    return plans
