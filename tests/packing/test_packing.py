"""The pure tensor functions of `trl_padfree.packing`, against tensors computed by hand.

Most tests use the same awkward row: three sequences of lengths 3, 1 and 2, then a 2-token padding tail.

    tokens        | a a a | b | c c | _ _ |
    position_ids  | 0 1 2 | 0 | 0 1 | 0 1 |
    segment_ids   | 0 0 0 | 1 | 2 2 | 3 3 |
    cu_seq_lens   0       3   4     6
"""

import pytest
import torch

from trl_padfree.packing.layout import (
    cu_seq_lens_from_lengths,
    cu_seq_lens_from_position_ids,
    pad_length_to_multiple,
    padded_view_index,
    pair_tokens,
    position_ids_from_lengths,
    segment_ids_from_lengths,
    segment_sum,
    to_padded_view,
)

LENGTHS = [3, 1, 2]


def test_position_ids_restart_at_zero_for_every_segment():
    position_ids = position_ids_from_lengths(LENGTHS)

    assert position_ids.dtype == torch.long
    assert torch.equal(position_ids, torch.tensor([[0, 1, 2, 0, 0, 1]]))


def test_position_ids_of_a_single_one_token_segment():
    assert torch.equal(position_ids_from_lengths([1]), torch.tensor([[0]]))


@pytest.mark.parametrize(
    "lengths, expected",
    [
        pytest.param([3, 1, 2], [0, 3, 4, 6], id="three-segments"),
        pytest.param([5], [0, 5], id="single-segment"),
        pytest.param([1, 1, 1, 1], [0, 1, 2, 3, 4], id="one-token-segments"),
        pytest.param([2, 40, 1], [0, 2, 42, 43], id="one-long-segment"),
    ],
)
def test_cu_seq_lens_from_lengths_are_int32_boundaries(lengths, expected):
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)

    # varlen kernels (flash-attn, torch varlen_attn) require int32 boundaries
    assert cu_seq_lens.dtype == torch.int32
    assert torch.equal(cu_seq_lens, torch.tensor(expected, dtype=torch.int32))


def test_segment_ids_without_tail():
    segment_ids = segment_ids_from_lengths(torch.tensor(LENGTHS))

    assert torch.equal(segment_ids, torch.tensor([0, 0, 0, 1, 2, 2]))


def test_segment_ids_tail_gets_one_past_the_last_segment():
    segment_ids = segment_ids_from_lengths(torch.tensor(LENGTHS), total_length=8)

    assert torch.equal(segment_ids, torch.tensor([0, 0, 0, 1, 2, 2, 3, 3]))


def test_segment_ids_total_length_equal_to_the_sum_adds_no_tail():
    segment_ids = segment_ids_from_lengths(torch.tensor(LENGTHS), total_length=6)

    assert torch.equal(segment_ids, torch.tensor([0, 0, 0, 1, 2, 2]))


def test_segment_ids_skip_an_empty_segment():
    segment_ids = segment_ids_from_lengths(torch.tensor([2, 0, 1]))

    assert torch.equal(segment_ids, torch.tensor([0, 0, 2]))


def test_padded_view_index_points_each_cell_at_its_packed_position():
    index, valid = padded_view_index(torch.tensor([0, 3, 4]), torch.tensor(LENGTHS), width=3)

    # Invalid cells point at position 0, to be filled by the caller
    assert torch.equal(index, torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 0]]))
    assert torch.equal(valid, torch.tensor([[True, True, True], [True, False, False], [True, True, False]]))


def test_padded_view_index_narrower_than_the_longest_sequence():
    # The shifted view of the forward: width and lengths both one less
    index, valid = padded_view_index(torch.tensor([0, 3, 4]), torch.tensor(LENGTHS) - 1, width=2)

    assert torch.equal(index, torch.tensor([[0, 1], [0, 0], [4, 0]]))
    assert torch.equal(valid, torch.tensor([[True, True], [False, False], [True, False]]))


def test_to_padded_view_gathers_and_fills():
    packed = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0])  # last two: padding tail
    index, valid = padded_view_index(torch.tensor([0, 3, 4]), torch.tensor(LENGTHS), width=3)

    padded = to_padded_view(packed, index, valid, fill_value=-1.0)

    assert torch.equal(padded, torch.tensor([[10.0, 11.0, 12.0], [13.0, -1.0, -1.0], [14.0, 15.0, -1.0]]))


