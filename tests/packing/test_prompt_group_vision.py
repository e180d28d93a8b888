"""Prompt groups on vision-language batches (packing/vision.py): with prefix sharing, the sequences of a batch whose
kept prompt tokens and images are identical lay the prompt out once, its images encoded once for every pair of that
prompt, on Qwen2.5-VL (image patches, mRoPE positions from its `get_rope_index`).

    K = 4 all pairs, one image    a>b a>c a>d b>c b>d c>d: 12 sequences of 4 distinct completions
    grouped row                   | <img> prompt a | b | c | d |      + the image inputs of one row

The collated row against TRL's padded batch, its positions against the model's own position function on every
sequence, one step against padded TRL, and `train_sampling_strategy="group_by_prompt"` on vision data.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny_vision import make_image, make_vision_trainer, vision_preference_rows
from trainer_utils import assert_same_step, one_step

from trl_padfree.integrations.trl import DataCollatorForVisionPreference
from trl_padfree.modeling.packed_batch import PackedBatch
from trl_padfree.modeling.vision import image_token_id, packed_position_ids
from trl_padfree.packing.prompt_groups import PromptGroupBatchSampler
from trl_padfree.packing.vision import IMAGE_INPUTS, SEQUENCE_IMAGE_GRIDS, pack_vision_batch

FAMILY = "qwen2_5_vl"
COMPLETIONS = 4  # per prompt, paired all ways: 6 pairs


def prompt_pairs(
    seed: int = 0, completions: int = COMPLETIONS, image_seed: int | None = None, family: str = FAMILY
) -> list[dict]:
    """One prompt with one image (of `image_seed`, else the data's) and `completions` distinct completions (one of a
    single word), every better one paired with every worse one, best first."""
    rows = vision_preference_rows(family, completions, seed=seed)
    answers = [row["chosen"] for row in rows]  # row 0's is a single word
    assert len({str(answer) for answer in answers}) == completions
    images = rows[0]["images"] if image_seed is None else [make_image(56, 84, seed=image_seed)]
    return [
        {"images": images, "prompt": rows[0]["prompt"], "chosen": answers[i], "rejected": answers[j]}
        for i, j in itertools.combinations(range(completions), 2)
    ]


def collate(collator, rows: list[dict]) -> dict:
    """`collator` on copies of `rows` (TRL's collator writes each image into its prompt's message, in place)."""
    return collator(copy.deepcopy(rows))


def padded_batch(trainer, rows: list[dict]) -> dict:
    """TRL's padded batch of `rows`, untruncated (as the padding-free collator packs it)."""
    return collate(DataCollatorForVisionPreference(trainer.processing_class), rows)


def grouped_trainer(rows: list[dict], padding_free: bool = True, family: str = FAMILY):
    options = dict(prefix_sharing=True) if padding_free else {}
    return make_vision_trainer(family, padding_free, rows, per_device_train_batch_size=len(rows), **options)


def count_vision_tower_images(trainer) -> list[int]:
    """Images the policy's vision tower is handed per call (one grid row per image)."""
    calls = []
    trainer.model.model.visual.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    return calls


# ---- the collated row ----


