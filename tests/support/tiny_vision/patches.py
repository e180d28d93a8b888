"""The families whose processors lay images out as patches (`layout="patches"`): each image's patches, flattened, in
`pixel_values (P, ...)`, with its grid in `image_grid_thw (images, 3)`.

Qwen-VL (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe) and its kin under other model types:
cosmos3_omni (Qwen3-VL), qwen2_5_omni_thinker and qwen3_omni_moe_thinker (Qwen2.5-VL's and Qwen3-VL-MoE's towers and
language models beside an audio tower, frozen: image pairs never run it), hyperclovax_vision_v2, lfm3_vl, exaone4_5;
GLM-4V (glm4v, glm4v_moe, glm46v, glm_ocr: GLM-4V's layout and GLM-4.6V's processor, glmga: GLM-4.6V's class and
processor); paddleocr_vl, kimi_k25 (DeepSeek-V3's language model), cosmos3_edge, video_llama_3 (each image's merge
an input of its own), llava_onevision1_5 (EXAONE 4.5's processor), ovis2_5 (a start and an end token around each
image); and hy_v4_vl (a newline token after each merged row of an image), exact on eager attention only.

    family          image inputs                                          per-token key (1 on)
    qwen2_vl        pixel_values (P, 1176), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    qwen2_5_vl      pixel_values (P, 1176), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    qwen3_vl(_moe)  pixel_values (P, 1536), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    cosmos3_omni    as Qwen3-VL (its processor)                           mm_token_type_ids (<|image_pad|>)
    hyperclovax_vision_v2  pixel_values (P, 1176), image_grid_thw (4, 3)  none (plain 1-D positions)
    lfm3_vl         pixel_values (P, 1536), image_grid_thw (4, 3)         none (plain 1-D positions)
    paddleocr_vl    pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    mm_token_type_ids (<|IMAGE_PLACEHOLDER|>)
    kimi_k25        pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    none (plain positions)
    cosmos3_edge    pixel_values (P, 768), image_grid_thw (4, 3)          mm_token_type_ids (<|image_pad|>)
    exaone4_5       pixel_values (P, 1176), image_grid_thw (4, 3)         none (plain positions)
    video_llama_3   pixel_values (P, 588), image_grid_thw (4, 3),         none (plain positions)
                      image_merge_sizes (4,)
    llava_onevision1_5  pixel_values (P, 588), image_grid_thw (4, 3)      none (plain positions)
    ovis2_5         pixel_values (P, 768), image_grid_thw (4, 3)          none (plain positions)
    qwen2_5_omni_thinker  as qwen2_5_vl                                   none (images found by <|vision_start|>)
    qwen3_omni_moe_thinker  as qwen3_vl                                   none (as Qwen2.5-Omni's)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    qwen*           image_token_id      yes                          1-12 <|image_pad|> in <|vision_start|> ... end
    paddleocr_vl    image_token_id      yes                          1-12 <|IMAGE_PLACEHOLDER|> in <|IMAGE_START|> ... END
    kimi_k25        image_token_id      yes                          1-16 <|media_pad|> in <|media_begin|>image...end
    ovis2_5         image_token_id      yes                          1-12 <|image_pad|> in <ovis_image_start> ... end

Qwen's P counts 4 patches per image token, each image twice (TRL processes the images for the chosen and again for
the rejected).

Departures from the real checkpoints, so that every parameter trains: LFM3-VL's language model has 3 layers (a short
convolution, a sliding-window and a full attention layer), its tower 2 (a convolution, then attention), so that each
kind of layer runs.

The Qwen-VL (Cosmos3-Omni's and Qwen-Omni's too), HyperCLOVAX-Vision-V2, LFM3-VL, GLM-4V, Kimi K2.5, Cosmos3 Edge,
EXAONE 4.5 (LLaVA-OneVision-1.5's too), Ovis2.5 and HY-V4-VL processors here are subclasses without a video
processor (tiny_vision.common). Kimi K2.5's image processor has only a torchvision backend:
`StandInKimiK25ImageProcessor` makes its patches with PIL. PaddleOCR-VL's processor is the stock class.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from transformers import (
    Cosmos3EdgeImageProcessorPil,
    Cosmos3EdgeProcessor,
    Exaone4_5_Processor,
    Glm4vImageProcessorPil,
    Glm4vProcessor,
    Glm46VImageProcessorPil,
    Glm46VProcessor,
    GlmgaImageProcessorPil,
    HyperCLOVAXVisionV2Processor,
    Kimi_K25Processor,
    Lfm3VlProcessor,
    PaddleOCRVLImageProcessorPil,
    PaddleOCRVLProcessor,
    Qwen2_5_VLProcessor,
    Qwen2_5OmniProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3OmniMoeProcessor,
    Qwen3VLProcessor,
    VideoLlama3ImageProcessorPil,
    VideoLlama3Processor,
    WhisperFeatureExtractor,
)
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs

from trl_padfree.cli.bench.vision import QWEN_VL_TOKENS, WithoutVideoProcessor

from .common import HEAD_DIM, MROPE_SECTION, SLIDING_WINDOW, TEXT, VISION, TinyFamily, freeze_post_layernorm

# Special tokens, given ids after the shipped tokenizer's 2048
QWEN_TOKENS = QWEN_VL_TOKENS
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# The Qwen-Omni processors read these names off their tokenizer (Qwen3-Omni's tokens; Qwen2.5-Omni's checkpoints
# spell them <|vision_bos|>, <|IMAGE|>, ...): Qwen-VL's four first, which _qwen_config reads
OMNI_TOKENS = {
    "vision_bos_token": QWEN_TOKENS[0],
    "vision_eos_token": QWEN_TOKENS[1],
    "image_token": QWEN_TOKENS[2],
    "video_token": QWEN_TOKENS[3],
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
}
# GLM-4V's processor also looks its video tokens up
GLM_TOKENS = (
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
)
# PaddleOCR-VL's image span; its processor reads the placeholder's name off its tokenizer
PADDLEOCR_TOKENS = {
    "image_start": "<|IMAGE_START|>",
    "image_token": "<|IMAGE_PLACEHOLDER|>",
    "image_end": "<|IMAGE_END|>",
}
# Kimi K2.5's image span (the word `image` between its begin and content tokens); its processor also looks its video
# placeholder up
KIMI_TOKENS = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)

# --- Processors ---------------------------------------------------------------------------------------------------


class TinyQwen2VLProcessor(WithoutVideoProcessor, Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor."""


