"""Token-budget batching: training micro-batches filled with whole pairs up to `max_tokens_per_batch` tokens.

Once padding is gone, a micro-batch costs memory in proportion to its real tokens. A fixed number of pairs per
micro-batch then leaves memory unused on short pairs and runs out on long ones. Here each micro-batch is a bin of
pairs (chosen and rejected together) whose packed row fits the budget.

The pairs are packed once per run, deterministically for the seed: shuffled, cut into windows of `window` pairs, and
each window packed best-fit decreasing (longest pair first, each into the fullest bin it still fits). The window
keeps the packing local to a random part of the data, so long and short pairs still mix across micro-batches. Each
epoch shuffles the order of the micro-batches (again from the seed), so the number of micro-batches, and of
optimizer steps, is the same in every epoch and on every process, and a resumed run sees the same batches.

Under data parallelism every process computes the same bins and accelerate deals them out round-robin; the bin
count is made a multiple of the number of processes by splitting the bins that hold the most pairs.

With prompt groups (`train_sampling_strategy="group_by_prompt"`) the packed units are a prompt's pairs instead of
single pairs, each sized as the row it lays out (`grouped_row_tokens` under prefix sharing: the prompt once, each
distinct completion, one repeated prompt token per branch), so a micro-batch holds whole groups and a process's row
computes each of its prompts once:

    groups, shuffled       a: 6 pairs, 3,075 tokens    b: 1 pair, 900    c: 6 pairs, 9,000 (over the budget)
    pieces that fit        a | b | c[:4] 5,900 | c[4:] 3,400                         budget 6,000
    best fit, largest      [c[:4]] [a, b] [c[4:]]

A group over the budget is cut, in its pairs' order, into pieces that each fit (each still grouped); a group that
fits is never cut, but where the bin count must grow to a multiple of the processes and every bin holds one group,
the group with the most pairs is cut in two.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator, Sequence

from torch.utils.data import Sampler

from ..costs.flops import Segment
from ..refusals.config import check_at_least_one
from ..refusals.token_budget import check_budget_bins_share, check_tokenized_pairs, check_training_set_not_empty
from .layout import kept_prompt_and_completion, kept_slice, pair_tokens
from .prefix_sharing import grouped_row_layout, pair_row_tokens
from .units import PairUnits


def pair_lengths(
    dataset,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    prefix_sharing_min_prompt_tokens: int | None = None,
) -> list[int]:
    """Row tokens of every pair of a dataset tokenized by TRL (`prompt_ids`, `chosen_ids`, `rejected_ids`):
    `packing.pair_tokens`, or with prefix sharing (a minimum prompt length given) `prefix_sharing.pair_row_tokens`."""
    check_tokenized_pairs(sorted({"prompt_ids", "chosen_ids", "rejected_ids"} - set(dataset.column_names)))
    columns = (dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
    if prefix_sharing_min_prompt_tokens is None:
        return [pair_tokens(len(p), len(c), len(r), max_length) for p, c, r in zip(*columns, strict=True)]
    return [
        pair_row_tokens(len(p), len(c), len(r), max_length, truncation_mode, prefix_sharing_min_prompt_tokens)
        for p, c, r in zip(*columns, strict=True)
    ]


def grouped_row(
    pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
    max_length: int | None,
    truncation_mode: str = "keep_start",
    min_prompt_tokens: int = 2,
) -> tuple[list[Segment], int]:
    """The row prefix sharing lays these pairs (`(prompt_ids, chosen_ids, rejected_ids)`, as TRL tokenizes them) out
    in, as the collator does (`prefix_sharing.grouped_row_layout`): each kept prompt once per group, each distinct
    sequence once, a branch repeating the prompt's last token. Returns its segments (each reading its prefix) and its
    scored (completion) tokens, what `costs.flops.packed_row_work` takes."""
    sequences, masks, prompt_lens = [], [], []
    for side in (1, 2):  # chosen sequences, then rejected ones
        for pair in pairs:
            prompt, completion = len(pair[0]), len(pair[side])
            kept = kept_slice(prompt + completion, max_length, truncation_mode)
            sequences.append((list(pair[0]) + list(pair[side]))[kept])
            masks.append(([0] * prompt + [1] * completion)[kept])
            prompt_lens.append(kept_prompt_and_completion(prompt, completion, max_length, truncation_mode)[0])
    sources = grouped_row_layout(sequences, prompt_lens, min_prompt_tokens)[0]
    segments = [Segment(len(sequences[sequence]) - first, prefix=first) for sequence, first in sources]
    return segments, sum(sum(masks[sequence][first:]) for sequence, first in sources)


def grouped_row_tokens(
    pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
    max_length: int | None,
    truncation_mode: str = "keep_start",
    min_prompt_tokens: int = 2,
) -> int:
    """Row tokens of these pairs laid out together under prefix sharing (`grouped_row`). One pair alone gives
    `pair_row_tokens`, or fewer (a pair whose two sequences are equal).

    >>> prompt = [1, 2, 3, 4]
    >>> grouped_row_tokens([(prompt, [5], [6]), (prompt, [5], [7, 8]), (prompt, [6], [7, 8])], None)  # 5 + 2 + 3
    10
    """
    return sum(segment.length for segment in grouped_row(pairs, max_length, truncation_mode, min_prompt_tokens)[0])


def fitting_pieces(group: Sequence[int], tokens: Callable[[Sequence[int]], int], capacity: int) -> list[list[int]]:
    """A prompt group's pairs, in order, cut into the fewest consecutive pieces whose rows (`tokens`) fit `capacity`:
    the whole group when it fits. Every pair alone fits (`_check_pairs_fit`).

    >>> fitting_pieces([0, 1, 2, 3], lambda pairs: 2 + 3 * len(pairs), capacity=9)  # 5, 8, 11 tokens: 2 and 2
    [[0, 1], [2, 3]]
    """
    if tokens(group) <= capacity:
        return [list(group)]
    pieces: list[list[int]] = []
    for index in group:
        if pieces and tokens([*pieces[-1], index]) <= capacity:
            pieces[-1].append(index)
        else:
            pieces.append([index])
    return pieces


def usable_budget(budget: int, pad_to_multiple_of: int | None) -> int:
    """The most real tokens a row may hold so that, padded to a multiple, it still fits the budget."""
    multiple = pad_to_multiple_of or 1
    return budget // multiple * multiple


def pack_window(indices: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each pair, longest first, into the bin with the least room that still holds it."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, bin number), sorted
    for index in sorted(indices, key=lambda i: -lengths[i]):  # stable: equal lengths keep the shuffled order
        position = bisect.bisect_left(rooms, (lengths[index], -1))
        if position == len(rooms):
            bins.append([index])
            bisect.insort(rooms, (capacity - lengths[index], len(bins) - 1))
            continue
        room, number = rooms.pop(position)
        bins[number].append(index)
        bisect.insort(rooms, (room - lengths[index], number))
    return bins


def split_units_to_multiple(
    bins: list[list[list[int]]], tokens: Callable[[Sequence[int]], int], multiple: int
) -> list[list[list[int]]]:
    """Split the bins holding the most units (a pair, or a prompt group's pairs, sized by `tokens`) until their count
    is a multiple of `multiple` (a split bin's halves each fit, so the budget still holds), so that whole groups stay
    whole; where every bin holds a single unit, the unit with the most pairs is cut in two halves (pairs of one
    prompt: each half's row is no longer than the whole's)."""
    bins = [[list(unit) for unit in each] for each in bins]
    while len(bins) % multiple:
        largest = max(range(len(bins)), key=lambda number: (len(bins[number]), sum(map(len, bins[number])), -number))
        units = bins[largest]
        if len(units) == 1 and len(units[0]) >= 2:
            middle = (len(units[0]) + 1) // 2
            units = [units[0][:middle], units[0][middle:]]
        check_budget_bins_share(len(bins), multiple, splittable=len(units) >= 2)
        # Alternate the units, longest first, so both halves get a similar number of tokens
        ordered = sorted(units, key=lambda unit: (-tokens(unit), unit[0]))
        bins[largest] = ordered[0::2]
        bins.append(ordered[1::2])
    return bins


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields micro-batches (lists of dataset indices) whose pairs fit `budget` tokens, for every process alike;
    `accelerator.prepare` deals them out round-robin. `set_epoch` reorders them.

    `units` are sized in row tokens: each pair alone (`lengths`), and with prompt groups the row of a set of one
    prompt's pairs (`grouped_row_tokens`), whole groups then packed instead of pairs: the module's docstring shows
    how."""

    def __init__(
        self,
        units: PairUnits,
        budget: int,
        *,
        seed: int,
        num_processes: int = 1,
        window: int = 1000,
        pad_to_multiple_of: int | None = None,
    ):
        check_at_least_one("max_tokens_per_batch", budget)
        check_at_least_one("token_budget_window", window)
        check_training_set_not_empty(len(units))
        self.lengths = list(units.sizes)
        self.budget = budget
        self.seed = seed
        self.epoch = 0
        capacity = usable_budget(budget, pad_to_multiple_of)
        groups = units.units
        order = list(range(len(groups)))
        random.Random(seed).shuffle(order)
        pieces = [piece for number in order for piece in fitting_pieces(groups[number], units.size, capacity)]
        piece_tokens = [units.size(piece) for piece in pieces]
        bins = []
        for start in range(0, len(pieces), window):
            packed = pack_window(range(start, min(start + window, len(pieces))), piece_tokens, capacity)
            bins.extend([pieces[number] for number in numbers] for numbers in packed)
        bins = split_units_to_multiple(bins, units.size, num_processes)
        self.bins = [[index for unit in each for index in unit] for each in bins]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.bins)

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(len(self.bins)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        for number in order:
            yield list(self.bins[number])
