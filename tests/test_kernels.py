"""The packed forward's CUDA branches, run on the CPU with stand-in kernels (trl_padfree/kernels.py,
tests/stand_in_kernels.py): what a GPU runs, checked where CI runs.

    varlen_attn        every signature torch has shipped (2.10, 2.11, 2.13-2.15): the call each gets (int32
                       boundaries, window, grouped heads or expanded ones), one step equal to padded TRL; on 2.15,
                       Flash chosen explicitly whatever backends the user disabled, and named in the log
    mixer kernels      causal-conv1d, flash-linear-attention, mamba-ssm (plain and fused scans): the whole row runs
                       through them only when the resolved function names its boundary argument
    families           every popular and hybrid family of the suite trains one step equal to padded TRL through
                       these branches
    faults             a conv kernel that ignores `seq_idx` (LFM3's case) is refused by the architecture check; one
                       that swallows keywords (transformers 5.23's LFM3) runs per sequence; LFM3's width-7 conv, which
                       the causal-conv1d kernel rejects, is refused with the kernel's error

The padded TRL side of every comparison runs outside the stand-ins, as CPU training runs today.
"""

import logging
import sys

import pytest
import torch
from stand_in_kernels import (
    CALLS,
    MIXER_STAND_INS,
    PLAYED_CAPABILITY,
    STAND_IN_DTYPES,
    VARLEN_SIGNATURES,
    calls_of,
    keyword_swallowing_causal_conv1d_stand_in,
    leaky_causal_conv1d_stand_in,
    varlen_stand_in,
)
from test_architecture import POPULAR_TYPES
from tiny_architectures import HYBRID_MODEL_TYPES, make_tiny_model
from tiny_fixtures import make_tokenizer
from torch.nn.attention import SDPBackend, sdpa_kernel
from trainer_utils import GRAD_ATOL, GRAD_ATOL_BY_MODEL, assert_same_step, make_trainer, one_step

from trl_padfree import ATTN_IMPLEMENTATION
from trl_padfree.integrations.transformers import kernel_wrapper, rewrapped
from trl_padfree.modeling import kernels
from trl_padfree.modeling.attention import interface as attention
from trl_padfree.modeling.attention import varlen
from trl_padfree.modeling.kernels import VarlenKernel, mixer_kernels, stand_in_kernels
from trl_padfree.modeling.mixers import mixer_calls, stateful_mixers
from trl_padfree.modeling.packability import check_architecture
from trl_padfree.packing.layout import cu_seq_lens_from_lengths

VOCAB_SIZE = len(make_tokenizer())
HEAD_DIM = 8  # of the tiny Llama: hidden 32, 4 heads, 2 key-value heads
# gemma4_text through the stand-ins, whose attention is the explicit softmax (as eager computes it): its embedding
# gradient differs from padded TRL's sdpa by 1.39e-5 (largest gradient 0.91), where TRL's own padded trainer differs
# from itself by 1.4e-5 between sdpa and eager (tests/trainer_utils.py); every other family stays within GRAD_ATOL
STAND_IN_GRAD_ATOL_BY_MODEL = {**GRAD_ATOL_BY_MODEL, "gemma4_text": 2e-5}
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


def packed_step_under(stand_ins, **trainer_options):
    """One padding-free step with `stand_ins` in force (the padded side runs outside them)."""
    make_trainer(True, **trainer_options)  # imports the model's modules before the stand-ins replace their kernels
    with stand_ins:
        return one_step(make_trainer(True, **trainer_options))


# ---- torch's varlen_attn, one signature per release ----

