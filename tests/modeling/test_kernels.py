"""The packed forward's CUDA branches, run on the CPU with stand-in kernels (trl_padfree/modeling/check/stand_ins.py,
tests/support/stand_in_kernels.py): what a GPU runs, checked where CI runs.

    varlen_attn        every signature torch has shipped (2.10, 2.11, 2.13-2.15): the call each gets (int32
                       boundaries, window, grouped heads, bf16 inputs), one step equal to padded TRL
                       in TRL's default precision; on 2.15, Flash chosen explicitly whatever backends the user
                       disabled, and named in the log
    mixer kernels      causal-conv1d, flash-linear-attention, mamba-ssm (plain and fused scans): the whole row runs
                       through them only when the resolved function names its boundary argument
    families           every popular and hybrid family of the suite trains one step equal to padded TRL through
                       these branches, in TRL's default precision (float32 weights under bf16 autocast)
    faults             a conv kernel that swallows keywords (transformers 5.23's LFM3) runs per sequence; LFM3's
                       width-7 conv, which the causal-conv1d kernel rejects, is refused with the way out

The varlen stand-in's contract is tested too: a deliberately understated `max_q` or `max_k` fails, `return_aux`
returns the log-sum-exp by head and token, the output keeps the query's layout, the forward rounds P as FA2 does, and
the backward op computes D from the `out` it is given.

The stand-ins refuse what the real kernels refuse (dtypes, head dims, shapes), so a step runs on the kernel only in
half precision, as on a GPU: steps here run in TRL's default precision and are compared with TRL's padded step in the
same precision (`trainer_utils.PRECISIONS`). The padded TRL side of every comparison runs outside the stand-ins.
"""

import functools
import logging
import sys

import numpy as np
import pytest
import torch
from stand_in_kernels import (
    CALLS,
    MIXER_STAND_INS,
    PLAYED_CAPABILITY,
    VARLEN_SIGNATURES,
    calls_of,
    keyword_swallowing_causal_conv1d_stand_in,
    varlen_stand_in,
)
from tiny_architectures import HYBRID_MODEL_TYPES, POPULAR_TYPES, make_tiny_model
from tiny_fixtures import make_tokenizer
from tolerances import HALF_GRAD_ATOL_BY_MODEL
from torch.nn.attention import SDPBackend, sdpa_kernel
from trainer_utils import (
    PRECISIONS,
    assert_same_step,
    first_batch,
    make_trainer,
    one_step,
)

from trl_padfree import ATTN_IMPLEMENTATION
from trl_padfree.integrations.transformers import kernel_wrapper, rewrapped
from trl_padfree.modeling import kernels
from trl_padfree.modeling.attention import interface as attention
from trl_padfree.modeling.attention import varlen
from trl_padfree.modeling.check.packability import check_architecture
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.kernels.attention import flash_backend
from trl_padfree.modeling.kernels.mixers import mixer_kernels
from trl_padfree.modeling.mixers import mixer_calls, stateful_mixers
from trl_padfree.packing.layout import cu_seq_lens_from_lengths

VOCAB_SIZE = len(make_tokenizer())
HEAD_DIM = 8  # of the tiny Llama: hidden 32, 4 heads, 2 key-value heads
# TRL's default: float32 weights under bf16 autocast
TRL_DEFAULT = PRECISIONS["trl_default"]
# Families whose every attention layer has sinks, which no varlen kernel computes: they run per segment on CUDA too
SINK_FAMILIES = ("gpt_oss",)


@pytest.fixture(autouse=True)
def fresh_records():
    CALLS.clear()
    kernels.log_once.cache_clear()
    varlen._log_fallback_once.cache_clear()
    yield
    CALLS.clear()


def all_stand_ins(version: str = "2.15"):
    return stand_in_kernels(varlen=varlen_stand_in(version), mixer_kernels=MIXER_STAND_INS)


def factory(model_type: str):
    return lambda seed: make_tiny_model(model_type, VOCAB_SIZE, seed=seed)


