"""What the architecture check needs to give a vision-language twin images (modeling/check/packability.py).

A twin of a vision-language model is shrunk as a text model's is, vision tower included (modeling/check/twin.py); then its
family's record shrinks its images to a few tokens and widens its image features to its language model
(`twin_geometry`), and makes random pixels of the shapes its processor makes (`twin_image_inputs`), placed in a padded
batch laid out as TRL's vision collator lays one out, which the check then packs as training packs it
(packing/vision.py). What each family keeps of its geometry is written beside its record, in the module of its layout.

Refused whatever the twin measures: Mllama's cross-attention to the images (modeling/vision.py), and the families whose
records say why (not_packed.py: Molmo 2, whose image tokens attend to every image token of their sequence and whose
pooling indices span the batch, ...). A type with no record is refused on image data, since the check cannot give its
twin images.
"""

from __future__ import annotations

import torch
import transformers

from ...integrations.transformers import base_model_class_names
from ..families.catalog import image_family
from ..families.record import VisionFamily

# The twin's special tokens (image placeholders, begin and end of image...) move below its vocabulary's end
SPECIAL_TOKEN_SUFFIXES = ("_token_id", "_token_index")
PLAIN_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# The twin's heads are 8 wide: 4 rotary frequencies, over time, height and width
TWIN_MROPE_SECTION = (1, 1, 2)


def remap_special_tokens(values: dict, vocab_size: int) -> None:
    """Move a config's special token ids that the twin's vocabulary cannot hold to its last ids, in place."""
    names = sorted(
        name
        for name, value in values.items()
        if name.endswith(SPECIAL_TOKEN_SUFFIXES)
        and name not in PLAIN_TOKEN_FIELDS
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value >= vocab_size
    )
    for offset, name in enumerate(names, start=1):
        values[name] = vocab_size - offset


def twin_geometry(model_type: str, values: dict, real_head_dims: bool = False) -> None:
    """Fix the shrunk config of a vision-language twin (`values`, as `to_dict` gives it) so its images are small and
    its image features as wide as its language model, in place; with `real_head_dims`, its mRoPE sections stay those
    of the real heads."""
    vision, text = values.get("vision_config"), values.get("text_config")
    if vision is None or text is None:
        return
    family = image_family(model_type)
    if "out_hidden_size" in vision:
        vision["out_hidden_size"] = text["hidden_size"]
    # mRoPE: the rotary half of a head, for a model with its own position function or MiniCPM-V's Qwen3.5 language
    # model (navit); not for a language model on plain 1-D positions, whose rotary config may not take the key
    # (LFM3-VL's is per layer type)
    if (
        family.layout in ("patches", "navit")
        and not real_head_dims
        and (family.layout == "navit" or has_position_function(model_type))
    ):
        rope = text.get("rope_parameters") or {}
        text["rope_parameters"] = {**rope, "mrope_section": list(TWIN_MROPE_SECTION)}
        # Rotary on a fraction of each head (GLM-4V-MoE: half): heads widened so the rotary part keeps its 8 dims
        fraction = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
        if fraction < 1.0:
            text["head_dim"] = round(2 * sum(TWIN_MROPE_SECTION) / fraction)
    if family.latent_mrope and not real_head_dims:  # latent attention: mRoPE rotates each head's rope part
        text["qk_rope_head_dim"] = text["head_dim"] = 2 * sum(TWIN_MROPE_SECTION)
    # Tokens around each image that a default config leaves unset (Qwen-Omni's thinkers; a checkpoint names them):
    # past the vocabulary, which remap_special_tokens moves below its end with the other special tokens
    for offset, name in enumerate(family.image_bounds or ()):
        if values.get(name) is None:
            values[name] = text["vocab_size"] + offset
    if family.shrink is not None:
        family.shrink(values)


def has_position_function(model_type: str) -> bool:
    """Whether `model_type`'s model places its tokens with its own position function (`get_rope_index`, found as
    modeling/vision.py's `position_function` finds it at run time: on its inner model)."""
    name = base_model_class_names().get(model_type)
    model_class = getattr(transformers, name, None) if name is not None else None
    return callable(getattr(model_class, "get_rope_index", None))


def twin_image_inputs(
    twin: torch.nn.Module, family: VisionFamily, images_per_example: list[int], seed: int
) -> tuple[dict, list[int]]:
    """Random image inputs for a batch of examples holding `images_per_example` images each, laid out as the family's
    processor and TRL's vision collator lay them out (every example's images on its chosen row, then again on its
    rejected row), and the image tokens each image of an example takes (example by example): from the twin's
    geometry, or where they depend on the image's size, from the twin's own image features."""
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return family.twin_images(twin, images_per_example, noise)
