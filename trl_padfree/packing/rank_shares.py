"""Dynamic context parallelism: each micro-step, which rows a context-parallel group trains and over how many of its
ranks each is split.

Static context parallelism (`context_parallel_size=C`) splits every row over all C ranks of its group. With
`dynamic_context_parallel=True` the token budget's micro-batch that the group would have split over its C ranks
(`max_tokens_per_batch` tokens, at most `max_tokens_per_batch / C` a rank) is cut into rows instead, each on an
aligned block of 1, 2, 4 ... C ranks, so that no rank holds more than its share of the budget and the slowest rank
is as fast as the cost model (costs/context_parallel.py) can make it:

    static     ranks 0-7   | A (long) ....... b c d e f g h |            one row, every rank gathers all keys
    dynamic    ranks 0-3   | A (long) .... |                              A over 4 ranks, gathering over 4
               ranks 4, 5  | b c |                                        b c d e f g h alone or in pairs, on
               ranks 6, 7  | d e | ... f g h on whichever rank is least busy    single ranks: nothing gathered

The same pairs train at the same step as under the static split (the loss is the same to rounding); only the layout
changes. Every rank trains exactly one row (or chunk) at every micro-step, so engines that gather parameters per
forward (ZeRO-3, FSDP2) stay in step: when a micro-step has fewer rows than ranks, rows are split over more ranks
than they need. The blocks come from a fixed set (`rank_sizes`, groups made once at set-up: parallel/groups.py).

How a micro-step is shared (`share_ranks`), deterministic and on plain numbers, so every process computes the same
plan with no communication: units (a pair, or a prompt group's pairs under `group_by_prompt`) longest first, each on
a new row of the fewest ranks that hold it while ranks are free, else added to the row that keeps the slowest rank
fastest; leftover ranks double the dearest row that fits them. That is tried with every unit's ranks doubled 0, 1,
... times (the last try is the static split), and the cheapest plan kept.

The plan reaches each rank through the batch sampler: every micro-step it yields one index list per process, the
pairs of the row that process's block trains, then a marker index past the dataset (`RowRanksDataset` turns it into
the row's rank count, which the collator wrapper `RowRanksCollator` puts in the batch as `ROW_RANKS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from torch.utils.data import Sampler

from ..costs.flops import Segment

ROW_RANKS = "row_ranks"  # the collated batch's entry: over how many ranks its row is split


@dataclass(frozen=True)
class UnitWork:
    """What one unit (a pair, or one prompt's pairs laid out together) adds to a row: its tokens, its attention
    spans, and its tokens the LM head scores."""

    tokens: int
    segments: tuple[Segment, ...]
    scored_tokens: int


@dataclass(frozen=True)
class RowShare:
    """A row of a micro-step: its units (numbers in the micro-step's list), on ranks `first_rank` to
    `first_rank + ranks - 1` of the group."""

    units: tuple[int, ...]
    first_rank: int
    ranks: int


RowCost = Callable[[Sequence[UnitWork], int], float]  # a row's units and its ranks -> its slowest rank's cost


def rank_sizes(ranks: int) -> tuple[int, ...]:
    """The ranks a row may be split over in a group of `ranks` (a power of two): 1, 2, 4 ... `ranks`."""
    return tuple(2**power for power in range(int(math.log2(ranks)) + 1))


def share_ranks(
    units: Sequence[UnitWork],
    ranks: int,
    fits: Callable[[int, int], bool],
    row_cost: RowCost,
) -> list[RowShare]:
    """Rows on blocks of a group of `ranks` ranks for one micro-step's `units`, the cheapest plan of the module's
    search; `fits(tokens, ranks)` says whether a row of `tokens` may be split over `ranks` (the budget), which all
    units together must do on `ranks`. Rows come in rank order; every rank is in exactly one row."""
    if not units:
        raise ValueError("A micro-step's row needs at least one pair.")
    order = sorted(range(len(units)), key=lambda unit: (-units[unit].tokens, unit))
    needed = [next(size for size in rank_sizes(ranks) if fits(unit.tokens, size)) for unit in units]
    best, best_cost = None, math.inf
    for doubling in range(int(math.log2(ranks)) + 1):
        least = [min(ranks, size << doubling) for size in needed]
        rows = _greedy(units, order, least, ranks, fits, row_cost)
        if rows is not None:
            cost = max(row.cost for row in rows)
            if cost < best_cost:
                best, best_cost = rows, cost
    if best is None:  # cannot happen when the units fit `ranks` together: the last try is one row
        raise ValueError(f"{len(units)} units do not fit one row over {ranks} ranks.")
    shares, first = [], 0
    for row in sorted(best, key=lambda row: -row.ranks):  # largest first: every block starts aligned
        shares.append(RowShare(tuple(row.units), first, row.ranks))
        first += row.ranks
    return shares


@dataclass
class _Row:
    units: list[int]
    ranks: int
    tokens: int
    cost: float


def _greedy(units, order, least, ranks, fits, row_cost) -> list[_Row] | None:
    rows: list[_Row] = []
    free = ranks

    def priced(members: list[int], size: int) -> float:
        return row_cost([units[unit] for unit in members], size)

    for unit in order:
        tokens = units[unit].tokens
        options = []  # (slowest rank after, choice)
        current = max((row.cost for row in rows), default=0.0)
        if free >= least[unit]:
            cost = priced([unit], least[unit])
            options.append((max(current, cost), 0, None, cost))
        for number, row in enumerate(rows):
            if row.ranks >= least[unit] and fits(row.tokens + tokens, row.ranks):
                cost = priced([*row.units, unit], row.ranks)
                others = max((other.cost for other in rows if other is not row), default=0.0)
                options.append((max(others, cost), 1 + number, row, cost))
        if not options:  # grow a row onto free ranks until the unit fits in it
            growable = [row for row in rows if row.ranks <= free and fits(row.tokens + tokens, 2 * row.ranks)]
            if not growable:
                return None
            row = min(growable, key=lambda row: row.ranks)
            free -= row.ranks
            row.ranks *= 2
            row.units.append(unit)
            row.tokens += tokens
            row.cost = priced(row.units, row.ranks)
            continue
        _, _, row, cost = min(options, key=lambda option: option[:2])
        if row is None:
            rows.append(_Row([unit], least[unit], tokens, cost))
            free -= least[unit]
        else:
            row.units.append(unit)
            row.tokens += tokens
            row.cost = cost
    while free:  # every rank trains: the dearest row that fits the free ranks doubles
        row = max((row for row in rows if row.ranks <= free), key=lambda row: row.cost)
        free -= row.ranks
        row.ranks *= 2
        row.cost = priced(row.units, row.ranks)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# The sampler and how its plan reaches each rank


class RowsOnRanksSampler(Sampler[list[int]]):
    """The micro-batches of `bins` (a token-budget sampler, which yields every process's micro-batches in deal order)
    trained as static context parallelism trains them, each group's rows shared out by `share_ranks`.

    Static context parallelism runs, per round of `processes` bins, each group's `ranks` bins one after the other
    (parallel/batch_hand_out.py). Here each of those micro-steps yields `processes` index lists, in process order:
    for each process, the pairs of its block's row, and the marker `pairs + ranks of the row`.

    Args:
        bins: yields lists of pair indices; `len(bins)` a multiple of `processes`.
        pairs: the dataset's pairs (markers are numbered from there).
        processes: every process of the run; groups are `ranks` consecutive processes.
        ranks: `context_parallel_size`, a power of two.
        unit_work: the work of one unit's pairs (a pair, or a group's pairs).
        group_numbers: each pair's prompt group (a bin's pairs of one group are one unit), or None: pairs alone.
        fits: `fits(tokens, ranks)`, the budget; row_cost: the cost model.
    """

    def __init__(self, bins, pairs: int, processes: int, ranks: int, unit_work, group_numbers, fits, row_cost):
        self.bins, self.pairs, self.processes, self.ranks = bins, pairs, processes, ranks
        self.unit_work, self.group_numbers, self.fits, self.row_cost = unit_work, group_numbers, fits, row_cost

    def set_epoch(self, epoch: int) -> None:
        self.bins.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.bins) * self.ranks

    def units_of(self, pairs: Sequence[int]) -> list[list[int]]:
        """A bin's units in bin order: its pairs, or its pairs of each prompt group together."""
        if self.group_numbers is None:
            return [[pair] for pair in pairs]
        units: dict[int, list[int]] = {}
        for pair in pairs:
            units.setdefault(self.group_numbers[pair], []).append(pair)
        return list(units.values())

    def rows_of(self, pairs: Sequence[int]) -> list[tuple[list[int], RowShare]]:
        """One micro-step of one group: each row's pairs and its ranks."""
        units = self.units_of(pairs)
        shares = share_ranks([self.unit_work(unit) for unit in units], self.ranks, self.fits, self.row_cost)
        return [([pair for unit in share.units for pair in units[unit]], share) for share in shares]

    def rounds(self) -> Iterator[list[list[list[tuple[list[int], RowShare]]]]]:
        """Each round's micro-steps, each a list over groups of that group's rows."""
        groups = self.processes // self.ranks
        round_bins: list[list[int]] = []
        for pairs in self.bins:
            round_bins.append(pairs)
            if len(round_bins) == self.processes:
                yield [
                    [self.rows_of(round_bins[group * self.ranks + step]) for group in range(groups)]
                    for step in range(self.ranks)
                ]
                round_bins = []

    def __iter__(self) -> Iterator[list[int]]:
        for micro_steps in self.rounds():
            for groups in micro_steps:
                for rows in groups:
                    for pairs, share in rows:
                        yield from ([*pairs, self.pairs + share.ranks] for _ in range(share.ranks))


class RowRanksDataset:
    """A map-style dataset of pairs whose index lists end with `RowsOnRanksSampler`'s marker, read as
    `{ROW_RANKS: ranks}`."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.pairs = len(dataset)

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, index: int):
        return {ROW_RANKS: index - self.pairs} if index >= self.pairs else self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:
        *pairs, marker = indices
        examples = (
            self.dataset.__getitems__(pairs)
            if hasattr(self.dataset, "__getitems__")
            else [self.dataset[index] for index in pairs]
        )
        return [*examples, self[marker]]


@dataclass(frozen=True)
class RowRanksCollator:
    """`collator` on a row's examples, the batch carrying `ROW_RANKS` (the marker example `RowRanksDataset` made)."""

    collator: Callable

    def __call__(self, examples: list) -> dict:
        *pairs, marker = examples
        batch = self.collator(pairs)
        batch[ROW_RANKS] = marker[ROW_RANKS]
        return batch
