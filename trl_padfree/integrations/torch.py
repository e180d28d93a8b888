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


# The arguments the sink correction passes to varlen attention's backward op, in order (torch 2.13 and 2.14). torch
# 2.15 adds `backend` after them, defaulting to Flash: the backend the sink correction's forward runs on (it calls
# `varlen_attn` with Flash alone enabled), so the same positional call runs Flash's backward there too.
VARLEN_BACKWARD_ARGUMENTS = (
    "grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
    "rng_state", "scale", "window_size",
)  # fmt: skip
VARLEN_BACKWARD_RELEASES = "torch 2.13 to 2.15"


def varlen_attn_backward_op():
    """`torch.ops.torch_attn._varlen_attn_backward`, the backward of torch's `varlen_attn` (registered when
    `torch.nn.attention.varlen` is imported): the op where its schema is one the sink correction was written against
    (`varlen_backward_schema_refusal`), an `UntestedVarlenBackward` that refuses at first use where the op takes
    another, None where this torch has no such op (before 2.13: sink layers run per segment)."""
    import torch.nn.attention.varlen  # noqa: F401  (registers the op)

    op = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn_backward", None)
    if op is None:
        return None
    refusal = varlen_backward_schema_refusal(op.default._schema)
    return op if refusal is None else UntestedVarlenBackward(refusal)


def varlen_backward_schema_refusal(schema: torch.FunctionSchema) -> str | None:
    """Why the sink correction cannot call a backward op of this schema, or None when it can: its arguments start
    with `VARLEN_BACKWARD_ARGUMENTS`, and any after them is torch 2.15's `backend` defaulting to Flash."""
    from torch.nn.attention import SDPBackend

    names = tuple(argument.name for argument in schema.arguments)
    extra = schema.arguments[len(VARLEN_BACKWARD_ARGUMENTS) :]
    flash_default = [(argument.name, argument.default_value) for argument in extra] in (
        [],
        [("backend", SDPBackend.FLASH_ATTENTION.value)],
    )
    if names[: len(VARLEN_BACKWARD_ARGUMENTS)] == VARLEN_BACKWARD_ARGUMENTS and flash_default:
        return None
    return (
        f"torch {torch.__version__}'s varlen attention backward op takes ({', '.join(names)}), not the arguments "
        f"trl-padfree's sink correction passes it ({VARLEN_BACKWARD_RELEASES}: {', '.join(VARLEN_BACKWARD_ARGUMENTS)}"
        ", then torch 2.15's `backend` defaulting to Flash), so a layer with attention sinks cannot run on the "
        'kernel. Train with attn_implementation="sdpa", or install a torch from 2.13 to 2.15.'
    )


class UntestedVarlenBackward:
    """A varlen backward op whose schema the sink correction was not written against: the plan takes it as present,
    so a layer with sinks reaches the sink correction, which refuses at its first forward with `refusal` (it would
    otherwise run per segment, many times slower, with only an INFO line)."""

    def __init__(self, refusal: str):
        self.refusal = refusal

    def __call__(self, *args, **kwargs):
        raise RuntimeError(self.refusal)


@functools.cache
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
