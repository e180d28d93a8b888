"""Vision-language models on a packed row (the batch side is packing/vision.py).

- **Positions.** A model with its own position function (`get_rope_index`: Qwen-VL's 3-D mRoPE, where an image's
  tokens take positions along time, height and width, and the text after it continues from the largest) gets, for
  every token of the row, the position that function gives it in its own sequence: computed on the padded view of the
  row (every sequence whole, as TRL's padded forward computes it), then laid back onto the row, under a row of plain
  text positions. transformers' Qwen-VL models read that `(4, 1, T)` layout as packed: row 0 keeps the sequences
  apart in mask-based attention, rows 1-3 rotate. A model without one reads the plain positions, as for text.
- **Attention.** Only the language model runs the packed attention (`set_language_model_attention`, in
  integrations/transformers.py); the vision tower keeps its own, and keeps its images apart itself. Gemma 3's image
  tokens attend to their whole image: the row carries those spans to `padfree_varlen` (attention/bidirectional.py).
- **Families.** The vision-language models trl-padfree packs images for, and how each lays its images out; each is
  still decided by the architecture check on a twin with images (modeling/vision_twin.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .packed_forward import PackedBatch


@dataclass(frozen=True)
class ImageFamily:
    # How its processor lays a batch's images out (packing/vision.py): "patches", "images", "sized" (images with
    # `image_sizes`, their tokens depending on their size), "tiles" (each image cut into tiles), "rows" or "navit"
    # (every crop's patches along one axis, with each crop's grid: MiniCPM-V)
    layout: str
    token_types: str | None  # the per-token input marking image tokens, if the model takes one
    bidirectional_images: bool = False  # an image's tokens attend to the whole image (marked by `token_types`)
    # the per-token input routing image tokens to experts of their own (ERNIE-4.5-VL's `moe_mm_token_type_ids`,
    # which also marks each image's begin and end tokens), packed as tokens are
    expert_token_types: str | None = None
    # On sliding-window layers an image's tokens see the whole image past the window too (Gemma 4 Unified: causal in
    # the window OR the same image), where Gemma 3's see only its tokens in the window (the window AND (causal OR the
    # same image)), as the packed attention does: the two agree on images no longer than the window
    images_past_window: bool = False
    position_grids: str = "image_grid_thw"  # the image grids its position function (`get_rope_index`) reads
    # Its projector calls its layers once per image, in a Python loop (PaddleOCR-VL): ZeRO-3 gathers a layer's weights
    # at each call, so ranks encoding different numbers of images issue different collectives, and hang
    layers_per_image: bool = False


FAMILIES = {
    "qwen2_vl": ImageFamily("patches", "mm_token_type_ids"),
    "qwen2_5_vl": ImageFamily("patches", "mm_token_type_ids"),
    "qwen3_vl": ImageFamily("patches", "mm_token_type_ids"),
    "qwen3_vl_moe": ImageFamily("patches", "mm_token_type_ids"),
    "qwen3_5": ImageFamily("patches", "mm_token_type_ids"),  # Qwen3-VL's images before a hybrid language model
    "qwen3_5_moe": ImageFamily("patches", "mm_token_type_ids"),
    "glm4v": ImageFamily("patches", "mm_token_type_ids"),  # Qwen2-VL's layout, its own position function
    "glm4v_moe": ImageFamily("patches", "mm_token_type_ids"),
    "glm46v": ImageFamily("patches", "mm_token_type_ids"),
    "glm_ocr": ImageFamily("patches", "mm_token_type_ids"),  # GLM-4V's layout and position function
    # Qwen2-VL's layout, each patch (C, 14, 14)
    "paddleocr_vl": ImageFamily("patches", "mm_token_type_ids", layers_per_image=True),
    "kimi_k25": ImageFamily("patches", None),  # plain positions: no position function
    "glmga": ImageFamily("patches", "mm_token_type_ids"),  # GLM-4.6V's class under another model type
    "cosmos3_edge": ImageFamily("patches", "mm_token_type_ids"),  # Qwen-VL's layout, its own position function
    "hy_v4_vl": ImageFamily("patches", "mm_token_type_ids"),  # a newline token after each merged row of an image
    "exaone4_5": ImageFamily("patches", None),  # plain positions: no position function
    # Qwen2-VL's layout, its own position function, image tokens through image experts; its twin packs exactly, but
    # TRL's padded batch fails its forward (vision_unsupported.REFUSED)
    "ernie4_5_vl_moe": ImageFamily("patches", "mm_token_type_ids", expert_token_types="moe_mm_token_type_ids"),
    "gemma3": ImageFamily("images", "token_type_ids", bidirectional_images=True),
    "shieldgemma2": ImageFamily("images", "token_type_ids", bidirectional_images=True),  # a Gemma 3 by another name
    "llava": ImageFamily("images", None),
    "vipllava": ImageFamily("images", None),
    "llava_next": ImageFamily("sized", None),  # any-resolution tiles, a base tile and a grid
    "llava_next_video": ImageFamily("sized", None),  # its images as LLaVA-NeXT's
    "llava_onevision": ImageFamily("sized", None),
    "mistral3": ImageFamily("sized", None),  # Pixtral: images of any size, a token per 2 x 2 patches
    "mistral_large4": ImageFamily("sized", None),
    "lighton_ocr": ImageFamily("sized", None),
    "lfm2_vl": ImageFamily("sized", None),  # SigLIP2's images of any size, flattened patches and their grid
    # Images of any size: each image's patches padded to a fixed count, with their (x, y) positions
    "gemma4": ImageFamily("sized", "mm_token_type_ids"),
    # No vision tower: a token per patch (of k x k patches)
    "gemma4_unified": ImageFamily("sized", "mm_token_type_ids", bidirectional_images=True, images_past_window=True),
    "internvl": ImageFamily("tiles", None),  # each image cut into tiles of a fixed number of tokens
    "aya_vision": ImageFamily("tiles", None),
    "cohere2_vision": ImageFamily("tiles", None),
    "llama4": ImageFamily("tiles", None),
    "idefics2": ImageFamily("rows", None),
    "idefics3": ImageFamily("rows", None),
    "smolvlm": ImageFamily("rows", None),
    # MiniCPM-V: images and their slices NaViT-packed along pixel_values' last axis, a grid per crop (`target_sizes`)
    "minicpmv4_6": ImageFamily("navit", None),
    "minicpm_ocr": ImageFamily("navit", None),
    "minicpmv4_7": ImageFamily("navit", "mm_token_type_ids", position_grids="target_sizes"),  # canvas mRoPE
    "cosmos3_omni": ImageFamily("patches", "mm_token_type_ids"),  # Qwen3-VL under its own model type
    "hyperclovax_vision_v2": ImageFamily("patches", None),  # Qwen2.5-VL's tower, plain 1-D text positions
    "lfm3_vl": ImageFamily("patches", None),  # Qwen3-VL's tower, plain 1-D text positions
    "video_llava": ImageFamily("images", None),  # LLaVA's images, from its image tower
    "qianfan_ocr": ImageFamily("tiles", None),  # InternVL's tiles, before Qwen3
    "deepseek_vl": ImageFamily("images", None),  # SigLIP, a token per patch
    "deepseek_vl_hybrid": ImageFamily("images", None),  # and each image again, high-resolution, through SAM
    "granite4_vision": ImageFamily("sized", None),  # LLaVA-NeXT's tiles, features added at several layers
    "ovis2": ImageFamily("tiles", None),  # a whole image and its tiles, a visual vocabulary's embeddings per patch
    "janus": ImageFamily("images", None),  # SigLIP-like, a token per patch (its VQ model only generates images)
    "got_ocr2": ImageFamily("tiles", None),  # SAM, 4 x 4 patches a token; images whole, or cut into tiles
    "pp_chart2table": ImageFamily("tiles", None),  # GOT-OCR2's model
    "aria": ImageFamily("images", None),  # Idefics3's tower, its patches cross-attended by a fixed number of queries
}


def image_family(model_type: str) -> ImageFamily | None:
    return FAMILIES.get(model_type)


def cross_attention_refusal(config) -> str | None:
    """Why a model whose images reach the language model through cross-attention (Mllama) cannot be packed."""
    layers = getattr(config.get_text_config(), "cross_attention_layers", None)
    if not layers:
        return None
    return (
        f"its images reach the language model through cross-attention (layers {list(layers)}): there every token "
        "attends to the images of its whole batch row, so packed sequences would read each other's images, and no "
        "packed form of that attention is built; train it padded (padding_free=False)"
    )


def bidirectional_image_marks(model: torch.nn.Module | None) -> str | None:
    """For a model whose image tokens attend to the whole image (Gemma 3), the per-token input that marks them."""
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    return family.token_types if family is not None and family.bidirectional_images else None


def image_past_window(model: torch.nn.Module | None, image_spans) -> tuple[int, int] | None:
    """(the longest image's tokens, the sliding window) when an image of this row is longer than the window of a model
    whose images see themselves whole past it (`ImageFamily.images_past_window`); else None."""
    config = getattr(model, "config", None)
    family = image_family(getattr(config, "model_type", None))
    if family is None or not family.images_past_window or not image_spans:
        return None
    window = getattr(config.get_text_config(), "sliding_window", None)
    longest = max(end - start for start, end in image_spans)
    return (longest, window) if window is not None and longest > window else None


def position_function(model: torch.nn.Module | None) -> Callable | None:
    """The model's own function for the positions of a sequence with images (`get_rope_index`), if it has one: on the
    model or on its inner model (transformers' `...ForConditionalGeneration.model`)."""
    for candidate in (model, getattr(model, "model", None)):
        function = getattr(candidate, "get_rope_index", None)
        if callable(function):
            return function
    return None


def packed_position_ids(model: torch.nn.Module | None, packed_batch: PackedBatch) -> torch.Tensor:
    """The positions `model` reads for the packed row: plain `(1, T)` positions, or for a vision-language batch on a
    model with a position function, `(4, 1, T)`: the plain positions over the model's own ones."""
    rope_index = position_function(model)
    if rope_index is None or packed_batch.image_inputs is None:
        return packed_batch.position_ids
    text = packed_batch.position_ids.unsqueeze(0)
    token_types = packed_batch.image_inputs.get("mm_token_type_ids")
    if token_types is None and packed_batch.sequence_image_grid_thw is not None:
        # the model's own forward raises on such a batch too (transformers 5.24's `compute_3d_position_ids`)
        raise ValueError(
            f"{type(model).__name__} places its images by mm_token_type_ids, which the processor did not return, so "
            "its image positions cannot be computed (its padded forward raises too); set "
            "`processor.return_mm_token_type_ids = True` before building the trainer"
        )
    if token_types is None or packed_batch.sequence_image_grid_thw is None:
        # TRL's padded forward then leaves positions to the language model: plain ones, on every axis
        return torch.cat([text] * 4)
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    grids = family.position_grids if family is not None else "image_grid_thw"
    padded_positions, _ = rope_index(
        input_ids=packed_batch.padded(packed_batch.input_ids),
        mm_token_type_ids=packed_batch.padded(token_types),
        attention_mask=packed_batch.token_valid.long(),
        **{grids: packed_batch.sequence_image_grid_thw},
    )
    return torch.cat([text, packed_batch.packed(padded_positions)])


def image_token_id(config) -> int | None:
    """The token a vision-language model's config places image features on."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def is_vision_language(config) -> bool:
    # A family's default config may leave its image token unset (MiniCPM-V's: the checkpoint's config names it)
    if getattr(config, "vision_config", None) is None:
        return False
    return image_token_id(config) is not None or image_family(getattr(config, "model_type", None)) is not None
