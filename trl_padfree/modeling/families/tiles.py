"""Families whose processor cuts each image into tiles of a fixed number of image tokens, one entry of `pixel_values`
per tile (InternVL, Aya Vision, Llama 4, GOT-OCR2, Ovis 2...).

Twin: 1, 3 and 2 tiles per image, each of a few patches pixel-shuffled (or convolved) to 4 tokens.
"""

from __future__ import annotations

from dataclasses import replace

from .record import VisionFamily
from .shapes import doubled, fixed_tokens, side

LAYOUT = "tiles"
TWIN_TILES = (1, 3, 2)  # tiles per image


def tile_images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
    config = twin.config
    vision = config.vision_config
    tiles = [TWIN_TILES[index % len(TWIN_TILES)] for index in range(sum(images_per_example))]
    size = side(vision.image_size)
    pixels = noise(sum(tiles), getattr(vision, "num_channels", 3), size, size)
    return doubled({"pixel_values": pixels}), [count * fixed_tokens(config) for count in tiles]


def _internvl(values: dict) -> None:  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
    patch = values["vision_config"]["patch_size"][0]
    values["vision_config"]["image_size"], values["image_seq_length"] = [4 * patch, 4 * patch], 4


def _aya_vision(values: dict) -> None:  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
    values["vision_config"]["image_size"] = 4 * values["vision_config"]["patch_size"]


def _llama4(values: dict) -> None:  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
    vision, hidden = values["vision_config"], values["text_config"]["hidden_size"]
    vision["image_size"] = 4 * vision["patch_size"]
    vision["projector_input_dim"] = vision["projector_output_dim"] = vision["vision_output_dim"] = hidden
    # its adapter reads the pixel-shuffled patches at the tower's intermediate width
    vision["intermediate_size"] = round(vision["hidden_size"] / vision["pixel_shuffle_ratio"] ** 2)


def _got_ocr2(values: dict) -> None:  # SAM on 8 x 8 patches (windows of 2 x 2), 4 x 4 per token
    vision = values["vision_config"]
    vision.update(image_size=8 * vision["patch_size"], window_size=2, output_channels=8)
    values["image_seq_length"] = 4


def _ovis2(values: dict) -> None:  # tiles of 2 x 2 tokens of hidden_stride^2 patches each
    vision = values["vision_config"]
    vision["image_size"] = 2 * vision["hidden_stride"] * vision["patch_size"]


TILES = VisionFamily(LAYOUT, twin_images=tile_images)

FAMILIES = {
    "internvl": replace(TILES, shrink=_internvl),  # each image cut into tiles of a fixed number of tokens
    "qianfan_ocr": replace(TILES, shrink=_internvl),  # InternVL's tiles, before Qwen3
    "aya_vision": replace(TILES, shrink=_aya_vision),
    "cohere2_vision": replace(TILES, shrink=_aya_vision),
    "llama4": replace(TILES, shrink=_llama4),
    "ovis2": replace(TILES, shrink=_ovis2),  # a whole image and its tiles, a visual vocabulary's embeddings per patch
    "got_ocr2": replace(TILES, shrink=_got_ocr2),  # SAM, 4 x 4 patches a token; images whole, or cut into tiles
    "pp_chart2table": replace(TILES, shrink=_got_ocr2),  # GOT-OCR2's model
}
