"""What every `trl-padfree bench` measurement shares: batches of tokenized pairs drawn from a length distribution,
DPO trainers on a bench model, and one timed training step with its peak memory.

Length distributions (token counts; content is random token ids, which does not change the cost):
- `ultrafeedback`: single-turn chat, short prompts; `capybara`: multi-turn, long prompts. Lognormal models fitted to
  published statistics of those datasets (`trl_padfree.data.length_models`, sources in docs/data.md).
- `shipped`: the exact lengths of the preference data shipped in the package, tokenized as TRL does.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from ...config import DPOConfig
from ...data import load_demo_dataset, load_demo_tokenizer
from ...data.length_models import MULTI_TURN, SINGLE_TURN, LengthModel
from ...packing.layout import kept_prompt_and_completion
from ...tiny import DEMO_MODEL_SIZES, make_demo_model, make_model
from ...trainer import DPOTrainer

DISTRIBUTIONS = ("ultrafeedback", "capybara", "shipped")
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
    # Hybrids at the small demo Llama's widths (128 hidden, 4 layers) and vocabulary (make_model's default), for the
    # cost of their mixers run per sequence next to the same-size Llama (`--model small`): 3 gated-delta-rule layers
    # + 1 attention; 3 short convolutions + 1
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
        lengths = shipped_lengths()
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
    # What TRL's keep_start truncation leaves of a pair (packing.layout's model), one token kept for the EOS and at
    # least one for each completion
    prompt = min(prompt, max_length - 2)
    chosen, rejected = (kept_prompt_and_completion(prompt, max(1, n), max_length - 1)[1] for n in (chosen, rejected))
    return prompt, chosen, rejected


def shipped_lengths() -> list[tuple[int, int, int]]:
    """Prompt, chosen and rejected token counts of every pair of the shipped train split."""
    tokenizer = load_demo_tokenizer()
    dataset = load_demo_dataset("train")
    return [
        tuple(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (p, c, r))
        for p, c, r in zip(dataset["prompt"], dataset["chosen"], dataset["rejected"], strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Models and trainers


def make_bench_model(
    name: str, attn_implementation: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu"
):
    """A bench model with random weights, built on `device`: initialising 0.5B weights on the CPU takes longer than
    the whole GPU benchmark (H200: 4 minutes of set-up for 30 s of steps)."""
    if name in DEMO_MODEL_SIZES:
        with torch.device(device):
            return make_demo_model(name, "llama", attn_implementation, seed).to(dtype)
    if name in MODEL_SHAPES:
        shape = dict(MODEL_SHAPES[name])
        with torch.device(device):
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
    models = [make_bench_model(model_name, "sdpa", dtype, device=device) for _ in range(2)]
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


class StepTimer:
    """Total seconds and peak memory of the training steps of each mode (a backend, a batching scheme, ...)."""

    def __init__(self, device: torch.device, modes):
        self.memory = PeakMemory(device)
        self.seconds = dict.fromkeys(modes, 0.0)
        self.peaks: dict[Any, float | None] = dict.fromkeys(modes)

    def warm_up(self, trainer: DPOTrainer, batch: list[dict]) -> None:
        timed_step(trainer, batch, self.memory)

    def step(self, mode, trainer: DPOTrainer, batch: list[dict]) -> None:
        seconds, peak = timed_step(trainer, batch, self.memory)
        self.seconds[mode] += seconds
        if peak is not None:
            self.peaks[mode] = max(self.peaks[mode] or 0.0, peak)


def bench_device(requested: str | None) -> tuple[torch.device, torch.dtype]:
    """The device to time on (`requested`, else CUDA when there is one) and the dtype the models are built in."""
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"


# ---------------------------------------------------------------------------------------------------------------------
# Report


def format_peak_mb(value: float | None) -> str:
    """A peak-memory cell of a results table ("n/a" where the platform cannot measure it)."""
    return f"{value:,.0f}" if value is not None else "n/a"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header, then one line of cells per row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)