def trl_default_step(padding_free: bool, **trainer_options):
    """One step in TRL's default precision."""
    return one_step(make_trainer(padding_free, **TRL_DEFAULT.trainer_options, **trainer_options))


def packed_step_under(stand_ins, **trainer_options):
    """One padding-free step in TRL's default precision with `stand_ins` in force (the padded side runs outside
    them)."""
    make_trainer(True, **trainer_options)  # imports the model's modules before the stand-ins replace their kernels
    with stand_ins:
        return trl_default_step(True, **trainer_options)


# ---- torch's varlen_attn, one signature per release ----

EXPECTED_CALL = {
    # No enable_gqa before 2.13: the wrappers hand grouped heads to Flash, which shares divisible heads itself
    "2.10": dict(is_causal=True, heads=(4, 2)),
    "2.11": dict(window_size=(-1, 0), scale=HEAD_DIM**-0.5, heads=(4, 2)),
    "2.13": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
    "2.14": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
    "2.15": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
}


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_every_varlen_signature_trains_one_step_equal_to_padded_trl(version):
    padded = trl_default_step(False)

    packed = packed_step_under(stand_in_kernels(varlen=varlen_stand_in(version)))

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    calls = calls_of("varlen_attn")
    assert calls, "the kernel branch did not run"
    for call in calls:
        assert call.details["dtype"] == torch.int32 and call.details["same_boundaries"]
        assert call.details["input_dtype"] == torch.bfloat16  # RoPE's float32 queries and keys cast, as autocast would
        assert call.details["backend"] == "flash"
        for name, value in EXPECTED_CALL[version].items():
            assert call.details[name] == value, (name, call.details)


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_sliding_windows_reach_the_kernel_that_takes_them(version, caplog):
    padded = trl_default_step(False, model_type="mistral")  # sliding window 6, shorter than many sequences

    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"):
        packed = packed_step_under(stand_in_kernels(varlen=varlen_stand_in(version)), model_type="mistral")

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    if version == "2.10":  # no `window_size`: those layers run per segment, and say why
        assert not calls_of("varlen_attn")
        assert "sliding window (this torch's varlen_attn takes no `window_size`)" in caplog.text
    else:
        # The model's window of 6 (the architecture check's float64 twin runs per segment, as float64 would on a GPU)
        assert {call.details["window_size"] for call in calls_of("varlen_attn")} == {(5, 0)}


def direct_attention(query, key, value, lengths):
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)
    output, _ = attention.padfree_varlen_attention(
        torch.nn.Module(), query, key, value, None, cu_seq_lens_q=cu_seq_lens, max_length_q=max(lengths)
    )
    return output


def bf16_row(lengths=(5, 1, 9)):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 4, sum(lengths), HEAD_DIM), (1, 2, sum(lengths), HEAD_DIM), (1, 2, sum(lengths), HEAD_DIM)]
    return [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]


def test_torch_2_15_would_pick_cudnn_and_flash_is_chosen_explicitly(caplog):
    lengths = [130, 1, 9]  # cuDNN takes rows whose longest sequence exceeds 128 tokens
    query, key, value = bf16_row(lengths)
    stand_in = varlen_stand_in("2.15").function
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)

    # Called as is, torch 2.15 takes cuDNN for causal bf16 self-attention with grouped heads on SM90
    stand_in(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seq_lens, cu_seq_lens,
             130, 130, window_size=(-1, 0), enable_gqa=True)  # fmt: skip
    assert calls_of("varlen_attn")[-1].details["backend"] == "cudnn"

    with (
        stand_in_kernels(varlen=varlen_stand_in("2.15")),
        caplog.at_level(logging.INFO, logger="trl_padfree.modeling.kernels"),
    ):
        direct_attention(query, key, value, lengths)
    assert calls_of("varlen_attn")[-1].details["backend"] == "flash"
    assert "on its Flash backend, chosen explicitly" in caplog.text


