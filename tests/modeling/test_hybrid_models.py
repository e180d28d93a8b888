"""Hybrid linear-attention and state-space models packed exactly (mixers.py): every stateful mixer restarts at each
sequence of the row, so packed training equals TRL's padded training.

    families          qwen3_5, qwen3_5_moe, qwen3_next (gated delta rule), lfm2, lfm2_moe (short convolution),
                      nemotron_h, falcon_h1, bamba, zamba2, granitemoehybrid (Mamba2)
    packed forward    float32, log-probs and every gradient vs each sequence alone (tolerances.HYBRID_*)
    trainer           one step vs TRL padded: loss within 1.8e-7, gradients within 6e-8 (the fp32 step bounds)
    refused           jamba, mamba, falcon_mamba: their layers hand the mixers no keyword arguments

CPU runs the per-segment path; the packed-kernel path (seq_idx / cu_seqlens) needs CUDA and the kernel packages and is
tested by the `gpu` test at the end.
"""

import logging

import pytest
import torch
from stand_in_kernels import MIXER_STAND_INS
from tiny_architectures import HYBRID_MODEL_TYPES, make_tiny_model, model_factory
from tiny_fixtures import make_tokenizer
from tolerances import HYBRID_GRAD_ATOL, HYBRID_LOG_PROB_ATOL
from trainer_utils import assert_same_step, make_trainer, one_step, with_checkpointing
from transformers import AutoConfig

from trl_padfree.cli.models import model_class_for
from trl_padfree.modeling import kernels
from trl_padfree.modeling.check.packability import check_architecture
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.kernels.mixers import mixer_kernels
from trl_padfree.modeling.mixers import (
    MixerSegments,
    mixer_calls,
    mixer_classes,
    mixers_run_per_segment,
    stateful_mixers,
)
from trl_padfree.modeling.packed_forward import PackedBatch, add_packed_forward
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import cu_seq_lens_from_lengths, position_ids_from_lengths
from trl_padfree.refusals.parallel import check_split_rows_without_stateful_mixers, check_zero3_mixer_calls

VOCAB_SIZE = len(make_tokenizer())
# One-token, odd and longer sequences (the Mamba2 scans of the tiny models run in chunks of 8)
LENGTHS = (11, 1, 17, 6)
# Families the GPU test runs: one of each mixer kind
GPU_FAMILIES = ("qwen3_5_text", "lfm2", "nemotron_h")


def packed_batch(lengths, vocab_size: int = VOCAB_SIZE) -> PackedBatch:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (1, sum(lengths)), generator=generator)
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids_from_lengths(lengths),
        completion_mask=torch.ones_like(input_ids),
        cu_seq_lens=cu_seq_lens,
        max_length=max(lengths),
        seq_lens=torch.tensor(lengths),
    )


def test_segments_of_a_row():
    segments = MixerSegments.from_lengths([3, 1, 0, 2])  # an empty (padding) segment is dropped

    assert segments.bounds == [(0, 3), (3, 4), (4, 6)]
    assert segments.cu_seqlens.tolist() == [0, 3, 4, 6] and segments.cu_seqlens.dtype == torch.int32
    assert segments.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2]] and segments.seq_idx.dtype == torch.int32


def test_prefix_sharing_segments_repeat_each_prompt_in_front_of_its_rejected_branch():
    pairs = [
        {"prompt_ids": [5, 6, 7, 8], "chosen_ids": [9, 10], "rejected_ids": [11, 12, 13]},
        {"prompt_ids": [20, 21, 22], "chosen_ids": [23], "rejected_ids": [24, 25]},
    ]
    batch = PackedBatch.from_collated(
        concatenated_inputs(pairs, prefix_sharing=True, prefix_sharing_min_prompt_tokens=2, pad_to_multiple_of=8)
    )
    segments = MixerSegments.of_packed_batch(batch)

    # The mixer row holds every sequence whole, as it would stand alone, then the row's padding
    mixer_row = batch.input_ids[0, segments.gather_index].tolist()
    sequences = [pair["prompt_ids"] + pair[key] for key in ("chosen_ids", "rejected_ids") for pair in pairs]
    assert [mixer_row[start:end] for start, end in segments.bounds[:-1]] == sequences
    assert segments.bounds[-1][1] - segments.bounds[-1][0] == batch.row_length - batch.real_row_tokens
    # Each row position takes its output from its own sequence: a prompt token from the chosen sequence
    assert segments.gather_index[segments.output_index].tolist() == list(range(batch.row_length))


