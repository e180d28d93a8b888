"""Tiny vision-language models and matching processors, built in memory with no download, fast on CPU.

    processor = make_vision_processor("qwen2_5_vl")  # the shipped tokenizer + the family's special tokens
    model = make_vision_model("qwen2_5_vl", processor)  # Qwen2_5_VLForConditionalGeneration, random weights
    rows = vision_preference_rows("qwen2_5_vl", 8)  # conversational pairs with noise images, for DPOTrainer

Each family is one `TinyFamily` record (tiny_vision.common: its tokens, processor and config builders, model fix-ups,
default attention and tags) in the module of its image layout, as the library's `ImageFamily.layout` names it:
tiny_vision.patches, .images, .sized, .tiles, .rows and .navit, each with its families' inputs, tokens, departures
from the checkpoints and stand-ins. A new family is one entry in its layout module's `TINY_FAMILIES`; this module
gathers them, and the groups tests select by (`VISION_FAMILIES`, `EAGER_FAMILIES`, `MOE_FAMILIES`...) from their
tags.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedModel, ProcessorMixin
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from . import images, navit, patches, rows, sized, tiles
from .common import TAGS, TinyFamily, chat_template, make_tokenizer
from .patches import TinyCosmos3EdgeProcessor, save_experts_in_hub_layout

__all__ = [
    "EAGER_FAMILIES",
    "FAMILIES",
    "FAMILIES_BEFORE_2026",
    "GOT_OCR2_FAMILIES",
    "IMAGE_SIZES",
    "MINICPM_FAMILIES",
    "MOE_FAMILIES",
    "VISION_FAMILIES",
    "TinyCosmos3EdgeProcessor",
    "TinyFamily",
    "default_attention",
    "make_image",
    "make_vision_config",
    "make_vision_model",
    "make_vision_processor",
    "make_vision_tokenizer",
    "make_vision_trainer",
    "save_experts_in_hub_layout",
    "save_vision_models",
    "vision_chat_template",
    "vision_preference_rows",
]


def _gather(*modules) -> dict[str, TinyFamily]:
    """Every layout module's families that the installed transformers builds (HY-V4-VL exists from transformers 5.24;
    the floors have 5.23), by layout."""
    families = {}
    for module in modules:
        if twice := families.keys() & module.TINY_FAMILIES.keys():
            raise ValueError(f"{module.__name__} defines {sorted(twice)} again")
        families |= {name: family for name, family in module.TINY_FAMILIES.items() if name in CONFIG_MAPPING_NAMES}
    return families


FAMILIES = _gather(patches, images, sized, tiles, rows, navit)


def _tagged(tag: str) -> tuple[str, ...]:
    assert tag in TAGS, tag
    return tuple(model_type for model_type, family in FAMILIES.items() if tag in family.tags)


# Exact on eager attention only (HY-V4-VL: its sparse indexer reads the attention mask): tests/integration/vision/test_vision.py trains
# them there, apart from the others
EAGER_FAMILIES = _tagged("eager_only")
VISION_FAMILIES = tuple(model_type for model_type in FAMILIES if model_type not in EAGER_FAMILIES)
FAMILIES_BEFORE_2026 = _tagged("before_2026")  # the families every test runs by default
MOE_FAMILIES = _tagged("router_loss")  # a router loss: prefix sharing refused with it (test_moe_aux_loss)
MINICPM_FAMILIES = _tagged("minicpm")  # a Qwen3.5 language model
GOT_OCR2_FAMILIES = _tagged("got_ocr2")  # PP-Chart2Table: GOT-OCR2's model under its own processor


def _family(model_type: str) -> TinyFamily:
    if model_type not in FAMILIES:
        raise ValueError(f"Unknown vision model type {model_type!r}; choose one of {tuple(FAMILIES)}.")
    return FAMILIES[model_type]


def vision_chat_template(model_type: str) -> str:
    """`User:<image> text</s>Assistant: text</s>`, with `<image>` the processor's placeholder for `model_type`."""
    return chat_template(_family(model_type))


