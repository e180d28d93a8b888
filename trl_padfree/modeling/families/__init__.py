"""Vision-language families, one record each (record.py), in the module of its image layout: patches.py, images.py,
sized.py, tiles.py, rows.py, navit.py; types that do not pack in not_packed.py. catalog.py gathers them; twin.py gives
the architecture check's twin its family's images."""

from .catalog import (
    IMAGE_FAMILIES,
    UNCHECKED,
    VISION_FAMILIES,
    image_family,
    image_refusal,
    unchecked_verdict,
    vision_family,
)
from .record import VisionFamily

__all__ = [
    "IMAGE_FAMILIES",
    "UNCHECKED",
    "VISION_FAMILIES",
    "VisionFamily",
    "image_family",
    "image_refusal",
    "unchecked_verdict",
    "vision_family",
]
