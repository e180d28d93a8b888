"""Preference collator that flattens a batch into one packed row, and the packed builder behind it."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..costs.flops import Segment
from ..integrations.trl import DataCollatorForPreference
from ..refusals.batches import (
    check_examples,
    check_no_empty_sequence,
    check_reference_log_probs,
    check_truncation_mode,
)
from .layout import (
    HOST_ROW,
    HostRow,
    cu_seq_lens_from_lengths,
    kept_slice,
    pad_length_to_multiple,
    position_ids_from_lengths,
)
from .prefix_sharing import (
    DEFAULT_MIN_PROMPT_TOKENS,
    MIN_SHARED_PROMPT_TOKENS,
    PrefixSharing,
    SharingCost,
    grouped_row_layout,
    layout_pays,
    shared_row_layout,
)

REQUIRED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _validate_examples(examples: list[dict[str, Any]]) -> None:
    missing = [
        (index, [column for column in REQUIRED_COLUMNS if column not in example], list(example))
        for index, example in enumerate(examples)
        if not set(REQUIRED_COLUMNS) <= set(example)
    ]
    check_examples(len(examples), missing)
    has_ref = [[column in example for column in REF_COLUMNS] for example in examples]
    paired = all(flags == has_ref[0] for flags in has_ref) and has_ref[0][0] == has_ref[0][1]
    non_finite = None
    if paired and has_ref[0][0]:
        values = [(example["ref_chosen_logps"], example["ref_rejected_logps"]) for example in examples]
        non_finite = next(
            ((index, pair) for index, pair in enumerate(values) if not all(map(_is_finite_number, pair))), None
        )
    check_reference_log_probs(paired, non_finite)


def _is_finite_number(value) -> bool:
    # Python floats, numpy scalars and 0-d tensors all arrive here, depending on the dataset's format
    if isinstance(value, (str, bytes)):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _leading_zeros(mask: list[int]) -> int:
    return next((index for index, flag in enumerate(mask) if flag), len(mask))


@dataclass
class Sequences:
    """Every sequence of a batch, truncated as TRL's collator truncates it, with its completion mask: the chosen ones,
    then the rejected ones (TRL's order)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    chosen_masks: list[list[int]]
    rejected_masks: list[list[int]]

    @classmethod
    def of(cls, examples: list[dict[str, Any]], max_length: int | None, truncation_mode: str) -> Sequences:
        if max_length is not None:
            check_truncation_mode(truncation_mode)
        sides = {"chosen": ([], []), "rejected": ([], [])}
        for example in examples:
            prompt = list(example["prompt_ids"])
            for side, (tokens, masks) in sides.items():
                completion = list(example[f"{side}_ids"])
                kept = kept_slice(len(prompt) + len(completion), max_length, truncation_mode)
                tokens.append((prompt + completion)[kept])
                masks.append(([0] * len(prompt) + [1] * len(completion))[kept])
        sequences = cls(sides["chosen"][0], sides["rejected"][0], sides["chosen"][1], sides["rejected"][1])
        check_no_empty_sequence(min(len(tokens) for tokens in sequences.chosen + sequences.rejected))
        return sequences

    @property
    def lengths(self) -> list[int]:
        return [len(tokens) for tokens in self.chosen + self.rejected]

    @property
    def masks(self) -> list[list[int]]:
        return self.chosen_masks + self.rejected_masks

    @property
    def prompt_lens(self) -> list[int]:
        """The prompt tokens each sequence kept: those before its first completion token."""
        return [_leading_zeros(mask) for mask in self.masks]


@dataclass
class RowLayout:
    """The row's segments, and where each sequence of the batch (chosen ones, then rejected ones) reads its tokens."""

    segments: list[tuple[list[int], list[int], int]]  # tokens, completion mask, position of the first token
    sources: list[tuple[int, int]]  # per segment: the (first) sequence it holds, and from which of its tokens on
    seq_starts: list[int]  # row start of each sequence's own tokens
    prefix_starts: list[int]  # row start of the shared prefix it reads first (prefix sharing)
    prefix_lens: list[int]  # tokens of that prefix, 0 if none
    shared: bool = False  # laid out for prefix sharing (whether or not any sequence reads another's tokens)

    @classmethod
    def of_sources(cls, sequences: Sequences, sources, seq_starts, prefix_starts, prefix_lens) -> RowLayout:
        """A prefix-sharing layout (`prefix_sharing.shared_row_layout`'s or `grouped_row_layout`'s host integers)."""
        tokens = sequences.chosen + sequences.rejected
        masks = sequences.chosen_masks + sequences.rejected_masks
        segments = [(tokens[sequence][first:], masks[sequence][first:], first) for sequence, first in sources]
        return cls(segments, sources, seq_starts, prefix_starts, prefix_lens, shared=True)


def lay_out_row(sequences: Sequences, prefixes: list[int] | None = None) -> RowLayout:
    """Without `prefixes`, TRL's order: every chosen sequence, then every rejected one. With them (prefix sharing),
    pair by pair, each rejected sequence reading the first `prefixes[pair]` tokens of the chosen one first
    (`prefix_sharing.shared_row_layout`)."""
    tokens = sequences.chosen + sequences.rejected
    if prefixes is None:
        segments = [(sequence, mask, 0) for sequence, mask in zip(tokens, sequences.masks, strict=True)]
        seq_starts = [0] + list(itertools.accumulate(len(sequence) for sequence in tokens))[:-1]
        sources = [(index, 0) for index in range(len(tokens))]
        return RowLayout(segments, sources, seq_starts, [0] * len(tokens), [0] * len(tokens))
    lengths = sequences.lengths
    return RowLayout.of_sources(
        sequences, *shared_row_layout(lengths[: len(prefixes)], lengths[len(prefixes) :], prefixes)
    )


def lay_out_groups(sequences: Sequences, min_prompt_tokens: int, keys: list | None = None) -> RowLayout:
    """Prefix sharing over prompt groups (`prefix_sharing.grouped_row_layout`): each prompt of at least
    `min_prompt_tokens` once per batch, each distinct sequence once; with `keys`, only sequences of equal keys in one
    group (a vision batch's: their images)."""
    tokens = sequences.chosen + sequences.rejected
    return RowLayout.of_sources(sequences, *grouped_row_layout(tokens, sequences.prompt_lens, min_prompt_tokens, keys))


def concatenated_inputs(
    examples: list[dict[str, Any]],
    pad_token_id: int = 0,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_to_multiple_of: int | None = None,
    return_attention_mask: bool = False,
    prefix_sharing: bool | str = False,
    prefix_sharing_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
    prefix_sharing_cost: SharingCost | None = None,
) -> dict[str, Any]:
    """Pack the chosen and rejected sequences of a batch into one row, with no padding between them.

    Order is the one of TRL's padded batch: every `prompt + chosen` sequence, then every `prompt + rejected` sequence.
    With `pad_to_multiple_of`, the row ends with one padding segment (positions restarting at 0, completion mask 0):
    kernels see it as a separate segment, so no real token attends to it, and it is not a sequence of the batch.

    With `prefix_sharing`, the sequences are laid out in prompt groups (see `trl_padfree.packing.prefix_sharing`):
    those whose truncated prompt tokens are identical as one `[prefix + first sequence]` segment and one `[branch]`
    segment per other distinct sequence, which reads the prefix; a sequence identical to one laid out reads that
    one's tokens. A pair of its own prompt is `[prefix + chosen branch]`, `[rejected branch]`. A sequence whose prompt
    is shorter than `prefix_sharing_min_prompt_tokens`, or kept other prompt tokens than every other, is laid out
    whole.

    Args:
        examples: dicts with `prompt_ids`, `chosen_ids`, `rejected_ids` (lists of token ids) and optionally both
            `ref_chosen_logps` and `ref_rejected_logps`.
        pad_token_id: token used for the trailing padding segment.
        max_length: per-sequence truncation length, as in TRL's collator.
        truncation_mode: `"keep_start"` or `"keep_end"`, as in TRL's collator.
        pad_to_multiple_of: pad the row (not each sequence) to a multiple of this length.
        return_attention_mask: also return `attention_mask` (1 on real tokens, 0 on the padding segment). It is for
            callers that want it; transformers treats a row with a mask as one sequence, so never pass it to a model.
        prefix_sharing: compute each prompt once per batch (needs the `padfree_varlen` attention); `"auto"`: when
            `prefix_sharing_cost` predicts the batch's step is cheaper shared (every prompt of 2 tokens or more).
        prefix_sharing_min_prompt_tokens: share only prompts of at least this many tokens (at least 2).
        prefix_sharing_cost: the model's cost model, for `"auto"` (without one, `"auto"` shares).

    Returns:
        A dict with `input_ids`, `position_ids`, `completion_mask` of shape `(1, total_length)`; `seq_lens` (one
        length per sequence, chosen then rejected); `cu_seq_lens_q`/`cu_seq_lens_k` (int32 segment boundaries,
        padding segment included) and `max_length_q`/`max_length_k` for varlen kernels; `host_row`, the same
        boundaries as host integers (`HostRow`); and the reference log-probs when the examples carry them. With
        `prefix_sharing`, also `seq_starts`, `shared_prefix_starts` and `shared_prefix_lens` (per sequence: row start
        of its own tokens, and of the prefix it reads first; equal for sequences that read the same tokens).
    """
    _validate_examples(examples)
    sequences = Sequences.of(examples, max_length, truncation_mode)
    layout = _layout(sequences, prefix_sharing, prefix_sharing_min_prompt_tokens, prefix_sharing_cost)
    output = packed_row(sequences, layout, pad_token_id, pad_to_multiple_of, return_attention_mask)
    if REF_COLUMNS[0] in examples[0]:
        for column in REF_COLUMNS:
            output[column] = torch.tensor([example[column] for example in examples])
    return output


def _layout(
    sequences: Sequences, prefix_sharing: bool | str | PrefixSharing, min_prompt_tokens: int, cost: SharingCost | None
) -> RowLayout:
    """TRL's order unshared, or prefix sharing's prompt groups; with "auto", the groups of every prompt that can
    share, or (as `cost` says) the pairs one after another, unshared."""
    prefix_sharing = PrefixSharing.of(prefix_sharing)
    if not prefix_sharing:
        return lay_out_row(sequences)
    if prefix_sharing is PrefixSharing.ON:
        return lay_out_groups(sequences, min_prompt_tokens)
    grouped = lay_out_groups(sequences, MIN_SHARED_PROMPT_TOKENS)
    # A branch starts at the token after the prefix it reads: its first token's position is the prefix's length
    segments = [Segment(len(tokens), prefix=first) for tokens, _, first in grouped.segments]
    scored = sum(map(sum, sequences.masks))
    row_scored = sum(sum(mask) for _, mask, _ in grouped.segments)
    if layout_pays(cost, sequences.lengths, segments, scored, row_scored):
        return grouped
    return lay_out_row(sequences, [0] * len(sequences.chosen))


def packed_row(
    sequences: Sequences,
    layout: RowLayout,
    pad_token_id: int,
    pad_to_multiple_of: int | None,
    return_attention_mask: bool,
) -> dict[str, Any]:
    """The row's tensors from its segments, then one padding segment up to `pad_to_multiple_of`; with prefix sharing
    (`layout` with shared prefixes), where each sequence reads its tokens."""
    real_length = sum(len(tokens) for tokens, _, _ in layout.segments)
    padding_length = pad_length_to_multiple(real_length, pad_to_multiple_of) - real_length
    segment_lens = [len(tokens) for tokens, _, _ in layout.segments] + ([padding_length] if padding_length else [])
    first_positions = [first for _, _, first in layout.segments] + ([0] if padding_length else [])
    input_ids = [token for tokens, _, _ in layout.segments for token in tokens] + [pad_token_id] * padding_length
    completion_mask = [flag for _, mask, _ in layout.segments for flag in mask] + [0] * padding_length
    cu_seq_lens = cu_seq_lens_from_lengths(segment_lens)
    row = {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "position_ids": position_ids_from_lengths(segment_lens, first_positions),
        "completion_mask": torch.tensor([completion_mask], dtype=torch.long),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens.clone(),
        "max_length_q": max(segment_lens),
        "max_length_k": max(segment_lens),
        "seq_lens": torch.tensor(sequences.lengths, dtype=torch.long),
        HOST_ROW: HostRow(
            tuple(itertools.accumulate(segment_lens, initial=0)),
            tuple(sequences.lengths),
            tuple(layout.seq_starts),
            tuple(layout.prefix_starts),
            tuple(layout.prefix_lens),
            sum(completion_mask),
        ),
    }
    if return_attention_mask:
        row["attention_mask"] = torch.tensor([[1] * real_length + [0] * padding_length], dtype=torch.long)
    if layout.shared:
        row["seq_starts"] = torch.tensor(layout.seq_starts, dtype=torch.long)
        row["shared_prefix_starts"] = torch.tensor(layout.prefix_starts, dtype=torch.long)
        row["shared_prefix_lens"] = torch.tensor(layout.prefix_lens, dtype=torch.long)
    return row


def is_packed_batch(batch: dict[str, Any]) -> bool:
    """Whether `batch` comes from the padding-free collator (one packed row plus its sequence lengths)."""
    return "seq_lens" in batch


@dataclass
class PaddingFreePreferenceCollator(DataCollatorForPreference):
    """
    TRL's preference collator with a `padding_free` switch: every chosen and rejected sequence of the batch in one row.

    With `padding_free=False` it is exactly TRL's `DataCollatorForPreference`. With `padding_free=True` (default) it
    returns what [`concatenated_inputs`] returns: no padding between sequences, positions restarting at 0 for every
    sequence, and the segment boundaries flash-attention-style varlen kernels need. No `attention_mask` unless
    `return_attention_mask=True`, because transformers only detects packed sequences when the mask is absent.

    Examples:
    ```python
    >>> from trl_padfree import PaddingFreePreferenceCollator

    >>> collator = PaddingFreePreferenceCollator(pad_token_id=0)
    >>> examples = [
    ...     {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    ...     {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11]},
    ... ]
    >>> batch = collator(examples)
    >>> batch["input_ids"]
    tensor([[ 1,  2,  3,  4,  5,  7,  8,  9,  1,  2,  3,  6,  7,  8, 10, 11]])
    >>> batch["position_ids"]
    tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]])
    >>> batch["completion_mask"]
    tensor([[0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1]])
    >>> batch["seq_lens"], batch["cu_seq_lens_q"], batch["max_length_q"]
    (tensor([5, 3, 4, 4]), tensor([ 0,  5,  8, 12, 16], dtype=torch.int32), 5)
    >>> "attention_mask" in batch
    False

    ```
    """

    padding_free: bool = True
    return_attention_mask: bool = False
    prefix_sharing: bool | str = False
    prefix_sharing_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    prefix_sharing_cost: SharingCost | None = None  # the model's, for prefix_sharing="auto" (set by the trainer)

    @classmethod
    def from_padded(cls, collator: DataCollatorForPreference, **overrides) -> PaddingFreePreferenceCollator:
        """The padding-free twin of a TRL collator: same pad token, truncation and row multiple."""
        fields = {
            "pad_token_id": collator.pad_token_id,
            "max_length": collator.max_length,
            "truncation_mode": collator.truncation_mode,
            "pad_to_multiple_of": collator.pad_to_multiple_of,
            "return_tensors": collator.return_tensors,
        }
        return cls(**{**fields, **overrides})

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.padding_free:
            _validate_examples(examples)
            return super().torch_call(examples)
        return concatenated_inputs(
            examples,
            pad_token_id=self.pad_token_id,
            max_length=self.max_length,
            truncation_mode=self.truncation_mode,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_attention_mask=self.return_attention_mask,
            prefix_sharing=self.prefix_sharing,
            prefix_sharing_min_prompt_tokens=self.prefix_sharing_min_prompt_tokens,
            prefix_sharing_cost=self.prefix_sharing_cost,
        )
