"""The hot path, counted: what an attention call and a training step ask of the device, through the packed forward's
CUDA branches on CPU (stand-in kernels of torch 2.15's `varlen_attn`, tests/stand_in_kernels.py).

A host read (tests/host_reads.py) is a read of a tensor's value on the host, or an op whose output size depends on
values: on a GPU each one waits for every kernel queued before it. Counted per training step (policy and reference
forwards, loss, metrics, backward) against TRL's padded step on the same batch, and inside every attention call,
where there must be none. docs/concepts/kernels.md states the counts.

Both in TRL's default precision (float32 weights under bf16 autocast, where RoPE hands attention float32 queries and
keys and bf16 values) and with bf16 weights: either way every attention call makes one kernel call.
"""

import dataclasses
import functools

import pytest
import torch
from host_reads import HostReads, kernel_call
from stand_in_fused_kernels import fused_stand_ins
from stand_in_kernels import CALLS, calls_of, varlen_backward_stand_in, varlen_stand_in
from trainer_utils import first_batch, make_trainer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.kernels import FlexKernel, FusedKernels, VarlenKernel, stand_in_kernels

SHARE = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
# A prefix-sharing or plain packed step may read the host at most this many times more than TRL's padded step
EXTRA_READS_ALLOWED = 2
FUSED_KERNELS = ("varlen_attn", "efficient_attention", "flash_attn_varlen_func", "flex_attention")
# TRL's default (its `bf16=True` autocast over the float32 weights it loads), and a model loaded in bf16
PRECISIONS = {"trl_default": dict(bf16=True), "bf16_weights": dict(dtype=torch.bfloat16)}


def _not_counted(function):
    """A stand-in whose own reads (the kernel's work on the device) are not counted."""
    if function is None:
        return None

    @functools.wraps(function)
    def kernel(*args, **kwargs):
        with kernel_call():
            return function(*args, **kwargs)

    return kernel


def counted_stand_in() -> VarlenKernel:
    """torch 2.15's stand-in, its forward and backward op."""
    stand_in = varlen_stand_in("2.15")
    return dataclasses.replace(
        stand_in, function=_not_counted(stand_in.function), backward=_not_counted(stand_in.backward)
    )


def _backward_not_counted(monkeypatch) -> None:
    """The backward op the stand-in's autograd calls, which reads its boundaries as the kernel does on the device
    (`stand_in_kernels.varlen_backward_stand_in`, made at each forward): not counted either."""
    monkeypatch.setattr(
        "stand_in_kernels.varlen_backward_stand_in",
        lambda *args, **kwargs: _not_counted(varlen_backward_stand_in(*args, **kwargs)),
    )


def counted_fused(flash_attn: bool = True) -> FusedKernels:
    fused = fused_stand_ins(flash_attn)
    flex = FlexKernel(_not_counted(fused.flex.attention), _not_counted(fused.flex.block_mask))
    return FusedKernels(_not_counted(fused.efficient), _not_counted(fused.flash_attn_varlen), flex)


class AttentionCalls:
    """Per call of the registered attention: the host reads and ops it made, and the kernel calls it made."""

    def __init__(self, reads: HostReads):
        self.reads, self.calls = reads, []

    def wrap(self, attention):
        @functools.wraps(attention)
        def counted(*args, **kwargs):
            reads, ops, kernels = self.reads.count, self.reads.ops, fused_calls()
            output = attention(*args, **kwargs)
            self.calls.append((self.reads.count - reads, self.reads.ops - ops, fused_calls() - kernels))
            return output

        return counted


def fused_calls() -> int:
    return sum(len(calls_of(kernel)) for kernel in FUSED_KERNELS)


