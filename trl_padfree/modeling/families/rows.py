"""Families whose processor hands over one entry of `pixel_values` per row of the batch, its images padded within it,
with a `pixel_attention_mask` (Idefics 2, Idefics 3, SmolVLM).

Twin: each example's images padded to the most of any example, 2 x 2 tokens (Idefics 2: 4 resampled latents) each.
"""

from __future__ import annotations

import torch

from .record import VisionFamily
from .shapes import doubled, fixed_tokens, side

LAYOUT = "rows"


def row_images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
    config = twin.config
    vision = config.vision_config
    size, channels, most = side(vision.image_size), getattr(vision, "num_channels", 3), max(images_per_example)
    pixels = torch.zeros(len(images_per_example), most, channels, size, size, dtype=torch.float64)
    mask = torch.zeros(len(images_per_example), most, size, size, dtype=torch.bool)
    for row, count in enumerate(images_per_example):
        pixels[row, :count] = noise(count, channels, size, size)
        mask[row, :count] = True
    tokens = [fixed_tokens(config)] * sum(images_per_example)
    return doubled({"pixel_values": pixels, "pixel_attention_mask": mask}), tokens


def _idefics2(values: dict) -> None:  # 2 x 2 patches, resampled to 4 latent tokens as wide as the language model
    values["vision_config"]["image_size"] = 2 * values["vision_config"]["patch_size"]
    values["perceiver_config"].update(resampler_n_latents=4, hidden_size=values["text_config"]["hidden_size"])


def _idefics3(values: dict) -> None:  # 2 x 2 tokens of scale_factor^2 patches each
    vision = values["vision_config"]
    vision["image_size"] = 2 * vision["patch_size"] * values["scale_factor"]


FAMILIES = {
    "idefics2": VisionFamily(LAYOUT, shrink=_idefics2, twin_images=row_images),
    "idefics3": VisionFamily(LAYOUT, shrink=_idefics3, twin_images=row_images),
    "smolvlm": VisionFamily(LAYOUT, shrink=_idefics3, twin_images=row_images),
}