class TinyQwen2_5_VLProcessor(WithoutVideoProcessor, Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without a video processor."""


class TinyQwen3VLProcessor(WithoutVideoProcessor, Qwen3VLProcessor):
    """`Qwen3VLProcessor` without a video processor."""


_QWEN_PROCESSORS = {
    "qwen2_vl": TinyQwen2VLProcessor,
    "qwen2_5_vl": TinyQwen2_5_VLProcessor,
    "qwen3_vl": TinyQwen3VLProcessor,
    "qwen3_vl_moe": TinyQwen3VLProcessor,
    "qwen3_5": TinyQwen3VLProcessor,  # Qwen3.5's checkpoints ship Qwen3-VL's processor
    "qwen3_5_moe": TinyQwen3VLProcessor,
}


def _qwen_processor(model_type, tokenizer, template, min_pixels=None, max_pixels=None):
    """Images resized to 1 to 12 merged patches (image tokens) unless `min_pixels` / `max_pixels` say otherwise."""
    patch_size = 16 if model_type.startswith("qwen3") else 14  # Qwen3-VL's tower uses 16-pixel patches
    token_pixels = (2 * patch_size) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=min_pixels or token_pixels,
        max_pixels=max_pixels or 12 * token_pixels,
    )
    processor_class = _QWEN_PROCESSORS[model_type]
    return processor_class(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyQwen2_5OmniProcessor(WithoutVideoProcessor, Qwen2_5OmniProcessor):
    """`Qwen2_5OmniProcessor` without a video processor."""


class TinyQwen3OmniMoeProcessor(WithoutVideoProcessor, Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` without a video processor."""


def _omni_processor(model_type, tokenizer, template):
    """Qwen2.5-VL's image processor (Qwen3-VL's 16-pixel patches for Qwen3-Omni), images resized to 1 to 12 merged
    patches, and Whisper's feature extractor (the checkpoints' own), which image pairs never call."""
    patch_size = 16 if model_type == "qwen3_omni_moe_thinker" else 14
    token_pixels = (2 * patch_size) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2, min_pixels=token_pixels,
        max_pixels=12 * token_pixels,
    )  # fmt: skip
    processor_class = TinyQwen3OmniMoeProcessor if model_type == "qwen3_omni_moe_thinker" else TinyQwen2_5OmniProcessor
    return processor_class(image_processor, None, WhisperFeatureExtractor(), tokenizer, chat_template=template)


def _cosmos3_processor(model_type, tokenizer, template, **options):
    """Cosmos3-Omni's checkpoints ship Qwen3-VL's processor."""
    return _qwen_processor("qwen3_vl", tokenizer, template, **options)