@pytest.mark.parametrize("model_type", HYBRID_MODEL_TYPES)
def test_packed_forward_equals_each_sequence_alone(model_type):
    model = make_tiny_model(model_type, VOCAB_SIZE, attn_implementation="padfree_varlen")
    reference = make_tiny_model(model_type, VOCAB_SIZE, attn_implementation="eager")
    add_packed_forward(model)
    batch = packed_batch(LENGTHS)

    log_probs = model(packed_batch=batch, use_cache=False).logits.log_softmax(-1)
    log_probs[batch.token_valid].sum().backward()
    alone = []
    for ids in batch.input_ids.split(LENGTHS, dim=1):
        alone.append(reference(input_ids=ids, use_cache=False).logits.log_softmax(-1)[0])
        alone[-1].sum().backward()

    # each mixer ran per sequence (the whole-row kernels run on CUDA, or under stand-ins: tests/modeling/test_kernels.py)
    assert all(calls.ran == calls.segmented > 0 and not calls.whole_row for calls in mixer_calls(model).values())
    torch.testing.assert_close(log_probs[batch.token_valid], torch.cat(alone), atol=HYBRID_LOG_PROB_ATOL, rtol=0)
    largest = max(parameter.grad.abs().max() for parameter in reference.parameters())
    for (name, packed), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(packed.grad, expected.grad, atol=HYBRID_GRAD_ATOL * largest, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", HYBRID_MODEL_TYPES)
def test_one_step_matches_padded(model_type):
    padded = one_step(make_trainer(False, model_factory=model_factory(model_type)))
    packed_trainer = make_trainer(True, model_factory=model_factory(model_type))

    assert packed_trainer.model._padfree_stateful_mixers == tuple(mixer_classes(packed_trainer.model))
    assert_same_step(padded, one_step(packed_trainer))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_prefix_sharing_carries_each_prompts_state_into_its_rejected_branch(model_type):
    options = dict(model_factory=model_factory(model_type))
    share = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    padded = one_step(make_trainer(False, **options))
    trainer = make_trainer(True, **options, **share)
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(8)])
    assert int((batch["shared_prefix_lens"] > 0).sum()) > 0  # the row really shares prompts

    assert_same_step(padded, one_step(trainer))


