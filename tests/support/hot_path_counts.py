"""A training step and its attention calls, counted: host reads (host_reads.py) and kernel calls through the
stand-in kernels (tests/modeling/test_hot_path.py, tests/packing/test_prompt_group_rows.py)."""

import dataclasses
import functools

from host_reads import HostReads, kernel_call
from stand_in_fused_kernels import fused_stand_ins
from stand_in_kernels import CALLS, calls_of, varlen_backward_stand_in, varlen_stand_in
from trainer_utils import first_batch, make_trainer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.kernels.attention import FlexKernel, FusedKernels, VarlenKernel

FUSED_KERNELS = ("varlen_attn", "efficient_attention", "flash_attn_varlen_func", "flex_attention")


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
