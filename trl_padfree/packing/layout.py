"""Pure functions for packed rows: TRL's truncation, positions, segment boundaries, padded views, segment sums.

A packed row holds every sequence of a batch back to back, chosen sequences first, then rejected ones,
then (only with ``pad_to_multiple_of``) one trailing padding segment:

    tokens        | p p c c | p c | p p c | p c c c | 0 0 |
    position_ids  | 0 1 2 3 | 0 1 | 0 1 2 | 0 1 2 3 | 0 1 |
    cu_seq_lens   0         4     6       9         13    15
                   chosen 0  ch. 1  rej. 0  rejected 1  padding (a segment, never a sequence of the batch)

Nothing here imports transformers or TRL, so these functions can be tested against hand-computed tensors. Each model
is written once here: which tokens TRL's truncation keeps (`kept_slice`), and the segment boundaries every kernel reads
(`cu_seq_lens_from_lengths`, from positions, cut into chunks).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# ---- TRL's truncation ----


def kept_slice(length: int, max_length: int | None, truncation_mode: str = "keep_start") -> slice:
    """The tokens of a sequence of `length` that TRL's collator keeps: the first `max_length` (`keep_start`) or the
    last (`keep_end`), each sequence cut on its own.

    >>> kept_slice(10, 4), kept_slice(10, 4, "keep_end"), kept_slice(3, 4)
    (slice(0, 4, None), slice(6, 10, None), slice(0, 3, None))
    """
    if max_length is None or length <= max_length:
        return slice(0, length)
    if truncation_mode == "keep_end":
        return slice(length - max_length, length)
    return slice(0, max_length)


def kept_prompt_and_completion(
    prompt: int, completion: int, max_length: int | None, truncation_mode: str = "keep_start"
) -> tuple[int, int]:
    """Prompt and completion tokens left of `prompt + completion` after TRL's truncation."""
    kept = kept_slice(prompt + completion, max_length, truncation_mode)
    prompt_kept = max(0, min(prompt, kept.stop) - kept.start)
    return prompt_kept, (kept.stop - kept.start) - prompt_kept


def pair_tokens(prompt: int, chosen: int, rejected: int, max_length: int | None) -> int:
    """Tokens a pair adds to an unshared packed row: prompt + chosen and prompt + rejected, each cut to `max_length`
    as the collator cuts every sequence (either truncation mode keeps as many)."""
    return sum(_length(kept_slice(prompt + completion, max_length)) for completion in (chosen, rejected))


def _length(kept: slice) -> int:
    return kept.stop - kept.start


# ---- the row on the host ----

HOST_ROW = "host_row"  # the collated batch's key for its `HostRow`


@dataclass(frozen=True)
class HostRow:
    """A packed row's boundaries as host integers, as the collator laid it out.

    The step builds every index it needs from these, never from the row's device tensors: on a GPU each read of a
    tensor's value (`.item()`, `int(...)`, `.tolist()`) waits for every kernel queued before it. Plain tuples, so the
    Trainer and accelerate hand it on untouched when they move the batch's tensors to the device.
    """

    cu_seq_lens: tuple[int, ...]  # segment boundaries, the padding segment included
    seq_lens: tuple[int, ...]  # per sequence, chosen then rejected
    seq_starts: tuple[int, ...]  # row start of each sequence's own tokens (equal sequences of a prompt group: one)
    prefix_starts: tuple[int, ...]  # row start of the shared prefix it reads first (prefix sharing)
    prefix_lens: tuple[int, ...]  # tokens of that prefix, 0 if none
    scored_tokens: int = 0  # completion tokens, which the LM head scores (the row's cost, `packing.balance.row_cost`)
    # [start, end) of each run of image tokens (a vision-language row's image placeholders); None: not known
    image_spans: tuple[tuple[int, int], ...] | None = ()

    @classmethod
    def of_tensors(cls, cu_seq_lens, seq_lens, seq_starts=None, prefix_starts=None, prefix_lens=None) -> HostRow:
        """From a batch's tensors, for a batch built without one (each read waits for the device)."""
        bounds, lengths = tuple(cu_seq_lens.tolist()), tuple(seq_lens.tolist())
        none = (0,) * len(lengths)
        return cls(
            bounds,
            lengths,
            bounds[: len(lengths)] if seq_starts is None else tuple(seq_starts.tolist()),
            none if prefix_starts is None else tuple(prefix_starts.tolist()),
            none if prefix_lens is None else tuple(prefix_lens.tolist()),
            image_spans=None,
        )

    @property
    def width(self) -> int:
        """The longest sequence: the width of the padded views."""
        return max(self.seq_lens)

    @property
    def real_row_tokens(self) -> int:
        """Tokens before the padding segment: the end of the last sequence's own tokens (a prompt group lays out
        fewer segments than sequences)."""
        ends = zip(self.seq_starts, self.seq_lens, self.prefix_lens, strict=True)
        return max((start + length - prefix for start, length, prefix in ends), default=0)

    @property
    def laid_out(self) -> tuple[int, ...]:
        """The sequences whose own tokens the row holds: of those reading the same tokens (a prompt group's equal
        sequences), the first."""
        first = {}
        for sequence, start in enumerate(self.seq_starts):
            first.setdefault(start, sequence)
        return tuple(first.values())

    @property
    def shared_pairs(self) -> int:
        """Pairs (sequences `i` and `pairs + i`) that do not lay out both their prompts: one of their sequences reads
        its prompt from another, or is another's tokens."""
        laid_out = {sequence for sequence in self.laid_out if self.prefix_lens[sequence] == 0}
        pairs = len(self.seq_lens) // 2
        return sum(1 for pair in range(pairs) if not {pair, pairs + pair} <= laid_out)

    def segment_of(self, row_position: int) -> int:
        return bisect.bisect_right(self.cu_seq_lens, row_position) - 1


