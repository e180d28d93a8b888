"""Run a model on a packed row, and hand back its per-token outputs as a right-padded view.

TRL's loss code (every loss type, `ld_alpha`, WPO weights, the metrics) reads per-token outputs of shape
`(2 * batch, len - 1)`, one row per sequence. Rather than re-implement it, the model runs once on the packed row and
its per-token outputs (log-probs, entropy, ...: a few scalars per token, never hidden states) are gathered into that
layout, zero where a row has no token, exactly as the padded forward leaves them. So the loss and metrics are TRL's
own code on the same numbers; only the forward differs.

    packed log-probs   | a1 a2 a3 a4 x | b1 b2 x | ...      (x: scores the next segment's first token, unused)
    padded view        [[a1 a2 a3 a4], [b1 b2 0 0], ...]

What the forward needs to know of the model (its attention, the longest exact row, how its images attend) is decided
once, when the model gets the packed forward at the trainer's set-up (`ForwardPlan`); each batch is only compared with
it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..integrations.transformers import attn_implementation, mask_creation_skipped
from ..refusals.forward import check_no_cache
from ..refusals.models import check_packed_row_length
from ..refusals.vision import check_image_within_window
from .attention.rows import PACKED_ROW_KWARG, PackedRow, row_in_flight
from .backends import ATTN_IMPLEMENTATION
from .mixers import CACHE_KWARGS, SEGMENTS_KWARG, MixerSegments, add_segmented_mixers, stateful_mixers
from .packed_batch import PackedBatch
from .vision import image_family, image_marks_of_config, packed_position_ids, spans_on_sliding_layers_only_of_config

PACKED_BATCH_KWARG = "packed_batch"


def packed_row_limit(config) -> int | None:
    """The longest packed row that stays exact for this architecture, or None when any length does.

    Llama 4's NoPE layers scale queries by their index in the row ("attention temperature tuning"), not by their
    position in their sequence: the scale is 1 for indices below `floor_scale - 1` (8191), so rows up to that length
    equal each sequence alone. The architecture check's short sequences cannot see this.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    floor_scale = getattr(text_config, "floor_scale", None)
    if getattr(text_config, "attn_temperature_tuning", False) and floor_scale:
        return int(floor_scale) - 1
    return None


@dataclass(frozen=True)
class ForwardPlan:
    """What a model's packed forward reads of the model, decided once (`of_model`) when `add_packed_forward` gives it
    the forward: after the trainer's set-up has chosen its attention (features/padding_free.py)."""

    attention: str | None  # the attention its language model runs
    model_type: str | None  # its text config's, named by the row-length refusal
    row_limit: int | None  # the longest packed row that stays exact (`packed_row_limit`); None: any length
    # The per-token input marking image tokens that attend to their whole image (vision.py), and whether they do on
    # sliding-window layers alone; None: images attend causally
    image_marks: str | None
    image_spans_on_sliding_layers_only: bool
    # The sliding window an image's tokens see past (Gemma 4 Unified), which the packed attention bounds them by: an
    # image longer than it is refused; None: no such model
    image_window: int | None

    @classmethod
    def of_model(cls, module: torch.nn.Module | None) -> ForwardPlan:
        # What it reads of the module, read here once: its config and the attention it runs
        config = getattr(module, "config", None)
        if config is None:  # a bare forward function: nothing to decide
            return cls(None, None, None, None, False, None)
        attention = attn_implementation(module)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        image_marks = image_marks_of_config(config)
        family = image_family(getattr(config, "model_type", None))
        image_window = None
        if image_marks is not None and family is not None and family.images_past_window:
            image_window = getattr(text_config, "sliding_window", None)
        return cls(
            attention=attention,
            model_type=getattr(text_config, "model_type", None),
            row_limit=packed_row_limit(config),
            image_marks=image_marks,
            image_spans_on_sliding_layers_only=spans_on_sliding_layers_only_of_config(config),
            image_window=image_window,
        )

    def check_row(self, packed_batch: PackedBatch) -> None:
        """The batch's row against what set-up decided: its length. (Set-up chose an attention that reads a shared
        row; a forward whose attention did not read it raises, `row_in_flight`.)"""
        check_packed_row_length(self.model_type, packed_batch.row_length, self.row_limit)

    def check_images(self, packed_batch: PackedBatch) -> None:
        """The batch's longest image against the window its tokens see past, where set-up found one."""
        if self.image_window is not None and packed_batch.image_inputs is not None:
            spans = packed_batch.image_spans(self.image_marks)
            longest = max((end - start for start, end in spans), default=0)
            check_image_within_window((longest, self.image_window) if longest > self.image_window else None)


