"""Balanced batches: `train_sampling_strategy="batch_rebalance"` with `padding_free=True`.

Each optimizer step trains on the pairs the default sampler gives all processes for that step (the same seeded
shuffle, the same global batch), split by cost instead of dealt `per_device_train_batch_size` at a time, so at every
micro-step the processes' rows cost about the same (`packing.balance.best_split`):

    default sampler's order   | p17 p3 p42 p8 | p25 p1 p30 p9 | ...      one step = processes x accumulation x batch
        |  split by cost (every process computes the same bins from the same lengths: no communication)
        v
    bins in deal order        micro-step 0: process 0, process 1, ... | micro-step 1: process 0, ...
        |  accelerate deals bins round-robin
        v
    each process's micro-batches, of different pair counts and about equal cost

A process's loss is then weighted by its share of the step's pairs (`PairWeightedSteps`,
features/pair_weighted_steps.py), so the step's gradient is padded TRL's on the same global batch. With `max_tokens_per_batch` the budget's bins are balanced
instead: each step's bins are sorted by cost and dealt so that a micro-step's processes get bins of neighbouring cost.

A step's pairs of one prompt (`group_ids`, under prefix sharing) stay together: the split takes each prompt group of
the step as one item priced as its grouped row (`grouped_pairs_cost`), so they land on one process and micro-step and
the collator computes their prompt once. A group is cut (into consecutive pieces, each grouped) only where it costs
more than the dealt step's costliest row, or where the step has fewer items than rows to fill. Without repeated
prompts in a step the split is the one pair by pair.

transformers' own `BatchRebalanceSampler` (padded mode) prices a micro-batch by its longest sequence and weighs every
process's loss equally; here a row costs its pairs' FLOPs (`packing.balance.pair_cost`), and the loss is exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from ..costs.flops import DecoderShape, packed_row_work, training_step_flops
from ..refusals.token_budget import check_balanced_batches_split
from .balance import best_split, bin_costs, imbalance, pair_cost, partition, sorted_partition
from .layout import kept_prompt_and_completion
from .prefix_sharing import shared_prefix_length
from .token_budget import fitting_pieces, grouped_row
from .units import PairUnits


def epoch_order(pairs: int, seed: int, epoch: int) -> list[int]:
    """The order of the default sampler: transformers' `RandomSampler`, which accelerate replaces with its
    `SeedableRandomSampler` (a generator seeded with `seed + epoch`, then `torch.randperm`)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(pairs, generator=generator).tolist()


def slot_of(micro_step: int, group: int, ranks: int, ranks_per_row: int = 1) -> int:
    """Which of accelerate's round-robin batches a row group runs as its `micro_step`-th of the epoch: its ranks'
    batches one after the other (the row split's wrapper), so round `micro_step // ranks_per_row`, the group's rank
    `micro_step % ranks_per_row`. Without split rows, batch `micro_step x ranks + group`."""
    rank = group * ranks_per_row + micro_step % ranks_per_row
    return micro_step // ranks_per_row * ranks + rank