def test_a_prompts_pairs_collate_to_one_prompt_segment_with_its_image_once():
    rows = prompt_pairs()
    trainer = grouped_trainer(rows)
    batch = collate(trainer.data_collator, rows)
    padded = padded_batch(trainer, rows)
    image_token = image_token_id(trainer.model.config)

    prompt = padded["completion_mask"][0].tolist().index(1)
    completions = {
        tuple(ids[mask.bool()].tolist())
        for ids, mask in zip(padded["input_ids"], padded["completion_mask"], strict=True)
    }
    assert len(completions) == COMPLETIONS
    # | prompt a | p b | p c | p d |: the prompt once, each branch repeating its last token
    assert len(batch["cu_seq_lens_q"]) - 1 == COMPLETIONS
    assert batch["input_ids"].shape[1] == prompt + sum(map(len, completions)) + COMPLETIONS - 1
    row_image_tokens = int((padded["input_ids"][0] == image_token).sum())
    assert int((batch["input_ids"] == image_token).sum()) == row_image_tokens
    # The image inputs of one row: its patches and its grid
    grids = padded["image_grid_thw"]
    patches = int(grids[0].prod())
    assert torch.equal(batch[IMAGE_INPUTS]["image_grid_thw"], grids[:1])
    assert torch.equal(batch[IMAGE_INPUTS]["pixel_values"], padded["pixel_values"][:patches])
    assert batch["image_units"].image_tokens == (row_image_tokens,)
    # Every sequence's grid and image count stay, in TRL's order, for the position function
    assert torch.equal(batch[SEQUENCE_IMAGE_GRIDS], grids)
    assert batch["images_per_sequence"].tolist() == [1] * 2 * len(rows)
    # The per-token image marks packed as the tokens are
    marks = batch[IMAGE_INPUTS]["mm_token_type_ids"]
    assert torch.equal(marks.bool(), batch["input_ids"] == image_token)


def test_every_sequence_reads_the_positions_the_model_gives_it():
    # 12 sequences reading 4 segments: each one's mRoPE positions, read back through the padded view, are those the
    # model's get_rope_index gives it in TRL's padded batch
    rows = prompt_pairs()
    trainer = grouped_trainer(rows)
    model = trainer.model
    packed = PackedBatch.from_collated(collate(trainer.data_collator, rows))
    padded = padded_batch(trainer, rows)

    positions = packed_position_ids(model, packed)  # (4, 1, T): text positions over mRoPE's 3
    expected, _ = model.model.get_rope_index(
        input_ids=padded["input_ids"],
        attention_mask=padded["attention_mask"],
        mm_token_type_ids=padded["mm_token_type_ids"],
        image_grid_thw=padded["image_grid_thw"],
    )
    read = packed.padded(positions[1:].permute(1, 2, 0))  # (sequences, width, 3)
    valid = packed.token_valid
    assert valid.sum() == padded["attention_mask"].sum()
    torch.testing.assert_close(read[valid], expected.permute(1, 2, 0)[padded["attention_mask"].bool()], rtol=0, atol=0)


def test_same_prompt_text_on_other_images_is_another_group():
    # 3 pairs of one prompt on one image, 3 of the same prompt text on another: two groups, each image once
    rows = prompt_pairs(completions=3) + prompt_pairs(completions=3, image_seed=7)
    trainer = grouped_trainer(rows)
    batch = collate(trainer.data_collator, rows)
    padded = padded_batch(trainer, rows)

    assert len(batch["cu_seq_lens_q"]) - 1 == 2 * 3
    grids = padded["image_grid_thw"]
    assert torch.equal(batch[IMAGE_INPUTS]["image_grid_thw"], grids[[0, 3]])  # pair 0's image, then pair 3's
    patches = grids.prod(-1).tolist()
    first, fourth = sum(patches[:3]), sum(patches[:4])
    expected = torch.cat([padded["pixel_values"][: patches[0]], padded["pixel_values"][first:fourth]])
    assert torch.equal(batch[IMAGE_INPUTS]["pixel_values"], expected)


def test_a_prompt_ending_on_an_image_token_groups_nothing():
    # Completions marked from right after each image: every branch would hold an image token, so every sequence is
    # laid out whole with its images, as TRL's rows
    rows = prompt_pairs()
    trainer = grouped_trainer(rows)
    padded = padded_batch(trainer, rows)
    image_token = image_token_id(trainer.model.config)
    for ids, mask, real in zip(padded["input_ids"], padded["completion_mask"], padded["attention_mask"], strict=True):
        last_image = (ids == image_token).nonzero().max()
        mask[last_image + 1 :] = real[last_image + 1 :]

    batch = pack_vision_batch(padded, [1] * 2 * len(rows), image_token, prefix_sharing=True)
    assert len(batch["cu_seq_lens_q"]) - 1 == 2 * len(rows)
    assert torch.equal(batch[IMAGE_INPUTS]["pixel_values"], padded["pixel_values"])
    assert int((batch["input_ids"] == image_token).sum()) == int((padded["input_ids"] == image_token).sum())


