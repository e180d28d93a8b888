"""`trl-padfree bench --vision`: padded TRL vs padding-free DPO on a Qwen2.5-VL-shaped model with images.

The same timed `training_step` as the text benchmark (harness.py), on batches of conversational pairs with one image
each, collated by each trainer's own collator (TRL's vision collator, or its packing twin). Three modes: padded TRL,
`padfree_varlen`, and `padfree_varlen+prefix_sharing`, where each pair's prompt and image are laid out once, so the
vision tower encodes each image once instead of twice. Reported per mode: seconds per step, peak memory, the images
the vision tower encodes per pair and per step, the language model's tokens (padded rows vs the packed row) and the
ideal speedup they allow. Text lengths are drawn uniformly (prompts of 4 to 24 words, completions of 4 to 96): no
length statistics of a public image preference set were at hand.

Models have random weights, built from a config on the device; the processor is Qwen2.5-VL's image processor over the
shipped tokenizer (no download). Images are noise: their content does not change the cost, their size does.
"""

from __future__ import annotations

import argparse
import copy
import random
from dataclasses import dataclass

import numpy as np
import torch
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

from ...config import DPOConfig
from ...data import load_demo_tokenizer
from ...trainer import DPOTrainer
from .harness import StepTimer, bench_device, device_name, format_peak_mb, markdown_table

QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ message['role'] | capitalize }}:"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else %} {{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{{ eos_token }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)
PATCH, MERGE = 14, 2  # Qwen2.5-VL: 14-pixel patches, merged 2 x 2 into one image token
# Qwen2.5-VL's shapes: the 3B checkpoint's, and a demo at the CPU bench models' width
VISION_MODEL_SHAPES = {
    "qwen2.5-vl-demo": dict(
        text=dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[4, 6, 6]),
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1]),
        image_tokens=(4, 64),
    ),
    "qwen2.5-vl-3b": dict(
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, mrope_section=[16, 24, 24], vocab_size=151936, tie_word_embeddings=True),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    fullatt_block_indexes=[7, 15, 23, 31]),
        image_tokens=(64, 1024),
    ),
}  # fmt: skip
MODES = ("padded", "padfree_varlen", "padfree_varlen+prefix_sharing")
VISION_MAX_WORDS = 96  # completions of up to 96 words, prompts of up to 24, next to the image


class WithoutVideoProcessor:
    """A processor mixin that lets `video_processor=None` through (Qwen-VL's and SmolVLM's video processors need
    torchvision): such a processor handles images and text only, and its `save_pretrained` fails."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


class _ImagesOnlyProcessor(WithoutVideoProcessor, Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor."""


def make_processor(image_tokens: tuple[int, int]) -> Qwen2_5_VLProcessor:
    """The shipped tokenizer with Qwen-VL's image tokens, images resized to `image_tokens` tokens (min, max)."""
    tokenizer = load_demo_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": list(QWEN_VL_TOKENS)}, replace_extra_special_tokens=False)
    token_pixels = (MERGE * PATCH) ** 2
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        min_pixels=image_tokens[0] * token_pixels,
        max_pixels=image_tokens[1] * token_pixels,
    )
    return _ImagesOnlyProcessor(images, tokenizer, video_processor=None, chat_template=CHAT_TEMPLATE)