class TinyHyperCLOVAXVisionV2Processor(WithoutVideoProcessor, HyperCLOVAXVisionV2Processor):
    """`HyperCLOVAXVisionV2Processor` without a video processor."""


class TinyLfm3VlProcessor(WithoutVideoProcessor, Lfm3VlProcessor):
    """`Lfm3VlProcessor` without a video processor."""


def _plain_position_processor(model_type, tokenizer, template):
    """HyperCLOVAX-Vision-V2 (Qwen2.5-VL's 14-pixel patches) and LFM3-VL (16-pixel ones): Qwen-VL's image processor,
    images resized to 1 to 12 merged patches (image tokens), `<|image_pad|>` repeated per merged patch."""
    patch_size = 16 if model_type == "lfm3_vl" else 14
    token_pixels = (2 * patch_size) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=token_pixels,
        max_pixels=12 * token_pixels,
    )
    processor_class = TinyLfm3VlProcessor if model_type == "lfm3_vl" else TinyHyperCLOVAXVisionV2Processor
    return processor_class(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyGlm4vProcessor(WithoutVideoProcessor, Glm4vProcessor):
    """`Glm4vProcessor` without a video processor."""


class TinyGlm46VProcessor(WithoutVideoProcessor, Glm46VProcessor):
    """`Glm46VProcessor` without a video processor."""


def _glm4v_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens), as `_qwen_processor`'s: GLM-4V lays its images out
    as Qwen2-VL does."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches of 14 pixels, merged
    # GLM-OCR's checkpoint ships GLM-4.6V's processor
    image_processor_class = Glm46VImageProcessorPil if model_type in ("glm46v", "glm_ocr") else Glm4vImageProcessorPil
    image_processor = image_processor_class(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )
    processor_class = (
        TinyGlm46VProcessor if model_type in ("glm46v", "glm_ocr") else TinyGlm4vProcessor
    )  # GLM-4V-MoE ships GLM-4V's
    return processor_class(image_processor, tokenizer, video_processor=None, chat_template=template)


def _glmga_processor(model_type, tokenizer, template):
    """GLM-4.6V's processor over GLMGA's image processor (GLM-4.6V's, its sides also multiples of
    `patch_expand_factor`, 1 by default): images resized to 1 to 12 merged patches, as `_glm4v_processor`'s."""
    token_pixels = (2 * 14) ** 2
    image_processor = GlmgaImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )  # fmt: skip
    return TinyGlm46VProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _paddleocr_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens) of 14-pixel patches, each patch (3, 14, 14)."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = PaddleOCRVLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=1, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return PaddleOCRVLProcessor(image_processor, tokenizer, chat_template=template)


class StandInKimiK25ImageProcessorKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