# ---- training ----


def test_one_step_on_a_prompts_pairs_equals_padded_trl_and_encodes_the_image_once():
    rows = prompt_pairs()
    padded_trainer, packed_trainer = grouped_trainer(rows, padding_free=False), grouped_trainer(rows)
    calls = {"padded": count_vision_tower_images(padded_trainer), "grouped": count_vision_tower_images(packed_trainer)}
    padded, packed = one_step(padded_trainer), one_step(packed_trainer)

    assert_same_step(padded, packed)
    assert calls == {"padded": [2 * len(rows)], "grouped": [1]}  # TRL's 12 images, one here
    assert packed.metrics["padfree/images_padded"] == 2 * len(rows)
    assert packed.metrics["padfree/images_encoded"] == 1


def test_one_step_on_two_images_of_one_prompt_text_equals_padded_trl():
    rows = prompt_pairs(completions=3) + prompt_pairs(completions=3, image_seed=7)
    padded_trainer, packed_trainer = grouped_trainer(rows, padding_free=False), grouped_trainer(rows)
    calls = count_vision_tower_images(packed_trainer)
    assert_same_step(one_step(padded_trainer), one_step(packed_trainer))
    assert calls == [2]


@pytest.mark.parametrize("family", ["gemma3", "llava", "idefics3"])  # images (Gemma 3's attended both ways), rows
def test_one_step_on_a_prompts_pairs_equals_padded_trl_on_other_image_layouts(family):
    rows = prompt_pairs(family=family)
    packed_trainer = grouped_trainer(rows, family=family)
    batch = collate(packed_trainer.data_collator, rows)
    padded = padded_batch(packed_trainer, rows)
    for key, value in batch[IMAGE_INPUTS].items():  # the image inputs of TRL's first row; per-token ones packed
        if padded[key].shape != padded["input_ids"].shape:
            assert torch.equal(value, padded[key][:1]), key
    assert_same_step(one_step(grouped_trainer(rows, padding_free=False, family=family)), one_step(packed_trainer))


def test_group_by_prompt_brings_a_prompts_pairs_on_its_image_together():
    # Three groups of 6 pairs, interleaved: two share their prompt text but not their image
    groups = [prompt_pairs(seed=0), prompt_pairs(seed=0, image_seed=7), prompt_pairs(seed=1)]
    rows = [pair for three in zip(*groups, strict=True) for pair in three]
    trainer = make_vision_trainer(
        FAMILY, True, rows, prefix_sharing=True, train_sampling_strategy="group_by_prompt",
        per_device_train_batch_size=6, max_steps=1,
    )  # fmt: skip
    sampler = trainer._batches.sampler
    assert isinstance(sampler, PromptGroupBatchSampler)
    batches = sampler.epoch_batches()
    assert sorted(sorted(batch) for batch in batches) == [list(range(group, 18, 3)) for group in range(3)]

    calls = count_vision_tower_images(trainer)
    trainer.train()
    assert calls == [1]  # the one step's batch: one prompt's 6 pairs on one image


@pytest.mark.parametrize("column", ["image", "images"])
def test_group_ids_read_the_prompt_and_the_images(column):
    from datasets import Dataset

    from trl_padfree.packing.prompt_groups import vision_prompt_group_ids

    rows = prompt_pairs()[:2] + prompt_pairs(image_seed=7)[:1] + prompt_pairs(seed=1)[:1]
    if column == "image":
        rows = [{"image": row.pop("images")[0], **row} for row in rows]
    ids = vision_prompt_group_ids(Dataset.from_list(rows))
    assert ids[0] == ids[1] and len(set(ids)) == 3
