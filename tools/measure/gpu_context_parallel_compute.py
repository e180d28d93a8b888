"""The compute of each rank's part of a context-parallel step, static against dynamic, on one device: the GPU report's
context parallelism row (tools/gpu_report.py). Communication between GPUs cannot be measured on one GPU: it is
modelled (costs/context_parallel.py), not measured, here.

A pool of pairs drawn from the reasoning-trace length model (`REASONING`, times the plan's `length_scale`, truncated
as TRL truncates them to half a group's budget) is packed two ways for a group of C ranks of `rank_budget` tokens
each, as `trl-padfree balance --context-parallel` packs them (cli/context_parallel_balance.py):

    static    bins of C x rank_budget tokens (`pack_window`), each one row cut into C chunks
    dynamic   micro-steps of the group's ranks (`pack_micro_steps`): rows on 1, 2 ... C ranks, each row cut into as
              many chunks as its ranks

One device runs every rank's chunk in turn, as that rank would: the chunk's forward through the real model
(`padfree_varlen` attention, activation checkpointing on as in TRL's defaults), the LM head on the chunk's completion
tokens, and the backward. A chunk of a row on several ranks is a `ContextParallelRow` whose all-gather is replaced by
a local stand-in: the chunk's own keys and values repeated to the row's length. The attention kernel's work is the
same as on the gathered row (its index picks, by row position, the keys each segment of the chunk reads, whatever
their values), and so is the backward's through the gather, less its reduce-scatter. A row on one rank runs as a
plain packed row, as the trainer runs it. The reference's forward is left out: it adds one forward of every chunk,
which the cost model scales alike.

A micro-step lasts as long as its slowest rank's chunk; a layout's compute is the sum over its micro-steps. Both
layouts train the same pairs, so static over dynamic is the gain of the dynamic split in compute alone. Beside it,
the cost model's compute-only prediction for the same micro-steps: `split_row_cost` with a free link (`Link(0, 0)`).

On CUDA each chunk runs its warm-ups, then its measured repetitions between CUDA events (the median kept), nothing
freed in between; on CPU (the report's dry run) the wall clock, one repetition.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from trl_padfree.cli.bench.harness import (
    decoder_shape,
    make_bench_model,
    markdown_table,
    sample_lengths,
    truncated_pair_lengths,
)
from trl_padfree.cli.bench.rows import KernelUse
from trl_padfree.cli.context_parallel_balance import (
    GroupBudget,
    default_max_length,
    dynamic_layout,
    pair_unit,
    static_layout,
)
from trl_padfree.costs.context_parallel import Link
from trl_padfree.data.length_models import REASONING
from trl_padfree.modeling.attention.rows import PACKED_ROW_KWARG, PackedRow, row_in_flight
from trl_padfree.packing.rank_shares import UnitWork, rank_sizes
from trl_padfree.parallel.context import ContextParallelRow
from trl_padfree.parallel.groups import RowGroup

FREE_LINK = Link(0, 0)  # communication costs nothing: the cost model's compute term alone

NOTE = (
    "Compute only: every rank's chunk (forward, LM head on its completion tokens, backward; activation "
    "checkpointing on) run in turn on this one device, its keys and values gathered by a local stand-in of the "
    "row's length; communication between GPUs is modelled (costs/context_parallel.py), not measured"
)


@dataclass(frozen=True)
class ComputePlan:
    """One measurement: `pairs` pairs of the reasoning-trace model (lengths times `length_scale`) on a group of `ranks`
    ranks holding `rank_budget` tokens each, on `model` (a bench shape), each chunk `warmup` times then `repetitions`
    times measured."""

    model: str
    ranks: int
    rank_budget: int
    pairs: int
    length_scale: float
    warmup: int
    repetitions: int
    seed: int = 0

    @property
    def max_length(self) -> int:
        """TRL's `max_length`: a pair of two sequences that long fills the whole group."""
        return default_max_length(self.ranks, self.rank_budget)


