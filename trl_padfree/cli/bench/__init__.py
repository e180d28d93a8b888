"""`trl-padfree bench`: padded TRL vs padding-free DPO training steps, side by side on the same batches.

A step is what `Trainer.training_step` does: the reference forward, the policy forward and backward, through the real
`DPOTrainer` of each mode (padded TRL, and padding-free with each attention backend). Every batch is run by every mode
before the next batch, in alternating order, so machine drift hits all modes alike. The yardstick is the ideal
speedup, padded tokens / real tokens: what removing padding gives if a step's cost is linear in tokens. With
`padfree_varlen`, a `padfree_varlen+prefix_sharing` mode (each prompt computed once) is timed too, and its rows also
report the speedup over `padfree_varlen` on the same batches.

The length distributions, the bench models and the timing are bench_harness.py's, shared with `--batching`
(bench_budget.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from ...data import load_demo_tokenizer
from ...modeling.packed_forward import PackedBatch
from ...tiny import DEMO_MODEL_SIZES
from ...trainer import DPOTrainer
from .budget import format_batching_table, run_batching_bench
from .harness import (
    DISTRIBUTIONS,
    MODEL_SHAPES,
    StepTimer,
    bench_device,
    device_name,
    format_peak_mb,
    make_batches,
    make_bench_trainer,
    markdown_table,
)
from .vision import VISION_MODEL_SHAPES, format_vision_table, run_vision_bench

CPU_BACKENDS = ("padfree_varlen", "sdpa")
# Padding-free with prefix sharing (on padfree_varlen, the attention it needs), timed next to the other modes
PREFIX_SHARING = "padfree_varlen+prefix_sharing"
VISION_MAX_WORDS = 96  # completions of up to 96 words, prompts of up to 24, next to the image
GPU_BACKENDS = ("padfree_varlen", "flash_attention_2", "sdpa")
ROW_KEYS = (
    "distribution",
    "backend",
    "device",
    "padded_step_s",
    "padfree_step_s",
    "speedup",
    "ideal_speedup",
    "padded_peak_mem_mb",
    "padfree_peak_mem_mb",
    "real_tokens_per_s",
)


@dataclass
class BenchRow:
    distribution: str
    backend: str
    device: str
    padded_step_s: float
    padfree_step_s: float
    speedup: float
    ideal_speedup: float
    padded_peak_mem_mb: float | None
    padfree_peak_mem_mb: float | None
    real_tokens_per_s: float
    # Beyond the required keys: what was measured, so a row can be checked
    fraction_of_ideal: float
    model: str
    pairs_per_batch: int
    batches: int
    real_tokens: int  # counted by the padding-free collator
    padded_mode_real_tokens: int  # counted from the padded batches' attention masks
    padded_tokens: int
    # Tokens the mode's packed rows hold: `real_tokens`, less the prompts prefix sharing computes once
    row_tokens: int
    # Prefix-sharing rows only: against padding-free without sharing (padfree_varlen) on the same batches
    speedup_over_unshared: float | None = None
    ideal_speedup_over_unshared: float | None = None


# ---------------------------------------------------------------------------------------------------------------------
# Padded vs padding-free steps


def bench_distribution(
    distribution: str, trainers: dict[str | None, DPOTrainer], options: argparse.Namespace, device: torch.device
) -> list[BenchRow]:
    vocab_size = len(load_demo_tokenizer())
    batches = make_batches(
        distribution, options.batches + 1, options.pairs_per_batch, options.max_length, vocab_size, options.seed
    )
    warmup, measured = batches[0], batches[1:]
    modes = list(trainers)
    timer = StepTimer(device, modes)
    for mode in modes:
        timer.warm_up(trainers[mode], warmup)
    for index, batch in enumerate(tqdm(measured, desc=distribution, unit="batch", leave=False)):
        for mode in modes if index % 2 == 0 else reversed(modes):
            timer.step(mode, trainers[mode], batch)
    seconds, peaks = timer.seconds, timer.peaks

    padded_collator = trainers[None].data_collator
    padded_mode_real = sum(int(padded_collator(batch)["attention_mask"].sum()) for batch in measured)
    packed = [trainers[modes[1]].data_collator(batch) for batch in measured]
    real_tokens = sum(int(batch["seq_lens"].sum()) for batch in packed)
    padded_tokens = sum(len(batch["seq_lens"]) * int(batch["seq_lens"].max()) for batch in packed)
    padded_step = seconds[None] / len(measured)
    rows = []
    for mode in modes[1:]:
        row_tokens = sum(
            PackedBatch.from_collated(trainers[mode].data_collator(batch)).real_row_tokens for batch in measured
        )
        padfree_step = seconds[mode] / len(measured)
        speedup = padded_step / padfree_step
        ideal = padded_tokens / row_tokens
        row = BenchRow(
            distribution=distribution,
            backend=mode,
            device=device_name(device),
            padded_step_s=padded_step,
            padfree_step_s=padfree_step,
            speedup=speedup,
            ideal_speedup=ideal,
            padded_peak_mem_mb=peaks[None],
            padfree_peak_mem_mb=peaks[mode],
            real_tokens_per_s=real_tokens / seconds[mode],
            fraction_of_ideal=speedup / ideal,
            model=options.model,
            pairs_per_batch=options.pairs_per_batch,
            batches=len(measured),
            real_tokens=real_tokens,
            padded_mode_real_tokens=padded_mode_real,
            padded_tokens=padded_tokens,
            row_tokens=row_tokens,
        )
        if mode == PREFIX_SHARING and "padfree_varlen" in seconds:
            row.speedup_over_unshared = seconds["padfree_varlen"] / seconds[mode]
            row.ideal_speedup_over_unshared = real_tokens / row_tokens
        rows.append(row)
    return rows


def available_backends(device: torch.device, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    if device.type == "cpu":
        return list(CPU_BACKENDS)
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    return [name for name in GPU_BACKENDS if name != "flash_attention_2" or has_flash_attn]


def run_bench(options: argparse.Namespace) -> list[BenchRow]:
    device, dtype = bench_device(options.device)
    backends = available_backends(device, options.backends)
    trainers: dict[str | None, DPOTrainer] = {None: make_bench_trainer(options.model, None, device, dtype)}
    for backend in backends:
        trainers[backend] = make_bench_trainer(options.model, backend, device, dtype)
    if "padfree_varlen" in backends and options.prefix_sharing:
        trainers[PREFIX_SHARING] = make_bench_trainer(options.model, "padfree_varlen", device, dtype, True)
    rows = []
    for distribution in options.distributions:
        rows += bench_distribution(distribution, trainers, options, device)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Report


TABLE_COLUMNS = (
    "distribution",
    "backend",
    "padded s/step",
    "padding-free s/step",
    "speedup",
    "ideal",
    "of ideal",
    "peak MB padded",
    "peak MB padding-free",
    "real tokens/s",
    "sharing vs unshared (ideal)",
)


def format_table(rows: list[BenchRow]) -> str:
    cells = (
        [
            row.distribution,
            row.backend,
            f"{row.padded_step_s:.3f}",
            f"{row.padfree_step_s:.3f}",
            f"{row.speedup:.2f}x",
            f"{row.ideal_speedup:.2f}x",
            f"{row.fraction_of_ideal:.0%}",
            format_peak_mb(row.padded_peak_mem_mb),
            format_peak_mb(row.padfree_peak_mem_mb),
            f"{row.real_tokens_per_s:,.0f}",
            _sharing_cell(row),
        ]
        for row in rows
    )
    return markdown_table(TABLE_COLUMNS, cells)


def _sharing_cell(row: BenchRow) -> str:
    if row.speedup_over_unshared is None:
        return ""
    return f"{row.speedup_over_unshared:.2f}x ({row.ideal_speedup_over_unshared:.2f}x)"


def plot(rows: list[BenchRow], path: str) -> None:
    """Bars of measured speedup per distribution and backend, with the ideal as a line over each group."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("--plot needs matplotlib: pip install 'trl-padfree[bench]'") from error
    distributions = list(dict.fromkeys(row.distribution for row in rows))
    backends = list(dict.fromkeys(row.backend for row in rows))
    width = 0.8 / len(backends)
    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(distributions), 3.6))
    for offset, backend in enumerate(backends):
        values = [
            next((r.speedup for r in rows if r.distribution == d and r.backend == backend), 0) for d in distributions
        ]
        positions = [index - 0.4 + width * (offset + 0.5) for index in range(len(distributions))]
        axes.bar(positions, values, width, label=f"padding-free, {backend}")
    for index, distribution in enumerate(distributions):
        ideal = next(row.ideal_speedup for row in rows if row.distribution == distribution)
        axes.hlines(
            ideal,
            index - 0.45,
            index + 0.45,
            colors="black",
            linestyles="dashed",
            label="ideal" if index == 0 else None,
        )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(distributions)), distributions)
    axes.set_ylabel("speedup over padded TRL")
    axes.set_title(f"{rows[0].model} on {rows[0].device}", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, few batches: a few minutes on 2 CPU cores")
    parser.add_argument(
        "--model", default=None, help=f"{sorted(DEMO_MODEL_SIZES)} (demo llama) or {sorted(MODEL_SHAPES)}"
    )
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    parser.add_argument("--backends", nargs="+", default=None, help="padding-free attention backends to time")
    parser.add_argument("--batches", type=int, default=None, help="measured batches per distribution")
    parser.add_argument("--pairs-per-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024, help="per-sequence truncation, as TRL's max_length")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="skip the padfree_varlen+prefix_sharing rows (timed by default next to padfree_varlen)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batching",
        action="store_true",
        help="instead: fixed pairs per micro-batch vs token-budget micro-batches at the same peak row length, "
        "padding-free both (tokens/s, optimizer steps per epoch)",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="instead: a Qwen2.5-VL-shaped model on pairs with one image each (--model qwen2.5-vl-demo, the default, "
        "or qwen2.5-vl-3b): padded vs padding-free vs prefix sharing, with the images each mode encodes",
    )
    parser.add_argument("--output", metavar="FILE.json", help="write the rows as a JSON list")
    parser.add_argument("--plot", metavar="FILE.png", help="plot speedup vs ideal per distribution")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    options.model = options.model or ("qwen2.5-vl-demo" if options.vision else "tiny" if options.quick else "small")
    options.batches = options.batches or (3 if options.quick else 8)
    if options.batches < 1 or options.pairs_per_batch < 1 or options.max_length < 3:
        raise ValueError("--batches and --pairs-per-batch must be at least 1, and --max-length at least 3.")
    if options.vision and (options.model not in VISION_MODEL_SHAPES or options.batching or options.plot):
        raise ValueError(f"--vision runs on --model {' or '.join(VISION_MODEL_SHAPES)}, without --batching or --plot.")
    datasets.disable_progress_bars()
    if options.vision:
        options.max_words = VISION_MAX_WORDS
        rows = run_vision_bench(options)
        print(format_vision_table(rows))
    elif options.batching:
        rows = run_batching_bench(options)
        print(format_batching_table(rows))
    else:
        rows = run_bench(options)
        print(format_table(rows))
    if options.output:
        Path(options.output).write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    if options.plot and not options.batching:
        plot(rows, options.plot)
    return 0
