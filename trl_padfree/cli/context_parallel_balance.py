"""`trl-padfree balance --context-parallel C`: the time context-parallel groups take to train the same pairs with every
row split over all C ranks of its group (static) and with each group's micro-steps packed as rows on the ranks their
lengths need (dynamic, `packing.rank_shares.pack_micro_steps`), simulated with the cost model of a split row
(`costs.context_parallel.split_row_cost`). No model, no GPU.

For each source of pairs, each group size C and each number of processes W (a multiple of C):

    pairs      a pool drawn from a length model (or a dataset), truncated to --max-length as TRL truncates them, about
               --pool-bins bins' worth; packed in windows of `PACKING_WINDOW` pairs, as both samplers pack
    static     the token budget's bins of C x --rank-budget tokens (`pack_window`), each one row over the C ranks of
               a group. As the trainer deals them, a round of W bins gives each group its ranks' C bins, trained one
               after the other: C micro-steps
    dynamic    micro-steps of the group's ranks (`pack_micro_steps`: rows on 1, 2 ... C ranks, no rank over
               --rank-budget tokens, free ranks given out by the trainer's cost model); a round gives each group one
    static C'  the same pairs in bins of C' x --rank-budget on groups of C', for every C' in 1, 2 ... C whose budget
               holds the longest pair (the best of them: the least time)

Each layout trains the pool's pairs whole epochs, enough that every W sees at least --steps rounds of micro-steps
(each epoch in a new order, as `set_epoch` reorders the samplers' micro-steps). Every forward runs in lockstep
(ZeRO-3 gathers each layer's parameters), so a micro-step lasts as long as its slowest rank in any group; the last
round of the epochs runs with the groups that have a micro-step left (the samplers instead split micro-steps until
their count is a multiple: at most one round in either case). Seconds are the slowest rank's FLOPs at
`ASSUMED_FLOPS_PER_SECOND`, a row's communication over the link of its own ranks (`link_of_group`: an aligned block
of up to `GPUS_PER_NODE` ranks is in one node), while dynamic's planner prices every row over the group's link, as the
trainer does. Static and dynamic train the same pairs, so their time ratio is their tokens-per-second ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..costs import context_parallel
from ..costs.context_parallel import exchanges_per_layer, gathered_bytes, link_of_group, split_row_cost
from ..costs.flops import DecoderShape, Segment
from ..packing.layout import row_multiple
from ..packing.rank_shares import UnitWork, pack_micro_steps, rank_sizes
from ..packing.token_budget import pack_window, usable_budget
from .bench.harness import markdown_table
from .bench.report import run_provenance

# The rate costs/context_parallel.py's links are built on (an H100 at 40% of its dense bf16 peak): FLOPs to seconds
ASSUMED_FLOPS_PER_SECOND = 400e12
PACKING_WINDOW = 1000  # token_budget_window's default: the pairs each sampler packs together
DEFAULT_PROCESSES = [8, 16, 32, 64, 128, 256, 512]
DEFAULT_DISTRIBUTIONS = ["ultrafeedback", "capybara", "reasoning"]
# Tokens a rank holds. `trl-padfree plan` for Llama 3.1 8B on 8 x 80 GiB under ZeRO-3, activation checkpointing on
# (TRL's default), --context-parallel 8: 8,192 tokens a GPU plan to 33.0 GiB, 65,536 to 76.3 GiB (the most that fits)
DEFAULT_RANK_BUDGET = 8192
# TRL's default, which that plan assumes: the backward runs the policy's forward again, its compute and its exchanges
ACTIVATION_CHECKPOINTING = True
EXCHANGES = exchanges_per_layer(reference_forward=True, recompute=ACTIVATION_CHECKPOINTING)
DEFAULT_POOL_BINS = 1024


def default_max_length(ranks: int, rank_budget: int) -> int:
    """--max-length's default for groups of `ranks`: a pair of two sequences that long fills the whole group."""
    return ranks * rank_budget // 2


def pair_unit(prompt: int, chosen: int, rejected: int) -> UnitWork:
    """A pair as the planner sees it: prompt + chosen and prompt + rejected, each its own causal span."""
    return UnitWork(
        2 * prompt + chosen + rejected, (Segment(prompt + chosen), Segment(prompt + rejected)), chosen + rejected
    )


