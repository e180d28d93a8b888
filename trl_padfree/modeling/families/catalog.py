"""Every vision-language family's record, gathered from the modules that hold them: one module per image layout, and
not_packed.py. A new family is one record in one of those modules; nothing here names a family."""

from __future__ import annotations

from . import images, navit, not_packed, patches, rows, sized, tiles
from .record import VisionFamily

LAYOUT_MODULES = (patches, images, sized, tiles, rows, navit)


def _gathered() -> dict[str, VisionFamily]:
    families: dict[str, VisionFamily] = {}
    for module in (*LAYOUT_MODULES, not_packed):
        for model_type, family in module.FAMILIES.items():
            if model_type in families:
                raise ValueError(f"{model_type} has two records ({module.__name__} and another)")
            if getattr(module, "LAYOUT", family.layout) != family.layout:
                raise ValueError(f"{model_type}'s record in {module.__name__} has layout {family.layout!r}")
            families[model_type] = family
    return families


VISION_FAMILIES = _gathered()
# The families the architecture check gives a twin with images (exact, or refused for a reason outside the model)
IMAGE_FAMILIES = {
    model_type: family
    for model_type, family in VISION_FAMILIES.items()
    if family.layout is not None and family.unchecked is None
}


def vision_family(model_type: str | None) -> VisionFamily | None:
    """The record of an image-text-to-text type; None for a type no record names."""
    return VISION_FAMILIES.get(model_type)


def image_family(model_type: str | None) -> VisionFamily | None:
    """The record of a type trl-padfree lays images out for; None for the others."""
    return IMAGE_FAMILIES.get(model_type)


UNCHECKED = "unchecked"  # how the verdict of a type the check cannot give images begins


def image_refusal(model_type: str | None) -> str | None:
    """Why padding-free cannot train `model_type` on image data, with the way out; None if its record refuses
    nothing."""
    family = vision_family(model_type)
    return family.refused if family is not None else None


def unchecked_verdict(model_type: str | None) -> str:
    """The verdict on image data of a type with no image layout: what is missing, and what trains it meanwhile."""
    family = vision_family(model_type)
    what = family.unchecked if family is not None and family.unchecked else "no record of its image layout"
    return (
        f"{UNCHECKED} ({what}): the check cannot give its twin images yet, so padding_free=True refuses it on image "
        "data; TRL's padded trainer (padding_free=False) trains it"
    )
