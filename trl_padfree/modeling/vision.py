"""Vision-language models on a packed row (the batch side is packing/vision.py).

- **Positions.** A model with its own position function (`get_rope_index`: Qwen-VL's 3-D mRoPE, where an image's
  tokens take positions along time, height and width, and the text after it continues from the largest) gets, for
  every token of the row, the position that function gives it in its own sequence: computed on the padded view of the
  row (every sequence whole, as TRL's padded forward computes it, with the per-token image marks it reads, or none
  where it finds images by the tokens around them: Qwen-Omni's thinkers), then laid back onto the row, under a row of
  plain text positions. transformers' Qwen-VL models read that `(4, 1, T)` layout as packed: row 0 keeps the sequences
  apart in mask-based attention, rows 1-3 rotate. A model without one reads the plain positions, as for text.
- **Attention.** Only the language model runs the packed attention (`set_language_model_attention`, in
  integrations/transformers.py); the vision tower keeps its own, and keeps its images apart itself. Gemma 3's image
  tokens attend to their whole image: the row carries those spans to `padfree_varlen` (attention/bidirectional.py).
- **Families.** The vision-language models trl-padfree packs images for, and how each lays its images out; each is
  still decided by the architecture check on a twin with images (modeling/vision_twin.py).
- **Which models take images** at all, as TRL's trainer will run them (`why_no_images`), for the data check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .packed_batch import PackedBatch


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
    # Images attended both ways only where the text config sets use_bidirectional_attention="vision" (Gemma 4's larger
    # checkpoints; transformers' `create_masks_for_vision_model`), and then on sliding-window layers alone: there the
    # window AND (causal OR the same image), as Gemma 3's; its full-attention layers stay causal
    bidirectional_on_vision_config: bool = False
    position_grids: str = "image_grid_thw"  # the image grids its position function (`get_rope_index`) reads
    # The per-token marks its position function finds images by, or None where it finds them by the tokens its
    # processor writes around each image instead (`image_bounds`)
    position_marks: str | None = "mm_token_type_ids"
    # The tokens (config names) its processor writes around each image, where its position function finds images by
    # them (Qwen-Omni's thinkers: an image token after a vision-start token); its forward then computes those
    # positions only given an attention mask
    image_bounds: tuple[str, str] | None = None
    # A module whose forward runs its layers once per image (or crop) in a Python loop, as `named_modules` names it
    # (`*`: any layer): a rank calls them as many times as its row has images, which DeepSpeed ZeRO-3 cannot follow
    # when the processes' rows differ (refusals.check_zero3_per_image_loop)
    per_image_loop: str | None = None
    per_image_unit: str = "image"


OMNI_IMAGE_BOUNDS = ("vision_start_token_id", "vision_end_token_id")

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
    # Qwen2-VL's layout, each patch (C, 14, 14); its projector runs once per image
    "paddleocr_vl": ImageFamily("patches", "mm_token_type_ids", per_image_loop="model.projector"),
    "kimi_k25": ImageFamily("patches", None),  # plain positions: no position function
    "glmga": ImageFamily("patches", "mm_token_type_ids"),  # GLM-4.6V's class under another model type
    "cosmos3_edge": ImageFamily("patches", "mm_token_type_ids"),  # Qwen-VL's layout, its own position function
    # a newline token after each merged row of an image; its tower's patch merger runs once per image
    "hy_v4_vl": ImageFamily("patches", "mm_token_type_ids", per_image_loop="model.vision_tower"),
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
    "gemma4": ImageFamily("sized", "mm_token_type_ids", bidirectional_on_vision_config=True),
    # No vision tower: a token per patch (of k x k patches)
    "gemma4_unified": ImageFamily("sized", "mm_token_type_ids", bidirectional_images=True, images_past_window=True),
    "internvl": ImageFamily("tiles", None),  # each image cut into tiles of a fixed number of tokens
    "aya_vision": ImageFamily("tiles", None),
    "cohere2_vision": ImageFamily("tiles", None),
    "llama4": ImageFamily("tiles", None),
    "idefics2": ImageFamily("rows", None),
    "idefics3": ImageFamily("rows", None),
    "smolvlm": ImageFamily("rows", None),
    # MiniCPM-V: images and their slices NaViT-packed along pixel_values' last axis, a grid per crop (`target_sizes`);
    # its merger runs its MLPs once per crop
    "minicpmv4_6": ImageFamily("navit", None, per_image_loop="model.merger", per_image_unit="crop"),
    "minicpm_ocr": ImageFamily("navit", None, per_image_loop="model.merger", per_image_unit="crop"),
    "minicpmv4_7": ImageFamily(  # canvas mRoPE
        "navit",
        "mm_token_type_ids",
        position_grids="target_sizes",
        per_image_loop="model.merger",
        per_image_unit="crop",
    ),
    "cosmos3_omni": ImageFamily("patches", "mm_token_type_ids"),  # Qwen3-VL under its own model type
    "hyperclovax_vision_v2": ImageFamily("patches", None),  # Qwen2.5-VL's tower, plain 1-D text positions
    # Qwen3-VL's tower, plain 1-D text positions; the tower's short convolutions run once per image
    "lfm3_vl": ImageFamily("patches", None, per_image_loop="model.vision_tower.layers.*.conv"),
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
    # Qwen2.5-VL's and Qwen3-VL's images beside an audio tower: the position function finds each image by the vision
    # start token before it, and places audio and video too (none on image pairs)
    "qwen2_5_omni_thinker": ImageFamily("patches", None, position_marks=None, image_bounds=OMNI_IMAGE_BOUNDS),
    "qwen3_omni_moe_thinker": ImageFamily("patches", None, position_marks=None, image_bounds=OMNI_IMAGE_BOUNDS),
}


def image_family(model_type: str) -> ImageFamily | None:
    return FAMILIES.get(model_type)


def per_image_loop(model: torch.nn.Module) -> tuple[str, str] | None:
    """(the module, the unit) of a model whose forward runs a module's layers once per image or crop
    (`ImageFamily.per_image_loop`); None for the others."""
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    if family is None or family.per_image_loop is None:
        return None
    return family.per_image_loop, family.per_image_unit


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
    """For a model whose image tokens attend to the whole image (Gemma 3; Gemma 4 where its config says so), the
    per-token input that marks them."""
    config = getattr(model, "config", None)
    family = image_family(getattr(config, "model_type", None))
    if family is None:
        return None
    if family.bidirectional_images or (family.bidirectional_on_vision_config and _vision_bidirectional(config)):
        return family.token_types
    return None


def image_spans_on_sliding_layers_only(model: torch.nn.Module | None) -> bool:
    """Whether a model's image spans (`bidirectional_image_marks`) hold on its sliding-window layers alone (Gemma 4)."""
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    return family is not None and family.bidirectional_on_vision_config


