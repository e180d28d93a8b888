"""`PackedBatch`: one packed row as the model runs it, and the index maps that turn its per-token outputs into the
padded views TRL's loss reads (modeling/packed_forward.py runs it; vision.py reads its positions; parallel/row_split.py
splits it over ranks).

    packed row    | a1 a2 a3 a4 | b1 b2 | ... | pad |     cu_seq_lens [0, 4, 6, ...], position_ids restart per segment
    padded view   [[a1 a2 a3 a4], [b1 b2 0 0], ...]      token_index / token_valid: each cell's packed position
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..packing.layout import HOST_ROW, HostRow, padded_view_index, to_padded_view, token_runs
from ..packing.vision import IMAGE_INPUTS, IMAGE_UNITS, IMAGES_PER_SEQUENCE, SEQUENCE_IMAGE_GRIDS, ImageUnitSizes
from .attention.rows import PACKED_ROW_KWARG, PackedRow


class SplitRun(Protocol):
    """A packed row shared by several ranks, each running its chunk (features/row_split.py marks a training batch with
    one): runs the model on this rank's chunk and returns the whole row's per-token outputs, padded views."""

    size: int  # ranks that share the row

    def run(self, forward, packed_batch: PackedBatch, kwargs: dict[str, Any], module) -> Any: ...


@dataclass
class PackedBatch:
    """One packed row and the index maps that turn its per-token outputs into padded views."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)
    completion_mask: torch.Tensor  # (1, T)
    cu_seq_lens: torch.Tensor  # (segments + 1,) int32, the padding segment included
    max_length: int
    seq_lens: torch.Tensor  # (sequences,), the padding segment excluded
    # From a prefix-sharing collator, for the padded views: per sequence, the row start of its own tokens and of the
    # prefix it reads first, and that prefix's tokens (a prompt group's equal sequences read the same positions: the
    # padded views' gather sums their gradients)
    seq_starts: torch.Tensor | None = None
    shared_prefix_starts: torch.Tensor | None = None
    shared_prefix_lens: torch.Tensor | None = None
    # Vision-language batches (packing/vision.py): the model's image inputs in row order and its per-token inputs
    # packed; every sequence's image grids in TRL's order and image counts
    image_inputs: dict[str, torch.Tensor] | None = None
    sequence_image_grid_thw: torch.Tensor | None = None
    images_per_sequence: torch.Tensor | None = None
    image_units: ImageUnitSizes | None = field(default=None, compare=False)  # host integers: which inputs are whose
    # Set on a training batch whose row several ranks share (sequence or context parallelism, features/row_split.py)
    split: SplitRun | None = field(default=None, compare=False)
    # The boundaries as host integers (the collator's): every index below is built from them without a device read
    host: HostRow | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.host is None:
            self.host = HostRow.of_tensors(
                self.cu_seq_lens, self.seq_lens, self.seq_starts, self.shared_prefix_starts, self.shared_prefix_lens
            )
        starts = self.seq_starts if self.seq_starts is not None else self.cu_seq_lens[: len(self.seq_lens)].long()
        prefix = (self.shared_prefix_starts, self.shared_prefix_lens)
        self.width = self.host.width
        self.token_index, self.token_valid = padded_view_index(starts, self.seq_lens, self.width, *prefix)
        # Shifted outputs: cell (i, j) scores token j + 1 of sequence i, computed at the packed position of token j.
        # (With prefix sharing, a rejected sequence's last prefix cell reads the output that scores the chosen
        # branch's first token: the same prompt token, never scored.)
        self.shifted_index, self.shifted_valid = padded_view_index(starts, self.seq_lens - 1, self.width - 1, *prefix)

    @classmethod
    def from_collated(cls, batch: dict[str, Any]) -> PackedBatch:
        return cls(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            completion_mask=batch["completion_mask"],
            cu_seq_lens=batch["cu_seq_lens_q"],
            max_length=int(batch["max_length_q"]),
            seq_lens=batch["seq_lens"],
            seq_starts=batch.get("seq_starts"),
            shared_prefix_starts=batch.get("shared_prefix_starts"),
            shared_prefix_lens=batch.get("shared_prefix_lens"),
            image_inputs=batch.get(IMAGE_INPUTS),
            sequence_image_grid_thw=batch.get(SEQUENCE_IMAGE_GRIDS),
            images_per_sequence=batch.get(IMAGES_PER_SEQUENCE),
            image_units=batch.get(IMAGE_UNITS),
            host=batch.get(HOST_ROW),
        )

    @property
    def real_row_tokens(self) -> int:
        """Tokens of the row before its padding segment (`HostRow.real_row_tokens`)."""
        return self.host.real_row_tokens

    @property
    def row_length(self) -> int:
        return self.input_ids.shape[1]

    def labels(self) -> torch.Tensor:
        # Score completion tokens only, and never the first token of a segment: the fused LM head shifts labels, so
        # that token would be scored from the last token of the previous sequence
        labels = self.input_ids.masked_fill(self.completion_mask == 0, -100)
        return labels.masked_fill(self.position_ids == 0, -100)

    def shift_labels(self) -> torch.Tensor:
        """`labels()` shifted left by one (position i scores token i + 1), for a forward on a chunk of the row."""
        labels = self.labels()
        return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)

    def padded(self, packed: torch.Tensor, fill_value=0) -> torch.Tensor:
        """`(1, T, ...)` -> `(sequences, width, ...)`."""
        return to_padded_view(packed[0], self.token_index, self.token_valid, fill_value)

    def packed(self, padded: torch.Tensor) -> torch.Tensor:
        """`(..., sequences, width)` -> `(..., 1, T)`: each token's value from its sequence's cell, 0 on the padding
        segment (with prefix sharing both sequences of a pair hold the prefix, with the same values)."""
        packed = padded.new_zeros(padded.shape[:-2] + (self.row_length,))
        packed[..., self.token_index[self.token_valid]] = padded[..., self.token_valid]
        return packed.unsqueeze(-2)

    @property
    def images_encoded(self) -> int:
        """Images the row hands the vision tower: those of every sequence laid out from its first token (each pair's
        twice unshared; once per pair, or once per prompt group, with prefix sharing: packing/vision.py)."""
        if self.images_per_sequence is None:
            return 0
        whole = [sequence for sequence in self.host.laid_out if self.host.prefix_lens[sequence] == 0]
        return int(self.images_per_sequence[whole].sum())

    def padded_shifted(self, packed: torch.Tensor, fill_value=0) -> torch.Tensor:
        """`(1, T - 1, ...)` next-token outputs -> `(sequences, width - 1, ...)`."""
        return to_padded_view(packed[0], self.shifted_index, self.shifted_valid, fill_value)

    def padded_inputs(self, pad_token_id: int) -> dict[str, torch.Tensor]:
        """The padded `input_ids`/`attention_mask`/`completion_mask` TRL's loss code reads (never fed to a model)."""
        return {
            "input_ids": self.padded(self.input_ids, pad_token_id),
            "attention_mask": self.token_valid.long(),
            "completion_mask": self.padded(self.completion_mask),
        }

    def row(self, image_marks: str | None = None, sliding_layers_only: bool = False) -> PackedRow:
        """How this row attends: the row of its host integers (`PackedRow.of_host_row`, modeling/attention/rows.py);
        for a model whose image tokens, marked in its per-token input `image_marks`, attend both ways (Gemma 3), each
        image's tokens to the whole image (with `sliding_layers_only`, on sliding-window layers alone: Gemma 4)."""
        spans = None
        if image_marks is not None and self.image_inputs is not None:
            spans = self.image_spans(image_marks)
        return PackedRow.of_host_row(self.host, self.cu_seq_lens, self.max_length, spans, sliding_layers_only)

    def image_spans(self, image_marks: str) -> tuple[tuple[int, int], ...]:
        """The runs of image tokens: the collator's host integers, or for a batch built without them the runs the
        model's per-token input `image_marks` marks (one device read)."""
        if self.host.image_spans is not None:
            return self.host.image_spans
        return token_runs(self.image_inputs[image_marks][0].tolist(), 1)

    def model_kwargs(
        self,
        position_ids: torch.Tensor | None = None,
        image_marks: str | None = None,
        sliding_layers_only: bool = False,
    ) -> dict[str, Any]:
        # No attention mask: transformers only honours packed position_ids without one, and flash kernels read
        # cu_seq_lens (all four keys, or they re-derive them with a host sync in every layer). `packed_row` reaches
        # `padfree_varlen` through transformers' keyword arguments
        return {
            **(self.image_inputs or {}),
            "input_ids": self.input_ids,
            "position_ids": self.position_ids if position_ids is None else position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "use_cache": False,
            PACKED_ROW_KWARG: self.row(image_marks, sliding_layers_only),
        }

    def to_padded_outputs(self, outputs):
        """Replace every per-token field of a model output by its padded view, in place."""
        for key in list(outputs.keys()):
            value = outputs[key]
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1:
                continue
            if value.shape[1] == self.row_length:
                outputs[key] = self.padded(value)
            elif value.shape[1] == self.row_length - 1:
                outputs[key] = self.padded_shifted(value)
        return outputs
