"""Vision-language models on a packed row (the batch side is packing/vision.py).

- **Positions.** A model with its own position function (`get_rope_index`: Qwen-VL's 3-D mRoPE, where an image's
  tokens take positions along time, height and width, and the text after it continues from the largest) gets, for
  every token of the row, the position that function gives it in its own sequence: computed on the padded view of the
  row (every sequence whole, as TRL's padded forward computes it, with the per-token image marks it reads, or none
  where it finds images by the tokens around them: Qwen-Omni's thinkers), then laid back onto the row, under a row of
  plain text positions. transformers' Qwen-VL models read that `(4, 1, T)` layout as packed: row 0 keeps the sequences
  apart in mask-based attention, rows 1-3 rotate. A model without one reads the plain positions, as for text.
- **Attention.** Only the language model runs the packed attention (`set_language_model_attention`, in
  integrations/transformers.py); the vision tower keeps its own, and keeps its images apart itself. Gemma 3's image
  tokens attend to their whole image: the row carries those spans to `padfree_varlen` (attention/bidirectional.py).
- **Families.** Each vision-language model type is one record (modeling/families/): how its processor lays its
  images out, how its forward reads them (the functions here read those records), its twin's geometry and its
  verdict, decided by the architecture check on a twin with images.
- **Which models take images** at all, as TRL's trainer will run them (`why_no_images`), for the data check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .families import image_family

if TYPE_CHECKING:
    from .packed_batch import PackedBatch


def per_image_loop(model: torch.nn.Module) -> tuple[str, str] | None:
    """(the module, the unit) of a model whose forward runs a module's layers once per image or crop
    (`VisionFamily.per_image_loop`); None for the others."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = image_family(model_type)
    if family is None or family.per_image_loop is None:
        return None
    return family.per_image_loop, family.per_image_unit


def cross_attention_refusal(config) -> str | None:
    """Why a model whose images reach the language model through cross-attention (Mllama) cannot be packed."""
    layers = getattr(config.get_text_config(), "cross_attention_layers", None)
    if not layers:
        return None
    return (
        f"its images reach the language model through cross-attention (layers {list(layers)}): there every token "
        "attends to the images of its whole batch row, so packed sequences would read each other's images, and no "
        "packed form of that attention is built; train it padded (padding_free=False)"
    )


def bidirectional_image_marks(model: torch.nn.Module | None) -> str | None:
    """For a model whose image tokens attend to the whole image (Gemma 3; Gemma 4 where its config says so), the
    per-token input that marks them."""
    return image_marks_of_config(getattr(model, "config", None))


def image_marks_of_config(config) -> str | None:
    """`bidirectional_image_marks`, read from a model's config."""
    family = image_family(getattr(config, "model_type", None))
    if family is None:
        return None
    if family.bidirectional_images or (family.bidirectional_on_vision_config and _vision_bidirectional(config)):
        return family.token_types
    return None


def image_spans_on_sliding_layers_only(model: torch.nn.Module | None) -> bool:
    """Whether a model's image spans (`bidirectional_image_marks`) hold on its sliding-window layers alone (Gemma 4)."""
    return spans_on_sliding_layers_only_of_config(getattr(model, "config", None))


def spans_on_sliding_layers_only_of_config(config) -> bool:
    """`image_spans_on_sliding_layers_only`, read from a model's config."""
    family = image_family(getattr(config, "model_type", None))
    return family is not None and family.bidirectional_on_vision_config


def _vision_bidirectional(config) -> bool:
    return getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"


def position_function(model: torch.nn.Module | None) -> Callable | None:
    """The model's own function for the positions of a sequence with images (`get_rope_index`), if it has one: on the
    model or on its inner model (transformers' `...ForConditionalGeneration.model`)."""
    for candidate in (model, getattr(model, "model", None)):
        function = getattr(candidate, "get_rope_index", None)
        if callable(function):
            return function
    return None