def step_counts(
    monkeypatch, padding_free: bool, on_step=None, flash_attn: bool = True, **options
) -> tuple[HostReads, AttentionCalls]:
    """One training step (forward, loss, metrics, backward) on the first batch, counted; `on_step()` is called right
    before it (after the trainer's construction, whose architecture check runs forwards too); `flash_attn`: whether
    flash-attn's kernel is installed (else FlexAttention takes softcapping)."""
    make_trainer(padding_free, **options)  # imports the model's modules before the stand-ins are in force
    _backward_not_counted(monkeypatch)
    with stand_in_kernels(varlen=counted_stand_in(), fused=counted_fused(flash_attn)):
        trainer = make_trainer(padding_free, **options)
        trainer.model.train()
        batch = first_batch(trainer)
        reads = HostReads()
        attention = AttentionCalls(reads)
        monkeypatch.setitem(
            ALL_ATTENTION_FUNCTIONS, ATTN_IMPLEMENTATION, attention.wrap(ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION])
        )
        CALLS.clear()
        if on_step is not None:
            on_step()
        with reads, trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, batch)
        with reads:
            loss.backward()
    return reads, attention


@pytest.fixture(scope="module", params=list(PRECISIONS))
def precision(request):
    return request.param


@pytest.fixture(scope="module")
def padded_reads(precision):
    with pytest.MonkeyPatch.context() as monkeypatch:
        reads, _ = step_counts(monkeypatch, False, **PRECISIONS[precision])
    return reads.count


@pytest.mark.parametrize("options", [{}, SHARE], ids=["packed", "prefix_sharing"])
def test_attention_calls_make_one_kernel_call_and_never_read_the_host(monkeypatch, precision, options):
    _, attention = step_counts(monkeypatch, True, **PRECISIONS[precision], **options)
    assert attention.calls, "the registered attention never ran"
    for reads, _, kernels in attention.calls:
        assert reads == 0
        assert kernels == 1


def test_prefix_sharing_adds_a_gather_and_nothing_else_to_an_attention_call(monkeypatch, precision):
    _, plain = step_counts(monkeypatch, True, **PRECISIONS[precision])
    _, shared = step_counts(monkeypatch, True, **PRECISIONS[precision], **SHARE)
    plain_ops = max(ops for _, ops, _ in plain.calls)
    # The keys' and the values' gather (index_select), and nothing per call beyond what the plain row does
    assert max(ops for _, ops, _ in shared.calls) <= plain_ops + 2


@pytest.mark.parametrize("options", [{}, SHARE], ids=["packed", "prefix_sharing"])
def test_a_packed_step_reads_the_host_at_most_twice_more_than_trls_padded_step(
    monkeypatch, precision, padded_reads, options
):
    reads, _ = step_counts(monkeypatch, True, **PRECISIONS[precision], **options)
    assert reads.count <= padded_reads + EXTRA_READS_ALLOWED, reads.where


def test_the_flash_backend_is_chosen_once_per_forward_and_the_users_flags_restored(monkeypatch):
    import contextlib

    import torch

    from trl_padfree.modeling.attention import varlen

    entered = []
    flash_backend = varlen.flash_backend

    @contextlib.contextmanager
    def counted():
        entered.append(1)
        with flash_backend():
            yield

    monkeypatch.setattr(varlen, "flash_backend", counted)
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)  # the user's choice, which the kernel call overrides and then restores
    try:
        _, attention = step_counts(monkeypatch, True, on_step=entered.clear, bf16=True, **SHARE)
        assert len(attention.calls) == 4 and len(entered) == 2  # one per forward (policy, reference), not per call
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(flags[0])


# ---- the fused kernels of the layers torch's varlen kernel cannot compute, at their real head dims ----

FUSED_LAYERS = {
    "gpt_oss": dict(model_type="gpt_oss"),  # sinks: the varlen kernel and its log-sum-exp correction
    "gemma2_flash_attn": dict(model_type="gemma2"),  # softcap: flash-attn
    "gemma2_flex": dict(model_type="gemma2", flash_attn=False),  # softcap: FlexAttention
    "gemma4_text": dict(model_type="gemma4_text"),  # 512-wide global layers: the memory-efficient kernel
}


@pytest.mark.parametrize("layers", list(FUSED_LAYERS))
def test_fused_attention_calls_make_one_kernel_call_and_never_read_the_host(monkeypatch, layers):
    from test_kernel_coverage import real_head_dims

    options = dict(FUSED_LAYERS[layers])
    factory = real_head_dims(options.pop("model_type"))
    _, attention = step_counts(monkeypatch, True, model_factory=factory, bf16=True, **options)

    assert attention.calls, "the registered attention never ran"
    for reads, _, kernels in attention.calls:
        assert reads == 0
        assert kernels == 1
