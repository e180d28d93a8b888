"""`trl-padfree bench`: padded TRL vs padding-free DPO training steps, side by side on the same batches.

A step is what `Trainer.training_step` does: the reference forward, the policy forward and backward, through the real
`DPOTrainer` of each mode (padded TRL, and padding-free with each attention backend). Each mode first runs `--warmup`
untimed steps; then every measured batch is run by every mode before the next batch, in alternating order, so machine
drift hits all modes alike, and each step's time is kept (median and spread next to the mean). Two yardsticks: the
token ideal, padded tokens / row tokens, what removing padding gives if a step's cost is linear in tokens; and the
FLOP ideal, padded training FLOPs / the mode's (trl_padfree/plan/flops.py), which also counts attention's square.
The training thread's CPU time per step is reported too: on CUDA, a step whose host time nears its time is
host-bound. With `padfree_varlen`, a `padfree_varlen+prefix_sharing` mode (each prompt computed once) is timed too,
and its rows also report the speedup over `padfree_varlen` on the same batches.

The length distributions, the bench models and the timing are harness.py's, shared with `--batching` (budget.py) and
`--vision` (vision.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from ...data import load_demo_tokenizer
from ...modeling.packed_forward import PackedBatch
from ...plan.flops import DecoderShape, training_step_flops
from ...tiny import DEMO_MODEL_SIZES
from ...trainer import DPOTrainer
from .budget import format_batching_table, run_batching_bench
from .harness import (
    DISTRIBUTIONS,
    MODEL_SHAPES,
    StepStats,
    StepTimer,
    batch_work,
    bench_device,
    decoder_shape,
    default_device,
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
PREFIX_SHARING_AUTO = "padfree_varlen+prefix_sharing=auto"  # each batch shared or not, as the cost model says
SHARING_MODES = {PREFIX_SHARING: True, PREFIX_SHARING_AUTO: "auto"}
VISION_MAX_WORDS = 96  # completions of up to 96 words, prompts of up to 24, next to the image
GPU_BACKENDS = ("padfree_varlen", "flash_attention_2", "sdpa")
# Default step counts per mode: on CUDA enough for a median and a spread; on CPU the figures docs/benchmarks.md
# had, where one step of the small model takes seconds
GPU_WARMUP, GPU_STEPS = 3, 20
CPU_WARMUP, CPU_STEPS, QUICK_STEPS = 1, 8, 3
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
    padded_step_s: float  # mean over the measured steps (speedup and tokens/s are over the same batches)
    padfree_step_s: float
    speedup: float
    ideal_speedup: float  # token ratio: padded tokens / row tokens
    padded_peak_mem_mb: float | None
    padfree_peak_mem_mb: float | None
    real_tokens_per_s: float
    # Beyond the required keys: what was measured, so a row can be checked
    fraction_of_ideal: float
    model: str
    pairs_per_batch: int
    batches: int  # measured steps per mode
    real_tokens: int  # counted by the padding-free collator
    padded_mode_real_tokens: int  # counted from the padded batches' attention masks
    padded_tokens: int
    # Tokens the mode's packed rows hold: `real_tokens`, less the prompts prefix sharing computes once
    row_tokens: int
    # Prefix-sharing rows only: against padding-free without sharing (padfree_varlen) on the same batches
    speedup_over_unshared: float | None = None
    ideal_speedup_over_unshared: float | None = None
    # The spread: per-step times of each mode (batch order), and the speedup batch by batch
    warmup_steps: int = 0
    padded_step_times_s: list[float] = field(default_factory=list)
    padfree_step_times_s: list[float] = field(default_factory=list)
    padded_step_s_median: float = 0.0
    padfree_step_s_median: float = 0.0
    speedup_per_batch_min: float = 0.0
    speedup_per_batch_median: float = 0.0
    speedup_per_batch_max: float = 0.0
    # The training thread's CPU time per step (mean); host-bound: at least 80% of the step's time, on CUDA only
    padded_host_step_s: float = 0.0
    padfree_host_step_s: float = 0.0
    padded_host_times_s: list[float] = field(default_factory=list)
    padfree_host_times_s: list[float] = field(default_factory=list)
    padded_host_bound: bool | None = None
    padfree_host_bound: bool | None = None
    # The FLOP model (trl_padfree/plan/flops.py): training FLOPs per step (mean), their ratio, the share reached
    padded_step_flops: float = 0.0
    padfree_step_flops: float = 0.0
    flop_ideal_speedup: float = 0.0
    fraction_of_flop_ideal: float = 0.0


@dataclass(frozen=True)
class ModeWork:
    """What a mode's trainer computes on the measured batches, from its own collator: tokens its rows hold and
    training FLOPs per step."""

    row_tokens: int
    step_flops: float

    @classmethod
    def of(cls, trainer: DPOTrainer, batches: list[list[dict]], shape: DecoderShape) -> ModeWork:
        collated = [trainer.data_collator(batch) for batch in batches]
        flops = sum(training_step_flops(shape, batch_work(batch)) for batch in collated)
        if "seq_lens" in collated[0]:
            row_tokens = sum(PackedBatch.from_collated(batch).real_row_tokens for batch in collated)
        else:
            row_tokens = sum(batch["input_ids"].numel() for batch in collated)
        return cls(row_tokens, flops / len(batches))


# ---------------------------------------------------------------------------------------------------------------------
# Padded vs padding-free steps


def measure_steps(
    distribution: str, trainers: dict[str | None, DPOTrainer], options: argparse.Namespace, device: torch.device
) -> tuple[StepTimer, list[list[dict]]]:
    """`options.warmup` untimed steps per mode, then `options.batches` measured batches, each run by every mode
    before the next, in alternating order (padded first, then padded last) so drift hits all modes alike."""
    vocab_size = len(load_demo_tokenizer())
    batches = make_batches(
        distribution,
        options.warmup + options.batches,
        options.pairs_per_batch,
        options.max_length,
        vocab_size,
        options.seed,
    )
    warmup, measured = batches[: options.warmup], batches[options.warmup :]
    modes = list(trainers)
    timer = StepTimer(device, modes)
    for mode in modes:
        timer.warm_up(trainers[mode], warmup)
    for index, batch in enumerate(tqdm(measured, desc=distribution, unit="batch", leave=False)):
        for mode in modes if index % 2 == 0 else reversed(modes):
            timer.step(mode, trainers[mode], batch)
    return timer, measured


def bench_distribution(
    distribution: str, trainers: dict[str | None, DPOTrainer], options: argparse.Namespace, device: torch.device
) -> list[BenchRow]:
    timer, measured = measure_steps(distribution, trainers, options, device)
    modes = list(trainers)
    padded_collator = trainers[None].data_collator
    padded_mode_real = sum(int(padded_collator(batch)["attention_mask"].sum()) for batch in measured)
    packed = [trainers[modes[1]].data_collator(batch) for batch in measured]
    real_tokens = sum(int(batch["seq_lens"].sum()) for batch in packed)
    padded_tokens = sum(len(batch["seq_lens"]) * int(batch["seq_lens"].max()) for batch in packed)
    shape = decoder_shape(trainers[None].model)
    padded_work = ModeWork.of(trainers[None], measured, shape)
    common = dict(
        distribution=distribution,
        device=device_name(device),
        model=options.model,
        pairs_per_batch=options.pairs_per_batch,
        batches=len(measured),
        warmup_steps=options.warmup,
        real_tokens=real_tokens,
        padded_mode_real_tokens=padded_mode_real,
        padded_tokens=padded_tokens,
    )
    rows = []
    for mode in modes[1:]:
        work = ModeWork.of(trainers[mode], measured, shape)
        row = bench_row(mode, timer.stats(None), timer.stats(mode), padded_work, work, common)
        if mode in SHARING_MODES and "padfree_varlen" in trainers:
            row.speedup_over_unshared = timer.seconds["padfree_varlen"] / timer.seconds[mode]
            row.ideal_speedup_over_unshared = real_tokens / row.row_tokens
        rows.append(row)
    return rows


def bench_row(
    mode: str, padded: StepStats, padfree: StepStats, padded_work: ModeWork, work: ModeWork, common: dict
) -> BenchRow:
    """One row: a padding-free mode against padded TRL on the same measured batches."""
    speedup = padded.mean_s / padfree.mean_s
    ideal = common["padded_tokens"] / work.row_tokens
    flop_ideal = padded_work.step_flops / work.step_flops
    per_batch = [padded_s / padfree_s for padded_s, padfree_s in zip(padded.times_s, padfree.times_s, strict=True)]
    return BenchRow(
        backend=mode,
        padded_step_s=padded.mean_s,
        padfree_step_s=padfree.mean_s,
        speedup=speedup,
        ideal_speedup=ideal,
        padded_peak_mem_mb=padded.peak_mb,
        padfree_peak_mem_mb=padfree.peak_mb,
        real_tokens_per_s=common["real_tokens"] / sum(padfree.times_s),
        fraction_of_ideal=speedup / ideal,
        row_tokens=work.row_tokens,
        padded_step_times_s=padded.times_s,
        padfree_step_times_s=padfree.times_s,
        padded_step_s_median=padded.median_s,
        padfree_step_s_median=padfree.median_s,
        speedup_per_batch_min=min(per_batch),
        speedup_per_batch_median=statistics.median(per_batch),
        speedup_per_batch_max=max(per_batch),
        padded_host_step_s=padded.host_mean_s,
        padfree_host_step_s=padfree.host_mean_s,
        padded_host_times_s=padded.host_times_s,
        padfree_host_times_s=padfree.host_times_s,
        padded_host_bound=padded.host_bound,
        padfree_host_bound=padfree.host_bound,
        padded_step_flops=padded_work.step_flops,
        padfree_step_flops=work.step_flops,
        flop_ideal_speedup=flop_ideal,
        fraction_of_flop_ideal=speedup / flop_ideal,
        **common,
    )


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
        for mode, sharing in SHARING_MODES.items():
            trainers[mode] = make_bench_trainer(options.model, "padfree_varlen", device, dtype, sharing)
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
    "per-batch speedup (min-max)",
    "token ideal",
    "of token ideal",
    "FLOP ideal",
    "of FLOP ideal",
    "host s/step padded",
    "host s/step padding-free",
    "peak MB padded",
    "peak MB padding-free",
    "real tokens/s",
    "sharing vs unshared (ideal)",
)
STEP_TABLE_COLUMNS = (
    "distribution",
    "mode",
    "warm-up + measured",
    "median s",
    "min s",
    "max s",
    "mean s",
    "host s (mean)",
    "host / step",
    "GFLOP/step",
    "GFLOP/s",
)


def format_table(rows: list[BenchRow]) -> str:
    """The speedup table: one line per distribution and padding-free mode, against padded TRL."""
    cells = (
        [
            row.distribution,
            row.backend,
            f"{row.padded_step_s:.3f}",
            f"{row.padfree_step_s:.3f}",
            f"{row.speedup:.2f}x",
            f"{row.speedup_per_batch_min:.2f}-{row.speedup_per_batch_max:.2f}x",
            f"{row.ideal_speedup:.2f}x",
            f"{row.fraction_of_ideal:.0%}",
            f"{row.flop_ideal_speedup:.2f}x",
            f"{row.fraction_of_flop_ideal:.0%}",
            _host_cell(row.padded_host_step_s, row.padded_host_bound),
            _host_cell(row.padfree_host_step_s, row.padfree_host_bound),
            format_peak_mb(row.padded_peak_mem_mb),
            format_peak_mb(row.padfree_peak_mem_mb),
            f"{row.real_tokens_per_s:,.0f}",
            _sharing_cell(row),
        ]
        for row in rows
    )
    return markdown_table(TABLE_COLUMNS, cells)


def format_step_table(rows: list[BenchRow]) -> str:
    """Per distribution and mode (padded TRL once): the spread of its measured steps, host time, FLOPs."""
    cells = []
    for index, row in enumerate(rows):
        modes = [("padded", "padded")] if index == 0 or rows[index - 1].distribution != row.distribution else []
        for mode, prefix in [*modes, (row.backend, "padfree")]:
            times = getattr(row, f"{prefix}_step_times_s")
            flops = getattr(row, f"{prefix}_step_flops")
            host = getattr(row, f"{prefix}_host_step_s")
            cells.append(
                [
                    row.distribution,
                    mode,
                    f"{row.warmup_steps} + {len(times)}",
                    f"{statistics.median(times):.3f}",
                    f"{min(times):.3f}",
                    f"{max(times):.3f}",
                    f"{statistics.fmean(times):.3f}",
                    _host_cell(host, getattr(row, f"{prefix}_host_bound")),
                    f"{host / statistics.fmean(times):.2f}",
                    f"{flops / 1e9:,.1f}",
                    f"{flops / statistics.fmean(times) / 1e9:,.1f}",
                ]
            )
    return markdown_table(STEP_TABLE_COLUMNS, cells)


def _host_cell(seconds: float, host_bound: bool | None) -> str:
    return f"{seconds:.3f}" + (" host-bound" if host_bound else "")


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
    parser.add_argument(
        "--steps",
        "--batches",
        dest="batches",
        metavar="N",
        type=int,
        default=None,
        help=f"measured steps (batches) per mode and distribution (default: {GPU_STEPS} on CUDA, {CPU_STEPS} on CPU, "
        f"{QUICK_STEPS} with --quick)",
    )
    parser.add_argument(
        "--warmup",
        metavar="N",
        type=int,
        default=None,
        help=f"untimed warm-up steps per mode (default: {GPU_WARMUP} on CUDA, {CPU_WARMUP} on CPU)",
    )
    parser.add_argument("--pairs-per-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024, help="per-sequence truncation, as TRL's max_length")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_false",
        help="skip the padfree_varlen+prefix_sharing rows, with prefix_sharing=True and 'auto' (timed by default next "
        "to padfree_varlen)",
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
    set_step_counts(options)
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
        print(format_table(rows) + "\n\n" + format_step_table(rows))
    if options.output:
        Path(options.output).write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    if options.plot and not options.batching:
        plot(rows, options.plot)
    return 0


def set_step_counts(options: argparse.Namespace) -> None:
    """Warm-up and measured steps: enough on CUDA for a median and a spread; on CPU, where a step takes seconds,
    few (a step's time there moves less with warm-up than with the machine's load)."""
    cuda = default_device(options.device).type == "cuda"
    if options.warmup is None:
        options.warmup = GPU_WARMUP if cuda else CPU_WARMUP
    if options.batches is None:
        options.batches = QUICK_STEPS if options.quick else GPU_STEPS if cuda else CPU_STEPS
    if options.batches < 1 or options.warmup < 0 or options.pairs_per_batch < 1 or options.max_length < 3:
        raise ValueError(
            "--steps and --pairs-per-batch must be at least 1, --warmup at least 0, and --max-length at least 3."
        )
