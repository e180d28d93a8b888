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

from torch.utils.data import IterableDataset, Sampler

from ..refusals import (
    check_budget_bins_share,
    check_pairs_fit,
    check_positive,
    check_token_budget_setup,
    check_tokenized_pairs,
    check_training_set_not_empty,
)
from .layout import pair_tokens
from .pair_sizes import lengths_of, training_set_pair_sizes
from .prefix_sharing import AUTO, pair_row_tokens


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


def _check_pairs_fit(
    lengths: Sequence[int], budget: int, pad_to_multiple_of: int | None, max_length, images: bool = False
) -> None:
    capacity = usable_budget(budget, pad_to_multiple_of)
    too_long = [index for index, length in enumerate(lengths) if length > capacity]
    longest = max(too_long, key=lambda i: lengths[i], default=0)
    longest_pair = (longest, lengths[longest] if lengths else 0)
    check_pairs_fit(len(too_long), longest_pair, budget, capacity, max_length, images)


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


class TokenBudgetBatching:
    """What the trainer sets up for `max_tokens_per_batch`: the pairs' row lengths, the refusals and the sampler
    (`set_up`). Its micro-batches hold different numbers of pairs: the trainer weighs their losses and metrics with
    `packing.pair_weights.PairWeightedSteps`."""

    def __init__(self, sampler: TokenBudgetBatchSampler, pair_sizes=None):
        self.sampler = sampler
        self.pair_sizes = pair_sizes  # a vision-language set's `packing.pair_sizes`, which balancing prices too

    @classmethod
    def set_up(cls, trainer) -> TokenBudgetBatching | None:
        """From `trainer`'s config and tokenized training set; None without `max_tokens_per_batch`."""
        args, collator = trainer.args, trainer.data_collator
        budget = getattr(args, "max_tokens_per_batch", None)
        if budget is None or trainer.train_dataset is None:
            return None
        check_token_budget_setup(
            trainer.padding_free_enabled,
            trainer.sequence_parallel_size,
            isinstance(trainer.train_dataset, IterableDataset),
        )
        sizes = None
        if trainer.is_vision_dataset:  # tokenized only when collated: each pair's row measured once per dataset
            sizes = training_set_pair_sizes(trainer, "Measuring pairs for max_tokens_per_batch")
            lengths = lengths_of(sizes)
        else:
            # "auto" lays a text batch out unshared when sharing would not pay: size pairs unshared, the larger row,
            # so every micro-batch fits the budget either way (vision batches always share under "auto")
            shares = collator.prefix_sharing and collator.prefix_sharing != AUTO
            lengths = pair_lengths(
                trainer.train_dataset,
                args.max_length,
                args.truncation_mode,
                collator.prefix_sharing_min_prompt_tokens if shares else None,
            )
        _check_pairs_fit(lengths, budget, collator.pad_to_multiple_of, args.max_length, trainer.is_vision_dataset)
        sampler = TokenBudgetBatchSampler(
            lengths,
            budget,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_processes=trainer.accelerator.num_processes,
            window=args.token_budget_window,
            pad_to_multiple_of=collator.pad_to_multiple_of,
        )
        return cls(sampler, sizes)
