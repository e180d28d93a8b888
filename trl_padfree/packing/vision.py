"""Vision-language preference batches packed into one row.

TRL's `DataCollatorForVisionPreference` runs the model's processor on each batch (tokens and pixels, on the fly) and
pads: one row per sequence, every chosen one then every rejected one, each row carrying its pair's images (so every
image is in the batch twice). trl-padfree keeps all of that, TRL's own code and numbers, and packs what it returns:

    TRL's padded batch     | p0 c0 . . | p1 c1 . | p0 r0 . | p1 r1 |   + images of rows 0, 1, 2, 3
    packed row             | p0 c0 | p1 c1 | p0 r0 | p1 r1 |          + the same images, in row order
    with prefix sharing    | p0 c0 | r0 | p1 c1 | r1 |                  + images of the chosen rows only
    one prompt, K = 3      | p0 a0 | b0 | c0 |                          + the images of row a only
    paired a>b a>c b>c

Per-token inputs (Gemma 3's `token_type_ids`, Qwen-VL's `mm_token_type_ids`) are packed as the tokens are. Image
inputs follow the image tokens: the row hands the model a row's images when that row's image tokens are in it. With
prefix sharing the sequences of a batch whose kept prompt tokens and images are identical form one prompt group
(`prefix_sharing.grouped_row_layout`, keyed by a digest of each row's image inputs): its prompt, image tokens
included, is laid out once, so its images are encoded once, for every pair of that prompt in the batch. A branch never
holds an image token: a sequence whose prompt ends on one is laid out whole, alone.

How a processor lays out a batch's images, read from the keys it returns:

    image_grid_thw           patches: `prod(grid)` rows of pixel_values per image, one grid row per image (Qwen-VL)
    pixel_attention_mask     rows: pixel_values `(rows, images, C, H, W)`, one entry per row of the batch (Idefics3,
                             SmolVLM)
    neither                  images: every image input has one entry per image (LLaVA, Gemma 3; with
                             `image_sizes` LLaVA-NeXT, Mistral 3), but a count per row (LLaVA-OneVision's
                             `batch_num_images`) one entry per row, and pixel_values with more entries than images
                             one per tile, as many per row as its image tokens say (InternVL, Aya Vision)
    target_sizes             navit: pixel_values `(1, C, patch, L)`, every crop's (an image's and its slices') patches
                             along the last axis, `prod(size)` patches of `patch` columns each, one size per crop
                             (MiniCPM-V): a row's crops are the next ones whose tokens add up to its image tokens
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ..integrations.trl import DataCollatorForVisionPreference
from ..refusals.vision import check_image_inputs_layout, check_image_tokens, refuse_truncated_image
from .collator import RowLayout, Sequences, lay_out_groups, lay_out_row, packed_row
from .layout import HOST_ROW, token_runs
from .prefix_sharing import DEFAULT_MIN_PROMPT_TOKENS

# The padded batch's per-token text inputs; any other `(rows, width)` tensor is a per-token input of the model
TEXT_KEYS = ("input_ids", "attention_mask", "completion_mask")
IMAGE_INPUTS = "image_inputs"  # the packed batch's key for what the model takes besides the row's tokens
# Qwen-VL's image grids in TRL's row order: the model's position function reads every sequence's images
SEQUENCE_IMAGE_GRIDS = "sequence_image_grid_thw"
IMAGES_PER_SEQUENCE = "images_per_sequence"
IMAGE_UNITS = "image_units"
NAVIT_SIZES = "target_sizes"  # MiniCPM-V's patch grid of each crop, its crops' patches along one axis


def image_count(example: dict[str, Any]) -> int:
    """Images of an example as TRL's vision collator reads them: `image` (one) or `images` (a list)."""
    if "image" in example:
        return int(example["image"] is not None)
    return len(example.get("images") or [])


