"""The text bench's rows: padded TRL against each padding-free mode, timed step by step on the same batches, in each
precision asked for (precision.py).

For each precision, one trainer per mode: padded TRL (on the attention its users pick, `harness.padded_attention`),
padding-free with each attention backend, and with `padfree_varlen` the prefix-sharing modes; all over one copy of
the weights (harness.BenchWeights), with activation checkpointing on as in TRL's defaults unless turned off. Each mode
first runs `--warmup` untimed steps; then every measured batch is run by every mode before the next batch, in
alternating order, so machine drift hits all modes alike. Over the measured steps each padding-free mode counts its
varlen kernel calls and its attention calls: one kernel call per attention call says every layer ran on the kernel; 0
says none did (CPU, a backend other than `padfree_varlen`, or a precision the kernel does not take, such as float32
without autocast).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ...costs.flops import DecoderShape, training_step_flops
from ...data import load_demo_tokenizer
from ...integrations.transformers import attention_calls_counted
from ...modeling.kernels.attention import varlen_calls_counted
from ...modeling.packed_forward import PackedBatch
from ...trainer import DPOTrainer
from .harness import (
    BenchWeights,
    StepStats,
    StepTimer,
    batch_work,
    bench_device,
    decoder_shape,
    default_device,
    device_name,
    make_batches,
    make_bench_trainer,
    padded_attention,
)
from .precision import BenchPrecision, bench_precisions

CPU_BACKENDS = ("padfree_varlen", "sdpa")
GPU_BACKENDS = ("padfree_varlen", "flash_attention_2", "sdpa")
# Padding-free with prefix sharing (on padfree_varlen, the attention it needs), timed next to the other modes
PREFIX_SHARING = "padfree_varlen+prefix_sharing"
PREFIX_SHARING_AUTO = "padfree_varlen+prefix_sharing=auto"  # each batch shared or not, as the cost model says
SHARING_MODES = {PREFIX_SHARING: True, PREFIX_SHARING_AUTO: "auto"}
# `--prefix-sharing`: which of the sharing modes to time
SHARING_CHOICES = {"both": tuple(SHARING_MODES), "true": (PREFIX_SHARING,), "auto": (PREFIX_SHARING_AUTO,), "none": ()}
# Default step counts per mode: on CUDA enough for a median and a spread; on CPU the figures docs/benchmarks.md
# had, where one step of the small model takes seconds
GPU_WARMUP, GPU_STEPS = 3, 20
CPU_WARMUP, CPU_STEPS, QUICK_STEPS = 1, 8, 3
ROW_KEYS = (
    "distribution",
    "backend",
    "precision",
    "device",
    "padded_step_s",
    "padfree_step_s",
    "speedup",
    "ideal_speedup",
    "padded_peak_mem_mb",
    "padfree_peak_mem_mb",
    "real_tokens_per_s",
    "varlen_calls_per_attention_call",
    "activation_checkpointing",
)


@dataclass
class BenchRow:
    distribution: str
    backend: str
    precision: str  # precision.py: trl_default, bf16 or float32, padded TRL's too
    device: str
    padded_step_s: float  # mean over the measured steps (speedup and tokens/s are over the same batches)
    padfree_step_s: float
    speedup: float
    ideal_speedup: float  # token ratio: padded tokens / row tokens
    padded_peak_mem_mb: float | None
    padfree_peak_mem_mb: float | None
    real_tokens_per_s: float
    # Varlen kernel calls / attention calls over the measured steps: 1.0 when every layer ran on the kernel
    varlen_calls_per_attention_call: float
    activation_checkpointing: bool  # every mode's, TRL's default (on): each layer's forward runs again in the backward
    padded_attention: str  # the attention padded TRL ran on (harness.padded_attention)
    # Beyond the required keys: what was measured, so a row can be checked
    varlen_calls: int
    attention_calls: int
    fraction_of_ideal: float
    model: str
    lora: bool
    pairs_per_batch: int
    batches: int  # measured steps per mode
    real_tokens: int  # counted by the padding-free collator
    padded_mode_real_tokens: int  # counted from the padded batches' attention masks
    padded_tokens: int
    # Tokens the mode's packed rows hold: `real_tokens`, less the prompts prefix sharing computes once
    row_tokens: int
    # Prefix-sharing rows only: against padding-free without sharing (padfree_varlen) on the same batches, and the
    # measured batches laid out shared (with prefix_sharing="auto", those the cost model found worth it)
    speedup_over_unshared: float | None = None
    ideal_speedup_over_unshared: float | None = None
    shared_batches: int | None = None
    # The spread: per-step times of each mode (batch order), and the speedup batch by batch
    warmup_steps: int = 0
    padded_step_times_s: list[float] = field(default_factory=list)
    padfree_step_times_s: list[float] = field(default_factory=list)
    padded_step_s_median: float = 0.0
    padfree_step_s_median: float = 0.0
    speedup_per_batch_min: float = 0.0
    speedup_per_batch_median: float = 0.0
    speedup_per_batch_max: float = 0.0
    # The process's CPU time per step (mean, every thread); host-bound: at least 80% of the step's time, on CUDA only
    padded_host_step_s: float = 0.0
    padfree_host_step_s: float = 0.0
    padded_host_times_s: list[float] = field(default_factory=list)
    padfree_host_times_s: list[float] = field(default_factory=list)
    padded_host_bound: bool | None = None
    padfree_host_bound: bool | None = None
    # The FLOP model (trl_padfree/costs/flops.py): training FLOPs per step (mean), their ratio, the share reached
    padded_step_flops: float = 0.0
    padfree_step_flops: float = 0.0
    flop_ideal_speedup: float = 0.0
    fraction_of_flop_ideal: float = 0.0


@dataclass(frozen=True)
class ModeWork:
    """What a mode's trainer computes on the measured batches, from its own collator: tokens its rows hold, training
    FLOPs per step, and the batches it laid out with shared prefixes."""

    row_tokens: int
    step_flops: float
    shared_batches: int

    @classmethod
    def of(cls, trainer: DPOTrainer, batches: list[list[dict]], shape: DecoderShape) -> ModeWork:
        collated = [trainer.data_collator(batch) for batch in batches]
        flops = sum(training_step_flops(shape, batch_work(batch)) for batch in collated)
        if "seq_lens" in collated[0]:
            row_tokens = sum(PackedBatch.from_collated(batch).real_row_tokens for batch in collated)
        else:
            row_tokens = sum(batch["input_ids"].numel() for batch in collated)
        shared = sum(int(batch["shared_prefix_lens"].sum()) > 0 for batch in collated if "shared_prefix_lens" in batch)
        return cls(row_tokens, flops / len(batches), shared)


@dataclass
class KernelUse:
    """A padding-free mode's varlen kernel calls and calls of its attention function, over its measured steps. The
    counters wrap the calls in a Python function each (nanoseconds per layer); they are entered outside the timed
    bracket."""

    attention: str  # the attention implementation the mode's packed forward calls
    varlen_calls: int = 0
    attention_calls: int = 0

    @classmethod
    def of_mode(cls, mode: str) -> KernelUse:
        return cls("padfree_varlen" if mode in SHARING_MODES else mode)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with varlen_calls_counted() as kernel, attention_calls_counted(self.attention) as attention:
            yield
        self.varlen_calls += kernel.calls
        self.attention_calls += attention.calls if attention is not None else 0  # None: eager, not countable

    @property
    def per_attention_call(self) -> float:
        return self.varlen_calls / self.attention_calls if self.attention_calls else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Trainers


def available_backends(device: torch.device, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    if device.type == "cpu":
        return list(CPU_BACKENDS)
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    return [name for name in GPU_BACKENDS if name != "flash_attention_2" or has_flash_attn]


def build_trainers(
    options: argparse.Namespace, precision: BenchPrecision, device: torch.device
) -> dict[str | None, DPOTrainer]:
    """One trainer per mode (padded TRL under None, first), all in `precision`, over one copy of the weights."""
    weights = BenchWeights(options.model, precision.weights, device)

    def trainer(backend: str | None, prefix_sharing: bool | str = False) -> DPOTrainer:
        return make_bench_trainer(
            options.model,
            backend,
            device,
            precision.weights,
            prefix_sharing,
            bf16_autocast=precision.bf16_autocast,
            activation_checkpointing=options.activation_checkpointing,
            lora=options.lora,
            weights=weights,
        )

    backends = available_backends(device, options.backends)
    trainers = {None: trainer(None), **{backend: trainer(backend) for backend in backends}}
    if "padfree_varlen" in backends:
        for mode in SHARING_CHOICES[options.prefix_sharing]:
            trainers[mode] = trainer("padfree_varlen", SHARING_MODES[mode])
    return trainers


def release_memory(device: torch.device) -> None:
    """Hand a finished precision's trainers' memory back before the next is built (outside any timed step)."""
    gc.collect()  # trainers hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# Padded vs padding-free steps


def measure_steps(
    distribution: str, trainers: dict[str | None, DPOTrainer], options: argparse.Namespace, device: torch.device
) -> tuple[StepTimer, list[list[dict]], dict[str, KernelUse]]:
    """`options.warmup` untimed steps per mode, then `options.batches` measured batches, each run by every mode
    before the next, in alternating order (padded first, then padded last) so drift hits all modes alike. The
    padding-free modes' kernel and attention calls are counted over the measured steps."""
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
    uses = {mode: KernelUse.of_mode(mode) for mode in modes[1:]}
    timer.warm_up((trainer, batch) for trainer in trainers.values() for batch in warmup)
    for index, batch in enumerate(tqdm(measured, desc=distribution, unit="batch", leave=False)):
        for mode in modes if index % 2 == 0 else reversed(modes):
            with uses[mode].counting() if mode is not None else contextlib.nullcontext():
                timer.step(mode, trainers[mode], batch)
    return timer, measured, uses


