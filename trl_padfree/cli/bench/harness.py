"""What every `trl-padfree bench` measurement shares: batches of tokenized pairs drawn from a length distribution,
DPO trainers on a bench model, and one timed training step with its peak memory.

Length distributions (token counts; content is random token ids, which does not change the cost):
- `ultrafeedback`: single-turn chat, short prompts; `capybara`: multi-turn, long prompts. Lognormal models fitted to
  published statistics of those datasets (`trl_padfree.data.length_models`, sources in docs/guides/quickstart.md).
- `shipped`: the exact lengths of the preference data shipped in the package, tokenized as TRL does.
- `prompt_groups`: many pairs of one prompt, as on-policy and UltraFeedback-style data give them: each of capybara's
  long prompts with 4 completions paired all ways (6 pairs, consecutive: `train_sampling_strategy="group_by_prompt"`
  batches them so). Not in the default set.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import importlib.util
import itertools
import platform
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig

from ...config import DPOConfig
from ...costs.flops import (
    EXPERT_COUNT_NAMES,
    BatchWork,
    DecoderShape,
    Segment,
    packed_row_work,
    padded_batch_work,
)
from ...data import load_demo_dataset, load_demo_tokenizer
from ...data.length_models import MULTI_TURN, SINGLE_TURN, LengthModel
from ...packing.layout import HOST_ROW, kept_prompt_and_completion
from ...tiny import DEMO_MODEL_SIZES, make_demo_model, make_model
from ...trainer import DPOTrainer

DISTRIBUTIONS = ("ultrafeedback", "capybara", "shipped", "prompt_groups")
DEFAULT_DISTRIBUTIONS = DISTRIBUTIONS[:3]
GROUP_COMPLETIONS = 4  # `prompt_groups`: completions per prompt, paired all ways
# Shapes of public models, built with random weights from the config alone (no download)
MODEL_SHAPES = {
    "llama3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
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
    # Attention that torch's varlen kernel cannot compute, at the real models' widths, 4 layers deep so a step fits
    # the GPU report's minutes. GPT-OSS (20B and 120B share the attention): sinks, 64 query heads and 8 key/value
    # heads of dim 64, a 128-token window on every other layer; 4 experts, all active, so each token computes what it
    # does in GPT-OSS (its top 4 experts) without the others' weights
    "gpt-oss-4-layers": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=4,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=4,
        vocab_size=201088,
    ),
    # Gemma 2 9B: logit softcapping (attention 50, final 30), head dim 256, a 4,096-token window on every other layer
    "gemma2-9b-4-layers": dict(
        model_type="gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=256000,
    ),
    # The same attention at the tiny demo model's widths (the GPU report's dry run): sinks; softcapping, a window
    # shorter than the pairs
    "gpt-oss-tiny": dict(
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
    "gemma2-tiny": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
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

    def tokens(count: int) -> list[int]:
        return [rng.randrange(4, vocab_size) for _ in range(count)]  # ids 0..3 are special tokens

    if distribution == "prompt_groups":
        pairs = []
        while len(pairs) < num_batches * pairs_per_batch:
            pairs += _prompt_group(rng, tokens, max_length)
    else:
        pairs = [
            {"prompt_ids": tokens(p), "chosen_ids": tokens(c), "rejected_ids": tokens(r)}
            for p, c, r in (
                truncated_pair_lengths(*draw, max_length)
                for draw in _pair_length_draws(distribution, rng, num_batches * pairs_per_batch, max_length)
            )
        ]
    pairs = pairs[: num_batches * pairs_per_batch]
    return [pairs[start : start + pairs_per_batch] for start in range(0, len(pairs), pairs_per_batch)]


def _pair_length_draws(distribution: str, rng: random.Random, count: int, max_length: int) -> list[tuple]:
    if distribution == "shipped":
        lengths = shipped_lengths()
        rng.shuffle(lengths)
        return [lengths[index % len(lengths)] for index in range(count)]
    if distribution in ("ultrafeedback", "capybara"):
        model = SINGLE_TURN if distribution == "ultrafeedback" else MULTI_TURN
        return [sample_lengths(model, rng, max_length) for _ in range(count)]
    raise ValueError(f"Unknown distribution {distribution!r}; choose from {list(DISTRIBUTIONS)}.")


def _prompt_group(rng: random.Random, tokens, max_length: int) -> list[dict]:
    """One prompt's pairs: `GROUP_COMPLETIONS` completions (capybara's lengths) paired all ways, each truncated as
    TRL's keep_start truncation cuts it (the same completion alike in every pair)."""
    draws = [sample_lengths(MULTI_TURN, rng, max_length) for _ in range(GROUP_COMPLETIONS // 2)]
    prompt = tokens(draws[0][0])
    completions = [tokens(length) for _, chosen, rejected in draws for length in (chosen, rejected)]
    pairs = []
    for better, worse in itertools.combinations(completions, 2):
        kept, chosen, rejected = truncated_pair_lengths(len(prompt), len(better), len(worse), max_length)
        pairs.append({"prompt_ids": prompt[:kept], "chosen_ids": better[:chosen], "rejected_ids": worse[:rejected]})
    return pairs


def truncated_pair_lengths(prompt: int, chosen: int, rejected: int, max_length: int) -> tuple[int, int, int]:
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


@dataclass(frozen=True)
class PaddedAttention:
    """The attention padded TRL runs a bench model on, and why: the kernel its users pick, among those that run with
    no download."""

    implementation: str
    why: str


def padded_attention(name: str) -> PaddedAttention:
    """What padded TRL runs bench model `name` on. Softcapping (Gemma 2) and sinks (GPT-OSS) are refused by
    transformers' sdpa; flash-attn 2 takes softcap, but transformers passes it no sinks (`s_aux` reaches FA3 and FA4
    only: it would drop them silently)."""
    model_type = MODEL_SHAPES.get(name, {}).get("model_type", "llama")
    if model_type == "gemma2":
        if importlib.util.find_spec("flash_attn") is not None:
            return PaddedAttention("flash_attention_2", "flash-attn's kernel takes Gemma 2's softcap")
        return PaddedAttention("eager", "flash-attn (softcap) is not installed; transformers refuses sdpa for softcap")
    if model_type == "gpt_oss":
        return PaddedAttention(
            "eager",
            "GPT-OSS users run the kernels hub's vllm-flash-attn3 (sinks), which cannot be downloaded offline; "
            "transformers refuses sdpa for sinks and would drop them on flash_attention_2",
        )
    return PaddedAttention("sdpa", "transformers' default")


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


# LoRA on every linear layer of the decoder (peft's "all-linear" leaves the LM head out): how an 8B model's DPO step
# fits one GPU. The reference is then the policy with its adapters off (TRL's `ref_model=None`), no second model
BENCH_LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


class BenchWeights:
    """The policy's and the reference's weights of one bench model in one dtype, built once and shared by every
    mode's trainer: each trainer gets its own modules and parameters over the same storage, so a mode's peak memory
    holds the weights of one run (policy and reference), not those of every trainer alive. The bench takes no
    optimizer step, so the weights never change; each trainer's gradients are its own, dropped after every step."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device):
        self.name, self.dtype, self.device = name, dtype, device
        self._templates: dict[str, torch.nn.Module] = {}

    def model(self, role: str) -> torch.nn.Module:
        """A fresh model of `role` ("policy" or "reference") over that role's weights (both built with seed 0, as
        a run's reference starts equal to its policy), on padded TRL's attention (a padding-free trainer switches
        its own copy)."""
        if role not in self._templates:
            attention = padded_attention(self.name).implementation
            self._templates[role] = make_bench_model(self.name, attention, self.dtype, device=self.device)
        template = self._templates[role]
        # New parameters over the template's storage; a tied LM head stays tied (one parameter, one entry)
        memo = {id(p): torch.nn.Parameter(p.data, requires_grad=p.requires_grad) for p in template.parameters()}
        return copy.deepcopy(template, memo)


def make_bench_trainer(
    model_name: str,
    backend: str | None,
    device: torch.device,
    dtype: torch.dtype,
    prefix_sharing: bool | str = False,
    *,
    bf16_autocast: bool = False,
    activation_checkpointing: bool = True,
    lora: bool = False,
    weights: BenchWeights | None = None,
) -> DPOTrainer:
    """A padded (`backend=None`) or padding-free trainer whose models sit on `device`, built in `dtype` (over
    `weights` when given, shared with other trainers), stepping under bf16 autocast with `bf16_autocast`: float32
    weights under bf16 autocast is TRL's default precision (`DPOConfig.bf16=True`, the model loaded in float32).
    `activation_checkpointing` is on by default, as in TRL's `DPOConfig` (`gradient_checkpointing=True`): each
    layer's forward runs again in the backward."""
    config = DPOConfig(
        output_dir="/tmp/trl-padfree-bench",
        padding_free=backend is not None,
        prefix_sharing=prefix_sharing,
        packed_attn_implementation=backend or "auto",
        bf16=bf16_autocast,
        use_cpu=device.type == "cpu",
        activation_checkpointing=activation_checkpointing,
        max_length=None,  # batches arrive truncated
        report_to="none",
    )
    weights = weights or BenchWeights(model_name, dtype, device)
    policy = weights.model("policy")
    reference, peft_config = (None, LoraConfig(**BENCH_LORA)) if lora else (weights.model("reference"), None)
    placeholder = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    trainer = DPOTrainer(
        policy,
        reference,
        config,
        train_dataset=placeholder,
        processing_class=load_demo_tokenizer(),
        peft_config=peft_config,
    )
    # What `train()`, which the benchmark does not run, sets up: the step count it weighs by, activation checkpointing
    # (as `train()` turns it on), and the policy prepared, its forward wrapped in place in accelerate's autocast under
    # mixed precision (the reference is, at init)
    trainer.current_gradient_accumulation_steps = 1
    if config.activation_checkpointing:
        enable_activation_checkpointing(trainer)
    trainer.accelerator.prepare_model(trainer.model)
    return trainer


def enable_activation_checkpointing(trainer: DPOTrainer) -> None:
    """Turn the policy's activation checkpointing on as `Trainer.train()` does with `activation_checkpointing=True`
    and no `activation_checkpointing_kwargs` (non-reentrant, every layer), and check that it took."""
    trainer.model.activation_checkpointing_enable()
    if not trainer.model.is_activation_checkpointing:
        raise RuntimeError(f"{type(trainer.model).__name__} did not turn activation checkpointing on.")


# ---------------------------------------------------------------------------------------------------------------------
# Measurement
#
# One timed step:   collate | reset peak | sync | [host clock, start event | training_step | end event, sync] | ...
#                   (untimed)                     (timed)
# Nothing in the timed bracket frees or trims memory: `torch.cuda.empty_cache()` runs once, before every mode's
# warm-ups (`StepTimer.warm_up`), so each mode's timed steps meet the caching allocator as training does, warm, and
# no mode starts from an allocator another mode's warm-up has filled while the others start from an empty one.

CU_CTX_SCHED_BLOCKING_SYNC = 4  # cuda.h: the host thread sleeps in a synchronisation instead of spinning
CU_CTX_SCHED_MASK = 7
HOST_BOUND_FRACTION = 0.8  # host CPU time at least this share of a step's time: the GPU waits on the host


class PeakMemory:
    """Peak memory of a measured region: CUDA allocator peak on GPU, peak resident set (VmHWM, reset) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._libc = ctypes.CDLL("libc.so.6") if device.type == "cpu" and platform.system() == "Linux" else None

    def release_cached(self) -> None:
        """Hand cached blocks back: once, before the warm-ups of every mode, never before a timed step (the next steps
        would pay the allocator's cudaMalloc calls, which training never does). On CPU there is no cache to hand back:
        `reset` trims the heap before every step, outside the timed bracket."""
        if self.device.type == "cuda":
            gc.collect()  # tensors only a reference cycle holds, so their blocks are free to hand back
            torch.cuda.empty_cache()

    def reset(self) -> None:
        gc.collect()  # so no collection of an earlier step's garbage lands inside this one
        if self.device.type == "cuda":
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


@dataclass(frozen=True)
class StepTiming:
    """One timed step: its time (CUDA events on GPU, wall clock on CPU), the host CPU time over it (every thread of
    the process), and the peak memory."""

    seconds: float
    host_seconds: float
    peak_mb: float | None


def timed_step(trainer: DPOTrainer, batch: list[dict], memory: PeakMemory) -> StepTiming:
    """One `training_step` on `batch`, collated outside the timed bracket; gradients dropped after it."""
    inputs = trainer.data_collator(batch)
    memory.reset()
    seconds, host_seconds = _run_timed(lambda: trainer.training_step(trainer.model, inputs), memory.device)
    trainer.model.zero_grad(set_to_none=True)
    return StepTiming(seconds, host_seconds, memory.peak_mb())


def _run_timed(run, device: torch.device) -> tuple[float, float]:
    """Seconds and host CPU seconds of `run()`; on CUDA, synchronised before and after, timed by events on the
    stream. Host time is the process's CPU time (`time.process_time`, every thread): on CUDA the backward's kernels
    are launched by autograd's device thread, which the training thread's own CPU time would miss."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)  # the previous step's kernels are not this one's
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_start, wall_start = time.process_time(), time.perf_counter()
    if cuda:
        start_event.record()
    run()
    if cuda:
        end_event.record()
        torch.cuda.synchronize(device)
    host_seconds, seconds = time.process_time() - host_start, time.perf_counter() - wall_start
    if cuda:
        seconds = start_event.elapsed_time(end_event) / 1000
    return seconds, host_seconds


@dataclass(frozen=True)
class StepStats:
    """A mode's measured steps: their times and host CPU times, in order, and its peak memory over them.

    `host_bound` is True when the process's threads (Python's, and autograd's device thread that launches the
    backward) spent CPU time of at least `HOST_BOUND_FRACTION` of the steps' time on CUDA: the GPU waited on Python
    and kernel launches. None on CPU, where the host does the compute, and where CUDA spins in synchronisations
    (waiting would count as host time).
    """

    times_s: list[float]
    host_times_s: list[float]
    peak_mb: float | None
    host_bound: bool | None

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def host_mean_s(self) -> float:
        return statistics.fmean(self.host_times_s)


class StepTimer:
    """Step times, host CPU times and peak memory of the training steps of each mode (a backend, a batching scheme,
    ...), kept per step so the spread and any drift across the run show."""

    def __init__(self, device: torch.device, modes):
        self.memory = PeakMemory(device)
        self.times_s: dict[Any, list[float]] = {mode: [] for mode in modes}
        self.host_times_s: dict[Any, list[float]] = {mode: [] for mode in modes}
        self.peaks: dict[Any, float | None] = dict.fromkeys(modes)
        # Host time means host work only where a waiting thread sleeps (see `request_blocking_cuda_sync`)
        self.host_time_is_work = device.type == "cuda" and cuda_sync_blocks(device)

    def warm_up(self, steps: Iterable[tuple[DPOTrainer, list[dict]]]) -> None:
        """Untimed steps (a mode's trainer and a batch each) of every mode, after handing the cached memory back once
        (the only place it is): every mode's timed steps then meet an allocator as warm as the others'."""
        self.memory.release_cached()
        for trainer, batch in steps:
            timed_step(trainer, batch, self.memory)

    def step(self, mode, trainer: DPOTrainer, batch: list[dict]) -> None:
        timing = timed_step(trainer, batch, self.memory)
        self.times_s[mode].append(timing.seconds)
        self.host_times_s[mode].append(timing.host_seconds)
        if timing.peak_mb is not None:
            self.peaks[mode] = max(self.peaks[mode] or 0.0, timing.peak_mb)

    @property
    def seconds(self) -> dict[Any, float]:
        """Total measured seconds per mode."""
        return {mode: sum(times) for mode, times in self.times_s.items()}

    def stats(self, mode) -> StepStats:
        times, host_times = self.times_s[mode], self.host_times_s[mode]
        host_bound = sum(host_times) >= HOST_BOUND_FRACTION * sum(times) if self.host_time_is_work else None
        return StepStats(list(times), list(host_times), self.peaks[mode], host_bound)


def request_blocking_cuda_sync(device: torch.device) -> bool:
    """Ask the CUDA driver to put a waiting host thread to sleep (CU_CTX_SCHED_BLOCKING_SYNC) rather than spin: a
    spinning wait (the default with fewer CUDA contexts than cores) burns CPU time, so the process's CPU time
    would equal the step's time whatever the host did. Costs microseconds of wake-up per synchronisation. Set on the
    primary context before it is created (before any model is built), through the driver API (`libcuda.so.1`, the
    one every CUDA runtime in the process shares). Returns whether the flag holds."""
    driver = _cuda_driver()
    handle = ctypes.c_int()
    if driver is None or driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(handle), device.index or 0):
        return False
    # The _v2 entry point (CUDA 11+) may set the flags of a primary context already active; the first may not
    set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or driver.cuDevicePrimaryCtxSetFlags
    set_flags(handle, CU_CTX_SCHED_BLOCKING_SYNC)
    return cuda_sync_blocks(device)


def cuda_sync_blocks(device: torch.device) -> bool:
    """Whether a host thread waiting on `device` sleeps (blocking sync) rather than spins."""
    driver = _cuda_driver()
    handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if driver is None or driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(handle), device.index or 0):
        return False
    if driver.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)):
        return False
    return flags.value & CU_CTX_SCHED_MASK == CU_CTX_SCHED_BLOCKING_SYNC


