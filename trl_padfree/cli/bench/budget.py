"""`trl-padfree bench --batching`: fixed pairs per micro-batch vs token-budget micro-batches, padding-free both.

One epoch over the same pool of pairs, batched two ways:
- `fixed`: `--pairs-per-batch` pairs per micro-batch, in the pool's order (what `per_device_train_batch_size` does);
- `budget`: `TokenBudgetBatchSampler` with the budget set to the longest row the fixed batches make, so no budgeted
  row is longer than the fixed scheme's peak: the same peak activation memory.

Both epochs run through the same padding-free trainer step (reference forward, policy forward and backward), in
alternating order, repeated. Reported per distribution: tokens/s, micro-batches (optimizer steps) per epoch, peak
memory, and how full the rows are.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from tqdm.auto import tqdm

from ...data import load_demo_tokenizer
from ...packing.layout import pair_tokens
from ...packing.token_budget import TokenBudgetBatchSampler
from ...packing.units import PairUnits
from .harness import (
    StepTimer,
    bench_device,
    device_name,
    format_peak_mb,
    make_batches,
    make_bench_trainer,
    markdown_table,
)

REPEATS = 2


@dataclass
class BatchingRow:
    distribution: str
    device: str
    model: str
    pairs: int
    pairs_per_batch: int
    budget_tokens: int
    fixed_steps_per_epoch: int
    budget_steps_per_epoch: int
    fixed_tokens_per_s: float
    budget_tokens_per_s: float
    speedup: float
    fixed_peak_mem_mb: float | None
    budget_peak_mem_mb: float | None
    fixed_fill: float  # mean row length / budget
    budget_fill: float


def batching_schemes(
    pairs: list[dict], pairs_per_batch: int, seed: int
) -> tuple[list[list[dict]], list[list[dict]], int]:
    """The fixed micro-batches, the token-budget ones, and the budget (the longest fixed row)."""
    lengths = [_pair_tokens(pair) for pair in pairs]
    fixed = [
        list(range(start, min(start + pairs_per_batch, len(pairs)))) for start in range(0, len(pairs), pairs_per_batch)
    ]
    budget = max(sum(lengths[index] for index in batch) for batch in fixed)
    budgeted = list(TokenBudgetBatchSampler(PairUnits(lengths), budget, seed=seed))
    to_pairs = lambda batches: [[pairs[index] for index in batch] for batch in batches]  # noqa: E731
    return to_pairs(fixed), to_pairs(budgeted), budget


def _pair_tokens(pair: dict) -> int:
    # The bench's pairs arrive truncated: no max_length
    return pair_tokens(len(pair["prompt_ids"]), len(pair["chosen_ids"]), len(pair["rejected_ids"]), None)


def row_length(batch: list[dict]) -> int:
    """Tokens of the packed row a micro-batch of tokenized pairs makes."""
    return sum(_pair_tokens(pair) for pair in batch)


def bench_batching_distribution(distribution: str, trainer, options: argparse.Namespace, device) -> BatchingRow:
    vocab_size = len(load_demo_tokenizer())
    pool_size = options.batches * options.pairs_per_batch
    pairs = make_batches(distribution, 1, pool_size, options.max_length, vocab_size, options.seed)[0]
    random.Random(options.seed).shuffle(pairs)
    fixed, budgeted, budget = batching_schemes(pairs, options.pairs_per_batch, options.seed)
    schemes = {"fixed": fixed, "budget": budgeted}
    timer = StepTimer(device, schemes)
    timer.warm_up((trainer, fixed[index % len(fixed)]) for index in range(options.warmup))
    progress = tqdm(total=REPEATS * (len(fixed) + len(budgeted)), desc=distribution, unit="batch", leave=False)
    for repeat in range(REPEATS):
        for name in schemes if repeat % 2 == 0 else reversed(list(schemes)):
            for batch in schemes[name]:
                timer.step(name, trainer, batch)
                progress.update()
    progress.close()
    seconds, peaks = timer.seconds, timer.peaks
    real_tokens = sum(row_length(batch) for batch in fixed) * REPEATS
    fill = {
        name: sum(row_length(batch) for batch in batches) / (len(batches) * budget)
        for name, batches in schemes.items()
    }
    return BatchingRow(
        distribution=distribution,
        device=device_name(device),
        model=options.model,
        pairs=len(pairs),
        pairs_per_batch=options.pairs_per_batch,
        budget_tokens=budget,
        fixed_steps_per_epoch=len(fixed),
        budget_steps_per_epoch=len(budgeted),
        fixed_tokens_per_s=real_tokens / seconds["fixed"],
        budget_tokens_per_s=real_tokens / seconds["budget"],
        speedup=seconds["fixed"] / seconds["budget"],
        fixed_peak_mem_mb=peaks["fixed"],
        budget_peak_mem_mb=peaks["budget"],
        fixed_fill=fill["fixed"],
        budget_fill=fill["budget"],
    )


def run_batching_bench(options: argparse.Namespace) -> list[BatchingRow]:
    device, dtype = bench_device(options.device)
    trainer = make_bench_trainer(
        options.model, "padfree_varlen", device, dtype, activation_checkpointing=options.activation_checkpointing
    )
    return [bench_batching_distribution(name, trainer, options, device) for name in options.distributions]


TABLE_COLUMNS = (
    "distribution",
    "pairs",
    "fixed: pairs/batch",
    "budget tokens",
    "steps/epoch fixed",
    "steps/epoch budget",
    "tokens/s fixed",
    "tokens/s budget",
    "speedup",
    "row fill fixed",
    "row fill budget",
    "peak MB fixed",
    "peak MB budget",
)


def format_batching_table(rows: list[BatchingRow]) -> str:
    cells = (
        [
            row.distribution,
            str(row.pairs),
            str(row.pairs_per_batch),
            f"{row.budget_tokens:,}",
            str(row.fixed_steps_per_epoch),
            str(row.budget_steps_per_epoch),
            f"{row.fixed_tokens_per_s:,.0f}",
            f"{row.budget_tokens_per_s:,.0f}",
            f"{row.speedup:.2f}x",
            f"{row.fixed_fill:.2f}",
            f"{row.budget_fill:.2f}",
            format_peak_mb(row.fixed_peak_mem_mb),
            format_peak_mb(row.budget_peak_mem_mb),
        ]
        for row in rows
    )
    return markdown_table(TABLE_COLUMNS, cells)