def test_to_padded_view_keeps_trailing_dimensions():
    packed = torch.arange(16).reshape(8, 2)  # (T, 2)
    index, valid = padded_view_index(torch.tensor([0, 3, 4]), torch.tensor(LENGTHS), width=3)

    padded = to_padded_view(packed, index, valid)

    expected = torch.tensor(
        [
            [[0, 1], [2, 3], [4, 5]],
            [[6, 7], [0, 0], [0, 0]],
            [[8, 9], [10, 11], [0, 0]],
        ]
    )
    assert torch.equal(padded, expected)


def test_to_padded_view_gradient_flows_back_to_the_right_packed_positions():
    packed = torch.zeros(8, requires_grad=True)
    index, valid = padded_view_index(torch.tensor([0, 3, 4]), torch.tensor(LENGTHS), width=3)
    cell_weights = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])

    (to_padded_view(packed, index, valid) * cell_weights).sum().backward()

    # Valid cells send their weight home; invalid cells (5, 6, 9) also point at position 0 but must send nothing,
    # and the padding tail (positions 6, 7) is never read
    assert torch.equal(packed.grad, torch.tensor([1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 0.0, 0.0]))


def test_segment_sum_drops_the_padding_segment():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0, 200.0])
    segment_ids = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])

    sums = segment_sum(values, segment_ids, num_segments=3)

    assert torch.equal(sums, torch.tensor([6.0, 4.0, 11.0]))


def test_segment_sum_of_a_segment_without_tokens_is_zero():
    sums = segment_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 2]), num_segments=3)

    assert torch.equal(sums, torch.tensor([3.0, 0.0, 3.0]))


def test_segment_sum_gradient_reaches_real_tokens_only():
    values = torch.ones(8, requires_grad=True)
    segment_ids = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])

    (segment_sum(values, segment_ids, num_segments=3) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()

    assert torch.equal(values.grad, torch.tensor([1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "length, multiple, expected",
    [
        pytest.param(17, None, 17, id="no-multiple"),
        pytest.param(17, 0, 17, id="multiple-zero"),
        pytest.param(16, 8, 16, id="already-a-multiple"),
        pytest.param(17, 8, 24, id="one-over"),
        pytest.param(1, 8, 8, id="one-token"),
        pytest.param(13, 1, 13, id="multiple-one"),
        pytest.param(0, 8, 0, id="empty"),
    ],
)
def test_pad_length_to_multiple(length, multiple, expected):
    assert pad_length_to_multiple(length, multiple) == expected


@pytest.mark.parametrize(
    "position_ids, expected",
    [
        pytest.param([0, 1, 2, 0, 0, 1], [0, 3, 4, 6], id="three-segments"),
        pytest.param([0, 1, 2, 3], [0, 4], id="single-sequence"),
        pytest.param([0], [0, 1], id="single-token"),
        pytest.param([5, 6, 7, 0, 1], [0, 3, 5], id="row-starts-at-nonzero-position"),
        pytest.param([0, 1, 2, 7, 8], [0, 3, 5], id="jump-not-to-zero"),
        pytest.param([0, 0, 0], [0, 1, 2, 3], id="one-token-segments"),
    ],
)
def test_cu_seq_lens_from_position_ids(position_ids, expected):
    cu_seq_lens = cu_seq_lens_from_position_ids(torch.tensor([position_ids]))

    assert cu_seq_lens.dtype == torch.int32
    assert torch.equal(cu_seq_lens, torch.tensor(expected, dtype=torch.int32))


def test_cu_seq_lens_from_position_ids_inverts_position_ids_from_lengths():
    lengths = [7, 1, 12, 2, 1]

    cu_seq_lens = cu_seq_lens_from_position_ids(position_ids_from_lengths(lengths))

    assert torch.equal(cu_seq_lens, cu_seq_lens_from_lengths(lengths))


def test_pair_tokens_cut_each_sequence_like_the_collator():
    assert pair_tokens(10, 5, 7, None) == 32
    assert pair_tokens(10, 5, 7, 12) == 24  # 15 -> 12, 17 -> 12