# Sized for the GPU report's minutes: Qwen2.5-0.5B's shape, 4K tokens a rank, 48 pairs of the reasoning model at half
# its lengths (median pair 1.5K tokens, the longest 9.1K of the group's 16K): 6 static micro-steps (24 chunks) against 7
# dynamic ones (28 chunks: 18 rows on 1 rank, 3 on 2, 1 on 4), about 0.85 PFLOP a pass with the recompute. The
# planner keeps a window static where the cost model finds static cheaper (`pack_micro_steps`), as it does for some
# pools of this model and budget; this pool (seed 1) it splits dynamically
GPU_PLAN = ComputePlan(
    "qwen2.5-0.5b", ranks=4, rank_budget=4096, pairs=48, length_scale=1 / 2, warmup=1, repetitions=3, seed=1
)
# The same code on CPU: the tiny demo model, lengths scaled so that dynamic puts rows on 1, 2 and 4 ranks
DRY_RUN_PLAN = ComputePlan("tiny", ranks=4, rank_budget=64, pairs=8, length_scale=1 / 32, warmup=0, repetitions=1)


# ---------------------------------------------------------------------------------------------------------------------
# Pairs and layouts (plain integers)


def draw_pairs(plan: ComputePlan) -> list[tuple[int, int, int]]:
    """`plan.pairs` (prompt, chosen, rejected) token counts of the scaled reasoning-trace model, truncated to
    `plan.max_length` as TRL truncates them."""
    model = replace(
        REASONING,
        prompt_median=REASONING.prompt_median * plan.length_scale,
        chosen_median=REASONING.chosen_median * plan.length_scale,
        rejected_median=REASONING.rejected_median * plan.length_scale,
    )
    rng = random.Random(plan.seed)
    return [
        truncated_pair_lengths(*sample_lengths(model, rng, plan.max_length), plan.max_length)
        for _ in range(plan.pairs)
    ]


# A micro-step: its rows, each (the pool's pair numbers, first rank, ranks)
MicroStep = Sequence[tuple[Sequence[int], int, int]]


@dataclass(frozen=True)
class ChunkLayout:
    """One rank's chunk of a packed row of pairs, laid out as the collator lays a row out (each pair's prompt +
    chosen, then prompt + rejected, each its own causal segment; the padding to a multiple of the row's ranks last,
    a segment of its own), in host integers.

    Args:
        bounds: the whole row's segment boundaries, padding included (`cu_seq_lens`).
        chunk: the chunk's row positions `[start, end)`.
        position_ids: the chunk's positions, each segment counting from 0.
        scored: the chunk's positions (from its start) of completion tokens: the LM head runs on as many.
    """

    bounds: tuple[int, ...]
    chunk: tuple[int, int]
    position_ids: tuple[int, ...]
    scored: tuple[int, ...]

    @property
    def row_length(self) -> int:
        return self.bounds[-1]


def chunk_layouts(pairs: Sequence[tuple[int, int, int]], padded_length: int, ranks: int) -> list[ChunkLayout]:
    """Every rank's chunk of the row holding `pairs` (prompt, chosen, rejected), padded to `padded_length` (a
    multiple of `ranks`).

    >>> [(c.chunk, c.position_ids, c.scored) for c in chunk_layouts([(2, 1, 2)], 8, 2)]
    [((0, 4), (0, 1, 2, 0), (2,)), ((4, 8), (1, 2, 3, 0), (1, 2))]
    >>> chunk_layouts([(2, 1, 2)], 8, 2)[0].bounds
    (0, 3, 7, 8)
    """
    bounds, positions, scored = [0], [], []
    for prompt, chosen, rejected in pairs:
        for completion in (chosen, rejected):
            start = bounds[-1]
            positions += range(prompt + completion)
            scored += range(start + prompt, start + prompt + completion)
            bounds.append(start + prompt + completion)
    if padded_length > bounds[-1]:
        positions += range(padded_length - bounds[-1])
        bounds.append(padded_length)
    length = padded_length // ranks
    return [
        ChunkLayout(
            tuple(bounds),
            (rank * length, (rank + 1) * length),
            tuple(positions[rank * length : (rank + 1) * length]),
            tuple(position - rank * length for position in scored if rank * length <= position < (rank + 1) * length),
        )
        for rank in range(ranks)
    ]