def bench_distribution(
    distribution: str,
    trainers: dict[str | None, DPOTrainer],
    options: argparse.Namespace,
    device: torch.device,
    precision: BenchPrecision,
) -> list[BenchRow]:
    timer, measured, uses = measure_steps(distribution, trainers, options, device)
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
        precision=precision.name,
        device=device_name(device),
        model=options.model,
        lora=options.lora,
        pairs_per_batch=options.pairs_per_batch,
        batches=len(measured),
        warmup_steps=options.warmup,
        real_tokens=real_tokens,
        padded_mode_real_tokens=padded_mode_real,
        padded_tokens=padded_tokens,
        activation_checkpointing=trainers[None].args.activation_checkpointing,
        padded_attention=padded_attention(options.model).implementation,
    )
    rows = []
    for mode in modes[1:]:
        work = ModeWork.of(trainers[mode], measured, shape)
        row = bench_row(mode, timer.stats(None), timer.stats(mode), padded_work, work, uses[mode], common)
        if mode in SHARING_MODES:
            row.shared_batches = work.shared_batches
            if "padfree_varlen" in trainers:
                row.speedup_over_unshared = timer.seconds["padfree_varlen"] / timer.seconds[mode]
                row.ideal_speedup_over_unshared = real_tokens / row.row_tokens
        rows.append(row)
    return rows


def bench_row(
    mode: str,
    padded: StepStats,
    padfree: StepStats,
    padded_work: ModeWork,
    work: ModeWork,
    use: KernelUse,
    common: dict,
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
        varlen_calls_per_attention_call=use.per_attention_call,
        varlen_calls=use.varlen_calls,
        attention_calls=use.attention_calls,
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


def bench_trainers(
    trainers: dict[str | None, DPOTrainer],
    options: argparse.Namespace,
    device: torch.device,
    precision: BenchPrecision,
) -> list[BenchRow]:
    """The rows of one precision's trainers, distribution by distribution."""
    rows = []
    for distribution in options.distributions:
        rows += bench_distribution(distribution, trainers, options, device, precision)
    return rows


def run_bench(options: argparse.Namespace) -> list[BenchRow]:
    """Every precision's rows, its trainers built, benched and released before the next precision's."""
    device, _ = bench_device(options.device)
    rows = []
    for precision in bench_precisions(options.precision, device):
        trainers = build_trainers(options, precision, device)
        rows += bench_trainers(trainers, options, device, precision)
        del trainers
        release_memory(device)
    return rows


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
