"""torch's private names trl-padfree relies on: the wrapper `torch.compile` puts around a module
(`torch._dynamo.eval_frame.OptimizedModule`) and the module it holds (`_orig_mod`). Under
`TrainingArguments(torch_compile=True)` accelerate wraps the models it prepares so, and whether a model packs is
decided on the class under the wrapper. And the fused attention kernels' private ops and compiler seams: varlen
attention's backward op, ATen's memory-efficient attention (behind an op of our own), FlexAttention compiled."""

from __future__ import annotations

import functools

import torch
from torch._dynamo.eval_frame import OptimizedModule


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
    """ATen's memory-efficient attention, which takes `cu_seqlens` (one call for a packed row), as trl-padfree's own
    op `trl_padfree::efficient_attention` (`wide_head_attention_op`); None if this torch has none."""
    forward = getattr(torch.ops.aten, "_efficient_attention_forward", None)
    backward = getattr(torch.ops.aten, "_efficient_attention_backward", None)
    if forward is None or backward is None:
        return None
    return wide_head_attention_op("trl_padfree::efficient_attention", forward, backward)


def wide_head_attention_op(name: str, forward, backward):
    """An op `name` whose forward calls `forward` (`aten::_efficient_attention_forward`'s signature) and whose backward
    calls `backward` (`aten::_efficient_attention_backward`'s) with the arguments ATen's own derivative passes, each
    eagerly: `torch.compile` sees one opaque node with a fake (shape-only) implementation each way, and never traces
    ATen's meta function of the backward, which in torch 2.13 lacks two arguments of the op's schema (`out`,
    `window_size`) and fails ("got multiple values for argument 'scale'").

    Called as `op(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, custom_mask_type, scale,
    compute_log_sumexp)` on `(1, T, heads, dim)` inputs; returns the output `(1, T_q, heads, value dim)` and the
    log-sum-exp. No dropout, no bias."""
    attention, attention_backward = _efficient_forward_op(name, forward), _efficient_backward_op(name, backward)

    def setup_context(ctx, inputs, output):
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, _ = inputs
        ctx.save_for_backward(query, key, value, *output, cu_seqlens_q, cu_seqlens_k)
        ctx.arguments = (max_seqlen_q, max_seqlen_k, mask, scale)

    def differentiate(ctx, grad_output, _grad_logsumexp):
        grads = attention_backward(grad_output, *ctx.saved_tensors, *ctx.arguments)
        return (*grads, None, None, None, None, None, None, None)

    attention.register_autograd(differentiate, setup_context=setup_context)
    return attention


def _efficient_forward_op(name: str, forward):
    @torch.library.custom_op(name, mutates_args=())
    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        custom_mask_type: int,
        scale: float,
        compute_log_sumexp: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, logsumexp, *_ = forward(
            query, key, value, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, custom_mask_type,
            compute_log_sumexp, scale=scale,
        )  # fmt: skip
        return output, logsumexp

    @attention.register_fake
    def _(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, log_sumexp):
        # ATen's shapes: the output in the value's head dim; a float32 log-sum-exp per segment and head, its rows
        # rounded up to 32
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        rows = (max_seqlen_q + 31) // 32 * 32 if log_sumexp else 0
        return output, query.new_empty(cu_seqlens_q.shape[0] - 1, query.shape[2], rows, dtype=torch.float32)

    return attention


def _efficient_backward_op(name: str, backward):
    @torch.library.custom_op(f"{name}_backward", mutates_args=())
    def attention_backward(
        grad: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        logsumexp: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        custom_mask_type: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The dropout generator's seed and offset: read only with dropout (attention_backward.cu), which is never on
        unused = torch.empty((), dtype=torch.long)
        grad_query, grad_key, grad_value, _ = backward(
            grad, query, key, value, None, output, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            logsumexp, 0.0, unused, unused, custom_mask_type, False, scale=scale,
        )  # fmt: skip
        return grad_query, grad_key, grad_value

    @attention_backward.register_fake
    def _(grad, query, key, value, *_):
        # Contiguous whatever the inputs' strides, as ATen allocates them (`at::empty(query.sizes(), ...)`)
        return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)

    return attention_backward


def compiled_flex_attention(backend: str = "inductor"):
    """torch's FlexAttention compiled as its fused kernel needs (eager, it writes out the score matrix): with dynamic
    shapes from the first call, so one graph serves every row length, window and causality (each a tensor of the
    block mask, attention.fused.DocumentTiles), leaving a graph per grad mode (training, the reference's no-grad
    forward) and per row whose keys outnumber its queries (prefix sharing); and whole (`fullgraph`), so that a
    variant past dynamo's recompile limit raises here instead of running unfused with only a warning."""
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True, fullgraph=True, backend=backend)

    def attention(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except FailOnRecompileLimitHit as error:
            raise RuntimeError(
                f"FlexAttention reached torch._dynamo.config.recompile_limit "
                f"({torch._dynamo.config.recompile_limit} graphs) for the softcapping layers; past it torch would run "
                "it unfused, writing out the T x T score matrix. Install flash-attn, which takes softcapping "
                "without compiling (pip install 'flash-attn>=2.6'), or raise torch._dynamo.config.recompile_limit."
            ) from error

    return attention


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