@dataclass(frozen=True)
class GroupBudget:
    """What the trainer builds for groups of `ranks` ranks holding `rank_budget` tokens each
    (`max_tokens_per_batch = ranks x rank_budget`, no `pad_to_multiple_of`): every row padded to a multiple of the
    group's ranks, what a row on some of them may hold, and the cost model its planner gives free ranks out by."""

    shape: DecoderShape
    ranks: int
    rank_budget: int

    @property
    def max_tokens_per_batch(self) -> int:
        return self.ranks * self.rank_budget

    @cached_property
    def multiple(self) -> int:
        return row_multiple(None, self.ranks) or 1

    def padded(self, tokens: int) -> int:
        return -(-tokens // self.multiple) * self.multiple

    @cached_property
    def capacities(self) -> dict[int, int]:
        """The real tokens a row on each share of the group's ranks may hold (`usable_budget`, as the trainer's)."""
        return {
            share: usable_budget(share * self.max_tokens_per_batch // self.ranks, self.multiple)
            for share in rank_sizes(self.ranks)
        }

    def capacity(self, share: int) -> int:
        return self.capacities[share]

    def planned_cost(self, units: Sequence[UnitWork], share: int) -> float:
        """The planner's cost of a row: every row over the group's link (`link_of_group(ranks)`), as the trainer's."""
        return self.row_cost(units, share, link_of_group(self.ranks))

    def row_cost(self, units: Sequence[UnitWork], share: int, link: context_parallel.Link) -> float:
        segments = [segment for unit in units for segment in unit.segments]
        scored = sum(unit.scored_tokens for unit in units)
        tokens = self.padded(sum(unit.tokens for unit in units))
        return split_row_cost(self.shape, segments, scored, tokens, share, link, recompute=ACTIVATION_CHECKPOINTING)


# ---------------------------------------------------------------------------------------------------------------------
# Layouts: the pool's pairs packed one way, every micro-step priced once


@dataclass
class Layout:
    """The pool's pairs packed into one group's micro-steps, each priced: its slowest rank's seconds, its real tokens
    and pairs, and each of the group's ranks' tokens (its chunk, padding included) and gathered bytes.

    `per_round`: the micro-steps a round of the sampler gives each group (static: its C ranks' bins, dynamic: 1)."""

    name: str
    ranks: int
    rank_budget: int
    per_round: int
    seconds: np.ndarray  # (micro-steps,)
    tokens: np.ndarray  # (micro-steps,)
    pairs: np.ndarray  # (micro-steps,)
    rank_tokens: np.ndarray  # (micro-steps, ranks)
    rank_bytes: np.ndarray  # (micro-steps, ranks)
    members: list  # per micro-step, its rows as (the pool's pairs, first rank, ranks)
    rows: list  # per micro-step, its rows as (pairs, tokens, first rank, ranks, milliseconds)


def priced_layout(
    name: str,
    units: Sequence[UnitWork],
    micro_steps: Sequence[Sequence[tuple[Sequence[int], int, int]]],
    budget: GroupBudget,
    per_round: int,
) -> Layout:
    """`micro_steps`, each its rows as (`units`' numbers, first rank, ranks), priced at each row's own link."""
    seconds, tokens, pairs, rank_tokens, rank_bytes, all_rows = [], [], [], [], [], []
    for rows in micro_steps:
        chunks, received, slowest, described = [0] * budget.ranks, [0] * budget.ranks, 0.0, []
        for numbers, first, share in rows:
            members = [units[number] for number in numbers]
            row_tokens = sum(unit.tokens for unit in members)
            padded = budget.padded(row_tokens)
            row_seconds = budget.row_cost(members, share, link_of_group(share)) / ASSUMED_FLOPS_PER_SECOND
            slowest = max(slowest, row_seconds)
            for rank in range(first, first + share):
                chunks[rank] = padded // share
                received[rank] = gathered_bytes(budget.shape, padded, share, exchanges=EXCHANGES) if share > 1 else 0
            described.append((len(members), row_tokens, first, share, round(row_seconds * 1e3, 2)))
        seconds.append(slowest)
        tokens.append(sum(row[1] for row in described))
        pairs.append(sum(row[0] for row in described))
        rank_tokens.append(chunks)
        rank_bytes.append(received)
        all_rows.append(described)
    return Layout(
        name,
        budget.ranks,
        budget.rank_budget,
        per_round,
        np.array(seconds),
        np.array(tokens),
        np.array(pairs),
        np.array(rank_tokens),
        np.array(rank_bytes),
        [list(rows) for rows in micro_steps],
        all_rows,
    )


def static_layout(units: Sequence[UnitWork], budget: GroupBudget) -> Layout:
    """The token budget's bins of the group's whole budget, each one row over all its ranks."""
    capacity = usable_budget(budget.max_tokens_per_batch, budget.multiple)
    lengths = [unit.tokens for unit in units]
    micro_steps = []
    for start in range(0, len(units), PACKING_WINDOW):
        window = range(start, min(start + PACKING_WINDOW, len(units)))
        micro_steps += [[(numbers, 0, budget.ranks)] for numbers in pack_window(window, lengths, capacity)]
    return priced_layout(f"static {budget.ranks}", units, micro_steps, budget, per_round=budget.ranks)


def dynamic_layout(units: Sequence[UnitWork], budget: GroupBudget) -> Layout:
    """The group's micro-steps as `RowsOnRanksSampler` packs them: `pack_micro_steps`, window by window."""
    micro_steps = []
    for start in range(0, len(units), PACKING_WINDOW):
        packed = pack_micro_steps(
            units[start : start + PACKING_WINDOW], budget.ranks, budget.capacity, budget.planned_cost
        )
        micro_steps += [
            [(tuple(start + number for number in share.units), share.first_rank, share.ranks) for share in step]
            for step in packed
        ]
    return priced_layout(f"dynamic {budget.ranks}", units, micro_steps, budget, per_round=1)


# ---------------------------------------------------------------------------------------------------------------------
# Training the pool's pairs


@dataclass(frozen=True)
class LayoutFigures:
    """One layout training the pool's pairs at W processes.

    Args:
        epoch_seconds: the time for the pool's pairs once (the simulated epochs' time over their count).
        tokens_per_second_per_gpu: real tokens (padding not counted).
        lockstep_micro_steps: micro-steps per epoch, every group's at once.
        fill: a micro-step's real tokens over its group's budget (ranks x rank budget), the mean.
        rank_tokens_max_over_mean: per lockstep micro-step, the tokens of the fullest rank of any group over the
            mean rank's (chunks, padding included), the mean.
        gathered_mb_per_rank: bytes a rank gathers per micro-step, the mean over ranks and micro-steps.
    """

    epoch_seconds: float
    tokens_per_second_per_gpu: float
    lockstep_micro_steps: float
    fill: float
    rank_tokens_max_over_mean: float
    gathered_mb_per_rank: float


def epochs_needed(layouts: Sequence[Layout], processes: int, rounds: int) -> int:
    """Epochs of the pool that give every layout at least `rounds` lockstep micro-steps at `processes`."""
    fewest = min(len(layout.seconds) * layout.ranks for layout in layouts)
    return max(1, math.ceil(rounds * processes / fewest))


def trained(layout: Layout, processes: int, epochs: int, seed: int) -> LayoutFigures:
    """`epochs` epochs of the layout's micro-steps, each in a new order, dealt in rounds of `per_round` micro-steps
    to each of `processes / ranks` groups; a lockstep micro-step lasts its slowest group's."""
    groups = processes // layout.ranks
    count = len(layout.seconds)
    order = np.concatenate([np.random.default_rng([seed, epoch]).permutation(count) for epoch in range(epochs)])
    deal = groups * layout.per_round
    order = np.concatenate([order, np.full(-len(order) % deal, count)])  # the last round: groups with none idle
    # [round, group, micro-step of the round] -> [lockstep micro-step, group]
    order = order.reshape(-1, groups, layout.per_round).transpose(0, 2, 1).reshape(-1, groups)
    seconds = np.append(layout.seconds, 0.0)[order].max(axis=1)
    held = np.vstack([layout.rank_tokens, np.full(layout.ranks, np.nan)])[order].reshape(len(order), -1)
    busy = ~np.isnan(held).all(axis=1)
    total = float(seconds.sum())
    return LayoutFigures(
        epoch_seconds=total / epochs,
        tokens_per_second_per_gpu=float(layout.tokens.sum()) * epochs / total / processes,
        lockstep_micro_steps=int(busy.sum()) / epochs,
        fill=float(np.mean(layout.tokens / (layout.ranks * layout.rank_budget))),
        rank_tokens_max_over_mean=float(np.mean(np.nanmax(held[busy], axis=1) / np.nanmean(held[busy], axis=1))),
        gathered_mb_per_rank=float(layout.rank_bytes.mean() / 1e6),
    )


@dataclass(frozen=True)
class ContextParallelRow:
    """One source, group size and process count: static and dynamic context parallelism at `ranks` on the same pairs,
    and static at each group size that holds the longest pair (`static_by_ranks`)."""

    distribution: str
    ranks: int
    link: str
    processes: int
    rank_budget: int
    max_length: int
    pool_pairs: int
    longest_pair: int
    epochs: int
    static: LayoutFigures
    dynamic: LayoutFigures
    static_by_ranks: dict[int, LayoutFigures]
    dynamic_pairs_by_ranks: dict[int, float]  # the share of the pool's pairs dynamic trains on rows of that many ranks
    # The pool's first dynamic micro-step with the most different row sizes: each row's (pairs, tokens, first rank,
    # ranks, milliseconds)
    sample_micro_step: list

    @property
    def time_ratio(self) -> float:
        """Static over dynamic time for the same pairs (= dynamic over static tokens per second)."""
        return self.static.epoch_seconds / self.dynamic.epoch_seconds

    @property
    def best_static_ranks(self) -> int:
        return min(self.static_by_ranks, key=lambda size: self.static_by_ranks[size].epoch_seconds)

    @property
    def over_best_static(self) -> float:
        """The best static group size's time over dynamic's, for the same pairs."""
        return self.static_by_ranks[self.best_static_ranks].epoch_seconds / self.dynamic.epoch_seconds

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "time_ratio": self.time_ratio,
            "best_static_ranks": self.best_static_ranks,
            "over_best_static": self.over_best_static,
        }


def simulate_source(
    name: str,
    pairs: Sequence[tuple[int, int, int]],
    shape: DecoderShape,
    ranks: int,
    rank_budget: int,
    max_length: int,
    processes: Sequence[int],
    rounds: int,
    seed: int,
) -> list[ContextParallelRow]:
    """Every process count's row for one source's pool of `pairs` on groups of `ranks`."""
    units = [pair_unit(*pair) for pair in pairs]
    longest = max(unit.tokens for unit in units)
    budget = GroupBudget(shape, ranks, rank_budget)
    if longest > budget.capacity(ranks):
        raise ValueError(
            f"{name}: a pair of {longest} tokens does not fit {ranks} ranks of --rank-budget {rank_budget}: raise "
            "--rank-budget or --context-parallel, or lower --max-length."
        )
    static, dynamic = static_layout(units, budget), dynamic_layout(units, budget)
    smaller = {
        size: static_layout(units, GroupBudget(shape, size, rank_budget))
        for size in rank_sizes(ranks)[:-1]
        if longest <= GroupBudget(shape, size, rank_budget).capacity(size)
    }
    assert static.pairs.sum() == dynamic.pairs.sum() == len(units), "a layout lost or doubled pairs"
    by_ranks = {size: 0 for size in rank_sizes(ranks)}
    for rows in dynamic.members:
        for numbers, _, share in rows:
            by_ranks[share] += len(numbers) / len(units)
    mixed = max(range(len(dynamic.rows)), key=lambda number: (len({row[3] for row in dynamic.rows[number]}), -number))
    rows = []
    for count in processes:
        if count % ranks:
            continue
        epochs = epochs_needed([static, dynamic, *smaller.values()], count, rounds)
        figures = {layout.ranks: trained(layout, count, epochs, seed) for layout in (*smaller.values(), static)}
        rows.append(
            ContextParallelRow(
                name,
                ranks,
                "nvlink" if link_of_group(ranks) == context_parallel.NVLINK else "infiniband",
                count,
                rank_budget,
                max_length,
                len(units),
                longest,
                epochs,
                figures[ranks],
                trained(dynamic, count, epochs, seed),
                figures,
                by_ranks,
                dynamic.rows[mixed],
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# The command (`balance.py` parses the options)


def pairs_needed(sample: Sequence[tuple[int, int, int]], capacity: int, pool_bins: int) -> int:
    """Pairs to draw for about `pool_bins` full bins of `capacity` tokens, from a sample's mean pair."""
    mean = sum(2 * prompt + chosen + rejected for prompt, chosen, rejected in sample) / len(sample)
    return max(1, int(pool_bins * capacity / mean))


Draw = Callable[[int, int], list]  # (pairs, max_length) -> truncated (prompt, chosen, rejected) token counts


def run_context_parallel(options: argparse.Namespace, shape: DecoderShape, sources: dict[str, Draw]):
    rows = []
    for ranks in options.context_parallel:
        max_length = options.max_length or default_max_length(ranks, options.rank_budget)
        for name, draw in sources.items():
            count = pairs_needed(draw(4096, max_length), ranks * options.rank_budget, options.pool_bins)
            rows += simulate_source(
                name,
                draw(count, max_length),
                shape,
                ranks,
                options.rank_budget,
                max_length,
                options.processes,
                options.steps,
                options.seed,
            )
    return rows


def format_table(rows: list[ContextParallelRow]) -> str:
    columns = (
        "distribution",
        "C",
        "processes",
        "epoch s static",
        "epoch s dynamic",
        "static / dynamic",
        "best static C'",
        "best static / dynamic",
        "fill static, dynamic",
        "tokens/rank max/mean static, dynamic",
        "MB gathered/rank static, dynamic",
    )
    cells = [
        (
            row.distribution,
            f"{row.ranks} ({row.link})",
            str(row.processes),
            f"{row.static.epoch_seconds:.1f}",
            f"{row.dynamic.epoch_seconds:.1f}",
            f"{row.time_ratio:.3f}x",
            str(row.best_static_ranks),
            f"{row.over_best_static:.3f}x",
            f"{row.static.fill:.3f}, {row.dynamic.fill:.3f}",
            f"{row.static.rank_tokens_max_over_mean:.2f}, {row.dynamic.rank_tokens_max_over_mean:.2f}",
            f"{row.static.gathered_mb_per_rank:.0f}, {row.dynamic.gathered_mb_per_rank:.0f}",
        )
        for row in rows
    ]
    return markdown_table(columns, cells)


NOT_MODELLED = (
    "Batches: both samplers split micro-steps until their count is a multiple of the groups (at most one round an "
    "epoch); the simulation instead runs the last round of its epochs with the groups that have a micro-step left. "
    "Links: a row's communication is priced over the link of its own ranks (an aligned block of up to 8 GPUs in one "
    "node: NVLink), while the trainer's planner prices every row over its group's link (InfiniBand for groups of 16), "
    "so at C=16 the planner overprices rows on 2-8 ranks when it gives free ranks out. Not simulated: the optimizer "
    "step and ZeRO-3's parameter gathers (the same per micro-step in every layout: they favour the layout with fewer "
    "micro-steps), dataloading, and the CPU time of packing (pack_micro_steps: 8-35 ms per window of 1,000 pairs, "
    "once a run)."
)


def write_rows(rows: list[ContextParallelRow], path: str, options: argparse.Namespace) -> None:
    """The rows under the run's provenance and the cost model's assumptions."""
    flags = {key: value for key, value in vars(options).items() if key != "run"}
    report = {
        "provenance": run_provenance(flags),
        "assumptions": {
            "flops_per_second": ASSUMED_FLOPS_PER_SECOND,
            "activation_checkpointing": ACTIVATION_CHECKPOINTING,
            "exchanges_per_layer": EXCHANGES,
            "links": {
                "nvlink": asdict(context_parallel.NVLINK),
                "infiniband": asdict(context_parallel.INFINIBAND),
                "gpus_per_node": context_parallel.GPUS_PER_NODE,
            },
            "cost_model": " ".join(context_parallel.__doc__.split()),
            "simulation": " ".join(__doc__.split()),
            "not_modelled": NOT_MODELLED,
            "packing_window": PACKING_WINDOW,
        },
        "rows": [row.to_json() for row in rows],
    }
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def run(options: argparse.Namespace, shape: DecoderShape, sources: dict[str, Draw]) -> int:
    start = time.perf_counter()
    rows = run_context_parallel(options, shape, sources)
    print(format_table(rows))
    print(
        f"\nSimulated: pools of about {options.pool_bins} bins, at least {options.steps} lockstep micro-steps per row, "
        f"model {options.model_config}, --context-parallel {' '.join(map(str, options.context_parallel))}, "
        f"--rank-budget {options.rank_budget}; {time.perf_counter() - start:.1f} s."
    )
    if options.output:
        write_rows(rows, options.output, options)
    return 0
