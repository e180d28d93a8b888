"""What the layout modules share about a twin's images: their sizes and the image tokens each takes."""

from __future__ import annotations

import torch


def side(size) -> int:
    """An image or patch size given as one number or as (height, width)."""
    return size[0] if isinstance(size, (list, tuple)) else size


def fixed_tokens(config, token_per_patch: bool = False) -> int:
    """Image tokens per image (or tile) of a family whose images all take as many (its twin geometry's)."""
    for name in ("mm_tokens_per_image", "image_seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    if getattr(config, "projector_patch_to_query_dict", None):  # Aria: the queries for the image's patches
        patches = (side(config.vision_config.image_size) // side(config.vision_config.patch_size)) ** 2
        return config.projector_patch_to_query_dict[patches]
    if getattr(config, "perceiver_config", None) is not None:  # Idefics2: a resampler's latents
        return config.perceiver_config.resampler_n_latents
    vision = config.vision_config
    patches = (side(vision.image_size) // side(vision.patch_size)) ** 2
    if token_per_patch:
        return patches
    # pixel shuffle: Idefics3's scale factor, Aya Vision's downsample factor, Llama 4's ratio
    factor = getattr(config, "scale_factor", None) or getattr(config, "downsample_factor", None)
    factor = factor or getattr(vision, "hidden_stride", None)  # Ovis 2's patches per token, on a side
    factor = factor or round(1 / vision.pixel_shuffle_ratio)
    return patches // factor**2


def feature_tokens(output) -> list[int]:
    """Each image's tokens, from its features as `get_image_features` returns them: its `pooler_output`, or where it
    only adds features inside the language model (Granite 4 Vision's deepstack, `(layer, per-image features)` pairs),
    the first layer's."""
    features = output.get("pooler_output")
    if features is None:
        features = output.deepstack_features[0][1]
    return [len(image) for image in features]


def doubled(inputs: dict[str, torch.Tensor], dim: int = 0) -> dict[str, torch.Tensor]:
    """Image inputs on the chosen rows, then again on the rejected rows, as TRL's vision collator lays them out."""
    return {key: torch.cat([value, value], dim=dim) for key, value in inputs.items()}
