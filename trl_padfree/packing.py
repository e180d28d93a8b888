"""Pure tensor functions for packed rows: positions, cumulative lengths, padded views, segment sums.

A packed row holds every sequence of a batch back to back, chosen sequences first, then rejected ones,
then (only with ``pad_to_multiple_of``) one trailing padding segment:

    tokens        | p p c c | p c | p p c | p c c c | 0 0 |
    position_ids  | 0 1 2 3 | 0 1 | 0 1 2 | 0 1 2 3 | 0 1 |
    cu_seq_lens   0         4     6       9         13    15
                   chosen 0  ch. 1  rej. 0  rejected 1  padding (a segment, never a sequence of the batch)

Nothing here imports transformers or TRL, so these functions can be tested against hand-computed tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def position_ids_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """Positions that restart at 0 for every segment, as one row of shape `(1, sum(lengths))`."""
    return torch.cat([torch.arange(length, dtype=torch.long) for length in lengths]).unsqueeze(0)


def cu_seq_lens_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """Cumulative segment boundaries `[0, l0, l0 + l1, ...]` as int32, the layout varlen kernels expect."""
    cu_seq_lens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seq_lens[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
    return cu_seq_lens


def segment_ids_from_lengths(lengths: torch.Tensor, total_length: int | None = None) -> torch.Tensor:
    """Index of the segment each token belongs to; tokens past the last segment get `len(lengths)`."""
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    if total_length is not None and total_length > segment_ids.numel():
        tail = segment_ids.new_full((total_length - segment_ids.numel(),), len(lengths))
        segment_ids = torch.cat([segment_ids, tail])
    return segment_ids


def padded_view_index(
    seq_starts: torch.Tensor, seq_lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each cell of a `(num_seqs, width)` right-padded view reads from in the packed row.

    Returns `(index, valid)`: cell `(i, j)` holds packed position `seq_starts[i] + j` when `valid[i, j]`, i.e. when
    `j < seq_lens[i]`. Invalid cells point at position 0 and must be filled by the caller.
    """
    offsets = torch.arange(width, device=seq_starts.device)
    valid = offsets.unsqueeze(0) < seq_lens.unsqueeze(1)
    index = torch.where(
        valid, seq_starts.unsqueeze(1) + offsets.unsqueeze(0), torch.zeros_like(valid, dtype=torch.long)
    )
    return index, valid


def to_padded_view(packed: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, fill_value=0) -> torch.Tensor:
    """Gather a packed per-token tensor `(T, ...)` into a right-padded `(num_seqs, width, ...)` view.

    Differentiable: the gradient of every valid cell flows back to its packed position.
    """
    gathered = packed[index]
    mask = valid.reshape(valid.shape + (1,) * (gathered.dim() - valid.dim()))
    return torch.where(mask, gathered, torch.full_like(gathered, fill_value))


def segment_sum(values: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum a per-token tensor `(T,)` per segment, in one vectorized scatter: returns `(num_segments,)`.

    Tokens whose id is `>= num_segments` (the padding segment) are dropped.
    """
    keep = segment_ids < num_segments
    sums = values.new_zeros(num_segments)
    return sums.index_add(0, segment_ids[keep], values[keep])


def pad_length_to_multiple(length: int, multiple: int | None) -> int:
    """Smallest multiple of `multiple` that is `>= length` (or `length` itself without a multiple)."""
    if not multiple:
        return length
    return -(-length // multiple) * multiple


def cu_seq_lens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of one packed row `(1, T)`: a segment starts at 0 and wherever the position does not go up
    by 1.

    This is transformers' own rule for detecting packed sequences, so both read a row the same way.
    """
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(positions, prepend=positions[:1]) != 1).reshape(-1)
    total = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, total]).to(torch.int32)