class StandInKimiK25ImageProcessor(PilBackend):
    """What `Kimi_K25ImageProcessor` makes, where it cannot be imported: it has only a torchvision backend, absent
    here. The same steps (transformers 5.24's image_processing_kimi_k25.py): each image shrunk, never enlarged, to at
    most `max_patches` patches and `size["max_height"]` patches a side, padded with zeros at its bottom and right to
    whole merged patches, rescaled and normalised; `pixel_values` every image's patches, each `(3, patch, patch)`, row
    by row, and `image_grid_thw` `(1, rows, columns)` in patches."""

    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    patch_size = 14
    merge_size = 2
    do_resize = do_rescale = do_normalize = do_convert_rgb = True
    image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    valid_kwargs = StandInKimiK25ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _preprocess(self, images, do_resize, size, resample, do_rescale, rescale_factor, do_normalize, image_mean,
                    image_std, patch_size, merge_size, max_patches, return_tensors, **kwargs):  # fmt: skip
        patches, grids = [], []
        for image in images:
            if do_resize:
                shrunk, padded = _kimi_sizes(*image.shape[-2:], patch_size, merge_size, max_patches, size.max_height)
                image = self.resize(image, SizeDict(height=shrunk[0], width=shrunk[1]), resample=resample)
                image = self.pad([image], pad_size=SizeDict(height=padded[0], width=padded[1]))[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels, height, width = image.shape
            rows, columns = height // patch_size, width // patch_size
            grid = image.reshape(channels, rows, patch_size, columns, patch_size).transpose(1, 3, 0, 2, 4)
            patches.append(grid.reshape(rows * columns, channels, patch_size, patch_size))
            grids.append([1, rows, columns])
        data = {"pixel_values": np.concatenate(patches), "image_grid_thw": np.array(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)


def _kimi_sizes(height, width, patch_size, merge_size, max_patches, max_patches_per_side):
    """Kimi K2.5's `navit_resize`: the shrunk size of an image, and that size padded to whole merged patches."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    side = max_patches_per_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    shrunk = [min(max(1, int(length * scale)), side) for length in (height, width)]
    factor = merge_size * patch_size
    return shrunk, [length + (factor - length % factor) % factor for length in shrunk]


class TinyKimiK25Processor(WithoutVideoProcessor, Kimi_K25Processor):
    """`Kimi_K25Processor` without a video processor."""


def _kimi_processor(model_type, tokenizer, template, max_patches=48):
    """Images shrunk to at most `max_patches` patches of 14 pixels (12 merged 2 x 2), padded to whole merged patches:
    up to 16 image tokens; the stand-in image processor (`StandInKimiK25ImageProcessor`) without torchvision."""
    image_processor = StandInKimiK25ImageProcessor(
        patch_size=14, merge_size=2, max_patches=max_patches, size={"max_height": 12, "max_width": 12}
    )
    return TinyKimiK25Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyCosmos3EdgeProcessor(WithoutVideoProcessor, Cosmos3EdgeProcessor):
    """`Cosmos3EdgeProcessor` without a video processor, returning `mm_token_type_ids`: transformers 5.24's leaves them
    off (its model then raises on images), so a user sets `processor.return_mm_token_type_ids = True`."""

    return_mm_token_type_ids = True


def _cosmos3_edge_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens) of 16-pixel patches, one frame each."""
    token_pixels = (2 * 16) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = Cosmos3EdgeImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=1,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )  # fmt: skip
    return TinyCosmos3EdgeProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyExaone4_5_Processor(WithoutVideoProcessor, Exaone4_5_Processor):
    """`Exaone4_5_Processor` without a video processor."""


def _exaone4_5_processor(model_type, tokenizer, template):
    """Qwen2-VL's image processor (EXAONE 4.5's checkpoints ship it): images resized to 1 to 12 merged patches."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches of 14 pixels, merged
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyExaone4_5_Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _hy_v4_vl_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches of 16-pixel patches, one frame each; a newline token after each row
    of merged patches: up to 18 image tokens. (HY-V4-VL is new in transformers 5.24: imported here, not at the top,
    so that the floors' 5.23 imports this file.)"""
    from transformers import HYV4VLImageProcessorPil, HYV4VLProcessor

    class TinyHYV4VLProcessor(WithoutVideoProcessor, HYV4VLProcessor):
        """`HYV4VLProcessor` without a video processor."""

    token_pixels = (2 * 16) ** 2
    image_processor = HYV4VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=1, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyHYV4VLProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


# --- Configs ------------------------------------------------------------------------------------------------------


def _patch_model(image_processor) -> tuple[dict, dict]:
    """The text and vision configs of a Qwen2-VL-like model: multimodal RoPE over 3 sections, and a tower over the
    processor's patches, merged 2 x 2."""
    text = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=MROPE_SECTION))
    vision = dict(
        depth=VISION["num_hidden_layers"],
        num_heads=VISION["num_attention_heads"],
        patch_size=image_processor.patch_size,
        spatial_merge_size=image_processor.merge_size,
        temporal_patch_size=image_processor.temporal_patch_size,
    )
    return text, vision


def _qwen_config(model_type, processor):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (MoE), Qwen3.5 (MoE)."""
    image_processor = processor.image_processor
    tokenizer = processor.tokenizer
    text, vision = _patch_model(image_processor)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=VISION["hidden_size"], hidden_size=TEXT["hidden_size"], mlp_ratio=2)
    else:
        vision.update(
            hidden_size=VISION["hidden_size"],
            intermediate_size=VISION["intermediate_size"],
            out_hidden_size=TEXT["hidden_size"],
        )
    if model_type == "qwen2_5_vl":
        # Windows of 2 x 2 merged patches in block 0, full attention in block 1
        vision.update(
            window_size=2 * image_processor.merge_size * image_processor.patch_size, fullatt_block_indexes=[1]
        )
    if model_type.startswith("qwen3"):
        text.update(head_dim=HEAD_DIM)
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])  # a 4 x 4 grid of learned positions
    if model_type == "qwen3_vl_moe":
        # experts narrower than the model: a checkpoint in the hub's layout is transposed on load (save_vision_models)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
    if model_type == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if model_type.startswith("qwen3_5"):  # a gated delta-net layer, then a gated attention layer
        text.update(
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
        image_token_id=image_id,
        video_token_id=video_id,
    )


def _omni_config(model_type, processor):
    """Qwen2.5-Omni's thinker (Qwen2.5-VL's tower and language model) and Qwen3-Omni's (Qwen3-VL-MoE's), and an audio
    tower as narrow as the rest, which image pairs never run (`_freeze_audio_tower`)."""
    values = _qwen_config("qwen3_vl_moe" if model_type == "qwen3_omni_moe_thinker" else "qwen2_5_vl", processor)
    audio_start, audio_end, audio = processor.tokenizer.convert_tokens_to_ids(list(OMNI_TOKENS.values())[4:])
    audio_config = dict(d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, encoder_layers=1, output_dim=32)
    if model_type == "qwen3_omni_moe_thinker":
        audio_config["downsample_hidden_size"] = 8
    return dict(
        values, audio_config=audio_config, audio_token_id=audio, audio_start_token_id=audio_start,
        audio_end_token_id=audio_end,
    )  # fmt: skip


def _cosmos3_config(model_type, processor):
    """Cosmos3-Omni: Qwen3-VL's model and config under its own model type."""
    return _qwen_config("qwen3_vl", processor)