def token_runs(tokens: Sequence[int], token: int) -> tuple[tuple[int, int], ...]:
    """`[start, end)` of each run of `token` in `tokens`.

    >>> token_runs([5, 9, 9, 9, 5, 9, 5], 9)
    ((1, 4), (5, 6))
    """
    runs, start = [], None
    for position, value in enumerate([*tokens, None]):
        if value == token and start is None:
            start = position
        elif value != token and start is not None:
            runs.append((start, position))
            start = None
    return tuple(runs)


# ---- positions and boundaries ----


def position_ids_from_lengths(lengths: Sequence[int], first_positions: Sequence[int] | None = None) -> torch.Tensor:
    """Positions that restart at 0 (or at `first_positions`) for every segment, as one row `(1, sum(lengths))`."""
    first_positions = first_positions or [0] * len(lengths)
    ranges = [torch.arange(first, first + length) for first, length in zip(first_positions, lengths, strict=True)]
    return torch.cat(ranges).to(torch.long).unsqueeze(0)


def cu_seq_lens_from_lengths(
    lengths: Sequence[int] | torch.Tensor, device: torch.device | None = None
) -> torch.Tensor:
    """Cumulative segment boundaries `[0, l0, l0 + l1, ...]` as int32, the layout varlen kernels expect.

    >>> cu_seq_lens_from_lengths([3, 1, 2]).tolist()
    [0, 3, 4, 6]
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device).reshape(-1)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])


def segment_ids_from_lengths(lengths: torch.Tensor, total_length: int | None = None) -> torch.Tensor:
    """Index of the segment each token belongs to; tokens past the last segment get `len(lengths)`."""
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    if total_length is not None and total_length > segment_ids.numel():
        tail = segment_ids.new_full((total_length - segment_ids.numel(),), len(lengths))
        segment_ids = torch.cat([segment_ids, tail])
    return segment_ids


def padded_view_index(
    seq_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    width: int,
    prefix_starts: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each cell of a `(num_seqs, width)` right-padded view reads from in the packed row.

    Returns `(index, valid)`: cell `(i, j)` holds packed position `seq_starts[i] + j` when `valid[i, j]`, i.e. when
    `j < seq_lens[i]`. Invalid cells point at position 0 and must be filled by the caller. With prefix sharing, a
    sequence reads its first `prefix_lens[i]` tokens from `prefix_starts[i]` and the rest from `seq_starts[i]` on.
    """
    offsets = torch.arange(width, device=seq_starts.device).unsqueeze(0)
    valid = offsets < seq_lens.unsqueeze(1)
    positions = seq_starts.unsqueeze(1) + offsets
    if prefix_lens is not None:
        in_prefix = offsets < prefix_lens.unsqueeze(1)
        positions = torch.where(in_prefix, prefix_starts.unsqueeze(1) + offsets, positions - prefix_lens.unsqueeze(1))
    index = torch.where(valid, positions, torch.zeros_like(positions))
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


def row_multiple(pad_to_multiple_of: int | None, ranks_per_row: int) -> int | None:
    """What a packed row's length is padded to a multiple of: `pad_to_multiple_of`, and a multiple of the ranks that
    share the row (sequence and context parallelism split it evenly). Applying it twice changes nothing.

    >>> row_multiple(None, 1), row_multiple(None, 4), row_multiple(6, 4), row_multiple(row_multiple(6, 4), 4)
    (None, 4, 12, 12)
    """
    if ranks_per_row == 1:
        return pad_to_multiple_of
    return math.lcm(pad_to_multiple_of or 1, ranks_per_row)


def cu_seq_lens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of one packed row `(1, T)`: a segment starts at 0 and wherever the position does not go up
    by 1.

    This is transformers' own rule for detecting packed sequences, so both read a row the same way.
    """
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(positions, prepend=positions[:1]) != 1).reshape(-1)
    total = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, total]).to(torch.int32)


def chunked_bounds(bounds: Sequence[int], chunk_size: int) -> list[int]:
    """Segment boundaries (host integers) that also cut each segment every `chunk_size` tokens from its start (Llama
    4's chunked attention layers).

    >>> chunked_bounds([0, 5, 6, 15], chunk_size=4)
    [0, 4, 5, 6, 10, 14, 15]
    """
    cut = [position for start, end in itertools.pairwise(bounds) for position in range(start, end, chunk_size)]
    return cut + [bounds[-1]]


def chunked_cu_seq_lens(cu_seq_lens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`chunked_bounds` of a boundary tensor, as int32 on its device (reads the boundaries once).

    >>> chunked_cu_seq_lens(torch.tensor([0, 5, 6, 15]), chunk_size=4).tolist()
    [0, 4, 5, 6, 10, 14, 15]
    """
    bounds = chunked_bounds(cu_seq_lens.tolist(), chunk_size)
    return torch.tensor(bounds, dtype=torch.int32, device=cu_seq_lens.device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host, copied to `device` without waiting for the device's queued work (pinned and
    asynchronous on CUDA: an ordinary copy from pageable memory synchronizes)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
