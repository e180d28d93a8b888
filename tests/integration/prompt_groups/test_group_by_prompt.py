"""`train_sampling_strategy="group_by_prompt"` in the trainer: pairs made by `pair_scored_completions` (K = 4
completions per prompt paired all ways, 6 pairs) in batches of 6 reach the collator a prompt's 6 pairs at a time, every
pair once per epoch, and train as padded TRL fed the same batches. The sampler alone: tests/packing/test_prompt_groups.py."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import trl
from grouped_pairs import PAIRS_PER_PROMPT, PROMPTS, make_grouped_trainer, scored_pairs
from tolerances import LOSS_ATOL, METRIC_ATOL, METRIC_RTOL, RESUMED_LOSS_ATOL, TRAINING_LOSS_ATOL
from torch.utils.data import DataLoader
from trainer_utils import LOSS_TYPES, assert_same_step, one_step

from trl_padfree import DPOConfig
from trl_padfree.packing.prompt_groups import PromptGroupBatchSampler, extra_prompt_computations


class PaddedOnTheseBatches(trl.DPOTrainer):
    """TRL's padded trainer, its training dataloader over the given batches of pair indices, in order."""

    def __init__(self, *args, batches: list[list[int]], **kwargs):
        self.batches = batches
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        return self.accelerator.prepare(DataLoader(dataset, batch_sampler=self.batches, collate_fn=self.data_collator))