@dataclass
class ImageUnits:
    """Every image input of a padded batch, cut into what each row of the batch holds."""

    by_row: dict[str, list[torch.Tensor]]  # key -> per row, that row's part of the input (possibly empty)
    # key -> each image's entries, where every input has its own entries per image (not per row or per tile)
    by_image: dict[str, list[int]] | None = None
    axes: dict[str, int] = dataclasses.field(default_factory=dict)  # key -> the axis its entries run along, if not 0

    @classmethod
    def of(
        cls, inputs: dict[str, torch.Tensor], images_per_row: list[int], image_tokens_per_row: list[int] | None = None
    ) -> ImageUnits:
        rows, images = len(images_per_row), sum(images_per_row)
        if NAVIT_SIZES in inputs:
            return cls._of_navit(inputs, image_tokens_per_row)
        if "pixel_attention_mask" in inputs and inputs["pixel_attention_mask"].dim() == 4:
            # one entry per row of the batch, images padded within it
            check_image_inputs_layout({key: value.shape[0] for key, value in inputs.items()}, rows, "rows")
            by_row = {
                key: [value[row : row + (1 if images_per_row[row] else 0)] for row in range(rows)]
                for key, value in inputs.items()
            }
            return cls(by_row)
        by_row = {
            key: list(value.split(1)) for key, value in inputs.items() if _is_count_per_row(value, images_per_row)
        }
        per_image = {key: list(value.split(1)) for key, value in inputs.items() if key not in by_row}
        if "image_grid_thw" in inputs:  # pixel_values holds each image's patches, prod(grid) rows of them
            patches = inputs["image_grid_thw"].prod(-1).tolist()
            check_image_inputs_layout({"pixel_values": inputs["pixel_values"].shape[0]}, sum(patches), "patches")
            per_image["pixel_values"] = list(inputs["pixel_values"].split(patches))
        tiles = _tiles_per_row(inputs, images, image_tokens_per_row)
        check_image_inputs_layout(
            {key: len(parts) for key, parts in per_image.items() if tiles is None or len(parts) != sum(tiles)},
            images,
            "images",
        )
        ends = list(itertools.accumulate(images_per_row))
        by_image = None
        if not by_row and tiles is None:
            by_image = {key: [part.shape[0] for part in parts] for key, parts in per_image.items()}
        for key, parts in per_image.items():
            if tiles is not None and len(parts) == sum(tiles):  # a row's tiles, in proportion to its image tokens
                by_row[key] = list(inputs[key].split(tiles))
            else:
                by_row[key] = [
                    _cat(parts[end - count : end], inputs[key])
                    for end, count in zip(ends, images_per_row, strict=True)
                ]
        return cls(by_row, by_image)

    @classmethod
    def _of_navit(cls, inputs: dict[str, torch.Tensor], image_tokens_per_row: list[int] | None) -> ImageUnits:
        """MiniCPM-V's crops, each `prod(size)` patches along pixel_values' last axis: every crop gives the same share
        of its patches as tokens (its merges), so a row's crops are the next ones whose tokens make its image tokens."""
        pixels, sizes = inputs["pixel_values"], inputs[NAVIT_SIZES]
        patches = sizes.prod(-1).tolist()
        check_image_inputs_layout({"pixel_values": pixels.shape[0]}, 1, "batch (every crop along the last axis)")
        check_image_inputs_layout({"pixel_values": pixels.shape[-1]}, sum(patches) * pixels.shape[-2], "pixels")
        tokens = image_tokens_per_row or []
        patches_per_token = sum(patches) // max(1, sum(tokens))
        crops_per_row, crop = [], 0
        for row_tokens in tokens:
            first = crop
            while row_tokens > 0 and crop < len(patches):
                row_tokens -= patches[crop] // patches_per_token
                crop += 1
            check_image_inputs_layout({NAVIT_SIZES: row_tokens}, 0, "image tokens left over by a row's crops")
            crops_per_row.append(crop - first)
        check_image_inputs_layout({NAVIT_SIZES: crop}, len(patches), "crops, each in a row")
        row_patches = [sum(part) for part in _split_list(patches, crops_per_row)]
        by_row = {
            "pixel_values": list(pixels.split([count * pixels.shape[-2] for count in row_patches], dim=-1)),
            NAVIT_SIZES: list(sizes.split(crops_per_row)),
        }
        by_row |= {  # anything else per crop (none today), cut as the sizes are
            key: list(value.split(crops_per_row)) for key, value in inputs.items() if key not in by_row
        }
        return cls(by_row, axes={"pixel_values": pixels.dim() - 1})

    def unit_sizes(
        self, keys, rows: list[int], images_per_row: list[int], image_tokens_per_row: list[int]
    ) -> ImageUnitSizes:
        """The units of `rows` (inputs `keys` concatenated in that order, as `of_rows` gives them): each image where
        every input has entries per image, else each row; a row's image tokens split over its images by entries."""
        first_image = [0, *itertools.accumulate(images_per_row)]
        entries: dict[str, list[int]] = {key: [] for key in keys}
        tokens: list[int] = []
        for row in rows:
            if self.by_image is None or images_per_row[row] < 2:
                for key in entries:
                    entries[key].append(self.by_row[key][row].shape[self.axes.get(key, 0)])
                tokens.append(image_tokens_per_row[row])
                continue
            images = range(first_image[row], first_image[row + 1])
            weights = [sum(self.by_image[key][image] for key in entries) for image in images]
            for key in entries:
                entries[key] += [self.by_image[key][image] for image in images]
            tokens += [max(1, image_tokens_per_row[row] * weight // sum(weights)) for weight in weights]
        axes = tuple((key, self.axes[key]) for key in entries if key in self.axes)
        return ImageUnitSizes(tuple((key, tuple(sizes)) for key, sizes in entries.items()), tuple(tokens), axes)

    def digest(self, row: int) -> bytes:
        """A digest of `row`'s images: the bytes, shape and type of its part of every image input (rows with the same
        images, as the processor made them, have the same digest)."""
        digest = hashlib.blake2b(digest_size=16)
        for key in sorted(self.by_row):
            part = self.by_row[key][row].contiguous()
            digest.update(f"{key}{tuple(part.shape)}{part.dtype};".encode())
            digest.update(part.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def of_rows(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The image inputs of `rows`, in that order; none where those rows hold no image."""
        inputs = {
            key: torch.cat([parts[row] for row in rows], dim=self.axes.get(key, 0))
            for key, parts in self.by_row.items()
        }
        return {key: value for key, value in inputs.items() if value.shape[self.axes.get(key, 0)] > 0}


@dataclass(frozen=True)
class ImageUnitSizes:
    """How a packed row's image inputs divide into units, in row order, as host integers: each image, or where the
    processor lays inputs out per sequence (a count per row, tiles, Idefics' rows), each sequence laid out with its
    images. A rank of a split row encodes a contiguous run of units (parallel/image_shares.py). Plain tuples, so the
    Trainer and accelerate hand it on untouched."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]  # image input -> its entries (dim 0) of each unit
    image_tokens: tuple[int, ...]  # each unit's image tokens
    axes: tuple[tuple[str, int], ...] = ()  # image input -> the axis its entries run along, where not dim 0

    def axis(self, key: str) -> int:
        return dict(self.axes).get(key, 0)

    def share(self, inputs: dict[str, torch.Tensor], first: int, end: int) -> dict[str, torch.Tensor]:
        """The image inputs of units `first` to `end` (exclusive): each input's entries of those units."""
        shared = {}
        for key, entries in self.entries:
            start = sum(entries[:first])
            shared[key] = inputs[key].narrow(self.axis(key), start, sum(entries[first:end]))
        return shared


def _is_count_per_row(value: torch.Tensor, images_per_row: list[int]) -> bool:
    """An input that counts each row's images (LLaVA-OneVision's `batch_num_images`): each row's count itself, not an
    input per image whose entries add up to as many (VideoLLaMA3's `image_merge_sizes`, all ones at merge 1)."""
    return value.dim() == 1 and not value.is_floating_point() and value.tolist() == images_per_row


def _tiles_per_row(
    inputs: dict[str, torch.Tensor], images: int, image_tokens_per_row: list[int] | None
) -> list[int] | None:
    """Each row's tiles, where the processor cut images into tiles of a fixed number of image tokens each (InternVL,
    Aya Vision): `pixel_values` holds more entries than there are images, as many per row as its tokens say."""
    pixels = inputs.get("pixel_values")
    if pixels is None or image_tokens_per_row is None or "image_grid_thw" in inputs or pixels.shape[0] == images:
        return None
    if any(key != "pixel_values" and len(value) == len(pixels) for key, value in inputs.items()):
        return None  # tiles of their own sizes (LFM2-VL's split images): their tokens differ, refused by the caller
    total_tiles, total_tokens = pixels.shape[0], sum(image_tokens_per_row)
    if total_tokens == 0 or total_tokens % total_tiles:
        return None
    per_tile = total_tokens // total_tiles
    if any(tokens % per_tile for tokens in image_tokens_per_row):
        return None
    return [tokens // per_tile for tokens in image_tokens_per_row]


def _split_list(values: list[int], counts: list[int]) -> list[list[int]]:
    ends = list(itertools.accumulate(counts))
    return [values[end - count : end] for end, count in zip(ends, counts, strict=True)]


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like[:0]


def _row_values(padded: dict[str, torch.Tensor], key: str) -> list[list[int]]:
    real = padded["attention_mask"].bool()
    return [values[keep].tolist() for values, keep in zip(padded[key], real, strict=True)]


def _checked_sequences(
    padded: dict[str, torch.Tensor], images_per_row: list[int], image_token_id: int, max_length: int | None
) -> Sequences:
    """Each row's tokens and completion mask, cut as TRL's collator cuts them (the first `max_length`), refusing rows
    whose image tokens disagree with their images or lose some to the cut."""
    tokens, masks = _row_values(padded, "input_ids"), _row_values(padded, "completion_mask")
    pairs = len(tokens) // 2
    for row, (ids, images) in enumerate(zip(tokens, images_per_row, strict=True)):
        image_tokens = ids.count(image_token_id)
        check_image_tokens(row % pairs, images, image_tokens)
        if max_length is not None and image_token_id in ids[max_length:]:
            last = len(ids) - ids[::-1].index(image_token_id)
            refuse_truncated_image(row % pairs, image_tokens, ids[:max_length].count(image_token_id), last, max_length)
    tokens, masks = [ids[:max_length] for ids in tokens], [mask[:max_length] for mask in masks]
    return Sequences(tokens[:pairs], tokens[pairs:], masks[:pairs], masks[pairs:])


def _group_keys(sequences: Sequences, units: ImageUnits | None, image_token_id: int) -> list:
    """Per sequence, what must match besides its prompt tokens for prefix sharing to group it with others: its images
    (`ImageUnits.digest`). A sequence whose branch would hold an image token (its prompt ends on one, the token every
    branch repeats) groups with none: its images would be needed in the prefix and in the branch."""
    tokens = sequences.chosen + sequences.rejected
    keys = []
    for sequence, (ids, prompt) in enumerate(zip(tokens, sequences.prompt_lens, strict=True)):
        if image_token_id in ids[max(prompt - 1, 0) :]:
            keys.append(("alone", sequence))
        else:
            keys.append(units.digest(sequence) if units is not None else None)
    return keys


def _packed_per_token(padded: dict[str, torch.Tensor], key: str, layout: RowLayout, length: int) -> torch.Tensor:
    """A per-token input laid out as the row's tokens are, 0 on the padding segment."""
    values = _row_values(padded, key)
    packed = [
        value
        for (sequence, start), (tokens, _, _) in zip(layout.sources, layout.segments, strict=True)
        for value in values[sequence][start : start + len(tokens)]
    ]
    packed += [0] * (length - len(packed))
    return torch.tensor([packed], dtype=padded[key].dtype)


def pack_vision_batch(
    padded: dict[str, Any],
    images_per_row: list[int],
    image_token_id: int,
    max_length: int | None = None,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    return_attention_mask: bool = False,
    prefix_sharing: bool = False,
    prefix_sharing_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
) -> dict[str, Any]:
    """Pack the padded batch TRL's vision collator returns (untruncated) into one row.

    Args:
        padded: TRL's `DataCollatorForVisionPreference` output with `max_length=None`: `input_ids`,
            `attention_mask`, `completion_mask` and per-token inputs `(2 * pairs, width)`, and the image inputs.
        images_per_row: images of each row (every chosen row, then every rejected row).
        image_token_id: the model's image placeholder token (`config.image_token_id`).
        max_length: TRL's truncation, applied here (`keep_start`, the one TRL allows with images).
        pad_token_id, pad_to_multiple_of, return_attention_mask, prefix_sharing, prefix_sharing_min_prompt_tokens: as
            for `concatenated_inputs`.

    Returns:
        What `concatenated_inputs` returns, plus `image_inputs` (the model's image inputs in row order and its
        per-token inputs packed), `images_per_sequence` and, with image grids, `sequence_image_grid_thw` (every
        sequence's grids in TRL's order, for the model's position function).
    """
    sequences = _checked_sequences(padded, images_per_row, image_token_id, max_length)
    width = padded["input_ids"].shape
    per_token = [key for key, value in padded.items() if key not in TEXT_KEYS and _shape(value) == width]
    image_inputs = {key: value for key, value in padded.items() if key not in TEXT_KEYS and key not in per_token}
    image_tokens_per_row = (padded["input_ids"] == image_token_id).sum(-1).tolist()
    units = ImageUnits.of(image_inputs, images_per_row, image_tokens_per_row) if image_inputs else None
    if prefix_sharing:
        keys = _group_keys(sequences, units, image_token_id)
        layout = lay_out_groups(sequences, prefix_sharing_min_prompt_tokens, keys)
    else:
        layout = lay_out_row(sequences)
    row = packed_row(sequences, layout, pad_token_id, pad_to_multiple_of, return_attention_mask)
    # A row's images are in the packed row when its sequence is laid out from its first token: a group's first
    # sequence, not its branches (which read its prefix) nor the sequences that read another's tokens
    rows_with_images = [sequence for sequence, start in layout.sources if start == 0]
    inputs = units.of_rows(rows_with_images) if units is not None else {}
    if inputs:
        row[IMAGE_UNITS] = units.unit_sizes(list(inputs), rows_with_images, images_per_row, image_tokens_per_row)
    length = row["input_ids"].shape[1]
    # Each image's tokens as row positions, for models whose images attend to themselves both ways (Gemma 3 marks
    # exactly these tokens in its `token_type_ids`)
    spans = token_runs(row["input_ids"][0].tolist(), image_token_id)
    row[HOST_ROW] = dataclasses.replace(row[HOST_ROW], image_spans=spans)
    inputs |= {key: _packed_per_token(padded, key, layout, length) for key in per_token}
    row[IMAGE_INPUTS] = inputs
    row[IMAGES_PER_SEQUENCE] = torch.tensor(images_per_row, dtype=torch.long)
    if "image_grid_thw" in padded:
        row[SEQUENCE_IMAGE_GRIDS] = padded["image_grid_thw"]
    elif NAVIT_SIZES in padded:  # MiniCPM-V 4.7's position function reads every crop's grid
        row[SEQUENCE_IMAGE_GRIDS] = padded[NAVIT_SIZES]
    return row


def _shape(value) -> torch.Size | None:
    return value.shape if isinstance(value, torch.Tensor) else None


def image_token_id_of(processor) -> int:
    """The image placeholder token a processor writes, as the model reads it (Gemma 3's processor names its
    begin-of-image token `image_token_id`; its tokenizer has the placeholder)."""
    tokenizer = getattr(processor, "tokenizer", None)
    token_id = getattr(tokenizer, "image_token_id", None)
    return token_id if token_id is not None else processor.image_token_id


@dataclass
class PaddingFreeVisionPreferenceCollator(DataCollatorForVisionPreference):
    """
    TRL's vision preference collator with a `padding_free` switch: every chosen and rejected sequence of the batch in
    one row, the images handed to the model in row order (see `pack_vision_batch`).

    With `padding_free=False` it is exactly TRL's `DataCollatorForVisionPreference`. The trainer sets
    `image_token_id` from the model's config.
    """

    padding_free: bool = True
    image_token_id: int | None = None
    return_attention_mask: bool = False
    prefix_sharing: bool = False
    prefix_sharing_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS

    @classmethod
    def from_padded(
        cls, collator: DataCollatorForVisionPreference, **overrides
    ) -> PaddingFreeVisionPreferenceCollator:
        """The padding-free twin of TRL's vision collator: same processor, truncation and row multiple."""
        fields = {
            "processor": collator.processor,
            "max_length": collator.max_length,
            "pad_to_multiple_of": collator.pad_to_multiple_of,
            "return_tensors": collator.return_tensors,
        }
        return cls(**{**fields, **overrides})

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.padding_free:
            return super().torch_call(examples)
        images_per_example = [image_count(example) for example in examples]
        # TRL's own tokenization and image processing; the cut to max_length is applied when packing, where an image
        # it would cut can be told from one it keeps
        padded = DataCollatorForVisionPreference(self.processor, return_tensors=self.return_tensors)(examples)
        tokenizer = self.processor.tokenizer
        return pack_vision_batch(
            padded,
            images_per_example * 2,
            self.image_token_id if self.image_token_id is not None else image_token_id_of(self.processor),
            max_length=self.max_length,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_attention_mask=self.return_attention_mask,
            prefix_sharing=self.prefix_sharing,
            prefix_sharing_min_prompt_tokens=self.prefix_sharing_min_prompt_tokens,
        )
