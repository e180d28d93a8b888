"""`PaddingFreePreferenceCollator` and `concatenated_inputs` against hand-computed rows and TRL's padded collator."""

import math

import numpy as np
import pytest
import torch
from trl.trainer.dpo_trainer import DataCollatorForPreference

from trl_padfree import PaddingFreePreferenceCollator, concatenated_inputs
from trl_padfree.packing.layout import HostRow

# The docstring example: rows chosen 0, chosen 1, rejected 0, rejected 1
DOC_EXAMPLES = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11]},
]

# Awkward on purpose: a one-token completion, an empty prompt, one sequence that dwarfs the others
AWKWARD_EXAMPLES = [
    {"prompt_ids": [11, 12, 13, 14, 15], "chosen_ids": [16], "rejected_ids": [17, 18, 19]},
    {"prompt_ids": [], "chosen_ids": [21, 22], "rejected_ids": [23]},
    {"prompt_ids": [31], "chosen_ids": list(range(40, 66)), "rejected_ids": [32, 33]},
]


def packed_segments(batch, key):
    """The per-sequence slices of a packed `(1, T)` tensor, padding segment excluded."""
    starts = batch["cu_seq_lens_q"][: len(batch["seq_lens"])].tolist()
    return [
        batch[key][0, start : start + length].tolist()
        for start, length in zip(starts, batch["seq_lens"].tolist(), strict=True)
    ]