def _vision_bidirectional(config) -> bool:
    return getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"


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
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    marks_key = family.position_marks if family is not None else "mm_token_type_ids"
    token_types = packed_batch.image_inputs.get(marks_key) if marks_key is not None else None
    if marks_key is not None and token_types is None and packed_batch.sequence_image_grid_thw is not None:
        # the model's own forward raises on such a batch too (transformers 5.24's `compute_3d_position_ids`)
        raise ValueError(
            f"{type(model).__name__} places its images by {marks_key}, which the processor did not return, so "
            "its image positions cannot be computed (its padded forward raises too); set "
            "`processor.return_mm_token_type_ids = True` before building the trainer"
        )
    if packed_batch.sequence_image_grid_thw is None:
        # TRL's padded forward then leaves positions to the language model: plain ones, on every axis
        return torch.cat([text] * 4)
    grids = family.position_grids if family is not None else "image_grid_thw"
    # As the model's forward calls it on image pairs: the marks where it reads them (Qwen-Omni's reads none)
    marks = {marks_key: packed_batch.padded(token_types)} if marks_key is not None else {}
    padded_positions, _ = rope_index(
        input_ids=packed_batch.padded(packed_batch.input_ids),
        attention_mask=packed_batch.token_valid.long(),
        **marks,
        **{grids: packed_batch.sequence_image_grid_thw},
    )
    # (Qwen3-Omni's positions are floats: the row takes their dtype, exact for whole positions below 2**24)
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


def vision_tower_left_out(config) -> bool:
    """A vision-language class whose config leaves its vision tower out (Gemma 4's default config): the model it
    builds is its language model alone, and takes no images."""
    return hasattr(config, "vision_config") and config.vision_config is None


def why_no_images(model, processing_class, args) -> str | None:
    """Why `model` (a model, or a name TRL will load) takes no images as TRL's `DPOTrainer` will run it, or None if it
    takes them. TRL reads images only through a processor, the one passed or the one `AutoProcessor` loads for the
    model; and a model without a vision tower has nothing to encode them with."""
    from transformers import AutoConfig, AutoProcessor, ProcessorMixin

    from ..integrations.trl import get_config_model_id

    trust_remote_code = getattr(args, "trust_remote_code", False)
    revision = None  # TRL passes the model's revision on to the processor only for a model it loads by name
    if isinstance(model, str):
        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    else:
        config = model.config
    if vision_tower_left_out(config):
        return f"its config ({type(config).__name__}) has no vision tower (vision_config=None)"
    if processing_class is None:  # as TRL loads it
        model_id = model if isinstance(model, str) else get_config_model_id(model.config)
        processing_class = AutoProcessor.from_pretrained(
            model_id, revision=revision, trust_remote_code=trust_remote_code
        )
    if not isinstance(processing_class, ProcessorMixin):
        return (
            f"its processing class is {type(processing_class).__name__}, a tokenizer; TRL reads images only through "
            "a vision-language model's processor"
        )
    return None
