"""`trl-padfree balance --context-parallel C`: a step of context-parallel groups with every row split over all C ranks
of its group (static) against each row on the ranks its length needs (dynamic, `packing.rank_shares.share_ranks`),
simulated with the cost model of a split row (`costs.context_parallel.split_row_cost`). No model, no GPU.

For each source of pairs and each number of processes W (a multiple of C):

    pairs      drawn from a length model (or a dataset), truncated to --max-length as TRL truncates them
    bins       the token budget's packing (best fit decreasing, windows of 1000 pairs) into bins of
               C x --rank-budget tokens: `max_tokens_per_batch`, each rank holding at most --rank-budget
    a step     one round of W bins: each of the W / C groups trains its C bins one after the other, a micro-step
               each. Every forward runs in lockstep (ZeRO-3 gathers each layer's parameters), so a micro-step lasts
               as long as its slowest rank anywhere, and a step is the sum of its micro-steps
    static     a micro-step's bin is one row over the group's C ranks
    dynamic    the same bin shared out by `share_ranks`: its dearest row on that row's ranks

and static C' on bins of C' x --rank-budget tokens, for every C' in 1, 2 ... C that holds the longest pair drawn: the
same data in other batches, so compared by real tokens per second, not by step time.

To stay fast (the planner takes 1-50 ms per bin in Python, more the more pairs a bin holds), each source's bins are
packed and priced once, --pool-bins of them per budget; every simulated step then draws its W bins from that pool
(without replacement where the pool holds W, as a shuffled sampler deals them). Seconds are the slowest rank's FLOPs
at `ASSUMED_FLOPS_PER_SECOND`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..costs import context_parallel
from ..costs.context_parallel import gathered_bytes, link_of_group, split_row_cost
from ..costs.flops import DecoderShape, Segment
from ..packing.rank_shares import UnitWork, rank_sizes, share_ranks
from ..packing.token_budget import pack_window
from .bench.harness import markdown_table
from .bench.report import run_provenance

# The rate costs/context_parallel.py's links are built on (an H100 at 40% of its dense bf16 peak): FLOPs to seconds
ASSUMED_FLOPS_PER_SECOND = 400e12
PACKING_WINDOW = 1000  # token_budget_window's default: the pairs packed together
DEFAULT_PROCESSES = [8, 16, 32, 64, 128, 256, 512]
DEFAULT_DISTRIBUTIONS = ["ultrafeedback", "capybara", "reasoning"]
# Tokens a rank holds. `trl-padfree plan` for Llama 3.1 8B on 8 x 80 GiB under ZeRO-3, activation checkpointing on
# (TRL's default), --context-parallel 8: 8,192 tokens a GPU plan to 33.0 GiB, 65,536 to 76.3 GiB (the most that
# fits). The default is the smaller: a bin's plan takes the planner longer the more pairs it holds
DEFAULT_RANK_BUDGET = 8192
DEFAULT_MAX_LENGTH = 32768  # a pair of two 32,768-token sequences fills 8 ranks of the default budget
DEFAULT_POOL_BINS = 512


def pair_unit(prompt: int, chosen: int, rejected: int) -> UnitWork:
    """A pair as the planner sees it: prompt + chosen and prompt + rejected, each its own causal span."""
    return UnitWork(
        2 * prompt + chosen + rejected, (Segment(prompt + chosen), Segment(prompt + rejected)), chosen + rejected
    )


def padded(tokens: int, ranks: int) -> int:
    """A row's tokens padded to a multiple of its ranks, as the collator pads a split row."""
    return -(-tokens // ranks) * ranks


@dataclass(frozen=True)
class SplitRows:
    """The budget and the cost model the planner and the simulation share: `fits` and `row_cost` of `share_ranks`."""

    shape: DecoderShape
    rank_budget: int

    def fits(self, tokens: int, ranks: int) -> bool:
        return padded(tokens, ranks) <= ranks * self.rank_budget

    def row_cost(self, units: Sequence[UnitWork], ranks: int) -> float:
        tokens = sum(unit.tokens for unit in units)
        segments = [segment for unit in units for segment in unit.segments]
        scored = sum(unit.scored_tokens for unit in units)
        return split_row_cost(self.shape, segments, scored, padded(tokens, ranks), ranks, link_of_group(ranks))


@dataclass
class PricedBins:
    """A pool of bins of one budget, each trained on a group of `ranks` ranks: its slowest rank's cost, its real
    tokens, and each of the group's ranks' tokens (its chunk, padding included) and gathered bytes."""

    cost: np.ndarray  # (bins,)
    tokens: np.ndarray  # (bins,)
    rank_tokens: np.ndarray  # (bins, ranks)
    rank_bytes: np.ndarray  # (bins, ranks)
    shares: list  # per bin, its rows as (pairs, tokens, first rank, ranks)


def price_bins(bins: Sequence[Sequence[UnitWork]], ranks: int, split: SplitRows, dynamic: bool) -> PricedBins:
    """Each bin as one row over `ranks` ranks, or (`dynamic`) shared out by `share_ranks`."""
    costs, tokens, rank_tokens, rank_bytes, all_shares = [], [], [], [], []
    for units in bins:
        if dynamic:
            shares = share_ranks(units, ranks, split.fits, split.row_cost)
            rows = [([units[unit] for unit in share.units], share.first_rank, share.ranks) for share in shares]
        else:
            rows = [(list(units), 0, ranks)]
        chunks, received, slowest, shares = [0] * ranks, [0] * ranks, 0.0, []
        for members, first, size in rows:
            row_tokens = sum(unit.tokens for unit in members)
            slowest = max(slowest, split.row_cost(members, size))
            for rank in range(first, first + size):
                chunks[rank] = padded(row_tokens, size) // size
                received[rank] = gathered_bytes(split.shape, padded(row_tokens, size), size) if size > 1 else 0
            shares.append((len(members), row_tokens, first, size))
        costs.append(slowest)
        tokens.append(sum(unit.tokens for unit in units))
        rank_tokens.append(chunks)
        rank_bytes.append(received)
        all_shares.append(shares)
    return PricedBins(np.array(costs), np.array(tokens), np.array(rank_tokens), np.array(rank_bytes), all_shares)


def packed_bins(pairs: Sequence[tuple[int, int, int]], capacity: int, count: int) -> list[list[UnitWork]]:
    """The first windows' bins of `pairs` (in drawn order), at least `count` of them, packed as the token budget packs
    them; each bin's pairs longest first, the order its row lays them out in."""
    units = [pair_unit(*pair) for pair in pairs]
    lengths = [unit.tokens for unit in units]
    bins: list[list[UnitWork]] = []
    for start in range(0, len(pairs), PACKING_WINDOW):
        window = range(start, min(start + PACKING_WINDOW, len(pairs)))
        bins += [[units[index] for index in packed] for packed in pack_window(window, lengths, capacity)]
        if len(bins) >= count:
            return bins
    raise ValueError(f"{len(pairs)} pairs make {len(bins)} bins of {capacity} tokens, fewer than --pool-bins {count}.")


# ---------------------------------------------------------------------------------------------------------------------
# Steps


@dataclass(frozen=True)
class LayoutFigures:
    """One layout's simulated steps: the mean step time, real tokens per second per GPU, each step's tokens per rank
    (the chunks it trains, summed over its micro-steps) slowest over mean, and bytes a rank gathers per step."""

    step_seconds: float
    tokens_per_second_per_gpu: float
    rank_tokens_max_over_mean: float
    gathered_gb_per_rank: float


def simulated_steps(
    pools: Sequence[PricedBins], processes: int, steps: int, rng: np.random.Generator
) -> list[LayoutFigures]:
    """`steps` steps of `processes` processes, each drawing its bins from the pools (several pools: the same bins,
    priced as different layouts), group g training the g-th `ranks` of the drawn bins, one a micro-step."""
    count, ranks = pools[0].rank_tokens.shape
    groups = processes // ranks
    draws = np.stack([rng.choice(count, size=processes, replace=processes > count) for _ in range(steps)])
    draws = draws.reshape(steps, groups, ranks)  # [step, group, micro-step]
    figures = []
    for pool in pools:
        seconds = pool.cost[draws].max(axis=1).sum(axis=1) / ASSUMED_FLOPS_PER_SECOND  # slowest group, each micro-step
        held = pool.rank_tokens[draws].sum(axis=2)  # [step, group, rank]: summed over micro-steps
        held = held.reshape(steps, processes)
        received = pool.rank_bytes[draws].sum(axis=2).reshape(steps, processes)
        figures.append(
            LayoutFigures(
                step_seconds=float(seconds.mean()),
                tokens_per_second_per_gpu=float(pool.tokens[draws].sum() / seconds.sum() / processes),
                rank_tokens_max_over_mean=float((held.max(axis=1) / held.mean(axis=1)).mean()),
                gathered_gb_per_rank=float(received.mean() / 1e9),
            )
        )
    return figures


@dataclass(frozen=True)
class ContextParallelRow:
    """One source and process count: static and dynamic context parallelism at `ranks` on the same bins, and static
    at each smaller group size that holds the longest pair (`static_by_ranks`, on bins of its own budget)."""

    distribution: str
    processes: int
    ranks: int
    rank_budget: int
    steps: int
    pool_bins: int
    longest_pair: int
    static: LayoutFigures
    dynamic: LayoutFigures
    static_by_ranks: dict[int, LayoutFigures]
    sample_group: list  # a group's C micro-steps, bins drawn at random: each row's (pairs, tokens, first rank, ranks)

    @property
    def step_time_ratio(self) -> float:
        """Static over dynamic step time, on the same pairs in the same micro-steps."""
        return self.static.step_seconds / self.dynamic.step_seconds

    @property
    def best_static_ranks(self) -> int:
        return max(self.static_by_ranks, key=lambda size: self.static_by_ranks[size].tokens_per_second_per_gpu)

    @property
    def over_best_static(self) -> float:
        """Dynamic's real tokens per second over the best static group size's."""
        best = self.static_by_ranks[self.best_static_ranks]
        return self.dynamic.tokens_per_second_per_gpu / best.tokens_per_second_per_gpu

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "step_time_ratio": self.step_time_ratio,
            "best_static_ranks": self.best_static_ranks,
            "over_best_static": self.over_best_static,
        }


