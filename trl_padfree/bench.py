"""`trl-padfree bench`: padded TRL vs padding-free DPO training steps, side by side on the same batches.

A step is what `Trainer.training_step` does: the reference forward, the policy forward and backward, through the real
`DPOTrainer` of each mode (padded TRL, and padding-free with each attention backend). Every batch is run by every mode
before the next batch, in alternating order, so machine drift hits all modes alike. The yardstick is the ideal
speedup, padded tokens / real tokens: what removing padding gives if a step's cost is linear in tokens. With
`padfree_varlen`, a `padfree_varlen+prefix_sharing` mode (each prompt computed once) is timed too, and its rows also
report the speedup over `padfree_varlen` on the same batches.

Length distributions (token counts; content is random token ids, which does not change the cost):
- `ultrafeedback`: single-turn chat, short prompts; `capybara`: multi-turn, long prompts. Lognormal models fitted to
  published statistics of those datasets (`trl_padfree.data.length_models`, sources in docs/data.md).
- `shipped`: the exact lengths of the preference data shipped in the package, tokenized as TRL does.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from datasets import Dataset
from tqdm.auto import tqdm

from .config import DPOConfig
from .data import load_demo_dataset, load_demo_tokenizer
from .data.length_models import MULTI_TURN, SINGLE_TURN, LengthModel
from .tiny import DEMO_MODEL_SIZES, make_demo_model, make_model
from .trainer import DPOTrainer

DISTRIBUTIONS = ("ultrafeedback", "capybara", "shipped")
CPU_BACKENDS = ("padfree_varlen", "sdpa")
# Padding-free with prefix sharing (on padfree_varlen, the attention it needs), timed next to the other modes
PREFIX_SHARING = "padfree_varlen+prefix_sharing"
GPU_BACKENDS = ("padfree_varlen", "flash_attention_2", "sdpa")
# Shapes of public models, built with random weights from the config alone (no download)
MODEL_SHAPES = {
    "llama3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # Hybrids at the small demo Llama's widths (128 hidden, 4 layers), for the cost of their mixers run per sequence
    # next to the same-size Llama (`--model small`): 3 gated-delta-rule layers + 1 attention; 3 short convolutions + 1
    "qwen3.5-demo": dict(
        model_type="qwen3_5_text",
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "lfm2-demo": dict(
        model_type="lfm2",
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention", "conv"],
    ),
}
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
# Batches


def sample_lengths(model: LengthModel, rng: random.Random, max_length: int) -> tuple[int, int, int]:
    """Prompt, chosen and rejected token counts of one pair, each sequence capped at `max_length`."""

    def draw(median: float, sigma: float, low: int = 1) -> int:
        return max(low, round(rng.lognormvariate(0.0, sigma) * median))

    prompt = min(draw(model.prompt_median, model.prompt_sigma), max_length // 2)
    chosen = min(draw(model.chosen_median, model.completion_sigma), max_length - prompt)
    rejected = min(draw(model.rejected_median, model.completion_sigma), max_length - prompt)
    return prompt, chosen, rejected


def make_batches(
    distribution: str, num_batches: int, pairs_per_batch: int, max_length: int, vocab_size: int, seed: int
) -> list[list[dict]]:
    """`num_batches` lists of tokenized pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`) following `distribution`."""
    rng = random.Random(seed)
    if distribution == "shipped":
        lengths = _shipped_lengths()
        rng.shuffle(lengths)
        draws = [lengths[index % len(lengths)] for index in range(num_batches * pairs_per_batch)]
    elif distribution in ("ultrafeedback", "capybara"):
        model = SINGLE_TURN if distribution == "ultrafeedback" else MULTI_TURN
        draws = [sample_lengths(model, rng, max_length) for _ in range(num_batches * pairs_per_batch)]
    else:
        raise ValueError(f"Unknown distribution {distribution!r}; choose from {list(DISTRIBUTIONS)}.")

    def tokens(count: int) -> list[int]:
        return [rng.randrange(4, vocab_size) for _ in range(count)]  # ids 0..3 are special tokens

    pairs = [
        {"prompt_ids": tokens(p), "chosen_ids": tokens(c), "rejected_ids": tokens(r)}
        for p, c, r in (_truncate(*draw, max_length) for draw in draws)
    ]
    return [pairs[start : start + pairs_per_batch] for start in range(0, len(pairs), pairs_per_batch)]


def _truncate(prompt: int, chosen: int, rejected: int, max_length: int) -> tuple[int, int, int]:
    # TRL's keep_start truncation: the prompt first, then the completion up to max_length (EOS included below)
    prompt = min(prompt, max_length - 2)
    return prompt, max(1, min(chosen, max_length - prompt - 1)), max(1, min(rejected, max_length - prompt - 1))


def _shipped_lengths() -> list[tuple[int, int, int]]:
    tokenizer = load_demo_tokenizer()
    dataset = load_demo_dataset("train")
    return [
        tuple(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (p, c, r))
        for p, c, r in zip(dataset["prompt"], dataset["chosen"], dataset["rejected"], strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Models and trainers


def make_bench_model(name: str, attn_implementation: str, dtype: torch.dtype, seed: int = 0):
    if name in DEMO_MODEL_SIZES:
        return make_demo_model(name, "llama", attn_implementation, seed).to(dtype)
    if name in MODEL_SHAPES:
        shape = dict(MODEL_SHAPES[name])
        shape.setdefault("vocab_size", len(load_demo_tokenizer()))  # the demo-size hybrids: the demo Llama's
        return make_model(shape.pop("model_type"), attn_implementation, seed, dtype, **shape)
    raise ValueError(f"Unknown bench model {name!r}; choose from {sorted(DEMO_MODEL_SIZES) + sorted(MODEL_SHAPES)}.")


def make_bench_trainer(
    model_name: str, backend: str | None, device: torch.device, dtype: torch.dtype, prefix_sharing: bool = False
) -> DPOTrainer:
    """A padded (`backend=None`) or padding-free trainer whose models sit on `device`."""
    config = DPOConfig(
        output_dir="/tmp/trl-padfree-bench",
        padding_free=backend is not None,
        prefix_sharing=prefix_sharing,
        packed_attn_implementation=backend or "auto",
        bf16=False,  # the models are built in `dtype`, no autocast
        use_cpu=device.type == "cpu",
        activation_checkpointing=False,
        max_length=None,  # batches arrive truncated
        report_to="none",
    )
    models = [make_bench_model(model_name, "sdpa", dtype).to(device) for _ in range(2)]
    placeholder = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    trainer = DPOTrainer(
        models[0], models[1], config, train_dataset=placeholder, processing_class=load_demo_tokenizer()
    )
    trainer.current_gradient_accumulation_steps = 1  # set by `train()`, which the benchmark does not run
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# Measurement


class PeakMemory:
    """Peak memory of a measured region: CUDA allocator peak on GPU, peak resident set (VmHWM, reset) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._libc = ctypes.CDLL("libc.so.6") if device.type == "cpu" and platform.system() == "Linux" else None

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._libc is not None:
            self._libc.malloc_trim(0)  # give freed heap back, or the last mode's leftovers count as this one's peak
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set

    def peak_mb(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self._libc is None:
            return None
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None


def timed_step(trainer: DPOTrainer, batch: list[dict], memory: PeakMemory) -> tuple[float, float | None]:
    inputs = trainer.data_collator(batch)
    memory.reset()
    if memory.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.training_step(trainer.model, inputs)
    if memory.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    trainer.model.zero_grad(set_to_none=True)
    return seconds, memory.peak_mb()


def bench_distribution(
    distribution: str, trainers: dict[str | None, DPOTrainer], options: argparse.Namespace, device: torch.device
) -> list[BenchRow]:
    vocab_size = len(load_demo_tokenizer())
    batches = make_batches(
        distribution, options.batches + 1, options.pairs_per_batch, options.max_length, vocab_size, options.seed
    )
    warmup, measured = batches[0], batches[1:]
    memory = PeakMemory(device)
    modes = list(trainers)
    for mode in modes:
        timed_step(trainers[mode], warmup, memory)
    seconds = {mode: 0.0 for mode in modes}
    peaks: dict[str | None, float | None] = {mode: None for mode in modes}
    for index, batch in enumerate(tqdm(measured, desc=distribution, unit="batch", leave=False)):
        for mode in modes if index % 2 == 0 else reversed(modes):
            step_seconds, peak = timed_step(trainers[mode], batch, memory)
            seconds[mode] += step_seconds
            if peak is not None:
                peaks[mode] = max(peaks[mode] or 0.0, peak)

    padded_collator = trainers[None].data_collator
    padded_mode_real = sum(int(padded_collator(batch)["attention_mask"].sum()) for batch in measured)
    packed = [trainers[modes[1]].data_collator(batch) for batch in measured]
    real_tokens = sum(int(batch["seq_lens"].sum()) for batch in packed)
    padded_tokens = sum(len(batch["seq_lens"]) * int(batch["seq_lens"].max()) for batch in packed)
    padded_step = seconds[None] / len(measured)
    rows = []
    for mode in modes[1:]:
        row_tokens = sum(_row_tokens(trainers[mode].data_collator(batch)) for batch in measured)
        padfree_step = seconds[mode] / len(measured)
        speedup = padded_step / padfree_step
        ideal = padded_tokens / row_tokens
        row = BenchRow(
            distribution=distribution,
            backend=mode,
            device=_device_name(device),
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


def _row_tokens(batch: dict) -> int:
    # Every pair lays out two segments, shared or not: the row's real tokens end where the last one does
    return int(batch["cu_seq_lens_q"][len(batch["seq_lens"])])


def available_backends(device: torch.device, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    if device.type == "cpu":
        return list(CPU_BACKENDS)
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    return [name for name in GPU_BACKENDS if name != "flash_attention_2" or has_flash_attn]


def run_bench(options: argparse.Namespace) -> list[BenchRow]:
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"


# ---------------------------------------------------------------------------------------------------------------------
# Report


def format_table(rows: list[BenchRow]) -> str:
    header = "| distribution | backend | padded s/step | padding-free s/step | speedup | ideal | of ideal | peak MB padded | peak MB padding-free | real tokens/s | sharing vs unshared (ideal) |"
    lines = [header, "|" + "---|" * 11]
    for row in rows:
        memory = [
            f"{value:,.0f}" if value is not None else "n/a"
            for value in (row.padded_peak_mem_mb, row.padfree_peak_mem_mb)
        ]
        lines.append(
            f"| {row.distribution} | {row.backend} | {row.padded_step_s:.3f} | {row.padfree_step_s:.3f} | "
            f"{row.speedup:.2f}x | {row.ideal_speedup:.2f}x | {row.fraction_of_ideal:.0%} | {memory[0]} | {memory[1]} | "
            f"{row.real_tokens_per_s:,.0f} | {_sharing_cell(row)} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--output", metavar="FILE.json", help="write the rows as a JSON list")
    parser.add_argument("--plot", metavar="FILE.png", help="plot speedup vs ideal per distribution")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    options.model = options.model or ("tiny" if options.quick else "small")
    options.batches = options.batches or (3 if options.quick else 8)
    if options.batches < 1 or options.pairs_per_batch < 1 or options.max_length < 3:
        raise ValueError("--batches and --pairs-per-batch must be at least 1, and --max-length at least 3.")
    datasets.disable_progress_bars()
    if options.batching:
        from .bench_budget import format_batching_table, run_batching_bench

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
