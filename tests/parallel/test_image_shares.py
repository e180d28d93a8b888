"""Dealing a split row's images over its ranks (trl_padfree/parallel/image_shares.py), the parts that need no launch:
which sequences each rank encodes, each rank's share of the image inputs, and what the gather rebuilds. The training
runs (2 and 4 CPU processes against TRL's padded trainer) are tests/integration/vision/test_vision_split_rows.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_vision import (
    FAMILIES_BEFORE_2026,
    VISION_FAMILIES,
    make_vision_model,
    make_vision_processor,
    vision_preference_rows,
)

from trl_padfree.modeling.vision import image_token_id
from trl_padfree.packing.vision import (
    IMAGE_INPUTS,
    IMAGE_UNITS,
    ImageUnits,
    ImageUnitSizes,
    PaddingFreeVisionPreferenceCollator,
)
from trl_padfree.parallel.image_shares import DROPPED_FIELDS, GATHERED_FIELDS, KEPT_FIELDS, deal_units, image_encoder


def brute_force_largest(image_tokens: tuple[int, ...], ranks: int) -> int:
    """The smallest largest share over every way to cut the units into `ranks` contiguous runs with images."""
    best = None
    for cuts in itertools.combinations(range(1, len(image_tokens)), ranks - 1):
        runs = list(zip((0, *cuts), (*cuts, len(image_tokens)), strict=True))
        if all(sum(image_tokens[start:end]) for start, end in runs):
            largest = max(sum(image_tokens[start:end]) for start, end in runs)
            best = largest if best is None else min(best, largest)
    return best


@pytest.mark.parametrize(
    "image_tokens, ranks",
    [
        ((4, 4, 4, 4), 2),
        ((10, 1, 1, 1, 1), 2),
        ((0, 3, 0, 5, 2, 0), 3),
        ((7, 0, 0, 1, 9, 2, 2, 0), 4),
        ((1, 2, 3, 4, 5, 6, 7, 8), 3),
    ],
)
def test_each_rank_gets_a_contiguous_run_with_images_and_the_largest_is_smallest(image_tokens, ranks):
    runs = deal_units(image_tokens, ranks)
    assert runs[0][0] == 0 and runs[-1][1] == len(image_tokens)
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(runs)), "runs cover the row in order"
    assert all(sum(image_tokens[start:end]) > 0 for start, end in runs), "a rank without an image"
    assert max(sum(image_tokens[start:end]) for start, end in runs) == brute_force_largest(image_tokens, ranks)


def test_random_rows_deal_as_well_as_the_best_cut():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        units = int(torch.randint(1, 9, (1,), generator=generator))
        image_tokens = tuple(torch.randint(0, 6, (units,), generator=generator).tolist())
        for ranks in range(1, 5):
            runs = deal_units(image_tokens, ranks)
            if sum(1 for tokens in image_tokens if tokens) < ranks:
                assert runs is None
                continue
            assert len(runs) == ranks and all(sum(image_tokens[start:end]) for start, end in runs)
            assert max(sum(image_tokens[start:end]) for start, end in runs) == brute_force_largest(image_tokens, ranks)


def test_too_few_sequences_with_images_are_not_dealt():
    assert deal_units((0, 5, 0), 2) is None  # every rank encodes the one sequence's images
    assert deal_units((3, 5), 2) == [(0, 1), (1, 2)]


def test_a_share_holds_its_sequences_entries_of_every_image_input():
    # 3 sequences with 2, 0 and 1 images: Qwen-VL patches (8, 0 and 6 rows), one grid row per image
    pixels, grids = torch.arange(14.0).unsqueeze(1), torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 3]])
    units = ImageUnitSizes((("pixel_values", (8, 0, 6)), ("image_grid_thw", (2, 0, 1))), (2, 0, 1))
    share = units.share({"pixel_values": pixels, "image_grid_thw": grids}, 1, 3)
    assert share["pixel_values"].flatten().tolist() == list(range(8, 14))
    assert share["image_grid_thw"].tolist() == [[1, 2, 3]]


def test_an_input_per_image_is_not_read_as_a_count_per_row():
    # VideoLLaMA3's image_merge_sizes at its checkpoints' merge of 1: one entry per image, all ones. With 2, 0, 2 and 0
    # images per row they add up to as many entries as rows, but they are no count per row (LLaVA-OneVision's
    # batch_num_images is the rows' counts themselves): they are cut per image, as the patches are
    grids = torch.tensor([[1, 2, 2]] * 4)
    inputs = {"pixel_values": torch.zeros(16, 3), "image_grid_thw": grids, "image_merge_sizes": torch.ones(4).long()}
    units = ImageUnits.of(inputs, [2, 0, 2, 0])
    assert [len(part) for part in units.by_row["image_merge_sizes"]] == [2, 0, 2, 0]
    counts = ImageUnits.of(
        {"pixel_values": torch.zeros(4, 3), "batch_num_images": torch.tensor([2, 0, 2, 0])}, [2, 0, 2, 0]
    )
    assert [part.tolist() for part in counts.by_row["batch_num_images"]] == [[2], [0], [2], [0]]


# Every family tests/support/tiny_vision/ packs: a packed row's image inputs cut at every sequence boundary, each share run
# through the model's own get_image_features, give what the whole row's call gives (what the gather rebuilds), fields
# and all, with and without prefix sharing (one sequence's images a pair)


def features_of(encoder, inputs: dict, forward_arguments: tuple[str, ...]):
    return encoder.get_image_features(**{key: inputs[key] for key in forward_arguments if key in inputs})


def flat(value) -> list[torch.Tensor]:
    if isinstance(value, int):  # a language model layer's index (Granite 4 Vision's deepstack pairs)
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [tensor for part in value for tensor in flat(part)]


# The families added in 2026 run with -m slow but for one of each new kind of image input (the default suite's time)
SHARE_FAMILIES_BY_DEFAULT = (*FAMILIES_BEFORE_2026, "minicpmv4_7", "gemma4",
                             "deepseek_vl_hybrid", "granite4_vision", "ovis2")  # fmt: skip


@pytest.mark.parametrize("prefix_sharing", [False, True], ids=["row", "shared-prefix"])
@pytest.mark.parametrize(
    "model_type",
    [
        family if family in SHARE_FAMILIES_BY_DEFAULT else pytest.param(family, marks=pytest.mark.slow)
        for family in VISION_FAMILIES
    ],
)
def test_every_share_encoded_alone_gives_the_whole_rows_features(model_type, prefix_sharing):
    import inspect

    processor = make_vision_processor(model_type)
    model = make_vision_model(model_type, processor).eval()
    collator = PaddingFreeVisionPreferenceCollator(
        processor, image_token_id=image_token_id(model.config), prefix_sharing=prefix_sharing
    )
    batch = collator(vision_preference_rows(model_type, 3, images_per_row=(2, 1, 3)))
    units, inputs = batch[IMAGE_UNITS], batch[IMAGE_INPUTS]
    encoder = image_encoder(model)
    arguments = tuple(inspect.signature(encoder.get_image_features).parameters)
    with torch.no_grad():
        whole = features_of(encoder, inputs, arguments)
        shares = [
            features_of(encoder, units.share(inputs, start, end), arguments)
            for start, end in deal_units(units.image_tokens, len([t for t in units.image_tokens if t]))
        ]
    for key in GATHERED_FIELDS:
        if key not in whole or whole[key] is None:
            continue
        expected = flat(whole[key])
        if isinstance(whole[key], torch.Tensor):
            got = [torch.cat([share[key] for share in shares])]
        elif all(isinstance(part, torch.Tensor) for part in whole[key]):
            got = [tensor for share in shares for tensor in share[key]]
        else:  # per layer, per image
            got = [
                tensor for layer in range(len(whole[key])) for share in shares for tensor in flat(share[key][layer])
            ]
        assert len(got) == len(expected), key
        for tensor, expected_tensor in zip(got, expected, strict=True):
            torch.testing.assert_close(tensor, expected_tensor, atol=1e-6, rtol=1e-5)
    for key in KEPT_FIELDS:  # the same on every share: each rank keeps its own
        if whole.get(key) is not None:
            for share in shares:
                torch.testing.assert_close(share[key], whole[key], atol=0, rtol=0)
    assert set(whole.keys()) <= {*GATHERED_FIELDS, *DROPPED_FIELDS, *KEPT_FIELDS}, "a field the gather would refuse"


def test_an_image_input_the_forward_renames_is_dealt_by_its_tensor(monkeypatch):
    # Video-LLaVA's processor returns `pixel_values_images`, which the model's forward hands get_image_features as
    # `pixel_values` (transformers' `deprecate_kwarg`): the share is found by the batch's tensor, not by the name
    from trl_padfree.parallel import image_shares
    from trl_padfree.parallel.groups import RowGroup

    class Gathered(Exception):
        """Stops the forward where the features would be gathered over the ranks (this test launches none)."""

    def gathered(output, row):
        raise Gathered(output.pooler_output)

    processor = make_vision_processor("video_llava")
    model = make_vision_model("video_llava", processor).eval()
    collator = PaddingFreeVisionPreferenceCollator(processor, image_token_id=image_token_id(model.config))
    batch = collator(vision_preference_rows("video_llava", 3, images_per_row=(2, 1, 3)))
    units, inputs = batch[IMAGE_UNITS], batch[IMAGE_INPUTS]
    assert set(inputs) == {"pixel_values_images"}
    monkeypatch.setattr(image_shares, "gathered_features", gathered)
    start, end = deal_units(units.image_tokens, 2)[0]  # rank 0 of 2
    with torch.no_grad(), pytest.raises(Gathered) as features:
        with image_shares.images_dealt(model, units, inputs, RowGroup(None, 0, 2)):
            model(input_ids=batch["input_ids"], **inputs)

    mine = units.share(inputs, start, end)["pixel_values_images"]
    assert 0 < mine.shape[0] < inputs["pixel_values_images"].shape[0]
    with torch.no_grad():
        expected = image_encoder(model).get_image_features(pixel_values=mine).pooler_output
    torch.testing.assert_close(features.value.args[0], expected, atol=0, rtol=0)