def micro_step_flops(units: Sequence[UnitWork], budget: GroupBudget, micro_step: MicroStep) -> float:
    """The cost model's compute of a micro-step (its slowest rank's, in FLOPs): each row's slowest chunk at a free
    link. Priced as `GroupBudget` prices a DPO step (the reference's forward, activation checkpointing's second
    policy forward): factors common to every chunk, which ratios drop."""
    return max(
        budget.row_cost([units[number] for number in numbers], ranks, FREE_LINK) for numbers, _, ranks in micro_step
    )


# ---------------------------------------------------------------------------------------------------------------------
# One chunk on the device


def chunk_step(model, layout: ChunkLayout, ranks: int, vocab_size: int, device: torch.device) -> Callable[[], None]:
    """A function running one rank's chunk forward and backward, its tensors made once (the collator's work); the
    row object made per forward, as the trainer makes it."""
    generator = torch.Generator().manual_seed(layout.chunk[0] + layout.row_length)
    length = layout.chunk[1] - layout.chunk[0]
    input_ids = torch.randint(4, vocab_size, (1, length), generator=generator).to(device)
    position_ids = torch.tensor([layout.position_ids], device=device)
    scored = torch.tensor(layout.scored, dtype=torch.long, device=device)
    targets = torch.randint(4, vocab_size, (len(layout.scored),), generator=generator).to(device)
    cu_seq_lens = torch.tensor(layout.bounds, dtype=torch.int32, device=device)
    max_length = max(end - start for start, end in zip(layout.bounds, layout.bounds[1:], strict=False))
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def make_row() -> PackedRow:
        if ranks == 1:  # alone on its rank: the plain packed row
            return PackedRow(cu_seq_lens, max_length, bounds=layout.bounds)
        row = ContextParallelRow(
            cu_seq_lens, None, group=RowGroup(None, layout.chunk[0] // length, ranks), row_length=layout.row_length,
            bounds=layout.bounds,
        )  # fmt: skip
        row.gather_keys_and_values = lambda key, value: (key.repeat(1, 1, ranks, 1), value.repeat(1, 1, ranks, 1))
        return row

    def run() -> None:
        row = make_row()
        with row_in_flight(row):
            hidden = decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **{PACKED_ROW_KWARG: row}
            )
        logits = head(hidden.last_hidden_state[0].index_select(0, scored))
        F.cross_entropy(logits.float(), targets).backward()

    return run


def timed(run: Callable[[], None], device: torch.device, warmup: int, repetitions: int) -> float:
    """The median seconds of `repetitions` runs after `warmup` ones: between CUDA events on CUDA, each synchronised
    before and after; the wall clock on CPU."""
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(repetitions):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


# ---------------------------------------------------------------------------------------------------------------------
# The measurement