@pytest.mark.parametrize(
    "user_setting",
    ["flash disabled", "cuDNN disabled", "math only"],
)
def test_the_explicit_backend_keeps_working_whatever_the_user_disabled(user_setting):
    query, key, value = bf16_row()
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        expected = direct_attention(query, key, value, [5, 1, 9])
        flags_before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
        try:
            if user_setting == "flash disabled":
                torch.backends.cuda.enable_flash_sdp(False)
            elif user_setting == "cuDNN disabled":
                torch.backends.cuda.enable_cudnn_sdp(False)
            with sdpa_kernel(SDPBackend.MATH) if user_setting == "math only" else torch.enable_grad():
                user_flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
                output = direct_attention(query, key, value, [5, 1, 9])
                # the user's settings are theirs again after the call
                assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()) == user_flags
        finally:
            torch.backends.cuda.enable_flash_sdp(flags_before[0])
            torch.backends.cuda.enable_cudnn_sdp(flags_before[1])

    assert calls_of("varlen_attn")[-1].details["backend"] == "flash"
    torch.testing.assert_close(output, expected, atol=0, rtol=0)


def test_gpus_older_than_sm80_run_per_segment_and_say_so(caplog):
    query, key, value = bf16_row()
    turing = varlen_stand_in("2.15", capability=(7, 5))
    with (
        stand_in_kernels(varlen=turing),
        caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"),
    ):
        direct_attention(query, key, value, [5, 1, 9])

    assert not calls_of("varlen_attn")
    assert "a GPU of compute capability 7.5 (the Flash kernel needs 8.0 or newer)" in caplog.text
    assert PLAYED_CAPABILITY >= (8, 0)  # the stand-ins play an SM90 GPU


def test_prefix_sharing_runs_one_kernel_call_per_attention_call():
    share = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    padded = trl_default_step(False)

    make_trainer(True, **share)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **TRL_DEFAULT.trainer_options, **share)
        CALLS.clear()
        packed = one_step(trainer)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    # One call per layer and forward (the policy's and the reference's): the row's queries against keys gathered
    # with each rejected branch's prompt first, so the key boundaries are not the query boundaries
    calls = calls_of("varlen_attn")
    assert len(calls) == 2 * trainer.model.config.num_hidden_layers
    assert not any(call.details["same_boundaries"] for call in calls)
    assert {call.details["backend"] for call in calls} == {"flash"}


# ---- the varlen stand-in's contract: what the real op returns, refuses and computes ----

LENGTHS = [5, 1, 9, 2]  # odd lengths, a one-token sequence
LONGEST = max(LENGTHS)