def make_vision_tokenizer(model_type: str):
    """The shipped tokenizer (`trl_padfree.data.load_demo_tokenizer`) with `model_type`'s special tokens added."""
    return make_tokenizer(_family(model_type))


def make_vision_processor(model_type: str, chat_template: str | None = None, **options) -> ProcessorMixin:
    """A processor for `model_type` over the shipped tokenizer, with tiny images and a chat template.

    `options` go to the family's builder: `min_pixels` / `max_pixels` (Qwen), `image_size` and `image_seq_length`
    (Gemma 3), `image_size` and `patch_size` (LLaVA), `image_size`, `image_seq_len` and `do_image_splitting`
    (Idefics3, SmolVLM). `make_vision_model` reads the image geometry back from the processor.
    """
    family = _family(model_type)
    tokenizer = make_tokenizer(family)
    template = chat_template if chat_template is not None else vision_chat_template(model_type)
    return family.processor(model_type, tokenizer, template, **options)


def make_vision_config(model_type: str, processor: ProcessorMixin, **config_overrides):
    """The tiny config of `model_type`, consistent with `processor` (token ids, vocabulary, image geometry).

    `config_overrides` set top-level fields; `text_config=` and `vision_config=` dicts are merged into the sub-configs.
    """
    values = _family(model_type).config(model_type, processor)
    values["text_config"]["vocab_size"] = len(processor.tokenizer)
    for key in ("text_config", "vision_config", "audio_config"):
        if values.get(key) is not None:  # Gemma 4 sets no audio tower (audio_config None)
            values[key].update(config_overrides.pop(key, {}))
    return AutoConfig.for_model(model_type, **values, **config_overrides)


