"""The vision tower of a split row, dealt over the row's ranks.

Every rank of a row builds the whole row's embeddings (the language model then runs its chunk, row_split.py). The
image features in them need not be computed N times: each rank runs the vision tower on a contiguous run of the row's
sequences with images (a share, balanced by image tokens) and the features are all-gathered, differentiably, into
what the model's own `get_image_features` returns for the whole row. The backward sums each feature's gradient over
the row's ranks (only the rank whose chunk holds a feature's token gives it one) and hands each rank its share's, so
the vision tower's gradient, summed over the ranks as every gradient is, is the whole row's.

    row of 3 ranks          | seq 0: 2 images | seq 1: 1 image | seq 2: 3 images | seq 3: 1 image |
    vision tower            | rank 0          | rank 1                           | rank 2         |
    features                all-gathered on every rank, in row order

The unit is an image, or where the processor lays an input out per sequence (LLaVA-OneVision's count per row,
InternVL's and Aya Vision's tiles, Idefics' rows) a sequence with its images (packing/vision.py, `ImageUnitSizes`).
Each rank runs the tower on at least one unit, so sharded engines (ZeRO-3, FSDP2) see every rank call it; a row with
fewer units than ranks runs the tower on all of them on every rank, as `deal_images=False` does.

The seam is the model's own `get_image_features`, which every family's forward calls once with the batch's image
inputs and whose `pooler_output` (and Qwen3-VL's `deepstack_features`) it places on the image tokens; that each
family's features on a share equal the whole row's is tested (tests/parallel/test_image_shares.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from ..packing.vision import ImageUnitSizes
from .groups import RowGroup, all_gather_dim0, gather_uneven

# What `get_image_features` returns that the model's forward reads (transformers 5.23-5.24): `pooler_output`, one
# tensor (images or tokens first) or one per image; Qwen3-VL's `deepstack_features`, per layer one per image (Granite 4
# Vision's: per layer a pair of the language model layer's index, the same on every rank, and one per image)
GATHERED_FIELDS = ("pooler_output", "deepstack_features")
DROPPED_FIELDS = ("last_hidden_state", "hidden_states", "attentions")
# DeepSeek-VL hybrid's high-resolution tower's, beside its features (in `pooler_output`)
DROPPED_FIELDS += ("high_res_vision_last_hidden_state", "high_res_vision_hidden_states", "high_res_vision_attentions")
# Fields that do not depend on the images, each rank's its own: Ovis 2's visual indicators (the embeddings of the
# tokens around its images), which every rank's forward places on the indicator tokens of the whole row
KEPT_FIELDS = ("visual_indicator_features",)
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def deal_units(image_tokens: tuple[int, ...], ranks: int) -> list[tuple[int, int]] | None:
    """Contiguous runs of units, one per rank, each with at least one image token, whose largest token count is the
    smallest possible; None when fewer units than ranks hold images. A binary search on that largest count, each
    candidate checked by filling runs from the left (O(units x log tokens): a row of hundreds of images costs
    microseconds, not the quadratic search's seconds)."""
    holding = [index for index, tokens in enumerate(image_tokens) if tokens]
    if len(holding) < ranks:
        return None
    # Cut between units holding images (a unit without any joins the run before it, the first run's if none)
    weights = [
        sum(image_tokens[start:end]) for start, end in zip(holding, [*holding[1:], len(image_tokens)], strict=True)
    ]
    low, high = max(weights), sum(weights)
    while low < high:
        middle = (low + high) // 2
        if len(_runs_within(weights, ranks, middle)) <= ranks:
            high = middle
        else:
            low = middle + 1
    bounds = [*holding, len(image_tokens)]
    runs = _runs_within(weights, ranks, low)
    return [(0 if start == 0 else bounds[start], bounds[end]) for start, end in runs]


def _runs_within(weights: list[int], ranks: int, limit: int) -> list[tuple[int, int]]:
    """Runs of `weights` filled from the left up to `limit` each, cut early where the weights left are only enough
    for one run each of the ranks still to fill: `ranks` runs if `limit` allows it, more if not."""
    runs, start, total = [], 0, 0
    for index, weight in enumerate(weights):
        still_to_fill = ranks - len(runs) - 1  # runs after the current one
        if index > start and (total + weight > limit or len(weights) - index <= still_to_fill):
            runs.append((start, index))
            start, total = index, 0
        total += weight
    runs.append((start, len(weights)))
    return runs


def image_encoder(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module defining `get_image_features`: the one whose forward calls it (the task model's only
    delegates to it)."""
    owners = [module for module in model.modules() if callable(getattr(type(module), "get_image_features", None))]
    if not owners:
        raise TypeError(f"{type(model).__name__} has no get_image_features: its images cannot be dealt over ranks")
    return owners[-1]


@contextlib.contextmanager
def images_dealt(model: torch.nn.Module, units: ImageUnitSizes, image_inputs: dict[str, torch.Tensor], row: RowGroup):
    """While the model's forward runs on the whole row, its `get_image_features` runs on this rank's share of
    `image_inputs` and returns every rank's features, gathered. Yields False, changing nothing, where the row has too
    few units with images to give every rank one."""
    runs = deal_units(units.image_tokens, row.size)
    if runs is None:
        yield False
        return
    encoder = image_encoder(model)
    whole_row = encoder.get_image_features  # bound to the class's method
    parameters = inspect.signature(whole_row).parameters.values()
    named = {parameter.name for parameter in parameters if parameter.kind is not inspect.Parameter.VAR_KEYWORD}
    positional = [parameter.name for parameter in parameters if parameter.kind in POSITIONAL]
    share = units.share(image_inputs, *runs[row.rank])
    totals = {key: sum(entries) for key, entries in units.entries}

    @functools.wraps(whole_row)
    def on_share(*args, **kwargs):
        # The call as the forward made it, each image input replaced by this rank's share of it (positional
        # arguments by the function's own parameter order: its decorators bind them again)
        if len(args) > len(positional):
            raise NotImplementedError(
                f"{type(encoder).__name__}.get_image_features was called with {len(args)} positional arguments, "
                "more than it names: set deal_images=False (every rank encodes the whole row's images)."
            )
        args = [_share_of(name, value) for name, value in zip(positional, args, strict=False)]
        kwargs = {name: _share_of(name, value) for name, value in kwargs.items()}
        return gathered_features(whole_row(*args, **kwargs), row)

    def _share_of(name: str, value):
        key = name if name in share else _input_passed_as(value)
        if key is not None:
            if value.shape[units.axis(key)] != totals[key]:
                raise RuntimeError(f"get_image_features got {key} of {value.shape[0]} entries, not the row's")
            return share[key]
        if isinstance(value, torch.Tensor) and name in named:  # an image input of its own (not the **kwargs)
            raise NotImplementedError(
                f"{type(encoder).__name__}.get_image_features takes {name}, which trl-padfree cannot deal over the "
                "ranks of a row: set deal_images=False (every rank encodes the whole row's images)."
            )
        return value

    def _input_passed_as(value) -> str | None:
        # A forward that renames an input before the call hands on the batch's own tensor: Video-LLaVA's takes the
        # processor's `pixel_values_images` as `pixel_values` (transformers' `deprecate_kwarg`)
        return next((key for key, tensor in image_inputs.items() if value is tensor and key in share), None)

    encoder.get_image_features = on_share
    try:
        yield True
    finally:
        del encoder.get_image_features  # the class's method again


def gathered_features(output, row: RowGroup):
    """`get_image_features`' output on a share, made the whole row's: the fields the forward reads gathered over
    `row` in rank order, the others dropped."""
    if isinstance(output, tuple) or not hasattr(output, "keys"):
        raise NotImplementedError(
            f"get_image_features returned a {type(output).__name__}, not a model output: set deal_images=False."
        )
    fields, kept = {}, {key: output[key] for key in KEPT_FIELDS if output.get(key) is not None}
    for key in output.keys():
        if key in DROPPED_FIELDS or key in kept:
            continue
        if key not in GATHERED_FIELDS:
            raise NotImplementedError(
                f"get_image_features returned {key!r}, which trl-padfree does not know how to gather over the ranks "
                "of a row: set deal_images=False."
            )
        fields[key] = output[key]
    # One exchange of every gathered tensor's entries (and per-image counts) from every rank
    mine = [_entries(value) for value in fields.values()]
    device = next(iter(_tensors(fields.values())), torch.empty(0)).device
    everyone = exchanged_entries(mine, row, device)
    return type(output)(**kept, **{
        key: _gathered(value, [ranks[index] for ranks in everyone], row)
        for index, (key, value) in enumerate(fields.items())
    })  # fmt: skip


def exchanged_entries(mine: list, row: RowGroup, device: torch.device) -> list[list]:
    """Every rank's `mine` (nested lists and tuples of ints, shaped alike on every rank but for the tuples' lengths),
    in rank order, over two tensor collectives: their lengths, then the integers. Not `all_gather_object`: no
    pickling, no object collective. Each rank's counts are not host integers the collator has: the features per image
    are the model's (a Qwen-VL image's merged patches, a LLaVA-NeXT image's unpadded tiles), and the image tokens
    `ImageUnitSizes` carries per image are a rounded share of its sequence's (two reads of the result on the host)."""
    flat = _flattened(mine)
    length = torch.tensor([len(flat)], dtype=torch.int64, device=device)
    lengths = all_gather_dim0(length, row.group).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.int64, device=device)
    padded[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
    received = all_gather_dim0(padded, row.group).view(row.size, -1).tolist()
    return [_unflattened(mine, iter(values[:size])) for values, size in zip(received, lengths, strict=True)]


def _flattened(entries) -> list[int]:
    if isinstance(entries, int):
        return [entries]
    if isinstance(entries, tuple):  # one count per image: how many, then each
        return [len(entries), *entries]
    return [value for part in entries for value in _flattened(part)]  # per field or layer: as many on every rank


def _unflattened(template, values):
    if isinstance(template, int):
        return next(values)
    if isinstance(template, tuple):
        return tuple(next(values) for _ in range(next(values)))
    return [_unflattened(part, values) for part in template]


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, int):  # a layer's index (Granite 4 Vision)
            continue
        else:
            yield from _tensors(value)


def _entries(value):
    """A field's shape as the gather needs it: a tensor's entries; per image, each one's; per layer, each layer's."""
    if isinstance(value, int):  # a layer's index (Granite 4 Vision), kept as it is
        return value
    if isinstance(value, torch.Tensor):
        return value.shape[0]
    if all(isinstance(part, torch.Tensor) for part in value):
        return tuple(part.shape[0] for part in value)
    return [_entries(part) for part in value]


def _gathered(value, entries: list, row: RowGroup):
    if isinstance(value, int):  # a layer's index (Granite 4 Vision), the same on every rank
        return value
    if isinstance(value, torch.Tensor):  # images or tokens first
        return gather_uneven(value, row, entries)
    if all(isinstance(part, torch.Tensor) for part in value):  # one tensor per image: every rank's images, in order
        whole = gather_uneven(torch.cat(value), row, [sum(sizes) for sizes in entries])
        return whole.split([size for sizes in entries for size in sizes])
    return [_gathered(part, [ranks[layer] for ranks in entries], row) for layer, part in enumerate(value)]