def _plain_position_config(model_type, processor):
    """HyperCLOVAX-Vision-V2 (Qwen2.5-VL's tower, a linear projector, HyperCLOVAX) and LFM3-VL (a Qwen3-VL-like
    tower of short convolutions and attention, an MLP projector, LFM3's convolutions, sliding and full attention):
    the language model on plain positions."""
    image_processor = processor.image_processor
    _, vision = _patch_model(image_processor)
    text = dict(TEXT, model_type="hyperclovax")
    vision.update(
        hidden_size=VISION["hidden_size"],
        intermediate_size=VISION["intermediate_size"],
        out_hidden_size=VISION["hidden_size"],
        window_size=2 * image_processor.merge_size * image_processor.patch_size,
        fullatt_block_indexes=[1],
    )
    values = {}
    if model_type == "lfm3_vl":
        text = dict(
            TEXT, model_type="lfm3", num_hidden_layers=3, head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW,
            layer_types=["conv", "sliding_attention", "full_attention"],
        )  # fmt: skip
        vision = dict(
            VISION, num_key_value_heads=1, patch_size=image_processor.patch_size,
            spatial_merge_size=image_processor.merge_size, temporal_patch_size=image_processor.temporal_patch_size,
            layer_types=["conv", "full_attention"],
        )  # fmt: skip
        start_id, end_id = processor.tokenizer.convert_tokens_to_ids(QWEN_TOKENS[:2])
        values = dict(projector_hidden_size=TEXT["intermediate_size"], vision_start_token_id=start_id,
                      vision_end_token_id=end_id)  # fmt: skip
    return dict(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        **values,
    )


def _glm4v_config(model_type, processor):
    """GLM-4V, GLM-4.5V (MoE) and GLM-4.6V: Qwen2-VL-like (`_patch_model`), a 2 x 2 grid of learned positions."""
    tokenizer = processor.tokenizer
    text, vision = _patch_model(processor.image_processor)
    vision.update(
        hidden_size=VISION["hidden_size"],
        intermediate_size=VISION["intermediate_size"],
        out_hidden_size=TEXT["hidden_size"],
        image_size=28,
    )
    if model_type == "glm4v_moe":  # a dense first layer, then 4 routed experts and a shared one
        # Rotary on half of each head (the checkpoints' partial_rotary_factor): heads twice as wide keep 3 sections
        text["rope_parameters"]["partial_rotary_factor"] = 0.5
        text.update(
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, head_dim=2 * HEAD_DIM,
        )  # fmt: skip
    ids = dict(zip(GLM_TOKENS, tokenizer.convert_tokens_to_ids(list(GLM_TOKENS)), strict=True))
    return dict(
        text_config=text,
        vision_config=vision,
        image_start_token_id=ids["<|begin_of_image|>"],
        image_token_id=ids["<|image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_token_id=ids["<|video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )


def _paddleocr_config(model_type, processor):
    """PaddleOCR-VL: a SigLIP-like tower over the processor's patches (learned positions resampled to each image's
    grid), merged 2 x 2 by its projector; ERNIE-4.5's language model with 3-section mRoPE."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        TEXT, head_dim=HEAD_DIM,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        VISION, patch_size=image_processor.patch_size, spatial_merge_size=image_processor.merge_size, image_size=56
    )
    start_id, image_id, end_id = tokenizer.convert_tokens_to_ids(list(PADDLEOCR_TOKENS.values()))
    return dict(
        text_config=text,
        vision_config=vision,
        image_token_id=image_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )


def _kimi_config(model_type, processor):
    """Kimi K2.5: MoonViT over the processor's patches (learned positions resampled to each image's grid, 2-D rotary),
    merged 2 x 2 by its projector; DeepSeek-V3's language model (latent attention, a dense first layer, then 4 routed
    experts and a shared one), plain text positions."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        TEXT, model_type="deepseek_v3", num_key_value_heads=TEXT["num_attention_heads"], kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1,
    )  # fmt: skip
    vision = dict(
        VISION, patch_size=image_processor.patch_size, merge_kernel_size=[image_processor.merge_size] * 2,
        pos_emb_height=8, pos_emb_width=8,
    )  # fmt: skip
    begin_id, _, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(KIMI_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=VISION["hidden_size"],  # the projector's norm, over the tower's features
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=begin_id,
        vision_end_token_id=end_id,
    )