def drawn_pairs(source: Sequence[tuple[int, int, int]] | None, count: int, draw, seed: int):
    """`count` pairs: `draw(count)` from a length model, or picked at random from a dataset's `source`."""
    if source is None:
        return draw(count)
    rng = random.Random(seed)
    return [source[rng.randrange(len(source))] for _ in range(count)]


def simulate_source(
    name: str,
    pairs: Sequence[tuple[int, int, int]],
    shape: DecoderShape,
    ranks: int,
    rank_budget: int,
    processes: Sequence[int],
    steps: int,
    pool_bins: int,
    seed: int,
) -> list[ContextParallelRow]:
    """Every process count's row for one source's drawn `pairs` (enough for `pool_bins` bins of every budget)."""
    split = SplitRows(shape, rank_budget)
    longest = max(2 * prompt + chosen + rejected for prompt, chosen, rejected in pairs)
    if longest > ranks * rank_budget:
        raise ValueError(
            f"{name}: a pair of {longest} tokens does not fit {ranks} ranks of --rank-budget {rank_budget}: raise "
            "--rank-budget or --context-parallel, or lower --max-length."
        )
    bins = packed_bins(pairs, ranks * rank_budget, pool_bins)[:pool_bins]
    static, dynamic = price_bins(bins, ranks, split, dynamic=False), price_bins(bins, ranks, split, dynamic=True)
    smaller = {
        size: price_bins(packed_bins(pairs, size * rank_budget, pool_bins)[:pool_bins], size, split, dynamic=False)
        for size in rank_sizes(ranks)[:-1]
        if longest <= size * rank_budget
    }
    rows = []
    for count in processes:
        rng = np.random.default_rng([seed, count, ranks])
        static_figures, dynamic_figures = simulated_steps([static, dynamic], count, steps, rng)
        by_ranks = {size: simulated_steps([pool], count, steps, rng)[0] for size, pool in smaller.items()}
        by_ranks[ranks] = static_figures
        sample = np.random.default_rng([seed, count]).choice(pool_bins, size=ranks, replace=False)
        rows.append(
            ContextParallelRow(
                name,
                count,
                ranks,
                rank_budget,
                steps,
                pool_bins,
                longest,
                static_figures,
                dynamic_figures,
                by_ranks,
                [dynamic.shares[number] for number in sample],
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# The command (`balance.py` parses the options)


def pairs_needed(sample: Sequence[tuple[int, int, int]], capacity: int, pool_bins: int) -> int:
    """Pairs to draw for `pool_bins` bins of `capacity` tokens, from a sample's mean pair: 20% and a window spare."""
    mean = sum(2 * prompt + chosen + rejected for prompt, chosen, rejected in sample) / len(sample)
    return int(1.2 * pool_bins * capacity / mean) + PACKING_WINDOW


def run_context_parallel(options: argparse.Namespace, shape: DecoderShape, sources: dict) -> list[ContextParallelRow]:
    """`sources`: name -> (a dataset's pairs, or None; `draw(count)` for a length model)."""
    capacity = options.context_parallel * options.rank_budget
    rows = []
    for name, (dataset, draw) in sources.items():
        sample = drawn_pairs(dataset, 4096, draw, options.seed)
        count = pairs_needed(sample, capacity, options.pool_bins)
        pairs = drawn_pairs(dataset, count, draw, options.seed)
        rows += simulate_source(
            name,
            pairs,
            shape,
            options.context_parallel,
            options.rank_budget,
            options.processes,
            options.steps,
            options.pool_bins,
            options.seed,
        )
    return rows


def format_table(rows: list[ContextParallelRow]) -> str:
    columns = (
        "distribution",
        "processes",
        "step s static",
        "step s dynamic",
        "static / dynamic",
        "best static C'",
        "tokens/s/GPU best static",
        "tokens/s/GPU dynamic",
        "dynamic / best static",
        "tokens/rank max/mean static, dynamic",
        "GB gathered/rank static, dynamic",
    )
    cells = [
        (
            row.distribution,
            str(row.processes),
            f"{row.static.step_seconds:.3f}",
            f"{row.dynamic.step_seconds:.3f}",
            f"{row.step_time_ratio:.2f}x",
            str(row.best_static_ranks),
            f"{row.static_by_ranks[row.best_static_ranks].tokens_per_second_per_gpu:,.0f}",
            f"{row.dynamic.tokens_per_second_per_gpu:,.0f}",
            f"{row.over_best_static:.2f}x",
            f"{row.static.rank_tokens_max_over_mean:.2f}, {row.dynamic.rank_tokens_max_over_mean:.2f}",
            f"{row.static.gathered_gb_per_rank:.1f}, {row.dynamic.gathered_gb_per_rank:.1f}",
        )
        for row in rows
    ]
    return markdown_table(columns, cells)


def write_rows(rows: list[ContextParallelRow], path: str, options: argparse.Namespace) -> None:
    """The rows under the run's provenance and the cost model's assumptions."""
    flags = {key: value for key, value in vars(options).items() if key != "run"}
    report = {
        "provenance": run_provenance(flags),
        "assumptions": {
            "flops_per_second": ASSUMED_FLOPS_PER_SECOND,
            "links": {
                "nvlink": asdict(context_parallel.NVLINK),
                "infiniband": asdict(context_parallel.INFINIBAND),
                "gpus_per_node": context_parallel.GPUS_PER_NODE,
            },
            "cost_model": " ".join(context_parallel.__doc__.split()),
        },
        "rows": [row.to_json() for row in rows],
    }
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def run(options: argparse.Namespace, shape: DecoderShape, sources: dict) -> int:
    start = time.perf_counter()
    rows = run_context_parallel(options, shape, sources)
    print(format_table(rows))
    print(
        f"\nSimulated: {options.steps} steps per row drawn from {options.pool_bins} bins per budget, model "
        f"{options.model_config}, --context-parallel {options.context_parallel}, --rank-budget {options.rank_budget}, "
        f"--max-length {options.max_length}; {time.perf_counter() - start:.1f} s."
    )
    if options.output:
        write_rows(rows, options.output, options)
    return 0