EXPECTED_CALL = {
    "2.10": dict(is_causal=True, heads=(4, 4)),  # no enable_gqa: key/value heads expanded
    "2.11": dict(window_size=(-1, 0), scale=HEAD_DIM**-0.5, heads=(4, 4)),
    "2.13": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
    "2.14": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
    "2.15": dict(window_size=(-1, 0), enable_gqa=True, heads=(4, 2)),
}


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_every_varlen_signature_trains_one_step_equal_to_padded_trl(version):
    padded = one_step(make_trainer(False))

    packed = packed_step_under(stand_in_kernels(varlen=varlen_stand_in(version)))

    assert_same_step(padded, packed)
    calls = calls_of("varlen_attn")
    assert calls, "the kernel branch did not run"
    for call in calls:
        assert call.details["dtype"] == torch.int32 and call.details["same_boundaries"]
        assert call.details["backend"] == "flash"
        for name, value in EXPECTED_CALL[version].items():
            assert call.details[name] == value, (name, call.details)


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_sliding_windows_reach_the_kernel_that_takes_them(version, caplog):
    padded = one_step(make_trainer(False, model_type="mistral"))  # sliding window 6, shorter than many sequences

    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"):
        packed = packed_step_under(stand_in_kernels(varlen=varlen_stand_in(version)), model_type="mistral")

    assert_same_step(padded, packed)
    if version == "2.10":  # no `window_size`: those layers run per segment, and say why
        assert not calls_of("varlen_attn")
        assert "sliding window (this torch's varlen_attn takes no `window_size`)" in caplog.text
    else:
        # the model's window of 6, and the architecture check's twin's of 3: the check runs the kernel branch too
        assert {call.details["window_size"] for call in calls_of("varlen_attn")} == {(5, 0), (2, 0)}


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
    query, key, value = bf16_row()
    stand_in = varlen_stand_in("2.15").function
    cu_seq_lens = cu_seq_lens_from_lengths([5, 1, 9])

    # Called as is, torch 2.15 takes cuDNN for causal bf16 self-attention with grouped heads on SM90
    stand_in(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seq_lens, cu_seq_lens,
             9, 9, window_size=(-1, 0), enable_gqa=True)  # fmt: skip
    assert calls_of("varlen_attn")[-1].details["backend"] == "cudnn"

    with stand_in_kernels(varlen=varlen_stand_in("2.15")), caplog.at_level(logging.INFO, logger="trl_padfree.modeling.kernels"):
        direct_attention(query, key, value, [5, 1, 9])
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
    turing = VarlenKernel(VARLEN_SIGNATURES["2.15"], dtypes=STAND_IN_DTYPES, capability=(7, 5))
    with stand_in_kernels(varlen=turing), caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"):
        direct_attention(query, key, value, [5, 1, 9])

    assert not calls_of("varlen_attn")
    assert "a GPU of compute capability 7.5 (the Flash kernel needs 8.0 or newer)" in caplog.text
    assert PLAYED_CAPABILITY >= (8, 0)  # the stand-ins play an SM90 GPU


def test_prefix_sharing_runs_one_kernel_call_per_attention_call():
    share = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    padded = one_step(make_trainer(False))

    make_trainer(True, **share)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **share)
        CALLS.clear()  # the architecture check's twin called it too
        packed = one_step(trainer)

    assert_same_step(padded, packed)
    # One call per layer and forward (the policy's and the reference's): the row's queries against keys gathered
    # with each rejected branch's prompt first, so the key boundaries are not the query boundaries
    calls = calls_of("varlen_attn")
    assert len(calls) == 2 * trainer.model.config.num_hidden_layers
    assert not any(call.details["same_boundaries"] for call in calls)
    assert {call.details["backend"] for call in calls} == {"flash"}


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