@pytest.mark.parametrize("use_reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_checkpointing_recomputes_per_sequence(use_reentrant):
    options = dict(model_factory=model_factory("qwen3_5_text"))
    padded = one_step(with_checkpointing(make_trainer(False, **options), use_reentrant))
    packed = one_step(with_checkpointing(make_trainer(True, **options), use_reentrant))

    assert_same_step(padded, packed)


# bf16 weights train to a finite loss: a short-conv and a Mamba-2 hybrid by default (TRL's default precision runs every
# family through the CUDA branches in tests/modeling/test_kernels.py), the other eight with -m slow
BF16_BY_DEFAULT = ("lfm2", "nemotron_h")


@pytest.mark.parametrize(
    "model_type",
    [
        model_type if model_type in BF16_BY_DEFAULT else pytest.param(model_type, marks=pytest.mark.slow)
        for model_type in HYBRID_MODEL_TYPES
    ],
)
def test_bf16_models_train(model_type):
    trainer = make_trainer(True, model_factory=model_factory(model_type, dtype=torch.bfloat16))

    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(torch.tensor(one_step(trainer).loss))


def test_the_path_that_runs_is_logged(caplog):
    kernels.log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.kernels"):
        one_step(make_trainer(True, model_factory=model_factory("lfm2")))

    assert "Lfm2ShortConv layers run once per sequence of the packed row, state starting fresh (on CPU)" in caplog.text


def test_whole_row_kernels_take_the_row_with_its_boundaries():
    seen = []

    def mixer_forward(hidden_states, **kwargs):
        seen.append((hidden_states.shape[1], kwargs))
        return hidden_states * 2

    segments = MixerSegments.from_lengths([3, 2])
    hidden_states = torch.randn(1, 5, 4)

    per_segment = segments.run(mixer_forward, hidden_states, {}, whole_row=False)
    assert [length for length, _ in seen] == [3, 2] and seen[0][1] == {}
    seen.clear()
    packed = segments.run(mixer_forward, hidden_states, {}, whole_row=True)
    assert [length for length, _ in seen] == [5]
    assert seen[0][1]["seq_idx"].tolist() == [[0, 0, 0, 1, 1]] and seen[0][1]["cu_seq_lens_q"].tolist() == [0, 3, 5]
    torch.testing.assert_close(packed, per_segment)


def test_a_packed_row_without_segments_is_an_error():
    model = make_tiny_model("lfm2", VOCAB_SIZE, attn_implementation="padfree_varlen")
    add_packed_forward(model)
    batch = packed_batch(LENGTHS)

    with pytest.raises(ValueError, match="Lfm2ShortConv got a packed row without its sequence boundaries"):
        model(**batch.model_kwargs())  # packing keywords, but not through the packed forward


def test_sequence_parallelism_is_refused_for_stateful_mixers():
    check_split_rows_without_stateful_mixers(())
    with pytest.raises(ValueError, match="Qwen3_5GatedDeltaNet layers carry state along the row.*sp_size=1"):
        check_split_rows_without_stateful_mixers(("Qwen3_5GatedDeltaNet",))


def test_zero3_with_uneven_batches_is_refused_where_mixers_run_per_sequence():
    model = make_tiny_model("lfm2", VOCAB_SIZE)
    assert mixers_run_per_segment(model, torch.device("cpu")) == ["Lfm2ShortConv"]
    with stand_in_kernels(mixer_kernels=MIXER_STAND_INS):  # CUDA's whole-row kernels: one call per row
        assert mixers_run_per_segment(model, torch.device("cpu")) == []

    for uneven, stage, processes in (("", 3, 2), ("max_tokens_per_batch", 2, 2), ("max_tokens_per_batch", 3, 1)):
        check_zero3_mixer_calls(["Lfm2ShortConv"], stage, processes, uneven)
    check_zero3_mixer_calls([], 3, 2, "max_tokens_per_batch")
    with pytest.raises(ValueError, match=r"ZeRO-3 cannot train this model with max_tokens_per_batch over 2 .*"
                       r"Lfm2ShortConv layers run once per sequence.*fsdp2.*zero2.*causal-conv1d"):  # fmt: skip
        check_zero3_mixer_calls(["Lfm2ShortConv"], 3, 2, "max_tokens_per_batch")


@pytest.mark.parametrize("model_type, mixer", [
    ("jamba", "JambaMambaMixer"), ("mamba", "MambaMixer"), ("falcon_mamba", "FalconMambaMixer")])  # fmt: skip
def test_mixers_the_model_gives_no_boundaries_are_refused_with_the_reason(model_type, mixer):
    model_class, config = model_class_for(AutoConfig.for_model(model_type))
    verdict = check_architecture(model_class, config, "padfree_varlen")

    assert not verdict.exact
    assert f"its {mixer} layers carry state along the row" in verdict.reason
    assert "pass no keyword arguments on to them" in verdict.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", GPU_FAMILIES)
def test_cuda_packed_forward_equals_each_sequence_alone(model_type):
    # With causal-conv1d / flash-linear-attention / mamba-ssm installed this runs the packed kernels, else per segment
    model = make_tiny_model(model_type, VOCAB_SIZE, attn_implementation="padfree_varlen").cuda()
    reference = make_tiny_model(model_type, VOCAB_SIZE, attn_implementation="eager").cuda()
    add_packed_forward(model)
    batch = packed_batch(LENGTHS)
    batch = PackedBatch(**{name: getattr(batch, name).cuda() for name in (
        "input_ids", "position_ids", "completion_mask", "cu_seq_lens", "seq_lens")}, max_length=batch.max_length)  # fmt: skip

    with torch.no_grad():
        log_probs = model(packed_batch=batch, use_cache=False).logits.log_softmax(-1)[batch.token_valid]
        alone = torch.cat([
            reference(input_ids=ids, use_cache=False).logits.log_softmax(-1)[0]
            for ids in batch.input_ids.split(LENGTHS, dim=1)])  # fmt: skip

    torch.testing.assert_close(log_probs, alone, atol=2e-4, rtol=0)  # TF32 and kernel rounding
    # Where every kernel the mixer calls takes its boundaries (the packages installed), the whole row ran through them
    for mixer_class in {type(mixer) for mixer in stateful_mixers(model)}:
        calls = mixer_calls(model)[mixer_class.__name__]
        assert bool(calls.whole_row) == mixer_kernels(mixer_class).whole_row, mixer_kernels(mixer_class).reason