def _cosmos3_edge_config(model_type, processor):
    """Cosmos3 Edge: a SigLIP-like tower over the processor's patches (a 4 x 4 grid of learned positions resampled to
    each image's), merged 2 x 2 by its projector; a language model with 3-section mRoPE."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        TEXT, head_dim=HEAD_DIM,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        VISION, patch_size=image_processor.patch_size, spatial_merge_size=image_processor.merge_size, num_patches=16
    )
    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        projector_hidden_size=64,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )


def _exaone4_5_config(model_type, processor):
    """EXAONE 4.5: Qwen2.5-VL's tower (windows of 2 x 2 merged patches in block 0, full attention in block 1, grouped
    key-value heads) over the processor's patches; EXAONE 4's language model (a sliding-window layer, then a full one),
    plain text positions."""
    image_processor = processor.image_processor
    _, vision = _patch_model(image_processor)
    vision.update(
        hidden_size=VISION["hidden_size"], intermediate_size=VISION["intermediate_size"], num_key_value_heads=1,
        out_hidden_size=TEXT["hidden_size"], window_size=2 * image_processor.merge_size * image_processor.patch_size,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    _, _, image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=dict(
            TEXT,
            model_type="exaone4",
            head_dim=HEAD_DIM,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
    )


def _hy_v4_vl_config(model_type, processor):
    """HY-V4-VL: its tower over the processor's patches, merged 2 x 2, a learned newline after each merged row; HY-V4's
    language model (latent attention with a sparse indexer of top-16 keys, hyper-connections, a dense layer then 4
    routed experts and a shared one), 3-section mRoPE over the latent attention's rope part."""
    image_processor = processor.image_processor
    text = dict(
        TEXT, num_key_value_heads=TEXT["num_attention_heads"], moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=2 * sum(MROPE_SECTION), v_head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=8,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        VISION, out_hidden_size=TEXT["hidden_size"], patch_size=image_processor.patch_size,
        spatial_merge_size=image_processor.merge_size,
    )  # fmt: skip
    _, _, image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(text_config=text, vision_config=vision, image_token_id=image_id, video_token_id=video_id)


class TinyVideoLlama3Processor(WithoutVideoProcessor, VideoLlama3Processor):
    """`VideoLlama3Processor` without a video processor."""


def _video_llama_3_processor(model_type, tokenizer, template, merge_size=2):
    """VideoLLaMA3's PIL image processor: 14-pixel patches, images resized to 1 to 12 tokens of `merge_size` x
    `merge_size` patches (its checkpoints merge images 1 x 1, videos 2 x 2; 2 here, so the tower's per-image
    downsampling runs), each image's merge in `image_merge_sizes`."""
    token_pixels = (merge_size * 14) ** 2
    image_processor = VideoLlama3ImageProcessorPil(
        patch_size=14, merge_size=merge_size, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyVideoLlama3Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _video_llama_3_config(model_type, processor):
    """VideoLLaMA3: a SigLIP-like tower over the processor's flattened patches (2-D rotary, attention per image), each
    image merged by its `image_merge_sizes`, a 2-layer MLP projector; Qwen2's language model on plain positions."""
    image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS[2:]))
    return dict(
        text_config=dict(TEXT, model_type="qwen2"),
        vision_config=dict(VISION, patch_size=processor.image_processor.patch_size),
        image_token_id=image_id,
        video_token_id=video_id,
    )


