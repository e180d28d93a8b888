"""The families whose processors lay a sequence's images out in a row of their own (`layout="rows"`):
`pixel_values (sequences, images, ...)`, each sequence's images padded to the most in a sequence.

idefics2, idefics3, smolvlm.

    family          image inputs                                          per-token key (1 on)
    idefics3        pixel_values (4, N, 3, 32, 32), pixel_attention_mask  none
    smolvlm           (4, N, 32, 32), as Idefics3                         none

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    idefics3        image_token_id      yes                          <fake> <global-img> 4 x <image> <fake>
    smolvlm         image_token_id      yes                          as Idefics3 (12 or 20 <image> if split)

Idefics3 / SmolVLM pad N, the images per sequence, to the most in a row with all-zero images, which the model skips.

SmolVLM's processor here is a subclass without a video processor (tiny_vision.common) that also skips its `num2words`
requirement, which only video prompts need. The Idefics processors are the stock classes and save and reload.
"""

from __future__ import annotations

import math

from transformers import (
    Idefics2ImageProcessorPil,
    Idefics2Processor,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    ProcessorMixin,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)

from trl_padfree.cli.bench.vision import WithoutVideoProcessor

from .common import TEXT, VISION, TinyFamily

# Special tokens, given ids after the shipped tokenizer's 2048
IDEFICS_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    # Tile tags of split images: the processors write `<row_r_col_c>` for a grid of up to 6 x 6 tiles
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)

# --- Processors ---------------------------------------------------------------------------------------------------


class TinySmolVLMProcessor(WithoutVideoProcessor, SmolVLMProcessor):
    """`SmolVLMProcessor` without a video processor, nor `num2words` (absent here, and only video prompts use it)."""

    def __init__(self, image_processor, tokenizer, video_processor=None, image_seq_len=169, chat_template=None):
        # SmolVLMProcessor.__init__ raises ImportError without num2words: set what it sets, then skip it
        self.fake_image_token = "<fake_token_around_image>"
        self.image_token = "<image>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.end_of_utterance_token = "<end_of_utterance>"
        self.global_image_token = "<global-img>"
        self.image_seq_len = image_seq_len
        self.video_token = "<video>"
        ProcessorMixin.__init__(self, image_processor, tokenizer, video_processor, chat_template=chat_template)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLM's own reads the video processor's frame defaults
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


def _idefics_processor(model_type, tokenizer, template, image_size=32, image_seq_len=4, do_image_splitting=False):
    """Images resized to `image_size` squares, `image_seq_len` tokens each; split into tiles of `image_size` (up to
    2 x 2, plus the whole image) only with `do_image_splitting`."""
    if model_type == "idefics2":  # whole images resized to fit `image_size`, `image_seq_len` resampled tokens each
        image_processor = Idefics2ImageProcessorPil(
            size={"longest_edge": image_size, "shortest_edge": image_size}, do_image_splitting=do_image_splitting
        )
        return Idefics2Processor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)
    image_processor_class = Idefics3ImageProcessorPil if model_type == "idefics3" else SmolVLMImageProcessorPil
    image_processor = image_processor_class(
        size={"longest_edge": 2 * image_size if do_image_splitting else image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=do_image_splitting,
    )
    if model_type == "idefics3":
        return Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)
    return TinySmolVLMProcessor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)


# --- Configs ------------------------------------------------------------------------------------------------------


def _idefics2_config(model_type, processor):
    """Idefics2: patch features resampled by a perceiver to the processor's `image_seq_len` latent tokens."""
    image_size = processor.image_processor.size["longest_edge"]
    return dict(
        text_config=dict(TEXT),
        vision_config=dict(VISION, image_size=image_size, patch_size=image_size // 4),
        perceiver_config=dict(
            hidden_size=TEXT["hidden_size"], resampler_n_latents=processor.image_seq_len, resampler_depth=1,
            resampler_n_heads=2, resampler_head_dim=8, num_key_value_heads=1,
        ),
        image_token_id=processor.image_token_id,
    )  # fmt: skip


def _idefics_config(model_type, processor):
    """Idefics3 / SmolVLM: patch features pixel-shuffled by `scale_factor` 2 into the processor's `image_seq_len`."""
    image_size = processor.image_processor.max_image_size["longest_edge"]
    scale_factor = 2
    tokens_per_side = math.isqrt(processor.image_seq_len)
    patch_size = image_size // (tokens_per_side * scale_factor)
    if tokens_per_side**2 != processor.image_seq_len or patch_size * tokens_per_side * scale_factor != image_size:
        raise ValueError(f"image_seq_len {processor.image_seq_len} does not tile {image_size}-pixel images")
    return dict(
        text_config=dict(TEXT),
        vision_config=dict(VISION, image_size=image_size, patch_size=patch_size),
        image_token_id=processor.image_token_id,
        scale_factor=scale_factor,
    )


# --- The families -------------------------------------------------------------------------------------------------

_IDEFICS = TinyFamily(
    tokens=IDEFICS_TOKENS,
    placeholder="<image>",
    processor=_idefics_processor,
    config=_idefics_config,
    tags={"before_2026"},
)

TINY_FAMILIES = {
    "idefics2": TinyFamily(
        tokens=IDEFICS_TOKENS,
        placeholder="<image>",
        processor=_idefics_processor,
        config=_idefics2_config,
        tags={"before_2026"},
    ),
    "idefics3": _IDEFICS,
    "smolvlm": _IDEFICS,
}