def packed_position_ids(model: torch.nn.Module | None, packed_batch: PackedBatch) -> torch.Tensor:
    """The positions `model` reads for the packed row: plain `(1, T)` positions, or for a vision-language batch on a
    model with a position function, `(4, 1, T)`: the plain positions over the model's own ones."""
    rope_index = position_function(model)
    if rope_index is None or packed_batch.image_inputs is None:
        return packed_batch.position_ids
    text = packed_batch.position_ids.unsqueeze(0)
    family = image_family(getattr(getattr(model, "config", None), "model_type", None))
    marks_key = family.position_marks if family is not None else "mm_token_type_ids"
    token_types = packed_batch.image_inputs.get(marks_key) if marks_key is not None else None
    if marks_key is not None and token_types is None and packed_batch.sequence_image_grid_thw is not None:
        # the model's own forward raises on such a batch too (transformers 5.24's `compute_3d_position_ids`)
        raise ValueError(
            f"{type(model).__name__} places its images by {marks_key}, which the processor did not return, so "
            "its image positions cannot be computed (its padded forward raises too); set "
            "`processor.return_mm_token_type_ids = True` before building the trainer"
        )
    if packed_batch.sequence_image_grid_thw is None:
        # TRL's padded forward then leaves positions to the language model: plain ones, on every axis
        return torch.cat([text] * 4)
    grids = family.position_grids if family is not None else "image_grid_thw"
    # As the model's forward calls it on image pairs: the marks where it reads them (Qwen-Omni's reads none)
    marks = {marks_key: packed_batch.padded(token_types)} if marks_key is not None else {}
    padded_positions, _ = rope_index(
        input_ids=packed_batch.padded(packed_batch.input_ids),
        attention_mask=packed_batch.token_valid.long(),
        **marks,
        **{grids: packed_batch.sequence_image_grid_thw},
    )
    # (Qwen3-Omni's positions are floats: the row takes their dtype, exact for whole positions below 2**24)
    return torch.cat([text, packed_batch.packed(padded_positions)])


def image_token_id(config) -> int | None:
    """The token a vision-language model's config places image features on."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def is_vision_language(config) -> bool:
    # A family's default config may leave its image token unset (MiniCPM-V's: the checkpoint's config names it)
    if getattr(config, "vision_config", None) is None:
        return False
    return image_token_id(config) is not None or image_family(getattr(config, "model_type", None)) is not None


def vision_tower_left_out(config) -> bool:
    """A vision-language class whose config leaves its vision tower out (Gemma 4's default config): the model it
    builds is its language model alone, and takes no images."""
    return hasattr(config, "vision_config") and config.vision_config is None


def why_no_images(model, processing_class, trust_remote_code: bool = False, revision: str | None = None) -> str | None:
    """Why `model` (a model, or a name TRL will load at `revision`) takes no images as TRL's `DPOTrainer` will run it,
    or None if it takes them. TRL reads images only through a processor, the one passed or the one `AutoProcessor`
    loads for the model; and a model without a vision tower has nothing to encode them with."""
    from transformers import AutoConfig, AutoProcessor, ProcessorMixin

    from ..integrations.trl import get_config_model_id

    if isinstance(model, str):
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    else:
        config = model.config
        revision = None  # TRL passes the model's revision on to the processor only for a model it loads by name
    if vision_tower_left_out(config):
        return f"its config ({type(config).__name__}) has no vision tower (vision_config=None)"
    if processing_class is None:  # as TRL loads it
        model_id = model if isinstance(model, str) else get_config_model_id(model.config)
        processing_class = AutoProcessor.from_pretrained(
            model_id, revision=revision, trust_remote_code=trust_remote_code
        )
    if not isinstance(processing_class, ProcessorMixin):
        return (
            f"its processing class is {type(processing_class).__name__}, a tokenizer; TRL reads images only through "
            "a vision-language model's processor"
        )
    return None
