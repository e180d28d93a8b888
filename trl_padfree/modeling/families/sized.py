"""Families whose images take tokens by their size, the processor handing over `image_sizes` or a grid per image
(LLaVA-NeXT's any-resolution tiles, Pixtral's images of any size, SigLIP2's NaFlex patches, Gemma 4's patches).

Twin: images of three sizes; each image's tokens are read from the twin's own `get_image_features`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .record import VisionFamily
from .shapes import doubled, feature_tokens

LAYOUT = "sized"
# Twin images in (rows, columns) of the vision tower's square input: any-resolution tiles (LLaVA-NeXT), or 2 x 2
# merged patches each (Pixtral)
TWIN_TILE_GRIDS = ((1, 1), (1, 2), (2, 1))
# Token grids (rows, columns) of Gemma 4's images: 4, 2 and 2 tokens; 3, 2 and 2 where an image's tokens must fit the
# twin's sliding window (3: `VisionFamily.images_past_window`)
TWIN_GRIDS_2D = ((2, 2), (1, 2), (2, 1))
TWIN_WINDOW_GRIDS_2D = ((1, 3), (1, 2), (2, 1))
# Patch grids (rows, columns) of SigLIP2's images of any size (LFM2-VL): 4, 2 and 2 tokens of 2 x 2 patches
TWIN_PATCH_GRIDS = ((4, 4), (2, 4), (4, 2))


def sized_images(pixels, count_per_example: bool = False):
    """The twin's images, `pixels(config, images, noise)` laid out as its processor lays them out; with
    `count_per_example`, the images of each example counted too (LLaVA-OneVision's `batch_num_images`)."""

    def images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
        inputs = pixels(twin.config, sum(images_per_example), noise)
        if count_per_example:  # a prompt of several images gets their base tiles only
            inputs["batch_num_images"] = torch.tensor(images_per_example)
        with torch.no_grad():
            tokens = feature_tokens(twin.model.get_image_features(**inputs))
        return doubled(inputs), tokens

    return images


def anyres_pixels(config, images: int, noise) -> dict:
    """LLaVA-NeXT's: each image a base tile and its grid of tiles, padded to the most tiles, with `image_sizes`."""
    vision = config.vision_config
    grids = [TWIN_TILE_GRIDS[index % len(TWIN_TILE_GRIDS)] for index in range(images)]
    side, channels = vision.image_size, getattr(vision, "num_channels", 3)
    most = 1 + max(rows * columns for rows, columns in grids)
    pixels = torch.zeros(images, most, channels, side, side, dtype=torch.float64)
    for image, (rows, columns) in enumerate(grids):
        pixels[image, : 1 + rows * columns] = noise(1 + rows * columns, channels, side, side)
    sizes = torch.tensor([[rows * side, columns * side] for rows, columns in grids])
    return {"pixel_values": pixels, "image_sizes": sizes}


def pixtral_pixels(config, images: int, noise) -> dict:
    """Pixtral's: images of grids of 2 x 2 merged patches, padded to the largest image, with `image_sizes`."""
    vision = config.vision_config
    grids = [TWIN_TILE_GRIDS[index % len(TWIN_TILE_GRIDS)] for index in range(images)]
    channels = getattr(vision, "num_channels", 3)
    side = 2 * vision.patch_size * config.spatial_merge_size
    pixels = torch.zeros(images, channels, 2 * side, 2 * side, dtype=torch.float64)
    for image, (rows, columns) in enumerate(grids):
        pixels[image, :, : rows * side, : columns * side] = noise(channels, rows * side, columns * side)
    sizes = torch.tensor([[rows * side, columns * side] for rows, columns in grids])
    return {"pixel_values": pixels, "image_sizes": sizes}


def naflex_pixels(config, images: int, noise) -> dict:
    """SigLIP2's NaFlex (LFM2-VL): every image's patches flattened, padded to the most, with their grid."""
    vision = config.vision_config
    width = getattr(vision, "num_channels", 3) * vision.patch_size**2
    shapes = torch.tensor([TWIN_PATCH_GRIDS[index % len(TWIN_PATCH_GRIDS)] for index in range(images)])
    pixels = torch.zeros(images, vision.num_patches, width, dtype=torch.float64)
    mask = torch.zeros(images, vision.num_patches, dtype=torch.long)
    for image, patches in enumerate(shapes.prod(-1).tolist()):
        pixels[image, :patches], mask[image, :patches] = noise(patches, width), 1
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def gemma4_pixels(merged_patches: bool = False, token_grids=TWIN_GRIDS_2D):
    """Gemma 4's: grids of k x k patches per token, every image padded to the largest's patches, with their (x, y)
    positions (-1 on padding); `merged_patches` where its processor merges each k x k patches into one (Gemma 4
    Unified, no vision tower)."""

    def pixels(config, images: int, noise) -> dict:
        vision = config.vision_config
        pool, width = vision.pooling_kernel_size, 3 * vision.patch_size**2
        if merged_patches:  # each token one patch of k x k patches' pixels
            pool, width = 1, width * pool**2
        most = pool**2 * max(rows * columns for rows, columns in token_grids)
        values = torch.zeros(images, most, width, dtype=torch.float64)
        positions = torch.full((images, most, 2), -1, dtype=torch.long)
        for image in range(images):
            rows, columns = (pool * side for side in token_grids[image % len(token_grids)])
            y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
            values[image, : rows * columns] = noise(rows * columns, width)
            positions[image, : rows * columns] = torch.stack([x.flatten(), y.flatten()], -1)
        return {"pixel_values": values, "image_position_ids": positions}

    return pixels


def _anyres(values: dict) -> None:  # tiles of 2 x 2 patches, in grids of 1 x 1, 1 x 2, 2 x 1
    vision = values["vision_config"]
    side = vision["image_size"] = 2 * vision["patch_size"]
    values["image_grid_pinpoints"] = [[side * rows, side * columns] for rows, columns in TWIN_TILE_GRIDS]


def _onevision(values: dict) -> None:
    _anyres(values)
    values["vision_aspect_ratio"] = "anyres_max_2"


def _pixtral(values: dict) -> None:  # images of up to 8 x 8 patches, merged 2 x 2
    values["vision_config"]["image_size"] = 8 * values["vision_config"]["patch_size"]


def _naflex(values: dict) -> None:  # up to 4 x 4 patches, 2 x 2 of them per token
    values["vision_config"]["num_patches"] = max(rows * columns for rows, columns in TWIN_PATCH_GRIDS)
    values["projector_hidden_size"] = values["text_config"]["hidden_size"]


def _gemma4(values: dict) -> None:  # images of up to 2 x 2 tokens of pooling_kernel_size^2 patches, 2-pixel patches
    vision = values["vision_config"]
    vision["patch_size"] = 2
    vision["position_embedding_size"] = 2 * vision["pooling_kernel_size"]


def _gemma4_unified(values: dict) -> None:  # its patch embedding as wide as the language model, positions per token
    _gemma4(values)
    vision = values["vision_config"]
    vision["mm_embed_dim"] = vision["output_proj_dims"] = values["text_config"]["hidden_size"]
    vision["mm_posemb_size"] = 3


def _granite4_vision(values: dict) -> None:  # LLaVA-NeXT's tiles of 4 x 4 patches, queried by 2 x 2
    vision, qformer = values["vision_config"], values["qformer_config"]
    side = vision["image_size"] = 4 * vision["patch_size"]
    values["image_grid_pinpoints"] = [[side * rows, side * columns] for rows, columns in TWIN_TILE_GRIDS]
    values["downsample_rate"] = "2/4"
    # Its Q-Former takes a head per 64 of the tower's width (Granite4VisionConfig)
    vision["hidden_size"] = qformer["hidden_size"] = 64
    qformer.update(encoder_hidden_size=64, num_attention_heads=1)
    if values.get("deepstack_layer_map") is None:  # the default config names none: the tower's last layer's
        values["deepstack_layer_map"] = [[-1, 0]]


ANYRES = VisionFamily(LAYOUT, shrink=_anyres, twin_images=sized_images(anyres_pixels))
PIXTRAL = VisionFamily(LAYOUT, shrink=_pixtral, twin_images=sized_images(pixtral_pixels))
GEMMA4 = VisionFamily(
    LAYOUT,
    shrink=_gemma4,
    twin_images=sized_images(gemma4_pixels()),
    token_types="mm_token_type_ids",
    bidirectional_on_vision_config=True,
)

FAMILIES = {
    "llava_next": ANYRES,  # any-resolution tiles, a base tile and a grid
    "llava_next_video": ANYRES,  # its images as LLaVA-NeXT's
    "llava_onevision": replace(ANYRES, shrink=_onevision, twin_images=sized_images(anyres_pixels, True)),
    "granite4_vision": replace(
        ANYRES, shrink=_granite4_vision
    ),  # LLaVA-NeXT's tiles, features added at several layers
    "mistral3": PIXTRAL,  # Pixtral: images of any size, a token per 2 x 2 patches
    "mistral_large4": PIXTRAL,
    "lighton_ocr": PIXTRAL,
    "lfm2_vl": VisionFamily(LAYOUT, shrink=_naflex, twin_images=sized_images(naflex_pixels)),
    # Images of any size: each image's patches padded to a fixed count, with their (x, y) positions
    "gemma4": GEMMA4,
    # No vision tower: a token per patch (of k x k patches)
    "gemma4_unified": replace(
        GEMMA4,
        shrink=_gemma4_unified,
        twin_images=sized_images(gemma4_pixels(merged_patches=True, token_grids=TWIN_WINDOW_GRIDS_2D)),
        bidirectional_images=True,
        bidirectional_on_vision_config=False,
        images_past_window=True,
    ),
}
