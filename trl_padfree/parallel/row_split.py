"""How a rank runs its chunk of a packed row that several ranks share (`SplitRowRun`): sequence parallelism (DeepSpeed
Ulysses, ulysses.py) and context parallelism (all-gathered keys and values, context.py), alone or together. The
trainer's feature (features/row_split.py, `RowSplit`) sets the split up and marks each training micro-batch's
`PackedBatch` with a run, which the packed forward hands the forward: this rank's chunk in, the whole row's per-token
outputs back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..modeling.attention.rows import PACKED_ROW_KWARG, row_in_flight
from ..modeling.packed_forward import PackedBatch
from ..modeling.vision import bidirectional_image_marks, image_spans_on_sliding_layers_only, packed_position_ids
from ..packing.prefix_sharing import shared_prefix_keys
from ..refusals.parallel import check_prefix_sharing_without_sequence_parallel
from .context import ContextParallelRow
from .groups import RowGroup
from .image_shares import images_dealt
from .ulysses import ulysses_enabled


@dataclass(frozen=True)
class SplitRowRun:
    """How this rank runs its chunk of a shared row: Ulysses (`ulysses`, DeepSpeed's group) exchanges heads for
    sequence inside attention; context parallelism (`context`) attends the chunk to the row's gathered keys; with
    both, Ulysses' group assembles a context-parallel chunk from its ranks' smaller ones. `row`: every rank of the
    row."""

    row: RowGroup
    ulysses: RowGroup | None
    context: RowGroup | None
    deal_images: bool = True
    image_rows: dict[str, int] | None = None  # counts rows whose images were dealt, or run whole, here

    @property
    def size(self) -> int:
        return self.row.size

    def run(self, forward, packed_batch: PackedBatch, kwargs: dict, module):
        # Stateful mixers were refused at set-up (features/row_split.py); a shared row is this batch's, read from its
        # host integers: a collator that shares may be handed in past the set-up check
        check_prefix_sharing_without_sequence_parallel(packed_batch.host.shared_pairs > 0, self.ulysses is not None)
        images = packed_batch.image_inputs is not None
        if images:  # the model's own forward embeds the whole row; its language model runs this rank's chunk
            marks = bidirectional_image_marks(module)  # Ulysses attends over the whole row: spans and all
            model_kwargs = packed_batch.model_kwargs(
                packed_position_ids(module, packed_batch), marks, image_spans_on_sliding_layers_only(module)
            )
        else:
            model_kwargs = packed_batch.model_kwargs()
            model_kwargs["input_ids"] = self.row.chunk(packed_batch.input_ids)
            model_kwargs["position_ids"] = self.row.chunk(packed_batch.position_ids)
        if kwargs.pop("labels", None) is not None:
            kwargs["shift_labels"] = self.row.chunk(packed_batch.shift_labels())
        if self.context is not None:  # carries prefix sharing's layout, localized to the chunk
            model_kwargs[PACKED_ROW_KWARG] = ContextParallelRow(
                packed_batch.cu_seq_lens, None, group=self.context, row_length=packed_batch.row_length,
                shared_prefix=shared_prefix_keys(packed_batch.host), bounds=packed_batch.host.cu_seq_lens,
            )  # fmt: skip
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(row_in_flight(model_kwargs[PACKED_ROW_KWARG]))
            if self.ulysses is not None:
                scopes.enter_context(ulysses_enabled(module))
            if images:
                scopes.enter_context(language_model_on_chunk(module, self.row, packed_batch.row_length))
                dealt = (
                    self.deal_images
                    and packed_batch.image_units is not None
                    and scopes.enter_context(
                        images_dealt(module, packed_batch.image_units, packed_batch.image_inputs, self.row)
                    )
                )
                if self.image_rows is not None:
                    self.image_rows["dealt" if dealt else "whole"] += 1
            outputs = forward(**{**kwargs, **model_kwargs})
        return packed_batch.to_padded_outputs(_gathered_outputs(outputs, self.row, packed_batch.row_length))


@contextlib.contextmanager
def language_model_on_chunk(model: torch.nn.Module, row: RowGroup, row_length: int):
    """Hand a vision-language model's language model this rank's chunk of what the model computed for the whole row:
    its embeddings (every image's features already placed, dealt or not: image_shares.py), its
    positions (the model's own position function, on the whole row) and any other per-token input. The chunk's
    gradient reaches the vision tower through the embeddings, summed over the row's ranks as the text's is."""

    def chunk_inputs(module, args, kwargs):
        if args:
            raise TypeError("trl-padfree splits a language model's inputs by keyword; it was called positionally")
        return args, chunked_language_model_inputs(kwargs, row, row_length)

    hook = model.get_decoder().register_forward_pre_hook(chunk_inputs, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


def chunked_language_model_inputs(kwargs: dict, row: RowGroup, row_length: int) -> dict:
    """`kwargs` of a language model call on the whole row, with every per-token input cut to `row`'s chunk."""
    chunked = dict(kwargs)
    chunked.pop("attention_mask", None)  # a mask of the whole row; the packed attention reads the row itself
    for key, value in kwargs.items():
        if key == "position_ids":  # (1, T), or (sections, 1, T) with a position function
            chunked[key] = row.chunk(value.movedim(-1, 1)).movedim(1, -1)
        elif key == "deepstack_visual_embeds" and value is not None:  # Qwen3-VL: features of the row's image tokens
            mine = _chunk_image_tokens(kwargs["visual_pos_masks"][0], row, row_length)
            chunked[key] = [features[mine] for features in value]
        elif key == "deepstack_features" and value is not None:  # Granite 4 Vision: per layer, as Qwen3-VL's
            mine = _chunk_image_tokens(kwargs["vision_mask"][0, :, 0], row, row_length)
            chunked[key] = {layer: features[mine] for layer, features in value.items()}
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, row_length):
            chunked[key] = row.chunk(value)
    return chunked


def _chunk_image_tokens(image_tokens: torch.Tensor, row: RowGroup, row_length: int) -> torch.Tensor:
    """Which of the row's image tokens (`image_tokens`, the row's mask of them) lie in `row`'s chunk."""
    length = row_length // row.size
    mine = torch.zeros_like(image_tokens)
    mine[row.rank * length : (row.rank + 1) * length] = True
    return mine[image_tokens]


def _gathered_outputs(outputs, group: RowGroup, row_length: int):
    """Every per-token output of a rank's chunk, all-gathered into the whole row (differentiably)."""
    chunk_length = row_length // group.size
    for key in list(outputs.keys()):
        value = outputs[key]
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, chunk_length):
            # Position i scored token i + 1: the row's last position scored nothing
            outputs[key] = group.gather(value)[:, : row_length - 1]
    return outputs