def pairs_of(rows) -> list[tuple]:
    """Each pair of `rows` (a dataset, or a batch's examples) as its (prompt, chosen, rejected) token tuples."""
    return [tuple(tuple(row[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids")) for row in rows]


def recording(collator, seen: list):
    """`collator`, noting each batch's pairs (`pairs_of`)."""

    def collate(examples):
        seen.append(pairs_of(examples))
        return collator(examples)

    return collate


# ---- the batches ----


def test_the_data_has_six_pairs_per_prompt_on_token_identical_prompts():
    trainer = make_grouped_trainer(max_steps=1)
    prompts = Counter(tuple(row["prompt_ids"]) for row in trainer.train_dataset)
    assert len(trainer.train_dataset) == PROMPTS * PAIRS_PER_PROMPT
    assert sorted(prompts.values()) == [PAIRS_PER_PROMPT] * PROMPTS
    assert min(len(prompt) for prompt in prompts) == 1  # the one-word prompt, tokenized (no BOS here)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
def test_every_batch_holds_one_prompts_six_pairs_and_an_epoch_every_pair_once(padding_free):
    options = dict(prefix_sharing=True) if padding_free else {}
    trainer = make_grouped_trainer(padding_free, max_steps=1, **options)
    collator = trainer.data_collator
    assert isinstance(trainer._batches.sampler, PromptGroupBatchSampler)
    epochs = []
    for epoch in range(2):
        seen = []
        trainer.data_collator = recording(collator, seen)
        dataloader = trainer.get_train_dataloader()
        dataloader.set_epoch(epoch)  # as Trainer does; accelerate's dataloader tells the sampler
        assert sum(1 for _ in dataloader) == PROMPTS
        assert [len(batch) for batch in seen] == [PAIRS_PER_PROMPT] * PROMPTS
        assert all(len({prompt for prompt, _, _ in batch}) == 1 for batch in seen), "a batch mixes prompts"
        assert Counter(pair for batch in seen for pair in batch) == Counter(pairs_of(trainer.train_dataset))
        epochs.append([batch[0][0] for batch in seen])
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])  # reshuffled each epoch


def test_a_batch_size_the_groups_do_not_divide_keeps_every_pair_and_cuts_few_prompts():
    # Batches of 4 over groups of 6: each prompt fills one batch and leaves 2 pairs, two such pieces per batch
    trainer = make_grouped_trainer(per_device_train_batch_size=4, max_steps=1)
    sampler = trainer._batches.sampler
    batches = sampler.epoch_batches()
    assert [len(batch) for batch in batches] == [4] * 9
    assert sorted(index for batch in batches for index in batch) == list(range(PROMPTS * PAIRS_PER_PROMPT))
    assert extra_prompt_computations(sampler.groups, batches, 4) == 0  # 6 pairs need 2 batches of 4 anyway


def test_the_log_says_how_many_prompts_are_cut_and_when_grouping_only_orders(caplog):
    with caplog.at_level(logging.INFO, logger="trl_padfree.features.batches"):
        make_grouped_trainer(per_device_train_batch_size=6, max_steps=1, prefix_sharing=True)
    assert "36 pairs of 6 prompts in batches of 6" in caplog.text and "only orders" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_padfree.features.batches"):
        make_grouped_trainer(per_device_train_batch_size=6, max_steps=1, prefix_sharing=False)
    assert "group_by_prompt only orders the batches here" in caplog.text
    assert extra_prompt_computations([[0, 1, 2], [3, 4, 5]], [[0, 1, 3, 4], [2, 5]], 4) == 2  # both cut once


# ---- training equals padded TRL fed the same batches ----

# Every pair's loss is computed within its micro-batch, as padded TRL does: the losses that couple a batch's pairs
# (aot sorts them, sft weighs them by tokens) stay equal because the batches are the same. Grouped (shared) under
# every loss type; unshared (the batches only ordered) under three
UNSHARED_LOSS_TYPES = ["sigmoid", "aot", "sft"]
assert set(UNSHARED_LOSS_TYPES) <= set(LOSS_TYPES)
ONE_STEP_CASES = [(True, loss_type) for loss_type in LOSS_TYPES] + [(False, loss) for loss in UNSHARED_LOSS_TYPES]


@pytest.mark.parametrize("prefix_sharing, loss_type", ONE_STEP_CASES)
def test_a_grouped_batch_steps_as_padded_trl_on_it(prefix_sharing, loss_type):
    grouped = make_grouped_trainer(max_steps=1, prefix_sharing=prefix_sharing, loss_type=[loss_type])
    batch = grouped._batches.sampler.epoch_batches()[0]
    padded = make_grouped_trainer(
        False, max_steps=1, loss_type=[loss_type], config_class=trl.DPOConfig, trainer_class=trl.DPOTrainer,
        train_sampling_strategy="random",
    )  # fmt: skip
    # one_step collates the training set's first pairs: make them this batch's, in its order, on both sides
    for trainer in (grouped, padded):
        trainer.train_dataset = trainer.train_dataset.select(batch)
    assert_same_step(one_step(padded), one_step(grouped))


@pytest.mark.parametrize("prefix_sharing", [True, False], ids=["shared", "unshared"])
def test_training_equals_padded_trl_fed_the_same_batches(prefix_sharing):
    """Three SGD steps of two micro-batches (one epoch: 6 prompts' batches), grouped and padding-free against TRL's
    padded trainer fed the grouped batches in the same order."""
    options = dict(max_steps=3, gradient_accumulation_steps=2, learning_rate=0.5, optim="sgd", logging_steps=1)
    grouped = make_grouped_trainer(prefix_sharing=prefix_sharing, **options)
    grouped.train()
    sampler = grouped._batches.sampler
    sampler.set_epoch(0)
    padded = make_grouped_trainer(
        False, config_class=trl.DPOConfig, trainer_class=PaddedOnTheseBatches,
        trainer_options=dict(batches=list(sampler)),
        train_sampling_strategy="random", **options,
    )  # fmt: skip
    padded.train()
    logged, expected = ([entry for entry in run.state.log_history if "loss" in entry] for run in (grouped, padded))
    assert len(logged) == len(expected) == 3
    assert [entry["loss"] for entry in logged] == pytest.approx(
        [entry["loss"] for entry in expected], abs=TRAINING_LOSS_ATOL
    )
    assert logged[0]["loss"] == pytest.approx(expected[0]["loss"], abs=LOSS_ATOL)
    for key in ("grad_norm", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens"):
        assert logged[0][key] == pytest.approx(expected[0][key], rel=METRIC_RTOL, abs=METRIC_ATOL), key


def test_a_run_resumed_in_its_second_epoch_continues_on_the_same_batches(tmp_path):
    # 3 optimizer steps per epoch: step 4, after resuming from step 2, is the second epoch's first
    options = dict(max_steps=4, num_train_epochs=2, gradient_accumulation_steps=2, learning_rate=0.5, optim="sgd")
    options.update(logging_steps=1, save_strategy="steps", save_steps=2, output_dir=str(tmp_path))
    uninterrupted = make_grouped_trainer(**options)
    seen = []
    uninterrupted.data_collator = recording(uninterrupted.data_collator, seen)
    uninterrupted.train()
    resumed = make_grouped_trainer(**options)
    seen_after_resume = []
    resumed.data_collator = recording(resumed.data_collator, seen_after_resume)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert seen_after_resume == seen[4:] and seen[6:] != seen[:2]  # the second epoch reshuffled
    losses = [
        [entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (uninterrupted, resumed)
    ]
    assert losses[1][-2:] == pytest.approx(losses[0][-2:], abs=RESUMED_LOSS_ATOL)


# ---- refusals ----


def test_a_streamed_training_set_is_refused():
    dataset = scored_pairs().to_iterable_dataset()
    with pytest.raises(ValueError, match="group_by_prompt' needs a training dataset with a length"):
        make_grouped_trainer(dataset=dataset, max_steps=1)


def test_vision_language_pairs_group_by_their_prompt_and_images():
    # Tokenized only when collated: grouped by the prompt's messages and the images' pixels
    # (tests/packing/test_prompt_group_vision.py trains them)
    from tiny_vision import make_vision_trainer, vision_preference_rows

    rows = vision_preference_rows("qwen2_5_vl", 4)
    trainer = make_vision_trainer(
        "qwen2_5_vl", True, rows + rows[:2], train_sampling_strategy="group_by_prompt",
        per_device_train_batch_size=2, max_steps=1,
    )  # fmt: skip
    assert sorted(trainer._batches.sampler.groups) == [[0, 4], [1, 5], [2], [3]]


def test_the_command_line_takes_the_option():
    from trl_padfree.cli.dpo import render_help

    assert "group_by_prompt" in render_help()
    assert DPOConfig.__dataclass_fields__["train_sampling_strategy"].metadata["choices"][-1] == "group_by_prompt"