def _llava_onevision1_5_processor(model_type, tokenizer, template):
    """LLaVA-OneVision-1.5's checkpoints ship EXAONE 4.5's processor over Qwen2-VL's image processor, one frame a patch
    (its tower embeds each 14-pixel patch by a 2-D convolution): images resized to 1 to 12 merged patches. (New in
    transformers 5.25, as Ovis2.5 below: the floors' 5.23 gathers neither.)"""
    token_pixels = (2 * 14) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=1, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyExaone4_5_Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _llava_onevision1_5_config(model_type, processor):
    """LLaVA-OneVision-1.5: a RICE-ViT tower over the processor's patches (a class token prepended to each image,
    2-D rotary, attention per image), merged 2 x 2; Qwen3's language model on plain positions."""
    image_processor = processor.image_processor
    _, _, image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    vision = dict(
        depth=VISION["num_hidden_layers"], num_heads=VISION["num_attention_heads"], hidden_size=VISION["hidden_size"],
        intermediate_size=VISION["intermediate_size"], patch_size=image_processor.patch_size,
        spatial_merge_size=image_processor.merge_size, out_hidden_size=TEXT["hidden_size"],
    )  # fmt: skip
    return dict(
        text_config=dict(TEXT, model_type="qwen3", head_dim=HEAD_DIM),
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
    )


# Ovis2.5's processor reads its tokens by name off the tokenizer: an image's tokens between a start and an end token,
# which its model replaces by learned embeddings (names of our own; its checkpoints add them after Qwen3's tokens)
OVIS_TOKENS = {
    "image_start_token": "<ovis_image_start>",
    "image_token": QWEN_TOKENS[2],
    "image_end_token": "<ovis_image_end>",
    "video_start_token": "<ovis_video_start>",
    "video_token": QWEN_TOKENS[3],
    "video_end_token": "<ovis_video_end>",
}


def _ovis2_5_processor(model_type, tokenizer, template):
    """Ovis2.5's PIL image processor: 16-pixel patches, one frame each, images resized to 1 to 12 merged patches."""
    from transformers import Ovis2_5ImageProcessorPil, Ovis2_5Processor

    class TinyOvis2_5Processor(WithoutVideoProcessor, Ovis2_5Processor):
        """`Ovis2_5Processor` without a video processor."""

    token_pixels = (2 * 16) ** 2
    image_processor = Ovis2_5ImageProcessorPil(
        patch_size=16, merge_size=2, size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels}
    )
    return TinyOvis2_5Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _ovis2_5_config(model_type, processor):
    """Ovis2.5: a SigLIP-like tower over the processor's patches (learned positions resampled to each image's grid,
    2-D rotary, windows of 2 x 2 merged patches in layer 0, the whole image in layer 1), a visual tokenizer (a softmax
    over 16 visual words, 4 of them the start and end indicators) and its embedding table; Qwen3's language model on
    plain positions."""
    image_processor = processor.image_processor
    tokens = processor.tokenizer.convert_tokens_to_ids(list(OVIS_TOKENS.values()))
    image_start, image_id, image_end, video_start, video_id, video_end = tokens
    window = 2 * image_processor.merge_size * image_processor.patch_size
    vision = dict(
        VISION, patch_size=image_processor.patch_size, spatial_merge_size=image_processor.merge_size,
        image_size=2 * window, window_size=window, layer_types=["window_attention", "full_attention"], vocab_size=16,
    )  # fmt: skip
    return dict(
        text_config=dict(TEXT, model_type="qwen3", head_dim=HEAD_DIM),
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
        image_start_token_id=image_start,
        image_end_token_id=image_end,
        video_start_token_id=video_start,
        video_end_token_id=video_end,
    )


# --- Model fix-ups ------------------------------------------------------------------------------------------------


def _freeze_audio_tower(model) -> None:
    """Qwen-Omni's thinkers: their audio tower, which image pairs never run."""
    model.model.audio_tower.requires_grad_(False)


