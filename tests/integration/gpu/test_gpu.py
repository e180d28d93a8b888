"""CUDA kernels against per-sequence sdpa: PyTorch's varlen flash attention behind `padfree_varlen`, and
flash-attn's `flash_attention_2` when installed. Skipped without a GPU (`-m gpu` selects only these).

The packed row and the helpers are the ones of tests/modeling/test_models.py, so the CPU and GPU checks cannot drift apart.
"""

import pytest
import torch
from packed_rows import (
    ATTENTION_LENGTHS,
    EXAMPLES,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    block_diagonal_attention,
    max_error,
    packed_log_probs,
    per_sequence_log_probs,
    random_qkv,
)
from tiny_fixtures import make_model
from tolerances import BF16_ATTENTION_ATOL, BF16_ATTENTION_RTOL, BF16_LOG_PROB_ATOL

from trl_padfree.modeling.attention import interface, varlen
from trl_padfree.modeling.attention.rows import PackedRow
from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import cu_seq_lens_from_lengths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_LAYERS = 2  # of every tiny config


def cuda_packed_batch():
    batch = concatenated_inputs(EXAMPLES, pad_to_multiple_of=8)
    return {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


@pytest.fixture
def varlen_kernel_calls(monkeypatch):
    """Spy on the CUDA kernel path of `padfree_varlen`: the window of every call."""
    calls = []
    kernel = varlen.fused_attention

    def spy(query, key, value, boundaries, max_lengths, plan, *args):
        left = plan.options["window_size"][0]  # transformers' window W is (W - 1, 0)
        calls.append(None if left < 0 else left + 1)
        return kernel(query, key, value, boundaries, max_lengths, plan, *args)

    monkeypatch.setattr(varlen, "fused_attention", spy)
    return calls


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
def test_torch_varlen_kernel_equals_block_diagonal_attention(sliding_window, varlen_kernel_calls):
    query, key, value = (tensor.cuda() for tensor in random_qkv())
    cu_seq_lens = cu_seq_lens_from_lengths(ATTENTION_LENGTHS).cuda()

    output, _ = interface.padfree_varlen_attention(
        torch.nn.Module(),
        query.bfloat16(),
        key.bfloat16(),
        value.bfloat16(),
        None,
        scaling=HEAD_DIM**-0.5,
        sliding_window=sliding_window,
        cu_seq_lens_q=cu_seq_lens,
        cu_seq_lens_k=cu_seq_lens,
        max_length_q=max(ATTENTION_LENGTHS),
    )

    assert varlen_kernel_calls == [sliding_window]
    assert NUM_HEADS != NUM_KV_HEADS  # grouped-query attention goes through the kernel too
    expected = block_diagonal_attention(query, key, value, ATTENTION_LENGTHS, sliding_window)
    # bf16 inputs: ~3 significant digits on outputs of magnitude ~1
    torch.testing.assert_close(output.float(), expected, atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])  # mistral: sliding window 6, shorter than 4 sequences
def test_padfree_varlen_kernel_equals_per_sequence_sdpa_in_bf16(model_type, varlen_kernel_calls):
    batch = cuda_packed_batch()
    packed_model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16)
    reference_model = make_model(model_type, attn_implementation="sdpa", dtype=torch.bfloat16)

    packed = packed_log_probs(packed_model.cuda().eval(), batch)
    reference = per_sequence_log_probs(reference_model.cuda().eval(), batch)

    # The kernel ran in every layer, not the per-sequence fallback, with the model's window
    expected_window = packed_model.config.sliding_window if model_type == "mistral" else None
    assert varlen_kernel_calls == [expected_window] * NUM_LAYERS
    print(f"\n{model_type} padfree_varlen vs per-sequence sdpa, bf16 log-probs: {max_error(packed, reference):.3g}")
    assert max_error(packed, reference) <= BF16_LOG_PROB_ATOL