def epoch_steps(
    pairs: int, batch_size: int, ranks: int, micro_steps: int, drop_last: bool = False, ranks_per_row: int = 1
) -> list[int]:
    """Micro-steps of each optimizer step of an epoch, as accelerate and Trainer run the default sampler's batches.

    accelerate deals `batch_size` pairs to each of the `ranks` per round: `ceil(pairs / (ranks x batch_size))`
    rounds, the last one filled up with the epoch's first pairs (whole rounds only with `drop_last`). With rows split
    over `ranks_per_row` ranks (sequence or context parallelism) each row group runs its ranks' batches one after the
    other, `ranks_per_row` micro-steps per round; Trainer groups `micro_steps` of them into an optimizer step, the
    epoch's last step shorter.

    >>> epoch_steps(30, 3, 2, 2)  # 5 rounds of 2 x 3 pairs: steps of 2, 2 and 1 micro-steps
    [2, 2, 1]
    >>> epoch_steps(40, 2, 8, 4, ranks_per_row=2)  # 3 rounds, 2 micro-steps of each of the 4 row groups per round
    [4, 2]
    """
    per_round = ranks * batch_size
    rounds = pairs // per_round if drop_last else -(-pairs // per_round)
    run = rounds * ranks_per_row  # micro-steps of each row group in the epoch
    return [min(micro_steps, run - first) for first in range(0, run, micro_steps)]


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields micro-batches (lists of dataset indices) in the order accelerate deals them out (round-robin over the
    ranks), so that at each micro-step every row group (a process, or the ranks sharing a split row) runs a row of
    about the same cost. The same on every process; `set_epoch` reshuffles as the default sampler does.

    Each optimizer step trains on the pairs the default sampler's batches give it (the same seed, the same pairs),
    partitioned by cost into `micro-steps x row groups` rows.

    Args:
        units (`PairUnits`):
            Each pair's training-step cost (`pair_costs`); with prompt groups (prefix sharing on), a step's pairs of
            one group are split as one item, a set of them priced as one group's row (`grouped_pairs_cost`; by
            default the sum of their costs).
        batch_size (`int`):
            `per_device_train_batch_size`: pairs per rank per micro-step as the default sampler deals them; a
            balanced row holds about as many.
        processes (`int`):
            Ranks (every process, `accelerator.num_processes`).
        micro_steps (`int`):
            Gradient accumulation steps.
        seed (`int`):
            The default sampler's seed (`data_seed`, else `seed`).
        drop_last (`bool`, *optional*, defaults to `False`):
            `dataloader_drop_last`.
        ranks_per_row (`int`, *optional*, defaults to `1`):
            Ranks sharing each row (sequence x context parallel sizes): a row group counts as one process.
    """

    def __init__(
        self,
        units: PairUnits,
        batch_size: int,
        *,
        processes: int,
        micro_steps: int,
        seed: int,
        drop_last: bool = False,
        ranks_per_row: int = 1,
    ):
        self.costs = [float(cost) for cost in units.sizes]
        self.group_ids = units.group_numbers()
        self.group_cost = units.size
        # Not `batch_size`: accelerate's BatchSamplerShard reads that attribute as a fixed size, and would cut and
        # refill these micro-batches of different sizes to it
        self.pairs_per_process, self.processes = batch_size, processes
        self.ranks_per_row, self.groups = ranks_per_row, processes // ranks_per_row
        self.drop_last, self.seed, self.epoch = drop_last, seed, 0
        self.steps = epoch_steps(len(self.costs), batch_size, processes, micro_steps, drop_last, ranks_per_row)
        check_balanced_batches_split(len(self.costs), processes * batch_size, bool(self.steps))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(self.steps) * self.groups

    def _slot(self, micro_step: int, group: int) -> int:
        return slot_of(micro_step, group, self.processes, self.ranks_per_row)

    def _dealt_order(self) -> list[int]:
        """The epoch's pairs in the order accelerate deals them, `batch_size` to a slot: the default sampler's order,
        its last round filled up with the epoch's first pairs as accelerate fills it (several processes), or cut to
        whole rounds (`drop_last`)."""
        order = epoch_order(len(self.costs), self.seed, self.epoch)
        dealt = sum(self.steps) // self.ranks_per_row * self.processes * self.pairs_per_process
        if self.drop_last or self.processes == 1:  # one process: no round to fill, the last batch is short
            return order[:dealt]
        first = order[: self.processes * self.pairs_per_process]
        return order + list(itertools.islice(itertools.cycle(first), dealt - len(order)))

    def dealt_bins(self) -> Iterator[list[list[list[int]]]]:
        """This epoch's steps as the default sampler deals them, `bins[micro_step][row group]`: the batch in the slot
        each row runs (a pair can appear twice where accelerate repeats the epoch's first pairs)."""
        dealt, size, first = self._dealt_order(), self.pairs_per_process, 0
        for micro in self.steps:
            slots = [[self._slot(first + step, group) * size for group in range(self.groups)] for step in range(micro)]
            yield [[dealt[start : start + size] for start in step] for step in slots]
            first += micro

    def global_batches(self) -> Iterator[list[int]]:
        """This epoch's global batches: the default sampler's pairs of each optimizer step."""
        for bins in self.dealt_bins():
            yield [index for step in bins for row in step for index in row]

    def step_bins(self) -> Iterator[list[list[list[int]]]]:
        """This epoch's steps, each as `bins[micro_step][row group]` of dataset indices: `packing.balance.best_split`
        of the step's pairs (never estimated slower than dealt as usual, nor with a row of higher cost)."""
        for dealt in self.dealt_bins():
            batch = [index for step in dealt for row in step for index in row]
            positions, start = [], 0  # the dealt rows as positions in `batch` (a repeated pair has two)
            for step in dealt:
                rows = []
                for row in step:
                    rows.append(list(range(start, start + len(row))))
                    start += len(row)
                positions.append(rows)
            split = self._grouped_split(batch, positions)
            if split is None:
                split = best_split([self.costs[index] for index in batch], self.groups, len(dealt), positions)
            yield [[sorted(batch[number] for number in row) for row in step] for step in split]

    def _grouped_split(self, batch: list[int], dealt: list[list[list[int]]]) -> list[list[list[int]]] | None:
        """The step's split with its prompt groups kept whole (positions in `batch`), or None where the step repeats
        no prompt (the split pair by pair). Each group is one item of `partition` and `sorted_partition`, priced by
        `group_cost`; a group costing more than the dealt step's costliest row is cut into pieces that do not, and
        the groups with the most pairs are halved while the step has fewer items than rows. Of the two splits, the
        one estimated shortest whose costliest row is no costlier than the dealt one's (else the dealt rows)."""
        if self.group_ids is None:
            return None
        by_group: dict[Hashable, list[int]] = {}
        for position, index in enumerate(batch):
            by_group.setdefault(self.group_ids[index], []).append(position)
        if len(by_group) == len(batch):
            return None

        def cost(positions: Sequence[int]) -> float:
            pairs = [batch[position] for position in positions]
            return self.costs[pairs[0]] if len(pairs) == 1 else self.group_cost(pairs)

        limit = max(max(step) for step in bin_costs([self.costs[index] for index in batch], dealt))
        items = [piece for group in by_group.values() for piece in fitting_pieces(group, cost, limit)]
        rows = self.groups * len(dealt)
        while len(items) < rows:  # every row needs an item: halve the group with the most pairs
            largest = max(range(len(items)), key=lambda number: (len(items[number]), -number))
            group = items.pop(largest)
            items[largest:largest] = [group[: (len(group) + 1) // 2], group[(len(group) + 1) // 2 :]]
        item_costs = [cost(item) for item in items]
        candidates = [partition(item_costs, self.groups, len(dealt))]
        if len(dealt) > 1:
            candidates.append(sorted_partition(item_costs, self.groups, len(dealt)))
        priced = [(bins, bin_costs(item_costs, bins)) for bins in candidates]
        allowed = [(bins, costs) for bins, costs in priced if max(max(step) for step in costs) <= limit]
        if not allowed:
            return dealt
        bins = min(allowed, key=lambda candidate: imbalance(candidate[1]))[0]
        return [[[position for number in row for position in items[number]] for row in step] for step in bins]

    def __iter__(self) -> Iterator[list[int]]:
        # Each step's rows go to their slots; slots are yielded in order as soon as all before them are filled (a
        # step at a time without split rows), so the first batches do not wait for the whole epoch's partition
        filled: dict[int, list[int]] = {}
        first = next_slot = 0
        for bins in self.step_bins():
            for step, rows in enumerate(bins):
                for group, row in enumerate(rows):
                    filled[self._slot(first + step, group)] = row
            first += len(bins)
            while next_slot in filled:
                yield filled.pop(next_slot)
                next_slot += 1

    def epoch_imbalance(self) -> tuple[float, float]:
        """This epoch's mean step imbalance (`packing.balance.imbalance` of the estimated costs) dealt as usual and
        balanced: what `train_sampling_strategy="batch_rebalance"` is expected to gain."""
        dealt, balanced = [], []
        for usual, split in zip(self.dealt_bins(), self.step_bins(), strict=True):
            dealt.append(imbalance(bin_costs(self.costs, usual)))
            balanced.append(imbalance(bin_costs(self.costs, split)))
        return sum(dealt) / len(dealt), sum(balanced) / len(balanced)


class BalancedBudgetBins(Sampler[list[int]]):
    """Token-budget micro-batches (`TokenBudgetBatchSampler`) dealt balanced: the bins of each optimizer step (the
    next `processes x micro_steps` in the epoch's order) sorted by cost, micro-step t taking the t-th `processes` of
    them, so each micro-step's processes run bins of neighbouring cost. The same bins as the budget sampler's, in
    another order within each step."""

    def __init__(self, budget_sampler, costs: Sequence[float], *, processes: int, micro_steps: int):
        self.budget_sampler = budget_sampler
        self.costs = [float(cost) for cost in costs]
        self.processes, self.micro_steps = processes, micro_steps

    def set_epoch(self, epoch: int) -> None:
        self.budget_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.budget_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        bins = list(self.budget_sampler)
        step = self.processes * self.micro_steps
        for start in range(0, len(bins), step):
            # A multiple of the processes (the budget sampler makes it one), so each micro-step deals one bin each
            group = sorted(bins[start : start + step], key=lambda row: -sum(self.costs[index] for index in row))
            yield from group


# ---------------------------------------------------------------------------------------------------------------------
# Costs of a training set


def grouped_pairs_cost(
    shape: DecoderShape,
    pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
    max_length: int | None,
    truncation_mode: str,
    min_prompt_tokens: int,
    reference_forward: bool,
) -> float:
    """Training-step FLOPs of these pairs (`(prompt_ids, chosen_ids, rejected_ids)`) laid out together under prefix
    sharing (`prefix_sharing.grouped_row_layout`): each kept prompt once per group, each distinct sequence once;
    `packing.balance.row_cost` of the row the collator lays them out in (`token_budget.grouped_row`)."""
    segments, scored = grouped_row(pairs, max_length, truncation_mode, min_prompt_tokens)
    return float(training_step_flops(shape, packed_row_work(segments, scored), reference_forward=reference_forward))


def pair_costs(
    dataset,
    shape: DecoderShape,
    max_length: int | None,
    truncation_mode: str,
    prefix_sharing_min_prompt_tokens: int | None,
    reference_forward: bool,
) -> list[float]:
    """Each pair's training-step cost (`pair_cost`) in a dataset tokenized by TRL, truncated as the collator
    truncates it and laid out shared when `prefix_sharing_min_prompt_tokens` is given (prefix sharing on)."""
    columns = (dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
    costs = []
    for prompt, chosen, rejected in zip(*(map(len, column) for column in columns), strict=True):
        chosen_prompt, chosen_kept = kept_prompt_and_completion(prompt, chosen, max_length, truncation_mode)
        rejected_prompt, rejected_kept = kept_prompt_and_completion(prompt, rejected, max_length, truncation_mode)
        shared = 0
        if prefix_sharing_min_prompt_tokens is not None:
            shared = shared_prefix_length(chosen_prompt, rejected_prompt, prefix_sharing_min_prompt_tokens)
        costs.append(
            pair_cost(
                shape,
                chosen_prompt + chosen_kept,
                rejected_prompt + rejected_kept,
                chosen_kept + rejected_kept,
                shared,
                reference_forward,
            )
        )
    return costs
