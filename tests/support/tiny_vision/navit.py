"""The families whose processors NaViT-pack images (`layout="navit"`): an image and its slices, crops of any size, along
one axis of `pixel_values`, with each crop's grid in `target_sizes`.

MiniCPM-V: minicpmv4_6, minicpm_ocr, minicpmv4_7, each before a Qwen3.5 language model.

    family          image inputs                                          per-token key (1 on)
    minicpm*        pixel_values (1, 3, 14, L), target_sizes (crops, 2)   mm_token_type_ids, 4.7 only (image tokens)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    minicpm*        image_token_id      yes                          <image_id>k</image_id><image> n x <image_pad>
                                                                     </image>, then <slice>...</slice> per slice;
                                                                     n = patches / 16 (OCR: / 4) per crop

MiniCPM-V's processors here are subclasses without a video processor (tiny_vision.common), and MiniCPM-OCR's
torchvision-only image processor is stood in for by MiniCPM-V 4.6's PIL one in its 4x mode (the same crops; OCR's
upscaling of small images aside).
"""

from __future__ import annotations

from transformers import (
    MiniCPMOcrProcessor,
    MiniCPMV4_6ImageProcessorPil,
    MiniCPMV4_6Processor,
    MiniCPMV4_7Processor,
    ProcessorMixin,
)

from trl_padfree.cli.bench.vision import WithoutVideoProcessor

from .common import HEAD_DIM, MROPE_SECTION, TEXT, VISION, TinyFamily

# Special tokens, given ids after the shipped tokenizer's 2048
# MiniCPM-V's processors read these names off their tokenizer
MINICPM_TOKENS = {
    "image_token": "<image_pad>",
    "video_token": "<video_pad>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}

# --- Processors ---------------------------------------------------------------------------------------------------


class _MiniCPMWithoutVideoProcessor(WithoutVideoProcessor):
    """MiniCPM-V's processors without a video processor: their `__init__` reads its slice and downsample modes, which
    only video prompts use; this sets what it sets for images and text."""

    def __init__(self, image_processor=None, video_processor=None, tokenizer=None, chat_template=None, **kwargs):
        ProcessorMixin.__init__(
            self, image_processor, video_processor, tokenizer, chat_template=chat_template, **kwargs
        )
        self.slice_mode = image_processor.slice_mode
        self.default_use_image_id = image_processor.use_image_id
        self.image_token_divisor = 4 if image_processor.downsample_mode == "4x" else 16
        for name in MINICPM_TOKENS:
            setattr(self, name, getattr(tokenizer, name))
        self.image_token_id, self.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id


class TinyMiniCPMV4_6Processor(_MiniCPMWithoutVideoProcessor, MiniCPMV4_6Processor):
    """`MiniCPMV4_6Processor` without a video processor."""


class TinyMiniCPMOcrProcessor(_MiniCPMWithoutVideoProcessor, MiniCPMOcrProcessor):
    """`MiniCPMOcrProcessor` without a video processor."""


class TinyMiniCPMV4_7Processor(_MiniCPMWithoutVideoProcessor, MiniCPMV4_7Processor):
    """`MiniCPMV4_7Processor` without a video processor."""


_MINICPM_PROCESSORS = {
    "minicpmv4_6": TinyMiniCPMV4_6Processor,
    "minicpm_ocr": TinyMiniCPMOcrProcessor,
    "minicpmv4_7": TinyMiniCPMV4_7Processor,
}


def _minicpm_processor(model_type, tokenizer, template, scale_resolution=56, max_slice_nums=4):
    """Crops of `scale_resolution` pixels or so, in whole 14-pixel patches merged 4 x 4 (MiniCPM-OCR: 2 x 2) into
    tokens; an image larger than one crop also cut into up to `max_slice_nums` slices. MiniCPM-OCR's own image
    processor needs torchvision: MiniCPM-V 4.6's PIL one in its 4x mode stands in (the same crops, without OCR's
    upscaling of small images)."""
    image_processor = MiniCPMV4_6ImageProcessorPil(
        patch_size=14,
        scale_resolution=scale_resolution,
        max_slice_nums=max_slice_nums,
        downsample_mode="4x" if model_type == "minicpm_ocr" else "16x",
    )
    return _MINICPM_PROCESSORS[model_type](image_processor, None, tokenizer, chat_template=template)


# --- Configs ------------------------------------------------------------------------------------------------------


def _minicpm_config(model_type, processor):
    """MiniCPM-V 4.6 / 4.7, MiniCPM-OCR: a SigLIP-like tower over each crop, its window merger after layer 0 (16x),
    then the merger, into a Qwen3.5 language model (a gated delta-net layer, then a gated attention layer)."""
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    text = dict(
        TEXT, head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=MROPE_SECTION),
    )  # fmt: skip
    vision = dict(VISION, image_size=image_processor.scale_resolution, patch_size=image_processor.patch_size)
    values = dict(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        downsample_mode=image_processor.downsample_mode,
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
    )
    if model_type == "minicpmv4_7":  # canvas mRoPE pins the markers around each crop
        newline = tokenizer("\n", add_special_tokens=False).input_ids
        values |= dict(
            image_start_id=tokenizer.image_start_token_id, image_end_id=tokenizer.image_end_token_id,
            slice_start_id=tokenizer.slice_start_token_id, slice_end_id=tokenizer.slice_end_token_id,
            newline_id=newline[0],
        )  # fmt: skip
    return values


# --- The families -------------------------------------------------------------------------------------------------

_MINICPM = TinyFamily(
    tokens=tuple(MINICPM_TOKENS.values()),
    placeholder=MINICPM_TOKENS["image_token"],
    processor=_minicpm_processor,
    config=_minicpm_config,
    named_tokens=MINICPM_TOKENS,
    tags={"minicpm"},
)

TINY_FAMILIES = {
    "minicpmv4_6": _MINICPM,
    "minicpm_ocr": _MINICPM,
    "minicpmv4_7": _MINICPM,  # canvas mRoPE
}