def padded_rows(batch, key):
    """The real (attention_mask == 1) tokens of each row of TRL's padded batch."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch[key], batch["attention_mask"], strict=True)]


def with_ref_logps(examples):
    return [
        {**example, "ref_chosen_logps": -1.5 - index, "ref_rejected_logps": -7.25 + index}
        for index, example in enumerate(examples)
    ]


def test_docstring_example():
    batch = PaddingFreePreferenceCollator(pad_token_id=0)(DOC_EXAMPLES)

    assert set(batch) == {
        "input_ids",
        "position_ids",
        "completion_mask",
        "seq_lens",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "host_row",
    }
    # The boundaries again as host integers, for the step to build its indices without reading the device (and the
    # 6 completion tokens, for the row's cost)
    assert batch["host_row"] == HostRow((0, 5, 8, 12, 16), (5, 3, 4, 4), (0, 5, 8, 12), (0,) * 4, (0,) * 4, 6)
    #                                       |  chosen 0   |chosen 1| rejected 0 | rejected 1  |
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 7, 8, 9, 1, 2, 3, 6, 7, 8, 10, 11]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]]))
    assert torch.equal(batch["completion_mask"], torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1]]))
    assert torch.equal(batch["seq_lens"], torch.tensor([5, 3, 4, 4]))
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 5, 8, 12, 16], dtype=torch.int32))
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert batch["max_length_q"] == batch["max_length_k"] == 5


def test_cu_seq_lens_k_is_not_the_same_tensor_as_q():
    batch = concatenated_inputs(DOC_EXAMPLES)

    # An in-place edit of one (e.g. moving to a device with copy_) must not change the other
    assert batch["cu_seq_lens_k"].data_ptr() != batch["cu_seq_lens_q"].data_ptr()


def test_awkward_lengths():
    batch = concatenated_inputs(AWKWARD_EXAMPLES)

    long_completion = list(range(40, 66))  # 26 tokens
    expected_tokens = [
        [11, 12, 13, 14, 15, 16],  # one-token completion
        [21, 22],  # empty prompt
        [31, *long_completion],  # dwarfs the rest
        [11, 12, 13, 14, 15, 17, 18, 19],
        [23],  # empty prompt and a one-token completion: a one-token sequence
        [31, 32, 33],
    ]
    expected_completion_mask = [
        [0, 0, 0, 0, 0, 1],
        [1, 1],
        [0] + [1] * 26,
        [0, 0, 0, 0, 0, 1, 1, 1],
        [1],
        [0, 1, 1],
    ]
    assert packed_segments(batch, "input_ids") == expected_tokens
    assert packed_segments(batch, "completion_mask") == expected_completion_mask
    assert packed_segments(batch, "position_ids") == [list(range(len(tokens))) for tokens in expected_tokens]
    assert torch.equal(batch["seq_lens"], torch.tensor([6, 2, 27, 8, 1, 3]))
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 6, 8, 35, 43, 44, 47], dtype=torch.int32))
    assert batch["input_ids"].shape == (1, 47)
    assert batch["max_length_q"] == batch["max_length_k"] == 27


def test_single_pair_of_one_token_completions():
    batch = concatenated_inputs([{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8]}])

    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7, 5, 6, 8]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert torch.equal(batch["completion_mask"], torch.tensor([[0, 0, 1, 0, 0, 1]]))
    assert torch.equal(batch["seq_lens"], torch.tensor([3, 3]))
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 3, 6], dtype=torch.int32))
    assert batch["max_length_q"] == 3


def test_accepts_tuples_of_token_ids():
    examples = [{"prompt_ids": (1, 2), "chosen_ids": (3,), "rejected_ids": (4, 5)}]

    batch = concatenated_inputs(examples)

    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 1, 2, 4, 5]]))


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("max_length", [1, 4, 7, 100], ids=lambda n: f"max_length={n}")
def test_truncation_keeps_the_same_tokens_as_trl(truncation_mode, max_length):
    trl_collator = DataCollatorForPreference(pad_token_id=0, max_length=max_length, truncation_mode=truncation_mode)
    collator = PaddingFreePreferenceCollator.from_padded(trl_collator)

    padded = trl_collator(AWKWARD_EXAMPLES)
    packed = collator(AWKWARD_EXAMPLES)

    assert packed_segments(packed, "input_ids") == padded_rows(padded, "input_ids")
    assert packed_segments(packed, "completion_mask") == padded_rows(padded, "completion_mask")
    assert packed["seq_lens"].tolist() == padded["attention_mask"].sum(1).tolist()
    assert packed["max_length_q"] == padded["input_ids"].shape[1]


def test_truncation_by_hand():
    examples = [{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6], "rejected_ids": [7]}]

    keep_start = concatenated_inputs(examples, max_length=3, truncation_mode="keep_start")
    keep_end = concatenated_inputs(examples, max_length=3, truncation_mode="keep_end")

    # keep_start cuts the whole completion; keep_end keeps the end of the prompt
    assert torch.equal(keep_start["input_ids"], torch.tensor([[1, 2, 3, 1, 2, 3]]))
    assert torch.equal(keep_start["completion_mask"], torch.tensor([[0, 0, 0, 0, 0, 0]]))
    assert torch.equal(keep_end["input_ids"], torch.tensor([[4, 5, 6, 3, 4, 7]]))
    assert torch.equal(keep_end["completion_mask"], torch.tensor([[0, 1, 1, 0, 0, 1]]))
    assert torch.equal(keep_end["position_ids"], torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert torch.equal(keep_end["cu_seq_lens_q"], torch.tensor([0, 3, 6], dtype=torch.int32))


def test_pad_to_multiple_of_adds_one_trailing_padding_segment():
    batch = concatenated_inputs(DOC_EXAMPLES, pad_token_id=99, pad_to_multiple_of=6)

    # 16 real tokens -> 18: one 2-token padding segment, positions restarting at 0, never a sequence of the batch
    #   | 5 | 3 | 4 | 4 | pad pad |
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 7, 8, 9, 1, 2, 3, 6, 7, 8, 10, 11, 99, 99]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]))
    assert torch.equal(
        batch["completion_mask"], torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0]])
    )
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 5, 8, 12, 16, 18], dtype=torch.int32))
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert torch.equal(batch["seq_lens"], torch.tensor([5, 3, 4, 4]))
    assert batch["max_length_q"] == batch["max_length_k"] == 5


def test_pad_to_multiple_of_a_length_already_a_multiple_adds_nothing():
    batch = concatenated_inputs(DOC_EXAMPLES, pad_to_multiple_of=8)

    assert batch["input_ids"].shape == (1, 16)
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 5, 8, 12, 16], dtype=torch.int32))


def test_padding_segment_longer_than_every_sequence_sets_max_length():
    batch = concatenated_inputs(DOC_EXAMPLES, pad_to_multiple_of=32)

    # A varlen kernel needs the longest segment, the padding one included
    assert torch.equal(batch["cu_seq_lens_q"], torch.tensor([0, 5, 8, 12, 16, 32], dtype=torch.int32))
    assert batch["position_ids"][0, 16:].tolist() == list(range(16))
    assert batch["max_length_q"] == batch["max_length_k"] == 16
    assert torch.equal(batch["seq_lens"], torch.tensor([5, 3, 4, 4]))


@pytest.mark.parametrize(
    "pad_to_multiple_of, expected_mask",
    [
        pytest.param(None, [1] * 16, id="no-padding"),
        pytest.param(6, [1] * 16 + [0, 0], id="padding-segment"),
    ],
)
def test_return_attention_mask(pad_to_multiple_of, expected_mask):
    collator = PaddingFreePreferenceCollator(
        pad_token_id=0, pad_to_multiple_of=pad_to_multiple_of, return_attention_mask=True
    )

    batch = collator(DOC_EXAMPLES)

    assert torch.equal(batch["attention_mask"], torch.tensor([expected_mask]))


def test_reference_log_probs_pass_through():
    batch = concatenated_inputs(with_ref_logps(DOC_EXAMPLES))

    assert torch.equal(batch["ref_chosen_logps"], torch.tensor([-1.5, -2.5]))
    assert torch.equal(batch["ref_rejected_logps"], torch.tensor([-7.25, -6.25]))


def test_integer_reference_log_probs_are_accepted():
    examples = [{**DOC_EXAMPLES[0], "ref_chosen_logps": -3, "ref_rejected_logps": 0}]

    batch = concatenated_inputs(examples)

    assert batch["ref_chosen_logps"].tolist() == [-3]
    assert batch["ref_rejected_logps"].tolist() == [0]


@pytest.mark.parametrize(
    "examples",
    [
        pytest.param(DOC_EXAMPLES, id="doc"),
        pytest.param(AWKWARD_EXAMPLES, id="awkward"),
        pytest.param(with_ref_logps(AWKWARD_EXAMPLES), id="ref-logps"),
    ],
)
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"max_length": 5, "truncation_mode": "keep_end"}, id="keep-end"),
        pytest.param({"max_length": 4, "pad_to_multiple_of": 3}, id="keep-start-multiple"),
        pytest.param({"pad_token_id": 7, "pad_to_multiple_of": 8}, id="multiple"),
    ],
)
def test_padding_free_false_is_exactly_trls_collator(examples, settings):
    settings = {"pad_token_id": 0, **settings}

    expected = DataCollatorForPreference(**settings)(examples)
    batch = PaddingFreePreferenceCollator(padding_free=False, **settings)(examples)

    assert list(batch) == list(expected)
    for key in expected:
        assert batch[key].dtype == expected[key].dtype, key
        assert torch.equal(batch[key], expected[key]), key


def test_from_padded_copies_every_field():
    trl_collator = DataCollatorForPreference(
        pad_token_id=7, max_length=9, truncation_mode="keep_end", pad_to_multiple_of=4, return_tensors="pt"
    )

    collator = PaddingFreePreferenceCollator.from_padded(trl_collator)

    assert isinstance(collator, PaddingFreePreferenceCollator)
    assert (collator.pad_token_id, collator.max_length, collator.truncation_mode) == (7, 9, "keep_end")
    assert (collator.pad_to_multiple_of, collator.return_tensors) == (4, "pt")
    assert collator.padding_free is True
    assert collator.return_attention_mask is False


def test_from_padded_overrides():
    trl_collator = DataCollatorForPreference(pad_token_id=7, max_length=9)

    collator = PaddingFreePreferenceCollator.from_padded(trl_collator, max_length=3, padding_free=False)

    assert (collator.pad_token_id, collator.max_length, collator.padding_free) == (7, 3, False)


def test_is_a_trl_collator():
    # TRL's trainer type-checks and copies its collator; the subclass must pass for one
    assert issubclass(PaddingFreePreferenceCollator, DataCollatorForPreference)


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("missing", ["prompt_ids", "chosen_ids", "rejected_ids"])
def test_missing_column_raises_key_error_naming_it(padding_free, missing):
    examples = [dict(DOC_EXAMPLES[0]), {key: value for key, value in DOC_EXAMPLES[1].items() if key != missing}]

    with pytest.raises(KeyError, match=f"Example 1 .*{missing}"):
        PaddingFreePreferenceCollator(pad_token_id=0, padding_free=padding_free)(examples)


def test_empty_batch_raises():
    with pytest.raises(ValueError, match="empty batch"):
        concatenated_inputs([])


@pytest.mark.parametrize(
    "examples",
    [
        pytest.param(
            [with_ref_logps(DOC_EXAMPLES)[0], DOC_EXAMPLES[1]],
            id="only-some-examples",
        ),
        pytest.param(
            [DOC_EXAMPLES[0], with_ref_logps(DOC_EXAMPLES)[1]],
            id="only-later-examples",
        ),
        pytest.param(
            [{**example, "ref_chosen_logps": -1.0} for example in DOC_EXAMPLES],
            id="only-chosen-key",
        ),
        pytest.param(
            [{**example, "ref_rejected_logps": -1.0} for example in DOC_EXAMPLES],
            id="only-rejected-key",
        ),
    ],
)
@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_incomplete_reference_log_probs_raise(examples, padding_free):
    with pytest.raises(ValueError, match="ref_chosen_logps.*ref_rejected_logps"):
        PaddingFreePreferenceCollator(pad_token_id=0, padding_free=padding_free)(examples)


@pytest.mark.parametrize(
    "bad_value", [math.nan, math.inf, -math.inf, None, "-1.0"], ids=["nan", "inf", "-inf", "none", "string"]
)
@pytest.mark.parametrize("column", ["ref_chosen_logps", "ref_rejected_logps"])
def test_reference_log_probs_that_are_not_finite_numbers_raise(column, bad_value):
    examples = with_ref_logps(DOC_EXAMPLES)
    examples[1][column] = bad_value

    with pytest.raises(ValueError, match="Example 1 has reference log-probs"):
        concatenated_inputs(examples)


@pytest.mark.parametrize("make_value", [np.float32, torch.tensor], ids=["numpy-float32", "0d-tensor"])
def test_finite_reference_log_probs_of_other_number_types_are_accepted(make_value):
    examples = [{**DOC_EXAMPLES[0], "ref_chosen_logps": make_value(-1.5), "ref_rejected_logps": make_value(-2.0)}]

    expected = DataCollatorForPreference(pad_token_id=0)(examples)
    batch = PaddingFreePreferenceCollator(pad_token_id=0, padding_free=False)(examples)

    assert torch.equal(batch["ref_chosen_logps"], expected["ref_chosen_logps"])


@pytest.mark.parametrize(
    "examples, settings",
    [
        pytest.param([{"prompt_ids": [], "chosen_ids": [], "rejected_ids": [3]}], {}, id="empty-chosen-sequence"),
        pytest.param(
            [DOC_EXAMPLES[0], {"prompt_ids": [], "chosen_ids": [1], "rejected_ids": []}],
            {},
            id="empty-rejected-sequence",
        ),
        pytest.param(DOC_EXAMPLES, {"max_length": 0}, id="truncated-to-nothing"),
    ],
)
def test_empty_sequence_raises(examples, settings):
    with pytest.raises(ValueError, match="is empty"):
        concatenated_inputs(examples, **settings)


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_bad_truncation_mode_raises(padding_free):
    collator = PaddingFreePreferenceCollator(
        pad_token_id=0, max_length=4, truncation_mode="keep_middle", padding_free=padding_free
    )

    with pytest.raises(ValueError, match="Unsupported truncation mode: keep_middle"):
        collator(DOC_EXAMPLES)
