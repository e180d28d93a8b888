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
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

from ..refusals import check_budget_bins_share, check_positive, check_tokenized_pairs, check_training_set_not_empty
from .layout import pair_tokens
from .prefix_sharing import pair_row_tokens


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


def split_to_multiple(bins: list[list[int]], lengths: Sequence[int], multiple: int) -> list[list[int]]:
    """Split the bins holding the most pairs until their count is a multiple of `multiple` (a split bin's halves
    each fit, so the budget still holds)."""
    bins = [list(each) for each in bins]
    while len(bins) % multiple:
        largest = max(range(len(bins)), key=lambda number: (len(bins[number]), -number))
        check_budget_bins_share(len(bins), multiple, splittable=len(bins[largest]) >= 2)
        # Alternate the pairs, longest first, so both halves get a similar number of tokens
        ordered = sorted(bins[largest], key=lambda i: (-lengths[i], i))
        bins[largest] = ordered[0::2]
        bins.append(ordered[1::2])
    return bins


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields micro-batches (lists of dataset indices) whose pairs fit `budget` tokens, for every process alike;
    `accelerator.prepare` deals them out round-robin. `set_epoch` reorders them."""

    def __init__(
        self,
        lengths: Sequence[int],
        budget: int,
        *,
        seed: int,
        num_processes: int = 1,
        window: int = 1000,
        pad_to_multiple_of: int | None = None,
    ):
        check_positive("max_tokens_per_batch", budget)
        check_positive("token_budget_window", window)
        check_training_set_not_empty(len(lengths))
        self.lengths = list(lengths)
        self.budget = budget
        self.seed = seed
        self.epoch = 0
        capacity = usable_budget(budget, pad_to_multiple_of)
        order = list(range(len(self.lengths)))
        random.Random(seed).shuffle(order)
        bins = []
        for start in range(0, len(order), window):
            bins.extend(pack_window(order[start : start + window], self.lengths, capacity))
        self.bins = split_to_multiple(bins, self.lengths, num_processes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.bins)

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(len(self.bins)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        for number in order:
            yield list(self.bins[number])