@pytest.mark.parametrize("user_disabled", ["nothing", "flash", "cudnn"])
def test_varlen_runs_on_flash_whatever_the_user_disabled(user_disabled, monkeypatch):
    # torch >= 2.15 would pick cuDNN for this GQA model (SM90+, bf16, head dim 8); the call must see Flash only, and
    # keep working when the user has disabled a backend (torch 2.15 raises "No viable backend" otherwise)
    import functools

    from trl_padfree.modeling.kernels import attention as kernels

    flags = []
    real = kernels.torch_varlen_kernel()

    @functools.wraps(real.function)
    def recording(*args, **kwargs):
        flags.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return real.function(*args, **kwargs)

    monkeypatch.setattr(kernels, "torch_varlen_kernel", lambda: kernels.VarlenKernel(recording))
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    try:
        if user_disabled == "flash":
            torch.backends.cuda.enable_flash_sdp(False)
        elif user_disabled == "cudnn":
            torch.backends.cuda.enable_cudnn_sdp(False)
        batch = cuda_packed_batch()
        packed_model = make_model("llama", attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16)
        reference_model = make_model("llama", attn_implementation="sdpa", dtype=torch.bfloat16)
        packed = packed_log_probs(packed_model.cuda().eval(), batch)
    finally:
        torch.backends.cuda.enable_flash_sdp(before[0])
        torch.backends.cuda.enable_cudnn_sdp(before[1])
    reference = per_sequence_log_probs(reference_model.cuda().eval(), batch)

    assert flags == [(True, False)] * NUM_LAYERS
    assert max_error(packed, reference) <= BF16_LOG_PROB_ATOL


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_flash_attention_2_packed_equals_per_sequence_sdpa_in_bf16(model_type):
    pytest.importorskip("flash_attn")
    batch = cuda_packed_batch()
    packed_model = make_model(model_type, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    reference_model = make_model(model_type, attn_implementation="sdpa", dtype=torch.bfloat16)

    packed = packed_log_probs(packed_model.cuda().eval(), batch)
    reference = per_sequence_log_probs(reference_model.cuda().eval(), batch)

    assert max_error(packed, reference) <= BF16_LOG_PROB_ATOL


# Prefix sharing on CUDA: one call of PyTorch's varlen kernel per layer, whose causal mask aligns to the bottom-right
# corner when a rejected branch has more keys (its prefix) than queries. (Its two-call predecessor was identical to
# per-sequence sdpa on an H200, docs/benchmarks.md.)


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
def test_shared_prefix_kernel_calls_equal_dense_attention_with_the_layout_mask(sliding_window, varlen_kernel_calls):
    from shared_prefix_rows import EXAMPLES as SHARING_EXAMPLES
    from shared_prefix_rows import SHARE, dense_attention, layout_mask

    from trl_padfree.modeling.packed_forward import PackedBatch

    batch = concatenated_inputs(SHARING_EXAMPLES, **SHARE, pad_to_multiple_of=8)
    packed = PackedBatch.from_collated({**batch, "input_ids": batch["input_ids"].cuda()})  # its indices on the GPU
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, NUM_HEADS, packed.row_length, HEAD_DIM)] + [(1, NUM_KV_HEADS, packed.row_length, HEAD_DIM)] * 2
    query, key, value = (torch.randn(shape, generator=generator) for shape in shapes)
    output, _ = interface.padfree_varlen_attention(
        torch.nn.Module(),
        *(tensor.cuda().bfloat16() for tensor in (query, key, value)),
        None,
        sliding_window=sliding_window,
        packed_row=PackedRow.of_host_row(packed.host, packed.cu_seq_lens.cuda(), packed.max_length),
    )
    assert varlen_kernel_calls == [sliding_window]  # one call: each rejected branch's keys gathered after its prefix
    expected = dense_attention(query, key, value, layout_mask(batch, sliding_window))
    torch.testing.assert_close(output.float().cpu(), expected, atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_shared_prefix_forward_equals_per_sequence_sdpa_in_bf16(model_type, varlen_kernel_calls):
    from shared_prefix_rows import EXAMPLES as SHARING_EXAMPLES
    from shared_prefix_rows import SHARE

    from trl_padfree.modeling.packed_forward import PackedBatch

    def log_probs(model, batch):
        packed = PackedBatch.from_collated(batch)
        with torch.no_grad():
            logits = model(**packed.model_kwargs()).logits.float().log_softmax(-1)
        return packed.padded(logits)[packed.token_valid]

    def on_cuda(batch):
        return {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}

    shared_model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16).cuda().eval()
    reference_model = make_model(model_type, attn_implementation="sdpa", dtype=torch.bfloat16).cuda().eval()
    shared = log_probs(shared_model, on_cuda(concatenated_inputs(SHARING_EXAMPLES, **SHARE)))
    reference = torch.cat(
        [
            reference_model(input_ids=torch.tensor([example["prompt_ids"] + example[completion]]).cuda())
            .logits.float()
            .log_softmax(-1)[0]
            for completion in ("chosen_ids", "rejected_ids")
            for example in SHARING_EXAMPLES
        ]
    )
    assert len(varlen_kernel_calls) == 2 * NUM_LAYERS
    print(f"\n{model_type} shared prefix vs per-sequence sdpa, bf16 log-probs: {max_error(shared, reference):.3g}")
    assert max_error(shared, reference) <= BF16_LOG_PROB_ATOL