def make_vision_bench_model(shape: dict, processor, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A `Qwen2_5_VLForConditionalGeneration` of `shape` with random weights, built on `device`."""
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    text.setdefault("vocab_size", len(processor.tokenizer))
    text["rope_parameters"] = dict(rope_type="default", rope_theta=1e6, mrope_section=mrope_section)
    vision = dict(shape["vision"], out_hidden_size=text["hidden_size"], patch_size=PATCH, spatial_merge_size=MERGE)
    vision.update(temporal_patch_size=2, window_size=112)
    start, end, image, video = processor.tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(text, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=vision,
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=image,
        video_token_id=video,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.config.name_or_path = "bench-qwen2.5-vl"
    return model


def make_pairs(count: int, image_tokens: tuple[int, int], max_words: int, seed: int) -> list[dict]:
    """Conversational pairs with one noise image each, of a size between `image_tokens` tokens; prompts of 4 to
    `max_words // 4` words, completions of 4 to `max_words` words."""
    from PIL import Image  # the `vision` extra; text benchmarks run without it

    rng = random.Random(seed)
    words = load_demo_tokenizer().convert_ids_to_tokens(list(range(8, 1008)))
    side = MERGE * PATCH

    def text(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    pairs = []
    for _ in range(count):
        tokens = rng.randint(*image_tokens)
        height = max(1, int(tokens**0.5 * rng.uniform(0.7, 1.4)))
        width = max(1, tokens // height)
        pixels = np.random.default_rng(rng.randrange(2**31)).integers(0, 256, (height * side, width * side, 3))
        prompt = [{"type": "image"}, {"type": "text", "text": text(4, max(4, max_words // 4))}]
        pairs.append(
            {
                "images": [Image.fromarray(pixels.astype(np.uint8))],
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": text(4, max_words)}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": text(4, max_words)}]}],
            }
        )
    return pairs


def make_vision_bench_trainer(mode: str, shape: dict, processor, pairs, device, dtype) -> DPOTrainer:
    config = DPOConfig(
        output_dir="/tmp/trl-padfree-bench",
        padding_free=mode != "padded",
        prefix_sharing=mode.endswith("prefix_sharing"),
        bf16=False,  # the models are built in `dtype`
        use_cpu=device.type == "cpu",
        max_length=None,
        report_to="none",
        save_strategy="no",
    )
    policy, reference = (make_vision_bench_model(shape, processor, dtype, device) for _ in range(2))
    trainer = DPOTrainer(
        policy, reference, config, train_dataset=Dataset.from_list(pairs[:1]), processing_class=processor
    )
    trainer.current_gradient_accumulation_steps = 1  # set by `train()`, which the benchmark does not run
    return trainer


@dataclass
class VisionBenchRow:
    mode: str
    device: str
    model: str
    step_s: float
    speedup: float  # over padded TRL
    peak_mem_mb: float | None
    images_encoded_per_step: float  # by the policy's and the reference's vision towers, each
    images_encoded_per_pair: float  # 2 when TRL hands each image over twice, 1 with prefix sharing
    language_model_tokens_per_step: float  # padded: rows x longest; packed: the row's real tokens
    ideal_speedup: float  # padded language-model tokens / this mode's, what the language model alone could gain
    pairs_per_batch: int
    batches: int


def fresh(batch: list[dict]) -> list[dict]:
    """The batch for one more collator call: TRL's vision collator writes each image into its prompt's image part, and
    a prompt whose parts already hold their images no longer has a placeholder for them."""
    return [{**example, "prompt": copy.deepcopy(example["prompt"])} for example in batch]


def count_encoded_images(trainer: DPOTrainer) -> list[int]:
    """Images the policy's vision tower encodes, appended per call (one grid row per image)."""
    calls: list[int] = []
    trainer.model.model.visual.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    return calls


def language_model_tokens(trainer: DPOTrainer, batch: list[dict]) -> int:
    collated = trainer.data_collator(fresh(batch))
    if "seq_lens" in collated:
        return int(collated["cu_seq_lens_q"][len(collated["seq_lens"])])
    return collated["input_ids"].numel()


def run_vision_bench(options: argparse.Namespace) -> list[VisionBenchRow]:
    device, dtype = bench_device(options.device)
    shape = VISION_MODEL_SHAPES[options.model]
    processor = make_processor(shape["image_tokens"])
    batches_of_pairs = make_pairs(
        (options.warmup + options.batches) * options.pairs_per_batch,
        shape["image_tokens"],
        options.max_words,
        options.seed,
    )
    batches = [
        batches_of_pairs[start : start + options.pairs_per_batch]
        for start in range(0, len(batches_of_pairs), options.pairs_per_batch)
    ]
    warmup, measured = batches[: options.warmup], batches[options.warmup :]
    trainers = {mode: make_vision_bench_trainer(mode, shape, processor, batches[0], device, dtype) for mode in MODES}
    timer = StepTimer(device, MODES)
    encoded = {mode: count_encoded_images(trainer) for mode, trainer in trainers.items()}
    timer.warm_up((trainer, fresh(batch)) for trainer in trainers.values() for batch in warmup)
    for calls in encoded.values():
        calls.clear()
    for index, batch in enumerate(tqdm(measured, desc="vision", unit="batch", leave=False)):
        for mode in MODES if index % 2 == 0 else reversed(MODES):
            timer.step(mode, trainers[mode], fresh(batch))
    padded_step = timer.seconds["padded"] / len(measured)
    tokens = {mode: sum(language_model_tokens(trainers[mode], batch) for batch in measured) for mode in MODES}
    pairs = len(measured) * options.pairs_per_batch
    return [
        VisionBenchRow(
            mode=mode,
            device=device_name(device),
            model=options.model,
            step_s=timer.seconds[mode] / len(measured),
            speedup=padded_step / (timer.seconds[mode] / len(measured)),
            peak_mem_mb=timer.peaks[mode],
            images_encoded_per_step=sum(encoded[mode]) / len(measured),
            images_encoded_per_pair=sum(encoded[mode]) / pairs,
            language_model_tokens_per_step=tokens[mode] / len(measured),
            ideal_speedup=tokens["padded"] / tokens[mode],
            pairs_per_batch=options.pairs_per_batch,
            batches=len(measured),
        )
        for mode in MODES
    ]


VISION_TABLE_COLUMNS = (
    "mode",
    "s/step",
    "speedup",
    "ideal (LM tokens)",
    "peak MB",
    "images encoded / pair",
    "LM tokens / step",
)


def format_vision_table(rows: list[VisionBenchRow]) -> str:
    cells = (
        [
            row.mode,
            f"{row.step_s:.3f}",
            f"{row.speedup:.2f}x",
            f"{row.ideal_speedup:.2f}x",
            format_peak_mb(row.peak_mem_mb),
            f"{row.images_encoded_per_pair:g}",
            f"{row.language_model_tokens_per_step:,.0f}",
        ]
        for row in rows
    )
    return markdown_table(VISION_TABLE_COLUMNS, cells)
