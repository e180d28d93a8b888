"""Families whose processor hands over one fixed-size image per entry of `pixel_values`, each taking as many image
tokens (LLaVA, Gemma 3, DeepSeek-VL...).

Twin: `pixel_values` `(images, C, side, side)` (DeepSeek-VL hybrid: each image again at its high-resolution tower's
size), images of a few patches, a fixed number of tokens each (its geometry below).
"""

from __future__ import annotations

from dataclasses import replace

from .record import VisionFamily
from .shapes import doubled, fixed_tokens, side

LAYOUT = "images"


def fixed_images(token_per_patch: bool = False):
    """The twin's images: `token_per_patch` where every patch is an image token (DeepSeek-VL)."""

    def images(twin, images_per_example: list[int], noise) -> tuple[dict, list[int]]:
        config, count = twin.config, sum(images_per_example)
        vision = config.vision_config
        pixels = noise(count, getattr(vision, "num_channels", 3), side(vision.image_size), side(vision.image_size))
        inputs = {"pixel_values": pixels}
        high_res = getattr(config, "high_res_vision_config", None)
        if high_res is not None:  # DeepSeek-VL hybrid: each image again, at its high-resolution tower's size
            inputs["high_res_pixel_values"] = noise(
                count, high_res.num_channels, high_res.image_size, high_res.image_size
            )
        return doubled(inputs), [fixed_tokens(config, token_per_patch)] * count

    return images


def _gemma3(values: dict) -> None:  # 4 x 4 patches pooled to 2 x 2 tokens
    vision = values["vision_config"]
    vision["image_size"], values["mm_tokens_per_image"] = 4 * vision["patch_size"], 4


def _llava(values: dict) -> None:  # 2 x 2 patches, one token each
    vision = values["vision_config"]
    vision["image_size"], values["image_seq_length"] = 2 * vision["patch_size"], 4


def _vipllava(values: dict) -> None:  # and its projector reads several vision layers: the twin's two
    _llava(values)
    values["vision_feature_layers"] = [-1, 0]


def _token_per_patch(values: dict) -> None:  # 2 x 2 patches, a token each
    vision = values["vision_config"]
    vision["image_size"] = 2 * vision["patch_size"]
    high_res = values.get("high_res_vision_config")
    if high_res is not None:  # SAM on 4 x 4 patches, in windows of 2 x 2, its features resized to SigLIP's grid
        high_res.update(image_size=4 * high_res["patch_size"], window_size=2, output_channels=8)


def _janus(values: dict) -> None:  # its aligner and its image generator's (a VQ-VAE, unused here) as wide as the text
    _token_per_patch(values)
    hidden = values["text_config"]["hidden_size"]
    values["vision_config"].update(num_image_tokens=4, projection_dim=hidden)
    values["vq_config"].update(
        projection_dim=hidden, image_token_embed_dim=hidden, num_embeddings=16, base_channels=32, latent_channels=32
    )


def _aria(values: dict) -> None:  # 2 x 2 patches, queried by 4
    values["vision_config"]["image_size"] = 2 * values["vision_config"]["patch_size"]
    values["projector_patch_to_query_dict"] = {4: 4}
    # its image token (9) is a low id, among the check's random text: past the vocabulary, remapped to its end
    values["image_token_index"] = values["text_config"]["vocab_size"]


IMAGES = VisionFamily(LAYOUT, twin_images=fixed_images())
GEMMA3 = replace(IMAGES, shrink=_gemma3, token_types="token_type_ids", bidirectional_images=True)
TOKEN_PER_PATCH = replace(IMAGES, shrink=_token_per_patch, twin_images=fixed_images(token_per_patch=True))

FAMILIES = {
    "gemma3": GEMMA3,
    "shieldgemma2": GEMMA3,  # a Gemma 3 by another name
    "llava": replace(IMAGES, shrink=_llava),
    "vipllava": replace(IMAGES, shrink=_vipllava),
    "video_llava": replace(IMAGES, shrink=_llava),  # LLaVA's images, from its image tower
    "deepseek_vl": TOKEN_PER_PATCH,  # SigLIP, a token per patch
    "deepseek_vl_hybrid": TOKEN_PER_PATCH,  # and each image again, high-resolution, through SAM
    "janus": replace(TOKEN_PER_PATCH, shrink=_janus),  # SigLIP-like (its VQ model only generates images)
    "aria": replace(IMAGES, shrink=_aria),  # Idefics3's tower, its patches cross-attended by a fixed number of queries
}
