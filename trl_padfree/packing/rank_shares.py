"""Dynamic context parallelism: micro-batches packed for a context-parallel group's ranks, each row over as many of
them as its length needs.

Static context parallelism (`context_parallel_size=C`) packs micro-batches of `max_tokens_per_batch` tokens and splits
every one over all C ranks of its group, however short its pairs. With `dynamic_context_parallel=True` each rank holds
at most `max_tokens_per_batch / C` tokens, and a group's micro-step is packed as rows on aligned blocks of 1, 2, 4 ...
C ranks: a pair that fits one rank runs there, packed with others, gathering nothing; a longer one takes the block it
needs, which other pairs fill up:

    static     ranks 0-7   | A (long) ....... b c d e f g h |            one row, every rank gathers all keys
    dynamic    ranks 0-3   | A (long) .... b |                            A and b over 4 ranks, gathering over 4
               rank 4, 5   | c d |  | e f |                               the rest alone on one rank each
               rank 6, 7   | g |    | h |

How micro-steps are packed (`pack_micro_steps`), deterministic and on plain numbers, so every process computes the same
plan with no communication: pairs (or a prompt group's pairs under `group_by_prompt`) longest first, each on a new row
of the fewest ranks that hold it while a micro-step has those ranks free, else into the row of that many ranks with
the least room left, else into a wider one, else on a new micro-step (best-fit decreasing, as the token budget packs,
over rank blocks; no pair split over more ranks than it needs while ranks are free), unless whole rows over all C
ranks (the static split) cost less by the cost model. Every rank trains
exactly one row (or chunk) at every micro-step, so engines that gather parameters per forward (ZeRO-3, FSDP2) stay in
step: a micro-step's free ranks go to its rows, the dearest by the cost model (costs/context_parallel.py) doubling its
block first. The blocks come from a fixed set (`rank_sizes`; groups made once at set-up: parallel/groups.py).

The plan reaches each rank through the batch sampler: every micro-step it yields one index list per process, the
pairs of the row that process's block trains, then a marker index past the dataset (`RowRanksDataset` turns it into
the row's rank count, which the collator wrapper `RowRanksCollator` puts in the batch as `ROW_RANKS`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from torch.utils.data import Sampler

from ..costs.flops import Segment
from ..refusals.token_budget import check_budget_bins_share
from .token_budget import fitting_pieces, pack_window
from .units import PairUnits

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
    """A row of a micro-step: its units (their numbers in the list packed), on ranks `first_rank` to
    `first_rank + ranks - 1` of the group."""

    units: tuple[int, ...]
    first_rank: int
    ranks: int


RowCost = Callable[[Sequence[UnitWork], int], float]  # a row's units and its ranks -> its slowest rank's cost


def rank_sizes(ranks: int) -> tuple[int, ...]:
    """The ranks a row may be split over in a group of `ranks` (a power of two): 1, 2, 4 ... `ranks`."""
    return tuple(2**power for power in range(int(math.log2(ranks)) + 1))


@dataclass
class _Row:
    units: list[int]
    ranks: int
    tokens: int


def pack_micro_steps(
    units: Sequence[UnitWork], ranks: int, capacity: Callable[[int], int], row_cost: RowCost
) -> list[list[RowShare]]:
    """`units` packed into micro-steps of a group of `ranks` ranks (best-fit decreasing over rank blocks, as the
    module's docstring shows), each micro-step its rows in rank order, every rank in exactly one.

    Args:
        units: what each unit adds to a row.
        ranks: the group's ranks, a power of two.
        capacity: the tokens a row on that many ranks may hold (`capacity(ranks)`: the whole budget).
        row_cost: the cost model, which decides which rows take a micro-step's free ranks.
    """
    micro_steps: list[list[_Row]] = []
    free: list[int] = []
    sizes = rank_sizes(ranks)
    capacity = dict(zip(sizes, map(capacity, sizes), strict=True)).__getitem__  # asked once per size
    for unit in sorted(range(len(units)), key=lambda unit: (-units[unit].tokens, unit)):
        tokens = units[unit].tokens
        if tokens > capacity(ranks):
            raise ValueError(f"A unit of {tokens} tokens does not fit {ranks} ranks ({capacity(ranks)} tokens).")
        need = next(size for size in sizes if tokens <= capacity(size))
        # A new row on free ranks of a micro-step (each rank trains at every micro-step: a free rank is room going
        # spare), else the row of the fewest ranks that hold it with the least room left, else a wider one's
        step = next((number for number, room in enumerate(free) if room >= need), None)
        row = None
        if step is None:
            row = _best_fit(micro_steps, tokens, capacity, need, wider=False)
            row = row or _best_fit(micro_steps, tokens, capacity, need, wider=True)
        if row is not None:
            row.units.append(unit)
            row.tokens += tokens
            continue
        if step is None:
            micro_steps.append([])
            free.append(ranks)
            step = len(micro_steps) - 1
        # Longest first: blocks are taken in sizes that never grow within a micro-step, so each starts aligned
        micro_steps[step].append(_Row([unit], need, tokens))
        free[step] -= need
    packed = [_shares(rows, room, units, row_cost) for rows, room in zip(micro_steps, free, strict=True)]
    # Never dearer, by the cost model, than whole rows over all C ranks (the static split of best-fit decreasing
    # rows): pairs a little over a rank's budget fill blocks of 2 poorly where 3 would share 4 ranks
    whole_rows = pack_window(range(len(units)), [unit.tokens for unit in units], capacity(ranks))
    static = sum(row_cost([units[unit] for unit in row], ranks) for row in whole_rows)
    dynamic = sum(
        max(row_cost([units[unit] for unit in share.units], share.ranks) for share in step) for step in packed
    )
    if static < dynamic:
        return [[RowShare(tuple(row), 0, ranks)] for row in whole_rows]
    return packed


def _best_fit(micro_steps: list[list[_Row]], tokens: int, capacity, need: int, wider: bool) -> _Row | None:
    """The row on `need` ranks (`wider`: on more) with the least room left that holds `tokens` more."""
    best, best_room = None, None
    for rows in micro_steps:
        for row in rows:
            room = capacity(row.ranks) - row.tokens - tokens
            if (
                room >= 0
                and (row.ranks > need if wider else row.ranks == need)
                and (best_room is None or room < best_room)
            ):
                best, best_room = row, room
    return best


def _shares(rows: list[_Row], free: int, units: Sequence[UnitWork], row_cost: RowCost) -> list[RowShare]:
    """A micro-step's rows in rank order, its `free` ranks given out first: the dearest row that fits them doubles."""

    def cost(row: _Row) -> float:
        return row_cost([units[unit] for unit in row.units], row.ranks)

    while free:
        row = max((row for row in rows if row.ranks <= free), key=cost)
        free -= row.ranks
        row.ranks *= 2
    shares, first = [], 0
    for row in sorted(rows, key=lambda row: -row.ranks):  # largest first: every block starts aligned
        shares.append(RowShare(tuple(row.units), first, row.ranks))
        first += row.ranks
    return shares


def split_micro_steps_to_multiple(micro_steps: list[list[RowShare]], groups: int, ranks: int, units, row_cost):
    """Split the micro-steps holding the most rows until their count is a multiple of `groups` (every group trains
    at every micro-step): a micro-step's rows dealt alternately, widest first, into two, each giving its free ranks
    out again; a micro-step of one row of several units splits that row's units. A part of a packed micro-step always
    fits."""
    micro_steps = [list(step) for step in micro_steps]
    while len(micro_steps) % groups:
        largest = max(range(len(micro_steps)), key=lambda n: (len(micro_steps[n]), len(micro_steps[n][0].units), -n))
        rows = [_Row(list(share.units), share.ranks, 0) for share in micro_steps[largest]]
        if len(rows) == 1 and len(rows[0].units) >= 2:
            (row,) = rows
            rows = [_Row(row.units[0::2], row.ranks, 0), _Row(row.units[1::2], row.ranks, 0)]
        check_budget_bins_share(len(micro_steps), groups, splittable=len(rows) >= 2)
        halves = rows[0::2], rows[1::2]
        parts = []
        for half in halves:  # each half keeps its rows' blocks and gives the other half's ranks out again
            parts.append(_shares(half, ranks - sum(row.ranks for row in half), units, row_cost))
        micro_steps[largest], extra = parts
        micro_steps.append(extra)
    return micro_steps


# ---------------------------------------------------------------------------------------------------------------------
# The sampler and how its plan reaches each rank


class RowsOnRanksSampler(Sampler[list[int]]):
    """Micro-batches for dynamic context parallelism: `units` packed into micro-steps of each group's ranks
    (`pack_micro_steps`), in shuffled windows as the token budget packs (token_budget.py), once; each epoch the
    micro-steps in a new order, `processes / ranks` groups training one each at every micro-step.

    Every micro-step it yields one index list per process, in process order (accelerate deals them round-robin): the
    pairs of the row its block trains, then the marker `pairs + ranks of the row`.

    Args:
        units: the pairs, sized in row tokens; prompt groups (with `group_size`) are packed whole where they fit.
        unit_work: what one unit's pairs add to a row (`UnitWork`).
        pairs: the dataset's pairs (markers are numbered from there).
        processes: every process of the run; groups are `ranks` consecutive processes.
        ranks: `context_parallel_size`, a power of two.
        capacity: the tokens a row on that many ranks may hold.
        row_cost: the cost model.
        seed, window: as `TokenBudgetBatchSampler`'s.
    """

    def __init__(self, units: PairUnits, unit_work, *, pairs, processes, ranks, capacity, row_cost, seed, window):
        self.pairs, self.processes, self.ranks, self.seed, self.epoch = pairs, processes, ranks, seed, 0
        order = list(range(len(units.units)))
        random.Random(seed).shuffle(order)
        capacity_of_group = capacity(ranks)
        pieces = [
            piece for number in order for piece in fitting_pieces(units.units[number], units.size, capacity_of_group)
        ]
        works = [unit_work(piece) for piece in pieces]
        micro_steps = []
        for start in range(0, len(pieces), window):
            packed = pack_micro_steps(works[start : start + window], ranks, capacity, row_cost)
            micro_steps += [
                [
                    RowShare(tuple(start + unit for unit in share.units), share.first_rank, share.ranks)
                    for share in step
                ]
                for step in packed
            ]
        self.micro_steps = split_micro_steps_to_multiple(micro_steps, processes // ranks, ranks, works, row_cost)
        # Each row's pairs (its units' pairs, in order) and its ranks
        self.rows = [
            [(tuple(pair for unit in share.units for pair in pieces[unit]), share) for share in step]
            for step in self.micro_steps
        ]

    def rows_by_ranks(self) -> dict[int, int]:
        """How many of the epoch's rows are split over each number of ranks."""
        counts = dict.fromkeys(rank_sizes(self.ranks), 0)
        for step in self.micro_steps:
            for share in step:
                counts[share.ranks] += 1
        return counts

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.micro_steps) // (self.processes // self.ranks) * self.processes

    def epoch_micro_steps(self) -> Iterator[list[list[tuple[tuple[int, ...], RowShare]]]]:
        """This epoch's micro-steps, each a list over groups of that group's rows (pairs, ranks)."""
        groups = self.processes // self.ranks
        order = list(range(len(self.micro_steps)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        for start in range(0, len(order), groups):
            yield [self.rows[number] for number in order[start : start + groups]]

    def __iter__(self) -> Iterator[list[int]]:
        for groups in self.epoch_micro_steps():
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
