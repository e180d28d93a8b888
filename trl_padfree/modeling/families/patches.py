"""Families whose processor hands over every image's patches in one `pixel_values`, with a grid per image
(`image_grid_thw`): Qwen-VL's layout and its descendants.

Twin: `pixel_values` of every image's patches (flattened, or `(channels, patch, patch)` where the tower embeds them by
a 2-D convolution), `image_grid_thw` of 1 x 2 x 2, 1 x 1 x 2 and 1 x 2 x 1 merged patches: 4, 2 and 2 tokens (HY-V4-VL:
a newline token after each merged row, (w + 1) x h). Where the model has its own position function, the twin's mRoPE
sections span its heads (twin.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .record import VisionFamily
from .shapes import doubled

LAYOUT = "patches"
# Twin image grids (temporal, height, width, in merged patches): tokens 4, 2 and 2
TWIN_GRIDS = ((1, 2, 2), (1, 1, 2), (1, 2, 1))
# Where the vision config names no merge and the processor hands each image's over (VideoLLaMA3's `image_merge_sizes`):
# the twin's images merged 2 x 2, so the tower's per-image downsampling really runs
TWIN_INPUT_MERGE = 2


def patch_images(unflattened: bool = False, newline_per_row: bool = False, merge_input: str | None = None):
    """The twin's images as its processor lays them out: `unflattened` where it hands each patch over as
    (channels, patch, patch); `newline_per_row` where every merged row of an image ends with a newline token;
    `merge_input` where it hands each image's merge over as an input of that name, the vision config naming none."""

    def images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
        vision = twin.config.vision_config
        kernel = getattr(vision, "merge_kernel_size", None)  # Kimi K2.5 names its merge a kernel
        if merge_input is not None:
            merge = TWIN_INPUT_MERGE
        else:
            merge = kernel[0] if kernel is not None else vision.spatial_merge_size
        count = sum(images_per_example)
        grids = torch.tensor([TWIN_GRIDS[index % len(TWIN_GRIDS)] for index in range(count)])
        grids[:, 1:] *= merge
        channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        channels *= getattr(vision, "temporal_patch_size", 1)
        patch = (channels, vision.patch_size, vision.patch_size) if unflattened else (channels * vision.patch_size**2,)
        pixels = noise(int(grids.prod(-1).sum()), *patch)
        tokens = grids.prod(-1) // merge**2
        if newline_per_row:
            tokens = grids[:, 0] * (grids[:, 1] // merge) * (grids[:, 2] // merge + 1)
        inputs = {"pixel_values": pixels, "image_grid_thw": grids}
        if merge_input is not None:
            inputs[merge_input] = torch.full((count,), merge)
        return doubled(inputs), tokens.tolist()

    return images


def _qwen2_vl(values: dict) -> None:  # its tower's embedding and merger widths
    values["vision_config"]["embed_dim"] = 32
    values["vision_config"]["hidden_size"] = values["text_config"]["hidden_size"]


def _kimi(values: dict) -> None:  # its projector's norm reads the tower's width
    values["projection_hidden_size"] = values["vision_config"]["hidden_size"]


def _ernie(values: dict) -> None:  # text and image experts of their own widths, a list the shrink skips
    text = values["text_config"]
    text["moe_intermediate_size"] = [32] * len(text["moe_intermediate_size"])


# The audio tower, which image pairs never run, narrowed only so that it builds: its heads dividing the shrunk width
# (the real 20 do not divide 32), its features as wide as the language model
TWIN_AUDIO = dict(encoder_attention_heads=4, encoder_ffn_dim=64, encoder_layers=1, downsample_hidden_size=8)


def _omni(values: dict) -> None:
    audio = values["audio_config"]
    audio.update({name: size for name, size in TWIN_AUDIO.items() if name in audio})
    audio["output_dim"] = values["text_config"]["hidden_size"]


QWEN_VL = VisionFamily(LAYOUT, twin_images=patch_images(), token_types="mm_token_type_ids")
PLAIN_POSITIONS = replace(QWEN_VL, token_types=None)  # no position function: plain 1-D text positions
OMNI_IMAGE_BOUNDS = ("vision_start_token_id", "vision_end_token_id")
# Qwen2.5-VL's and Qwen3-VL's images beside an audio tower: the position function finds each image by the vision start
# token before it, and places audio and video too (none on image pairs)
OMNI_THINKER = replace(PLAIN_POSITIONS, shrink=_omni, position_marks=None, image_bounds=OMNI_IMAGE_BOUNDS)

FAMILIES = {
    "qwen2_vl": replace(QWEN_VL, shrink=_qwen2_vl),
    "qwen2_5_vl": QWEN_VL,
    "qwen3_vl": QWEN_VL,
    "qwen3_vl_moe": QWEN_VL,
    "qwen3_5": QWEN_VL,  # Qwen3-VL's images before a hybrid language model
    "qwen3_5_moe": QWEN_VL,
    "glm4v": QWEN_VL,  # Qwen2-VL's layout, its own position function
    "glm4v_moe": QWEN_VL,
    "glm46v": QWEN_VL,
    "glm_ocr": QWEN_VL,  # GLM-4V's layout and position function
    "glmga": QWEN_VL,  # GLM-4.6V's class under another model type
    "cosmos3_edge": QWEN_VL,  # one frame a patch; its processor returns mm_token_type_ids only if asked
    "cosmos3_omni": QWEN_VL,  # Qwen3-VL under its own model type
    # each patch (C, 14, 14); its projector runs once per image
    "paddleocr_vl": replace(QWEN_VL, twin_images=patch_images(unflattened=True), per_image_loop="model.projector"),
    "kimi_k25": replace(PLAIN_POSITIONS, twin_images=patch_images(unflattened=True), shrink=_kimi),
    # a newline token after each merged row of an image; its tower's patch merger runs once per image; its latent
    # attention's rope part rotates by mRoPE
    "hy_v4_vl": replace(
        QWEN_VL,
        twin_images=patch_images(newline_per_row=True),
        per_image_loop="model.vision_tower",
        latent_mrope=True,
    ),
    "exaone4_5": PLAIN_POSITIONS,
    "hyperclovax_vision_v2": PLAIN_POSITIONS,  # Qwen2.5-VL's tower
    # Qwen3-VL's tower; the tower's short convolutions run once per image
    "lfm3_vl": replace(PLAIN_POSITIONS, per_image_loop="model.vision_tower.layers.*.conv"),
    # a Qwen2 language model on plain positions; each image's merge an input of its own (image_merge_sizes), applied
    # by a bilinear resize per image
    "video_llama_3": replace(PLAIN_POSITIONS, twin_images=patch_images(merge_input="image_merge_sizes")),
    "qwen2_5_omni_thinker": OMNI_THINKER,
    "qwen3_omni_moe_thinker": OMNI_THINKER,
    # EXAONE 4.5's model and processor around a tower of its own (a class token per image, dropped before the merge)
    # and a Qwen3 language model, on plain positions
    "llava_onevision1_5": PLAIN_POSITIONS,
    # a start and an end token around each image, which its forward replaces by learned embeddings (one pair per
    # image, counted over the whole batch); a Qwen3 language model on plain positions
    "ovis2_5": replace(PLAIN_POSITIONS, image_bounds=("image_start_token_id", "image_end_token_id")),
    # Unchecked: what the check needs before it can give their twins images
    "minimax_m3_vl": VisionFamily(
        LAYOUT,
        unchecked="its checkpoints' sparse layers (minimax_m3_sparse) run a lightning indexer that compares key "
        "slots with position_ids, of which no packed form is built; its image processor needs torchvision",
    ),
    "dots3_note": VisionFamily(
        LAYOUT,
        unchecked="Qwen2-VL-style image patches, after its language model's twin (dots3_note_text fails to build)",
    ),
    "muse_glimmer": VisionFamily(
        LAYOUT, unchecked="Kimi-K2.5-style image patches: a twin branch; its image processor needs torchvision"
    ),
    # Its own position function, image tokens through image experts. Its twin packs exactly, but its processor adds
    # `moe_mm_token_type_ids` over the prompt only, and TRL 1.16's vision collator extends `mm_token_type_ids` over the
    # completions, not it
    "ernie4_5_vl_moe": replace(
        QWEN_VL,
        shrink=_ernie,
        expert_token_types="moe_mm_token_type_ids",
        refused="TRL's vision collator leaves its processor's moe_mm_token_type_ids at the prompt's length, so its "
        "forward fails on TRL's padded batch too; its architecture packs exactly on a tiny twin: once TRL pads that "
        "input over the completions, it can be checked; until then TRL's DPO cannot train it on image data",
    ),
}
