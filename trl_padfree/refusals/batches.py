"""Refusals of the batches: the collator, the examples it gets, and accelerate's handing out of packed batches."""

from __future__ import annotations

from collections.abc import Sequence

# ---- batches ----


def check_packing_collator(collator_name: str, packs: bool) -> None:
    if not packs:
        raise ValueError(
            f"padding_free=True needs packed batches, but the data collator is {collator_name}. Pass "
            "`PaddingFreePreferenceCollator(...)` (padding_free=True), or no collator at all."
        )


def check_packed_batch_expected(padding_free: bool) -> None:
    if not padding_free:
        raise ValueError(
            "Got a packed batch (from PaddingFreePreferenceCollator) but padding_free=False. Set "
            "`padding_free=True` in the config, or use TRL's padded collator."
        )


def check_examples(count: int, missing_by_example: Sequence[tuple[int, list[str], list[str]]]) -> None:
    """A preference batch: not empty; `missing_by_example` lists (index, missing columns, columns it has)."""
    if not count:
        raise ValueError("The preference collator received an empty batch.")
    for index, missing, has in missing_by_example:
        raise KeyError(
            f"Example {index} of the batch has no {missing} column(s); got {sorted(has)}. The collator expects "
            "tokenized preference data: let DPOTrainer tokenize a `prompt`/`chosen`/`rejected` dataset, or provide "
            "`prompt_ids`, `chosen_ids` and `rejected_ids` yourself."
        )


def check_reference_log_probs(paired_on_all_or_none: bool, first_non_finite: tuple[int, tuple] | None) -> None:
    if not paired_on_all_or_none:
        raise ValueError(
            "Reference log-probs must come as a pair (`ref_chosen_logps` and `ref_rejected_logps`) on every example of "
            "the batch or on none. Recompute them (e.g. `precompute_ref_log_probs=True`) or drop both columns."
        )
    if first_non_finite is not None:
        index, values = first_non_finite
        raise ValueError(
            f"Example {index} has reference log-probs {values}: each must be one finite number per sequence. "
            "Recompute them with the same tokenizer, `max_length` and `truncation_mode` as training."
        )


def check_truncation_mode(truncation_mode: str) -> None:
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'")


def check_no_empty_sequence(shortest: int) -> None:
    if shortest == 0:
        raise ValueError(
            "A sequence of the batch is empty (no prompt and no completion tokens). Remove such pairs from the dataset."
        )


def check_datasets_not_empty(sizes: dict[str, int | None], max_length: int | None) -> None:
    # TRL drops examples whose prompt alone fills `max_length`; with none left, torch's sampler fails obscurely
    for name, size in sizes.items():
        if size == 0:
            raise ValueError(
                f"The {name} dataset has no examples left: it was empty, or TRL dropped every example because its "
                f"prompt alone fills max_length={max_length}. Check the data, or increase `max_length` (or shorten "
                "the prompts)."
            )


def check_batches_not_dispatched(dispatch_batches: bool | None, split_batches: bool) -> None:
    """accelerate's dispatcher concatenates and slices every tensor of a batch along its first dimension: a packed
    batch is one row of varying length with per-sequence tensors beside it, so neither survives."""
    if dispatch_batches:
        raise ValueError(
            "accelerator_config.dispatch_batches=True cannot carry packed batches: accelerate concatenates the "
            "processes' batches and slices every tensor to the batch size of the first, cutting the per-sequence "
            "lengths of a packed row. Set dispatch_batches=False (each process then builds its own rows; a streamed "
            "dataset is read by every process, each keeping its share)."
        )
    if split_batches:
        raise ValueError(
            "accelerator_config.split_batches=True cannot split a packed batch: it is one row, not a batch of rows. "
            "Set split_batches=False and per_device_train_batch_size to the pairs each process trains on."
        )
