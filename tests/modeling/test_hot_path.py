"""The hot path, counted: what an attention call and a training step ask of the device, through the packed forward's
CUDA branches on CPU (stand-in kernels of torch 2.15's `varlen_attn`, tests/support/stand_in_kernels.py).

A host read (tests/support/host_reads.py) is a read of a tensor's value on the host, or an op whose output size depends on
values: on a GPU each one waits for every kernel queued before it. Counted per training step (policy and reference
forwards, loss, metrics, backward) against TRL's padded step on the same batch, and inside every attention call,
where there must be none. docs/concepts/kernels.md states the counts.

Both in TRL's default precision (float32 weights under bf16 autocast, where RoPE hands attention float32 queries and
keys and bf16 values) and with bf16 weights: either way every attention call makes one kernel call.
"""

import pytest
import torch
from hot_path_counts import step_counts
from shared_prefix_rows import SHARE

# A prefix-sharing or plain packed step may read the host at most this many times more than TRL's padded step
EXTRA_READS_ALLOWED = 2
# TRL's default (its `bf16=True` autocast over the float32 weights it loads), and a model loaded in bf16
PRECISIONS = {"trl_default": dict(bf16=True), "bf16_weights": dict(dtype=torch.bfloat16)}


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
    from tiny_architectures import real_head_dims

    options = dict(FUSED_LAYERS[layers])
    factory = real_head_dims(options.pop("model_type"))
    _, attention = step_counts(monkeypatch, True, model_factory=factory, bf16=True, **options)

    assert attention.calls, "the registered attention never ran"
    for reads, _, kernels in attention.calls:
        assert reads == 0
        assert kernels == 1