def _cuda_driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def decoder_shape(model) -> DecoderShape:
    """The FLOP model's shape of a bench model: its layers' parameters counted (exact for hybrids too), except for a
    mixture of experts, whose count would include the experts a token skips: read from the config."""
    config = model.config.get_text_config()
    if any(getattr(config, name, None) for name in EXPERT_COUNT_NAMES):
        return DecoderShape.from_config(config)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    excluded = embedding.weight.numel()
    if head is not None and head.weight is not embedding.weight:  # untied: the LM head is counted apart
        excluded += head.weight.numel()
    counted = sum(parameter.numel() for parameter in model.parameters()) - excluded
    return DecoderShape.from_config(config, linear_params=counted)


def batch_work(collated: dict[str, Any]) -> BatchWork:
    """What one forward of a collated batch processes: a padded batch (`attention_mask`, no `seq_lens`) at its padded
    width, or a packed row's segments, each laid-out sequence's own tokens reading its shared prefix where it has one
    (a prompt group's sequences that read the same tokens counted once)."""
    scored_tokens = int(collated["completion_mask"].sum())
    if "seq_lens" not in collated:
        lengths = collated["attention_mask"].sum(dim=1).tolist()
        return padded_batch_work(lengths, scored_tokens, padded_length=collated["input_ids"].shape[1])
    row = collated[HOST_ROW]
    segments = [
        Segment(row.seq_lens[sequence] - row.prefix_lens[sequence], row.prefix_lens[sequence])
        for sequence in row.laid_out
    ]
    return packed_row_work(segments, scored_tokens, row_tokens=collated["input_ids"].shape[1])


def default_device(requested: str | None) -> torch.device:
    """`requested`, else CUDA when there is one."""
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def bench_device(requested: str | None) -> tuple[torch.device, torch.dtype]:
    """The device to time on (`default_device`) and the dtype the models are built in."""
    device = default_device(requested)
    if device.type == "cuda":
        request_blocking_cuda_sync(device)  # before any model is built; whether it held, `StepTimer` reads back
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
