"""Gemma 3's images attend to themselves both ways: a packed row with image spans attends in a causal and a
bidirectional call laid out from the collator's host integers (trl_padfree/modeling/attention/bidirectional.py).

    layout       equal to dense attention under Gemma 3's mask (same sequence, causal OR same image, AND the window),
                 plain rows and prefix-sharing rows, forward and gradients, on the CPU path
    kernel       through the strict stand-in of torch's varlen kernel in bf16: two kernel calls per attention call,
                 no host read, no token computed twice, output equal to the dense reference within bf16 rounding
    training     Gemma 3 trains one step equal to TRL's padded vision trainer in TRL's default precision through the
                 stand-in, two kernel calls per attention call, row and shared prefix
    collator     the spans the collator records are the runs Gemma 3's `token_type_ids` mark
"""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads, kernel_call
from stand_in_kernels import CALLS, calls_of, varlen_stand_in
from tiny_vision import make_vision_trainer, vision_preference_rows
from tolerances import ATTENTION_ATOL, BF16_ATTENTION_ATOL, BF16_ATTENTION_RTOL
from trainer_utils import PRECISIONS, assert_same_step, first_batch, one_step

from trl_padfree.modeling.attention.bidirectional import SpanAttention
from trl_padfree.modeling.attention.rows import PackedRow
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.kernels.attention import VarlenKernel
from trl_padfree.packing.layout import HOST_ROW, HostRow, cu_seq_lens_from_lengths, token_runs
from trl_padfree.packing.prefix_sharing import segment_keys
from trl_padfree.packing.vision import IMAGE_INPUTS

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
# Sequences of 9, 6, 1 and 11 tokens, then 3 of padding; images (row positions) in the first, second and last
LENGTHS = (9, 6, 1, 11, 3)
SPANS = ((2, 5), (10, 13), (17, 19), (22, 25))
TRL_DEFAULT = PRECISIONS["trl_default"]


def dense_reference(query, key, value, lengths, spans, window=None, key_ranges=None):
    """Float64 attention of each row position over the keys Gemma 3's mask lets it see."""
    total = sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(total)
    span_id = torch.full((total,), -1)
    for index, (start, end) in enumerate(spans):
        span_id[start:end] = index
    offset = position - torch.tensor(bounds)[segment]
    query_pos, key_pos = offset.unsqueeze(1), offset.unsqueeze(0)
    same = segment.unsqueeze(1) == segment.unsqueeze(0)
    same_span = (span_id.unsqueeze(1) == span_id.unsqueeze(0)) & (span_id.unsqueeze(1) >= 0)
    allowed = same & ((key_pos <= query_pos) | same_span)
    if window is not None:
        allowed &= key_pos > query_pos - window
    if key_ranges is not None:  # prefix sharing: a branch's queries also see its prompt's keys, all before them
        for branch, ranges in enumerate(key_ranges):
            for start, end in ranges[:-1]:
                rows = slice(bounds[branch], bounds[branch + 1])
                allowed[rows, start:end] = True
    q, k, v = (tensor[0].double() for tensor in (query, key, value))
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1).unsqueeze(0)


def random_inputs(total, requires_grad=False):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, HEADS, total, HEAD_DIM), (1, KV_HEADS, total, HEAD_DIM), (1, KV_HEADS, total, HEAD_DIM)]
    return [torch.randn(shape, generator=generator).requires_grad_(requires_grad) for shape in shapes]


def span_row(lengths=LENGTHS, spans=SPANS) -> PackedRow:
    bounds = tuple(cu_seq_lens_from_lengths(lengths).tolist())
    host = HostRow(bounds, tuple(lengths[:-1]), bounds[:-2], (0,) * 4, (0,) * 4, image_spans=spans)
    layout = SpanAttention.of_row(segment_keys(host), bounds, spans, torch.device("cpu"))
    return PackedRow(cu_seq_lens_from_lengths(lengths), max(lengths), spans=layout, bounds=bounds)


def attend(row, query, key, value, window=None):
    options = dict(scaling=HEAD_DIM**-0.5, sliding_window=window, dropout=0.0, softcap=None, sinks=None)
    return row.attend(query, key, value, row.cu_seq_lens, row.max_length, options)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding"])
