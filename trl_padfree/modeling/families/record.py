"""The record of a vision-language family: everything trl-padfree knows about one image-text-to-text model type.

A family's record lives in the module of its image layout (patches.py, images.py, sized.py, tiles.py, rows.py,
navit.py), or, for a type that does not pack, in not_packed.py; catalog.py gathers them. Everything that depends on the
family reads its record: the architecture check's twin (its geometry and random images, twin.py), the packed forward
(modeling/vision.py: its positions and image marks), the engines' refusals (its per-image loops) and
`trl-padfree models` (its verdict). The collator needs none of it: it reads a batch's layout from the keys the
processor returns (packing/vision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (the twin, images per example, a noise source) -> (image inputs as the processor and TRL's vision collator lay them
# out, every image on the chosen rows then again on the rejected ones; the image tokens of each image)
TwinImages = Callable[[torch.nn.Module, list[int], Callable[..., torch.Tensor]], tuple[dict, list[int]]]


@dataclass(frozen=True)
class VisionFamily:
    """One image-text-to-text model type.

    Its verdict on image data: **exact** (a `layout`, nothing `refused`), **refused** (`refused`: the reason and the
    way out) or **unchecked** (`unchecked`: what the architecture check is missing to give its twin images).
    """

    # How its processor lays a batch's images out: "patches", "images", "sized" (images with `image_sizes`, their
    # tokens depending on their size), "tiles" (each image cut into tiles), "rows" or "navit" (every crop's patches
    # along one axis, with each crop's grid: MiniCPM-V); None where it is not known
    layout: str | None = None
    # The twin's geometry: its images shrunk to a few tokens, in place on the shrunk config's `to_dict()` values
    shrink: Callable[[dict], None] | None = None
    # The twin's random image inputs, as its processor lays them out (the layout module's builders)
    twin_images: TwinImages | None = None
    token_types: str | None = None  # the per-token input marking image tokens, if the model takes one
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
    # The tokens (config names) its processor writes around each image, where its forward reads them: Qwen-Omni's
    # thinkers' position function finds images by them (an image token after a vision-start token), computing those
    # positions only given an attention mask; Ovis2.5 replaces them by learned embeddings, one pair per image
    image_bounds: tuple[str, str] | None = None
    # A module whose forward runs its layers once per image (or crop) in a Python loop, as `named_modules` names it
    # (`*`: any layer): a rank calls them as many times as its row has images, which DeepSpeed ZeRO-3 cannot follow
    # when the processes' rows differ (refusals.check_zero3_per_image_loop)
    per_image_loop: str | None = None
    per_image_unit: str = "image"
    # Its twin's mRoPE rotates each head's rope part of a latent attention (HY-V4-VL), not the whole head
    latent_mrope: bool = False
    refused: str | None = None  # why padding-free cannot train it on image data, and what a user can do
    unchecked: str | None = None  # what the architecture check is missing to give its twin images

    def __post_init__(self):
        packs = self.layout is not None and self.twin_images is not None
        if not packs and self.refused is None and self.unchecked is None:
            raise ValueError("a vision family without a layout is refused or unchecked, with the reason")

    @property
    def exact(self) -> bool:
        return self.layout is not None and self.refused is None and self.unchecked is None


TRAIN_PADDED = "train it padded (padding_free=False)"


def refused(reason: str) -> VisionFamily:
    """A type looked at and refused on image data, with the reason and the way out."""
    return VisionFamily(refused=reason)


def unchecked(missing: str) -> VisionFamily:
    """A type that could pack, but that the architecture check cannot give a twin with images yet."""
    return VisionFamily(unchecked=missing)