@pytest.mark.parametrize("model_type", POPULAR_TYPES + HYBRID_MODEL_TYPES)
def test_every_family_trains_one_step_equal_to_padded_trl_through_the_cuda_branches(model_type):
    padded = one_step(make_trainer(False, model_factory=factory(model_type)))

    packed = packed_step_under(all_stand_ins(), model_factory=factory(model_type))

    assert_same_step(padded, packed, grad_atol=STAND_IN_GRAD_ATOL_BY_MODEL.get(model_type, GRAD_ATOL))
    assert calls_of("varlen_attn") or model_type in SINK_FAMILIES, "no attention layer took the kernel branch"
    if model_type in HYBRID_MODEL_TYPES:
        # Packed rows reach every whole-row kernel of the model with int32 boundaries (the architecture check's
        # sequences alone call them without any)
        packed_calls = [call for call in CALLS if call.kernel != "varlen_attn" and call.boundaries is not None]
        assert all(call.boundaries.dtype == torch.int32 for call in packed_calls)
        kernels_called = {call.kernel for call in packed_calls}
        for mixer_class in hybrid_mixer_classes(model_type):
            with all_stand_ins():
                row_kernels = {kernel.name for kernel in mixer_kernels(mixer_class).kernels if kernel.boundary}
            assert row_kernels <= kernels_called, (mixer_class, row_kernels - kernels_called)


# ---- kernels that do not keep sequences apart ----


def test_a_conv_kernel_that_ignores_seq_idx_is_refused_by_the_check():
    make_tiny_model("lfm2", VOCAB_SIZE)
    leaky = {**MIXER_STAND_INS, "causal_conv1d_fn": leaky_causal_conv1d_stand_in}
    with stand_in_kernels(varlen=varlen_stand_in(), mixer_kernels=leaky):
        with pytest.raises(
            ValueError, match="Lfm2ShortConv layers ran the whole row through `causal_conv1d_fn`"
        ) as error:
            make_trainer(True, model_factory=factory("lfm2"))
    assert "uninstall causal-conv1d (the layers then run once per sequence)" in str(error.value)
    assert any(call.details.get("ignored") for call in calls_of("causal_conv1d_fn"))


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


def test_lfm3s_width_7_conv_which_the_kernel_rejects_is_refused_with_its_error():
    from transformers import AutoConfig

    from trl_padfree.cli.models import model_class_for

    model_class, config = model_class_for(AutoConfig.for_model("lfm3"))  # imports its module
    with all_stand_ins():
        verdict = check_architecture(model_class, config, ATTN_IMPLEMENTATION)

    conv = kernel_wrapper(vars(sys.modules[model_class.__module__])["causal_conv1d_fn"])
    if conv is None:  # transformers 5.23: LFM3's convolution is PyTorch code of its own, which runs per sequence
        assert verdict.exact, verdict.reason
    else:  # 5.24: it calls the causal-conv1d kernel with its width of 7, which the kernel rejects
        assert not verdict.exact
        assert "causal_conv1d only supports width between 2 and 4" in verdict.reason


def test_the_check_runs_the_twin_on_pytorch_fallbacks_when_gpu_kernels_are_installed(monkeypatch):
    """A GPU machine with causal-conv1d installed: transformers resolved the CUDA kernel, which the architecture
    check's CPU twin must not be handed (it would fail there, and refuse every hybrid model)."""
    import transformers.models.lfm2.modeling_lfm2 as modeling_lfm2

    def cuda_only(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):  # fmt: skip
        if not x.is_cuda:
            raise RuntimeError("Expected x.is_cuda() to be true, but got false.")
        raise AssertionError("unreachable on this machine")

    monkeypatch.setattr(
        modeling_lfm2, "causal_conv1d_fn", rewrapped(modeling_lfm2.causal_conv1d_fn, cuda_only)
    )
    assert mixer_kernels(modeling_lfm2.Lfm2ShortConv).whole_row  # what a GPU run picks

    model_class, config = modeling_lfm2.Lfm2ForCausalLM, make_tiny_model("lfm2", VOCAB_SIZE).config
    verdict = check_architecture(model_class, config, ATTN_IMPLEMENTATION)

    assert verdict.exact, verdict.reason
    assert modeling_lfm2.causal_conv1d_fn is not None and kernel_wrapper(
        modeling_lfm2.causal_conv1d_fn
    ).implementation is cuda_only  # restored after the check