def test_the_two_calls_equal_dense_attention_under_gemma3s_mask(window):
    query, key, value = random_inputs(sum(LENGTHS), requires_grad=True)

    output = attend(span_row(), query, key, value, window)
    expected = dense_reference(query, key, value, LENGTHS, SPANS, window)

    torch.testing.assert_close(output.double(), expected, atol=ATTENTION_ATOL, rtol=0)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((output * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad.double(), atol=ATTENTION_ATOL, rtol=0)


def test_a_prefix_sharing_branch_reads_its_prompts_images_causally():
    # Segment 0: a prompt (with an image at 2..5) and its chosen completion; segment 1: the rejected branch, which
    # reads the prompt's 7 tokens first, then its own 4
    lengths, spans = (9, 4, 3), ((2, 5),)
    bounds = (0, 9, 13, 16)
    host = HostRow(bounds, (9, 11), (0, 9), (0, 0), (0, 7), image_spans=spans)
    layout = SpanAttention.of_row(segment_keys(host), bounds, spans, torch.device("cpu"))
    row = PackedRow(cu_seq_lens_from_lengths(lengths), 9, spans=layout, bounds=bounds)
    query, key, value = random_inputs(sum(lengths))

    output = attend(row, query, key, value)

    expected = dense_reference(query, key, value, lengths, spans, key_ranges=segment_keys(host))
    torch.testing.assert_close(output.double(), expected, atol=ATTENTION_ATOL, rtol=0)


def counted_stand_in() -> VarlenKernel:
    stand_in = varlen_stand_in("2.15")

    def varlen_attn(*args, **kwargs):
        with kernel_call():
            return stand_in.function(*args, **kwargs)

    varlen_attn.__wrapped__ = stand_in.function  # its signature
    return VarlenKernel(varlen_attn, stand_in.capability)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding"])
def test_the_kernel_runs_two_calls_without_reading_the_host_or_computing_a_token_twice(window):
    query, key, value = (tensor.bfloat16() for tensor in random_inputs(sum(LENGTHS)))
    row = span_row()
    CALLS.clear()

    with stand_in_kernels(varlen=counted_stand_in()), HostReads() as reads:
        output = attend(row, query, key, value, window)

    calls = calls_of("varlen_attn")
    assert reads.count == 0
    assert [call.details["window_size"] for call in calls] == (
        [(-1, 0), (-1, -1)] if window is None else [(window - 1, 0), (window - 1, -1)]
    )
    # Every row position is a query of exactly one call
    assert sum(int(call.boundaries[-1]) for call in calls) == sum(LENGTHS)
    expected = dense_reference(query, key, value, LENGTHS, SPANS, window)
    torch.testing.assert_close(
        output.double(), expected, atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL
    )  # bf16 inputs


@pytest.mark.parametrize("prefix_sharing", [False, True], ids=["row", "shared-prefix"])
def test_gemma3_trains_one_step_equal_to_padded_trl_through_the_kernel(prefix_sharing):
    data = vision_preference_rows("gemma3", 8, images_per_row=(1, 2, 1, 1))
    options = dict(TRL_DEFAULT.trainer_options)
    padded = one_step(make_vision_trainer("gemma3", False, data, **options))
    make_vision_trainer("gemma3", True, data)  # imports the model's modules
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_vision_trainer("gemma3", True, data, prefix_sharing=prefix_sharing, **options)
        CALLS.clear()
        packed = one_step(trainer)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    layers = trainer.model.config.get_text_config().num_hidden_layers
    calls = calls_of("varlen_attn")
    # Policy and reference forwards, every language-model layer: a causal and a bidirectional call
    assert len(calls) == 2 * 2 * layers
    assert {call.details["window_size"][1] for call in calls} == {0, -1}


def test_the_collators_spans_are_the_runs_gemma3_marks():
    trainer = make_vision_trainer("gemma3", True, vision_preference_rows("gemma3", 4, images_per_row=(1, 2, 1, 1)))
    batch = first_batch(trainer)

    marks = batch[IMAGE_INPUTS]["token_type_ids"][0].tolist()
    assert batch[HOST_ROW].image_spans == token_runs(marks, 1)
    assert len(batch[HOST_ROW].image_spans) == 2 * 5  # each image of each pair's two sequences