def save_experts_in_hub_layout(model_dir) -> None:
    """Rewrite a saved Qwen3-VL-MoE's expert weights as the hub's checkpoints hold them, (experts, in, out), which
    transformers transposes on load. Saved in its own layout, the checkpoint loads under DeepSpeed ZeRO-3's zero.Init
    with a size error (transformers 5.23-5.24 compares the partitioned parameter's empty shape, so it always transposes;
    docs/guides/long-sequences.md), as a user's own saved Qwen3-VL-MoE would."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


# --- The families -------------------------------------------------------------------------------------------------

_QWEN = TinyFamily(
    tokens=QWEN_TOKENS,
    placeholder=QWEN_PLACEHOLDER,
    processor=_qwen_processor,
    config=_qwen_config,
    tags={"before_2026"},
)
_OMNI = TinyFamily(
    tokens=tuple(OMNI_TOKENS.values()),
    placeholder=QWEN_PLACEHOLDER,
    processor=_omni_processor,
    config=_omni_config,
    named_tokens=OMNI_TOKENS,
    prepare_model=_freeze_audio_tower,
)
_GLM = TinyFamily(
    tokens=GLM_TOKENS,
    placeholder="<|begin_of_image|><|image|><|end_of_image|>",
    processor=_glm4v_processor,
    config=_glm4v_config,
    tags={"before_2026"},
)
# Qwen-VL's image layout and tokens before a language model on plain 1-D positions (no get_rope_index)
_PLAIN_POSITIONS = TinyFamily(
    tokens=QWEN_TOKENS,
    placeholder=QWEN_PLACEHOLDER,
    processor=_plain_position_processor,
    config=_plain_position_config,
)

TINY_FAMILIES = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    # experts narrower than the model: saved in the hub's layout, which transformers transposes on load
    "qwen3_vl_moe": replace(_QWEN, tags={"before_2026", "router_loss"}, after_save=save_experts_in_hub_layout),
    "qwen3_5": _QWEN,
    "qwen3_5_moe": replace(_QWEN, tags={"before_2026", "router_loss"}),
    "cosmos3_omni": replace(_QWEN, processor=_cosmos3_processor, config=_cosmos3_config, tags=()),
    "qwen2_5_omni_thinker": _OMNI,
    "qwen3_omni_moe_thinker": replace(_OMNI, tags={"router_loss"}),
    "glm4v": _GLM,
    "glm4v_moe": replace(_GLM, tags={"before_2026", "router_loss"}),
    "glm46v": _GLM,
    "glm_ocr": replace(_GLM, tags=()),
    "glmga": replace(_GLM, processor=_glmga_processor, tags=()),  # GLM-4.6V's class and processor
    "paddleocr_vl": TinyFamily(
        tokens=tuple(PADDLEOCR_TOKENS.values()),
        placeholder="".join(PADDLEOCR_TOKENS.values()),
        processor=_paddleocr_processor,
        config=_paddleocr_config,
        named_tokens={"image_token": PADDLEOCR_TOKENS["image_token"]},
    ),
    "hyperclovax_vision_v2": _PLAIN_POSITIONS,
    "lfm3_vl": _PLAIN_POSITIONS,
    "kimi_k25": TinyFamily(
        tokens=KIMI_TOKENS,
        placeholder="<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
        processor=_kimi_processor,
        config=_kimi_config,
    ),
    "cosmos3_edge": TinyFamily(
        tokens=QWEN_TOKENS,
        placeholder=QWEN_PLACEHOLDER,
        processor=_cosmos3_edge_processor,
        config=_cosmos3_edge_config,
    ),
    "exaone4_5": TinyFamily(
        tokens=QWEN_TOKENS,
        placeholder=QWEN_PLACEHOLDER,
        processor=_exaone4_5_processor,
        config=_exaone4_5_config,
    ),
    "video_llama_3": TinyFamily(
        tokens=QWEN_TOKENS,  # Qwen2.5's tokenizer; its processor looks <|image_pad|> and <|video_pad|> up by name
        placeholder=QWEN_TOKENS[2],  # <|image_pad|>, expanded to the image's tokens
        processor=_video_llama_3_processor,
        config=_video_llama_3_config,
    ),
    "llava_onevision1_5": TinyFamily(
        tokens=QWEN_TOKENS,
        placeholder=QWEN_PLACEHOLDER,
        processor=_llava_onevision1_5_processor,
        config=_llava_onevision1_5_config,
    ),
    # The tower's features before its post-layernorm feed the visual tokenizer: the norm frozen, as it gets no gradient
    "ovis2_5": TinyFamily(
        tokens=tuple(OVIS_TOKENS.values()),
        placeholder=OVIS_TOKENS["image_token"],  # expanded to the image's tokens between its start and end tokens
        processor=_ovis2_5_processor,
        config=_ovis2_5_config,
        named_tokens=OVIS_TOKENS,
        prepare_model=freeze_post_layernorm,
    ),
    # Its sparse indexer reads the attention mask: exact on eager attention only (its model has no sdpa)
    "hy_v4_vl": TinyFamily(
        tokens=QWEN_TOKENS,
        placeholder=QWEN_PLACEHOLDER,
        processor=_hy_v4_vl_processor,
        config=_hy_v4_vl_config,
        attention="eager",
        tags={"eager_only"},
    ),
}
