"""torch's private names trl-padfree relies on: the wrapper `torch.compile` puts around a module
(`torch._dynamo.eval_frame.OptimizedModule`) and the module it holds (`_orig_mod`). Under
`TrainingArguments(torch_compile=True)` accelerate wraps the models it prepares so, and whether a model packs is
decided on the class under the wrapper."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import OptimizedModule


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(module)` returns."""
    return isinstance(model, OptimizedModule)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module under `torch.compile`'s wrapper (under each, if compiled twice), or `model` itself."""
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


# The arguments the sink correction passes to varlen attention's backward op, by name (torch 2.13 to 2.15)
VARLEN_BACKWARD_ARGUMENTS = (
    "grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
    "rng_state", "scale", "window_size",
)  # fmt: skip


def varlen_attn_backward_op():
    """`torch.ops.torch_attn._varlen_attn_backward`, the backward of torch's `varlen_attn` (registered when
    `torch.nn.attention.varlen` is imported), when its schema takes `VARLEN_BACKWARD_ARGUMENTS`; else None."""
    import torch.nn.attention.varlen  # noqa: F401  (registers the op)

    op = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn_backward", None)
    if op is None:
        return None
    names = tuple(argument.name for argument in op.default._schema.arguments)
    return op if names == VARLEN_BACKWARD_ARGUMENTS else None


def efficient_attention_op():
    """`torch.ops.aten._efficient_attention_forward`: ATen's memory-efficient attention, which takes `cu_seqlens` (one
    call for a packed row) and differentiates through autograd; None if this torch has none."""
    return getattr(torch.ops.aten, "_efficient_attention_forward", None)


def flash_attn_varlen_with_softcap():
    """flash-attn's `flash_attn_varlen_func` when an installed release takes `softcap` (2.6 or newer), else None."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # a build for another torch or CUDA fails at import
        return None
    return flash_attn_varlen_func if "softcap" in inspect.signature(flash_attn_varlen_func).parameters else None