def forward_plan(module: torch.nn.Module | None) -> ForwardPlan:
    """The plan `add_packed_forward` recorded on `module`; for a module run without it, decided at this call."""
    plan = getattr(module, "_padfree_forward_plan", None)
    return plan if plan is not None else ForwardPlan.of_model(module)


def run_packed(forward, packed_batch: PackedBatch, kwargs: dict[str, Any], module: torch.nn.Module | None = None):
    """Call `forward` on the packed row in place of the padded inputs TRL built, and return padded views."""
    check_no_cache(bool(kwargs.get("use_cache")) or any(kwargs.get(name) is not None for name in CACHE_KWARGS))
    # TRL built these for its padded layout; the packed row replaces them
    for key in ("input_ids", "attention_mask", "position_ids", "inputs_embeds"):
        kwargs.pop(key, None)
    plan = forward_plan(module)
    plan.check_row(packed_batch)
    if packed_batch.split is not None:
        return packed_batch.split.run(forward, packed_batch, kwargs, module)
    if getattr(module, "_padfree_stateful_mixers", ()):  # hybrid models: their mixers restart at every sequence
        kwargs[SEGMENTS_KWARG] = MixerSegments.of_packed_batch(packed_batch)
    if kwargs.get("labels") is not None:
        kwargs["labels"] = packed_batch.labels()
    plan.check_images(packed_batch)
    model_kwargs = packed_batch.model_kwargs(
        packed_position_ids(module, packed_batch), plan.image_marks, plan.image_spans_on_sliding_layers_only
    )
    row = model_kwargs[PACKED_ROW_KWARG]
    with row_in_flight(row), _once_per_forward(row, packed_batch, plan.attention):
        outputs = forward(**{**kwargs, **model_kwargs})
    return packed_batch.to_padded_outputs(outputs)


@contextlib.contextmanager
def _once_per_forward(row: PackedRow, packed_batch: PackedBatch, attention: str | None):
    """What the attention calls of a packed text row would otherwise each do: the Flash backend chosen once around
    the forward (the user's flags restored after, and for layers that run per segment), and no mask built for a
    backend that reads the row itself (modeling/backends.py)."""
    with contextlib.ExitStack() as scopes:
        if attention == ATTN_IMPLEMENTATION:
            scopes.enter_context(mask_creation_skipped(attention))
            if packed_batch.image_inputs is None:  # a vision tower's own attention would run under the flags too
                scopes.enter_context(row.session.flash_around_forward(packed_batch.input_ids))
        yield


def add_packed_forward(model: torch.nn.Module) -> None:
    """Let `model(..., packed_batch=PackedBatch)` run on the packed row and return padded per-token outputs.

    Wraps `model.forward` the way TRL's `add_fused_lm_head` does, on the same module, so every caller inside TRL
    (policy, reference model, adapter-disabled reference, precompute) goes through it. The model's stateful mixers
    (hybrid models, mixers.py) learn to keep the row's sequences apart. Idempotent.
    """
    model._padfree_forward_plan = ForwardPlan.of_model(model)  # again at each set-up: its attention may have changed
    if getattr(model, "_padfree_packed_forward", False):
        return
    mixers = stateful_mixers(model)
    model._padfree_stateful_mixers = tuple(add_segmented_mixers(mixers))
    inner_forward = model.forward

    @functools.wraps(inner_forward)
    def forward(*args, packed_batch: PackedBatch | None = None, **kwargs):
        if packed_batch is None:
            return inner_forward(*args, **kwargs)
        if args:
            raise TypeError("A packed forward takes keyword arguments only.")
        return run_packed(inner_forward, packed_batch, kwargs, model)

    model.forward = forward
    model._padfree_packed_forward = True