def measure(plan: ComputePlan, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Static and dynamic layouts of the plan's pairs, every chunk of every micro-step timed: each layout's compute
    (the sum of its micro-steps' slowest chunks), the cost model's for the same micro-steps, their ratios, and the
    varlen kernel calls per attention call (1.0: every layer on the kernel; counted on every run, as the bench
    counts them)."""
    model = make_bench_model(plan.model, "padfree_varlen", dtype, device=device)
    model.train()
    model.activation_checkpointing_enable()
    if not model.is_activation_checkpointing:
        raise RuntimeError(f"{type(model).__name__} did not turn activation checkpointing on.")
    pairs = draw_pairs(plan)
    units = [pair_unit(*pair) for pair in pairs]
    budget = GroupBudget(decoder_shape(model), plan.ranks, plan.rank_budget)
    layouts = {}
    for layout in (static_layout(units, budget), dynamic_layout(units, budget)):
        kernel = KernelUse("padfree_varlen")
        with kernel.counting():
            micro_steps = [
                timed_micro_step(model, micro_step, pairs, units, budget, plan, device)
                for micro_step in layout.members
            ]
        rows_by_ranks = dict.fromkeys(rank_sizes(plan.ranks), 0)
        for micro_step in layout.members:
            for _, _, ranks in micro_step:
                rows_by_ranks[ranks] += 1
        layouts[layout.name.split()[0]] = dict(
            micro_steps=len(micro_steps),
            rows_by_ranks=rows_by_ranks,
            seconds=sum(step["seconds"] for step in micro_steps),
            predicted_flops=sum(step["predicted_flops"] for step in micro_steps),
            varlen_calls_per_attention_call=kernel.per_attention_call,
            detail=micro_steps,
        )
    static, dynamic = layouts["static"], layouts["dynamic"]
    clock = "CUDA events" if device.type == "cuda" else "wall clock"
    return dict(
        plan=asdict(plan),
        dtype=str(dtype).removeprefix("torch."),
        timing=f"{clock}, median of {plan.repetitions} after {plan.warmup} warm-up per chunk",
        pair_tokens=dict(
            median=statistics.median(unit.tokens for unit in units),
            max=max(unit.tokens for unit in units),
            total=sum(unit.tokens for unit in units),
        ),
        static=static,
        dynamic=dynamic,
        measured_ratio=static["seconds"] / dynamic["seconds"],
        predicted_ratio=static["predicted_flops"] / dynamic["predicted_flops"],
        note=NOTE,
    )


def timed_micro_step(
    model,
    micro_step: MicroStep,
    pairs: Sequence[tuple[int, int, int]],
    units: Sequence[UnitWork],
    budget: GroupBudget,
    plan: ComputePlan,
    device: torch.device,
) -> dict:
    """Every rank's chunk of every row of one micro-step, timed; the micro-step lasts its slowest. Gradients
    accumulate over its chunks, as over a step's micro-batches, and are dropped after it."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    chunk_seconds = []  # per row, each of its ranks' chunk
    for numbers, _, ranks in micro_step:
        padded = budget.padded(sum(units[number].tokens for number in numbers))
        chunk_seconds.append(
            [
                timed(chunk_step(model, chunk, ranks, vocab_size, device), device, plan.warmup, plan.repetitions)
                for chunk in chunk_layouts([pairs[number] for number in numbers], padded, ranks)
            ]
        )
    model.zero_grad(set_to_none=True)
    return dict(
        rows=[dict(pairs=len(numbers), first_rank=first, ranks=ranks) for numbers, first, ranks in micro_step],
        row_tokens=[sum(units[number].tokens for number in numbers) for numbers, _, _ in micro_step],
        chunk_seconds=chunk_seconds,
        seconds=max(max(row) for row in chunk_seconds),
        predicted_flops=micro_step_flops(units, budget, micro_step),
    )


def markdown_lines(result: dict) -> list[str]:
    """The report's section: one line per layout, the ratios, and what is measured."""
    plan = result["plan"]
    return [
        f"{plan['model']} ({result['dtype']}), C = {plan['ranks']}, {plan['rank_budget']:,} tokens a rank; "
        f"{plan['pairs']} reasoning-trace pairs (lengths x {plan['length_scale']:g}, median "
        f"{result['pair_tokens']['median']:,.0f} tokens, longest {result['pair_tokens']['max']:,}); "
        f"{result['timing']}",
        "",
        markdown_table(
            (
                "layout",
                "micro-steps",
                "rows on " + " / ".join(map(str, result["static"]["rows_by_ranks"])) + " ranks",
                "compute s (slowest rank, summed)",
                "cost model TFLOP (the same)",
                "varlen calls / attention call",
            ),
            (
                [
                    kind,
                    str(layout["micro_steps"]),
                    " / ".join(map(str, layout["rows_by_ranks"].values())),
                    f"{layout['seconds']:.3f}",
                    f"{layout['predicted_flops'] / 1e12:.3g}",
                    f"{layout['varlen_calls_per_attention_call']:.2f}",
                ]
                for kind, layout in (("static", result["static"]), ("dynamic", result["dynamic"]))
            ),
        ),
        "",
        f"static / dynamic compute: measured {result['measured_ratio']:.2f}x, cost model "
        f"{result['predicted_ratio']:.2f}x. {result['note']}.",
    ]