def packed_inputs(lengths=LENGTHS, heads=4, kv_heads=2, head_dim=64, seed=0):
    """bf16 query, key, value `(T, heads, dim)` laid out as attention hands them over (a transposed `(heads, T, dim)`,
    so not contiguous), and the row's int32 boundaries."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tensors = [
        torch.randn(count, total, head_dim, generator=generator).bfloat16().transpose(0, 1)
        for count in (heads, kv_heads, kv_heads)
    ]
    return (*tensors, cu_seq_lens_from_lengths(lengths))


def float64_attention(query, key, value, bounds, scale=None):
    """Causal attention per segment in float64, heads shared by consecutive query heads: output and log-sum-exp."""
    query, key, value = (tensor.double() for tensor in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outputs, lses = [], []
    for start, end in zip(bounds, bounds[1:], strict=False):
        scores = torch.einsum("qhd,khd->hqk", query[start:end], key[start:end]) * scale
        scores = scores.masked_fill(torch.ones(end - start, end - start, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[start:end]))
        lses.append(scores.logsumexp(-1))
    return torch.cat(outputs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("max_length", ["max_q", "max_k"])
def test_an_understated_max_length_fails_where_the_gpu_would_leave_rows_unwritten(max_length):
    query, key, value, cu_seq_lens = packed_inputs()
    stand_in = varlen_stand_in("2.15").function
    lengths = dict(max_q=LONGEST, max_k=LONGEST)

    lengths[max_length] = LONGEST - 1
    with pytest.raises(RuntimeError, match=f"{max_length}={LONGEST - 1} is below the longest segment \\({LONGEST}"):
        stand_in(query, key, value, cu_seq_lens, cu_seq_lens, **lengths, window_size=(-1, 0), enable_gqa=True)

    # Overstated is what the kernel takes: a larger grid, the same result
    exact = stand_in(
        query, key, value, cu_seq_lens, cu_seq_lens, LONGEST, LONGEST, window_size=(-1, 0), enable_gqa=True
    )
    lengths[max_length] = 4 * LONGEST
    larger = stand_in(query, key, value, cu_seq_lens, cu_seq_lens, **lengths, window_size=(-1, 0), enable_gqa=True)
    torch.testing.assert_close(larger, exact, atol=0, rtol=0)


def test_boundaries_that_leave_rows_outside_every_segment_fail():
    query, key, value, cu_seq_lens = packed_inputs()
    short = cu_seq_lens[:-1].contiguous()  # the last sequence's rows belong to no segment
    with pytest.raises(RuntimeError, match="must rise from 0 to the 17 rows it cuts"):
        varlen_stand_in("2.15").function(query, key, value, short, short, LONGEST, LONGEST, enable_gqa=True)


@pytest.mark.parametrize("accepted", [True, np.int64(LONGEST), torch.tensor(LONGEST), torch.tensor([LONGEST + 0.5])])
def test_max_lengths_take_what_the_ops_schema_takes(accepted):
    # The schema's `int`: a bool, anything with __index__, a one-element tensor (truncated)
    query, key, value, cu_seq_lens = packed_inputs(lengths=[1, 1, 1] if accepted is True else LENGTHS)
    varlen_stand_in("2.15").function(query, key, value, cu_seq_lens, cu_seq_lens, accepted, accepted, enable_gqa=True)


@pytest.mark.parametrize(("refused", "kind"), [(9.0, "float"), (None, "NoneType"), (torch.tensor([9, 9]), "Tensor")])
def test_max_lengths_refuse_what_the_ops_schema_refuses(refused, kind):
    query, key, value, cu_seq_lens = packed_inputs()
    with pytest.raises(RuntimeError, match=f"argument 'max_q' but instead found type '{kind}'"):
        varlen_stand_in("2.13").function(query, key, value, cu_seq_lens, cu_seq_lens, refused, 9, enable_gqa=True)


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_return_aux_gives_the_lse_by_head_and_token_and_the_output_keeps_the_querys_layout(version):
    from torch.nn.attention.varlen import AuxRequest

    query, key, value, cu_seq_lens = packed_inputs(heads=4, kv_heads=4)
    causal = dict(is_causal=True) if version == "2.10" else dict(window_size=(-1, 0))
    output, lse = varlen_stand_in(version).function(
        query, key, value, cu_seq_lens, cu_seq_lens, LONGEST, LONGEST, return_aux=AuxRequest(lse=True), **causal
    )

    expected_output, expected_lse = float64_attention(query, key, value, cu_seq_lens.tolist())
    # `mha_varlen_fwd` allocates `softmax_lse` (num_heads, total_q) float32 and the output `at::empty_like(q)`
    assert lse.dtype == torch.float32 and lse.shape == (4, sum(LENGTHS))
    assert output.stride() == query.stride() and not output.is_contiguous()
    # float32 (measured 2.3e-7), a bf16 output within one bf16 step at its largest value, 4.3 (measured 6.9e-3)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-6, rtol=0)
    torch.testing.assert_close(output.double(), expected_output, atol=2**-5, rtol=0)


def test_the_forward_rounds_p_to_the_input_dtype_before_multiplying_by_v():
    query, key, value, cu_seq_lens = packed_inputs(lengths=[300])
    output = varlen_stand_in("2.15").function(query, key, value, cu_seq_lens, cu_seq_lens, 300, 300, enable_gqa=True)

    # FA2 in float64: unnormalised P rounded to bf16, times V, over the unrounded row sum, rounded once
    scores = torch.einsum("qhd,khd->hqk", query.double(), key.double().repeat_interleave(2, 1)) * 64**-0.5
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    products = torch.einsum("hqk,khd->qhd", weights.bfloat16().double(), value.double().repeat_interleave(2, 1))
    fa2 = (products / weights.sum(-1).t().unsqueeze(-1)).bfloat16()
    unrounded = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value.double().repeat_interleave(2, 1)).bfloat16()
    # FA2's rounding but where float32 and float64 sums land on different sides of a bf16 step (measured: 0.04% of
    # the elements differ from it, 39% from the output of an unrounded P)
    assert (output != fa2).float().mean() < 0.01 and (output != unrounded).float().mean() > 0.2


def test_the_backward_op_computes_d_from_the_out_it_is_given():
    """The sink correction hands the backward op a corrected output: dQ and dK then move by exactly what
    D = rowsum(dO * out) predicts, and dV does not move."""
    from torch.nn.attention.varlen import AuxRequest

    query, key, value, cu_seq_lens = packed_inputs()
    kernel = varlen_stand_in("2.15")
    with flash_backend():  # as the sink correction calls it: the backward op's default backend
        output, lse = kernel.function(
            query, key, value, cu_seq_lens, cu_seq_lens, LONGEST, LONGEST,
            return_aux=AuxRequest(lse=True), window_size=(-1, 0), enable_gqa=True,
        )  # fmt: skip
    grad_out = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    zeros = torch.zeros(2, dtype=torch.uint64)

    def backward(out):
        return kernel.backward(
            grad_out, query, key, value, out, lse, cu_seq_lens, cu_seq_lens, LONGEST, LONGEST, True, zeros, None,
            [-1, 0],
        )  # fmt: skip

    given = (output.float() * 0.75).bfloat16()
    (query_grad, key_grad, value_grad), (moved_query, moved_key, moved_value) = backward(output), backward(given)

    torch.testing.assert_close(moved_value, value_grad, atol=0, rtol=0)
    # float64: dQ = scale * sum_k P (dP - D) K, with D from each output
    groups, scale = 2, 64**-0.5
    q, k, v, g = (tensor.double() for tensor in (query, key, value, grad_out))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    for out, computed in ((output, query_grad), (given, moved_query)):
        expected = []
        for start, end in zip(cu_seq_lens.tolist(), cu_seq_lens.tolist()[1:], strict=False):
            rows = slice(start, end)
            scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale
            scores = scores.masked_fill(torch.ones(end - start, end - start, dtype=torch.bool).triu(1), -torch.inf)
            weights = torch.exp(scores - lse[:, rows].double().unsqueeze(-1))
            delta = (g[rows] * out[rows].double()).sum(-1).t().unsqueeze(-1)
            grad_scores = weights * (torch.einsum("qhd,khd->hqk", g[rows], v[rows]) - delta)
            expected.append(torch.einsum("hqk,khd->qhd", grad_scores, k[rows]) * scale)
        # bf16 dS and dQ: about two bf16 steps where dQ reaches 3.7 (measured 1.4e-2 and 1.0e-2)
        torch.testing.assert_close(computed.double(), torch.cat(expected), atol=3e-2, rtol=0)
    assert (moved_query - query_grad).abs().max() > 0.1 and (moved_key - key_grad).abs().max() > 0.1


def test_the_backward_takes_a_strided_gradient_and_refuses_another_dtype_or_an_lse_it_would_misread():
    from torch.nn.attention.varlen import AuxRequest

    query, key, value, cu_seq_lens = packed_inputs()
    kernel = varlen_stand_in("2.15")
    query.requires_grad_()
    output, lse = kernel.function(
        query, key, value, cu_seq_lens, cu_seq_lens, LONGEST, LONGEST,
        return_aux=AuxRequest(lse=True), window_size=(-1, 0), enable_gqa=True,
    )  # fmt: skip
    # ATen makes the incoming gradient contiguous first (`_flash_attention_backward`)
    strided = torch.randn(output.shape[-1], *output.shape[:-1]).bfloat16().permute(1, 2, 0)
    assert strided.stride(-1) != 1
    (output * 1).backward(strided)

    zeros = torch.zeros(2, dtype=torch.uint64)
    arguments = (query.detach(), key, value, output.detach(), lse.detach(), cu_seq_lens, cu_seq_lens, LONGEST, LONGEST)
    with pytest.raises(RuntimeError, match="query and dout must have the same dtype"):
        kernel.backward(output.detach().float(), *arguments, True, zeros)
    arguments = (*arguments[:4], lse.detach().t().contiguous(), *arguments[5:])
    with pytest.raises(RuntimeError, match="stand-in: lse must be the forward's contiguous float32"):
        kernel.backward(output.detach(), *arguments, True, zeros)


def test_only_releases_with_the_backward_ops_schema_offer_it():
    assert {version for version in VARLEN_SIGNATURES if varlen_stand_in(version).backward is not None} == {
        "2.13", "2.14", "2.15"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("longest", "head_dim", "options", "backend"),
    [
        (130, 64, {}, "cudnn"),  # non-causal, equal head counts, a segment past 128 queries
        (LONGEST, 64, {}, "flash"),  # no segment past 128 queries
        (130, 64, dict(window_size=(-1, 0)), "flash"),  # causal
        (130, 64, dict(num_splits=2), "flash"),
        (130, 256, {}, "head_dim should be no more than 128"),  # cuDNN's graph on SM90 refuses it
    ],
    ids=["cudnn", "short", "causal", "num_splits", "wide_head"],
)
def test_torch_2_14_routes_non_causal_rows_past_128_queries_to_cudnn(longest, head_dim, options, backend):
    """torch 2.14.1's `_can_use_cudnn` (varlen.py): it reads no `sdpa_kernel` flag, and routes to Flash what cuDNN
    would refuse, except head dims above 128, which its graph refuses."""
    query, key, value, cu_seq_lens = packed_inputs([5, 1, longest], heads=4, kv_heads=4, head_dim=head_dim)
    stand_in = varlen_stand_in("2.14").function
    call = functools.partial(stand_in, query, key, value, cu_seq_lens, cu_seq_lens, longest, longest, **options)

    if backend not in ("cudnn", "flash"):
        with pytest.raises(RuntimeError, match=backend):
            call()
        return
    call()
    assert calls_of("varlen_attn")[-1].details["backend"] == backend


# ---- mixer kernels: decided from what the resolved function takes ----


def hybrid_mixer_classes(model_type: str) -> set[type]:
    return {type(mixer) for mixer in stateful_mixers(make_tiny_model(model_type, VOCAB_SIZE))}


@pytest.mark.parametrize("model_type", HYBRID_MODEL_TYPES)
def test_the_whole_row_needs_every_kernel_to_take_its_boundaries(model_type):
    classes = hybrid_mixer_classes(model_type)
    for mixer_class in classes:  # this machine has none of the kernel packages
        decision = mixer_kernels(mixer_class)
        assert not decision.whole_row and "transformers runs its PyTorch fallbacks" in decision.reason
    with stand_in_kernels(mixer_kernels=MIXER_STAND_INS):
        for mixer_class in classes:
            decision = mixer_kernels(mixer_class)
            assert decision.whole_row, decision.reason
            assert "given `seq_idx`" in decision.reason or "given `cu_seqlens`" in decision.reason


# Hybrids in the default run: a gated delta rule, a short convolution, Mamba2 beside attention and in its own layers;
# the others (each a few seconds in bf16 on a CPU) with -m slow
DEFAULT_HYBRIDS = ("qwen3_5_text", "lfm2", "nemotron_h", "falcon_h1")
# Popular families in the default run: one of each attention the plan treats apart (grouped heads, biases, MoE,
# sliding windows, head dim 512, latent attention, sinks, chunks, partial rotary, parallel blocks); the other eight
# (plain GQA decoders like the ones kept) with -m slow
DEFAULT_POPULAR = (
    "llama", "qwen2", "qwen3_moe", "mistral", "gemma3_text", "gemma4_text", "phi3", "deepseek_v3", "gpt_oss",
    "llama4_text", "gpt_neox", "cohere2",
)  # fmt: skip
FAMILIES = tuple(
    model_type if model_type in DEFAULT_POPULAR else pytest.param(model_type, marks=pytest.mark.slow)
    for model_type in POPULAR_TYPES
) + tuple(
    model_type if model_type in DEFAULT_HYBRIDS else pytest.param(model_type, marks=pytest.mark.slow)
    for model_type in HYBRID_MODEL_TYPES
)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_trains_one_step_equal_to_padded_trl_through_the_cuda_branches(model_type):
    padded = trl_default_step(False, model_factory=factory(model_type))

    make_trainer(True, model_factory=factory(model_type))  # imports the model's modules
    with all_stand_ins():
        trainer = make_trainer(True, model_factory=factory(model_type), **TRL_DEFAULT.trainer_options)
        packed = one_step(trainer)
        # An eval forward too: Mamba2 mixers run their fused split-conv-scan kernel in training, the plain
        # convolution and scan kernels in eval
        trainer.model.eval()
        with torch.no_grad(), trainer.accelerator.autocast():
            trainer.compute_loss(trainer.model, first_batch(trainer))

    grad_atol = HALF_GRAD_ATOL_BY_MODEL.get(model_type)
    assert_same_step(padded, packed, grad_atol=grad_atol, tolerances=TRL_DEFAULT.tolerances)
    assert calls_of("varlen_attn") or model_type in SINK_FAMILIES, "no attention layer took the kernel branch"
    if model_type in HYBRID_MODEL_TYPES:
        # Packed rows reach every whole-row kernel of the model, with int32 boundaries
        packed_calls = [call for call in CALLS if call.kernel != "varlen_attn"]
        assert all(call.boundaries is not None and call.boundaries.dtype == torch.int32 for call in packed_calls)
        kernels_called = {call.kernel for call in packed_calls}
        for mixer_class in hybrid_mixer_classes(model_type):
            with all_stand_ins():
                row_kernels = {kernel.name for kernel in mixer_kernels(mixer_class).kernels if kernel.boundary}
            assert row_kernels <= kernels_called, (mixer_class, row_kernels - kernels_called)


# ---- kernels that do not keep sequences apart ----


def test_a_conv_kernel_that_swallows_keywords_runs_per_sequence(caplog):
    padded = one_step(make_trainer(False, model_factory=factory("lfm2")))
    swallowing = {**MIXER_STAND_INS, "causal_conv1d_fn": keyword_swallowing_causal_conv1d_stand_in}

    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.kernels"):
        make_trainer(True, model_factory=factory("lfm2"))
        with stand_in_kernels(varlen=varlen_stand_in(), mixer_kernels=swallowing):
            trainer = make_trainer(True, model_factory=factory("lfm2"))
            packed = one_step(trainer)

    assert_same_step(padded, packed)
    assert all(calls.segmented and not calls.whole_row for calls in mixer_calls(trainer.model).values())
    assert "Lfm2ShortConv layers run once per sequence" in caplog.text and "takes no `seq_idx`" in caplog.text


def _kernel_warnings(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "trl_padfree.modeling.kernels" and record.levelno == logging.WARNING
    ]


def test_a_kernel_wrapper_a_release_moved_runs_per_sequence_and_says_so(monkeypatch, caplog):
    """A transformers release that wraps a mixer's kernel in a way trl-padfree cannot read (as 5.25 did, wrapping each
    in a `kernels` function module): the run stays exact, its mixers run once per sequence, and it says at WARNING
    what it lost, the tested releases and the way out, never only at INFO."""
    padded = one_step(make_trainer(False, model_factory=factory("lfm2")))
    mixer_class = type(stateful_mixers(make_trainer(True, model_factory=factory("lfm2")).model)[0])
    module = sys.modules[mixer_class.__module__]

    class MovedWrapper(torch.nn.Module):
        kernel_layer_name = "causal_conv1d_fn"  # the hub name, readable whatever the layout

        def __init__(self, target):
            super().__init__()
            self.target = target

        def forward(self, *args, **kwargs):
            return self.target(*args, **kwargs)

    monkeypatch.setattr(module, "causal_conv1d_fn", MovedWrapper(module.causal_conv1d_fn))
    kernels.log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.kernels"):
        with stand_in_kernels(varlen=varlen_stand_in(), mixer_kernels=MIXER_STAND_INS):
            decision = mixer_kernels(mixer_class)
            trainer = make_trainer(True, model_factory=factory("lfm2"))
            packed = one_step(trainer)

    assert decision.moved_seam and not decision.whole_row
    assert_same_step(padded, packed)
    assert all(calls.segmented and not calls.whole_row for calls in mixer_calls(trainer.model).values())
    (warning,) = _kernel_warnings(caplog)
    assert "`causal_conv1d_fn`" in warning and "cannot read" in warning and "once per sequence" in warning
    assert "pip install 'transformers>=5.23.0,<=5.25.0'" in warning


def test_a_kernelized_mixer_runs_per_sequence():
    """`use_kernels=True`: `kernels.kernelize` puts hub kernels in place of transformers' functions, which trl-padfree
    cannot read: the mixers run once per sequence (exact) rather than hand those kernels a whole row."""
    padded = one_step(make_trainer(False, model_factory=factory("lfm2")))
    make_trainer(True, model_factory=factory("lfm2"))  # imports the model's module
    with stand_in_kernels(varlen=varlen_stand_in(), mixer_kernels=MIXER_STAND_INS):
        trainer = make_trainer(True, model_factory=factory("lfm2"))
        for mixer in stateful_mixers(trainer.model):  # as kernelize leaves a layer: a hub forward on its function
            hub = vars(mixer).setdefault("_kernel_funcs", {}).setdefault("causal_conv1d_fn", torch.nn.Identity())
            hub.forward = hub.forward
        packed = one_step(trainer)

    assert_same_step(padded, packed)
    assert all(calls.segmented and not calls.whole_row for calls in mixer_calls(trainer.model).values())


def test_lfm3s_width_7_conv_which_the_kernel_rejects_is_refused_with_the_way_out():
    lfm3 = factory("lfm3")
    model = lfm3(0)  # imports its module
    conv = kernel_wrapper(vars(sys.modules[type(model).__module__])["causal_conv1d_fn"])
    if conv is None:  # transformers 5.23: LFM3's convolution is PyTorch code of its own, which runs per sequence
        with all_stand_ins():
            make_trainer(True, model_factory=lfm3)
        return
    # 5.24: it hands its width-7 convolution to the causal-conv1d kernel, which takes widths 2 to 4: refused at once,
    # where the kernel is installed, with the way out; transformers' PyTorch convolution (no kernel) trains it
    with all_stand_ins(), pytest.raises(ValueError, match="convolve over 7 tokens") as error:
        make_trainer(True, model_factory=lfm3)
    assert "takes widths 2 to 4 only" in str(error.value) and "Uninstall causal-conv1d" in str(error.value)
    make_trainer(True, model_factory=lfm3)


def test_the_check_runs_the_twin_on_pytorch_fallbacks_when_gpu_kernels_are_installed(monkeypatch):
    """A GPU machine with causal-conv1d installed: transformers resolved the CUDA kernel, which the architecture
    check's CPU twin must not be handed (it would fail there, and refuse every hybrid model)."""
    import transformers.models.lfm2.modeling_lfm2 as modeling_lfm2

    def cuda_only(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):  # fmt: skip
        if not x.is_cuda:
            raise RuntimeError("Expected x.is_cuda() to be true, but got false.")
        raise AssertionError("unreachable on this machine")

    monkeypatch.setattr(modeling_lfm2, "causal_conv1d_fn", rewrapped(modeling_lfm2.causal_conv1d_fn, cuda_only))
    assert mixer_kernels(modeling_lfm2.Lfm2ShortConv).whole_row  # what a GPU run picks

    model_class, config = modeling_lfm2.Lfm2ForCausalLM, make_tiny_model("lfm2", VOCAB_SIZE).config
    verdict = check_architecture(model_class, config, ATTN_IMPLEMENTATION)

    assert verdict.exact, verdict.reason
    assert (
        modeling_lfm2.causal_conv1d_fn is not None
        and kernel_wrapper(modeling_lfm2.causal_conv1d_fn).implementation is cuda_only
    )  # restored after the check
