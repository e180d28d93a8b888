"""MiniCPM-V's layout: an image and its slices NaViT-packed along `pixel_values`' last axis, `(1, C, patch, L)`, with
each crop's patch grid (`target_sizes`); its merger runs its MLPs once per crop.

Twin: crops of 4 x 8, 4 x 4 and 8 x 4 patches, one per image; their tokens read from the twin's own
`get_image_features`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .record import VisionFamily
from .shapes import doubled

LAYOUT = "navit"
TWIN_CROP_GRIDS = (
    (4, 8),
    (4, 4),
    (8, 4),
)  # rows, columns of patches: 2, 1 and 2 tokens merged 4 x 4 (4x mode: 8, 4, 8)


def crop_images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
    vision = twin.config.vision_config
    grids = torch.tensor([TWIN_CROP_GRIDS[index % len(TWIN_CROP_GRIDS)] for index in range(sum(images_per_example))])
    pixels = noise(1, vision.num_channels, vision.patch_size, int(grids.prod(-1).sum()) * vision.patch_size)
    with torch.no_grad():
        features = twin.model.get_image_features(pixels, grids.int()).pooler_output
    inputs = doubled({"pixel_values": pixels}, dim=-1) | doubled({"target_sizes": grids.int()})
    return inputs, [len(crop) for crop in features]


def _crops(values: dict) -> None:  # crops of up to 8 x 8 patches
    values["vision_config"]["image_size"] = 8 * values["vision_config"]["patch_size"]
    # A default config leaves its image token unset (a checkpoint's config names it): one past the vocabulary, which
    # twin.remap_special_tokens moves below its end with the other special tokens
    if values.get("image_token_id") is None:
        values["image_token_id"] = values["text_config"]["vocab_size"]


MINICPM_V = VisionFamily(
    LAYOUT, shrink=_crops, twin_images=crop_images, per_image_loop="model.merger", per_image_unit="crop"
)

FAMILIES = {
    "minicpmv4_6": MINICPM_V,
    "minicpm_ocr": MINICPM_V,
    "minicpmv4_7": replace(MINICPM_V, token_types="mm_token_type_ids", position_grids="target_sizes"),  # canvas mRoPE
}
