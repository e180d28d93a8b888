"""Refusals of vision-language batches: images and their placeholders, images cut by `max_length`, image inputs
that cannot be told apart per sequence, images longer than a sliding window that they see past."""

from __future__ import annotations

# ---- vision-language batches ----


def check_image_tokens(example: int, images: int, image_tokens: int) -> None:
    """Each sequence's image placeholders and images must come together: features are placed on the placeholders."""
    if images and not image_tokens:
        raise ValueError(
            f"Example {example} of the batch has {images} image(s) but no image placeholder in its text, so the model "
            "has nowhere to put them. Put the images in the prompt (a conversational prompt with {'type': 'image'} "
            "parts, or the processor's image token in a plain prompt), or remove them from the example."
        )
    if image_tokens and not images:
        raise ValueError(
            f"Example {example} of the batch has {image_tokens} image tokens in its text but no image: the model would "
            "read the placeholders as text and train on them. Give the example its images (an `images` list) or "
            "remove the image tokens from its text."
        )


def refuse_truncated_image(example: int, image_tokens: int, kept: int, needed: int, max_length: int) -> None:
    """TRL's vision collator cuts every sequence to its first `max_length` tokens; an image must survive whole."""
    raise ValueError(
        f"max_length={max_length} cuts the images of example {example} of the batch: {kept} of its {image_tokens} "
        f"image tokens are within the first {max_length} tokens, and the model would get an image without its "
        f"placeholders (TRL's padded trainer fails there with 'Image features and image tokens do not match'). Set "
        f"max_length to at least {needed} (or None), use smaller images, or drop such examples."
    )


def check_image_inputs_layout(sizes: dict[str, int], expected: int, unit: str) -> None:
    """Each image input must be cut into the parts each sequence holds (packing/vision.py)."""
    wrong = {key: size for key, size in sizes.items() if size != expected}
    if wrong:
        raise ValueError(
            f"trl-padfree cannot tell which image inputs belong to which sequence: from this processor's keys it "
            f"expects {expected} {unit} in each, but found {wrong}. Train with padding_free=False (TRL pads, and "
            "packs nothing)."
        )


def check_image_within_window(past_window: tuple[int, int] | None) -> None:
    """Gemma 4 Unified's image tokens see their whole image on sliding-window layers, past the window too; the packed
    attention bounds them by the window, as Gemma 3's are: the same for images no longer than the window."""
    if past_window is not None:
        tokens, window = past_window
        raise ValueError(
            f"An image of {tokens} tokens is longer than this model's sliding window ({window}): its tokens see the "
            "whole image past the window, which the packed attention does not compute. Use images of at most "
            f"{window} tokens (the image processor's max_soft_tokens), or set padding_free=False."
        )