def make_vision_model(
    model_type: str,
    processor: ProcessorMixin,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny `<Family>ForConditionalGeneration` matching `processor`, the same weights for the
    same seed, on `attn_implementation` (default `default_attention(model_type)`); see `make_vision_config` for
    `config_overrides`. The family's `prepare_model` runs on it, after the seeded initialisation."""
    family = _family(model_type)
    attn_implementation = attn_implementation or family.attention
    config = make_vision_config(model_type, processor, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if family.prepare_model is not None:
        family.prepare_model(model)
    model.config.name_or_path = f"tiny-{model_type}"
    return model


def default_attention(model_type: str) -> str:
    """sdpa, but for the families whose models have none (HY-V4-VL; GOT-OCR2's, whose SAM tower runs its own
    attention): eager, as transformers picks for them."""
    return _family(model_type).attention


def save_vision_models(directory, families) -> None:
    """Each family's model in `<directory>/<family>`, with its processor where it saves and `AutoProcessor` loads it back
    as itself (not so without a video processor, or for a stand-in, whose folder AutoProcessor reads as a tokenizer):
    tests/support/distributed/train_dpo.py builds the others again."""
    from pathlib import Path

    from transformers import AutoProcessor

    directory = Path(directory)
    for model_type in families:
        family = _family(model_type)
        processor = make_vision_processor(model_type)
        model = make_vision_model(model_type, processor)
        model.save_pretrained(directory / model_type, save_original_format=family.save_original_format)
        _check_loads_back(model_type, directory / model_type)
        if family.after_save is not None:
            family.after_save(directory / model_type)
        scratch = directory / "processors" / model_type
        try:
            processor.save_pretrained(scratch)
        except AttributeError:  # no video processor here
            continue
        if type(AutoProcessor.from_pretrained(scratch)) is type(processor):
            processor.save_pretrained(directory / model_type)


def _check_loads_back(model_type: str, model_dir) -> None:
    """Refuse a saved model that does not load back whole: a weight missing from the checkpoint would be initialised
    anew at each load, and a run compared with another would train a different model."""
    loaded, info = AutoModelForImageTextToText.from_pretrained(model_dir, output_loading_info=True)
    wrong = {kind: keys for kind, keys in info.items() if kind in ("missing_keys", "unexpected_keys") and keys}
    del loaded
    assert not wrong, f"{model_type} saved in {model_dir} does not load back: {wrong}"


# --- Data ---------------------------------------------------------------------------------------------------------

# Sizes (height, width) that give Qwen 1 to 12 image tokens, and odd aspect ratios to the square-resizing families
IMAGE_SIZES = ((28, 28), (56, 84), (84, 56), (45, 61), (100, 30), (64, 64), (33, 97), (90, 90), (84, 112))
_WORDS = (
    "the a cat dog red blue small large house tree river sky what is this picture shows colour shape left right "
    "near far bright dark noise pixel square round many few one two three green yellow under over next to behind"
).split()


def make_image(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image of uniform random noise, the same for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def _sentence(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def vision_preference_rows(
    model_type: str,
    count: int,
    seed: int = 0,
    images_per_row: int | Sequence[int] = 1,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> list[dict]:
    """`count` conversational preference rows with images, as TRL's `DataCollatorForVisionPreference` takes them.

    Each row has `images` (noise from `make_image`, sizes drawn from `sizes`, default `IMAGE_SIZES`), a user `prompt`
    with one `{"type": "image"}` part per image before its text, and one-message assistant `chosen` / `rejected`.
    Text lengths vary: 1 to 12 prompt words, 1 to 16 completion words, one-word completions every few rows.
    `images_per_row` is a count, or counts cycled over the rows. The rows do not depend on `model_type` (it is only
    checked), so every family sees the same data for the same seed.
    """
    _family(model_type)  # an unknown family is refused
    rng = random.Random(seed)
    counts = [images_per_row] if isinstance(images_per_row, int) else list(images_per_row)
    sizes = list(sizes or IMAGE_SIZES)
    rows = []
    for index in range(count):
        images = [
            make_image(*rng.choice(sizes), seed=rng.randrange(2**31)) for _ in range(counts[index % len(counts)])
        ]
        chosen_words = 1 if index % 5 == 0 else rng.randint(1, 16)
        rejected_words = 1 if index % 7 == 3 else rng.randint(1, 16)
        prompt = [{"type": "image"} for _ in images] + [{"type": "text", "text": _sentence(rng, rng.randint(1, 12))}]
        rows.append(
            {
                "images": images,
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, chosen_words)}]}],
                "rejected": [
                    {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, rejected_words)}]}
                ],
            }
        )
    return rows


# --- Trainers -----------------------------------------------------------------------------------------------------


def make_vision_trainer(
    model_type: str,
    padding_free: bool,
    rows: list[dict] | None = None,
    ref_seed: int | None = 1,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    model_overrides: dict | None = None,
    eval_rows: list[dict] | None = None,
    **config_kwargs,
):
    """A `trl_padfree.DPOTrainer` on a tiny `model_type` model and `rows` (default: 8 of `vision_preference_rows`),
    fp32 on CPU unless `config_kwargs` say otherwise; the reference has other weights (`ref_seed`)."""
    from datasets import Dataset

    from trl_padfree import DPOConfig, DPOTrainer

    processor = make_vision_processor(model_type)
    rows = rows if rows is not None else vision_preference_rows(model_type, 8)
    options = dict(
        output_dir="/tmp/trl-padfree-tests",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        seed=0,
        report_to=[],
        save_strategy="no",  # the Qwen-VL and SmolVLM processors here cannot save
        bf16=False,
        use_cpu=True,
    )
    args = DPOConfig(padding_free=padding_free, **{**options, **config_kwargs})

    def model(seed):
        return make_vision_model(model_type, processor, seed, dtype, attn_implementation, **(model_overrides or {}))

    return DPOTrainer(
        model=model(0),
        ref_model=model(ref_seed) if ref_seed is not None else None,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows is not None else None,
        processing_class=processor,
    )
