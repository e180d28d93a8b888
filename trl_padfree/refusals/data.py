"""Refusals of the preference data, as TRL will read it: its columns, the format of each row, its image column."""

from __future__ import annotations

from collections.abc import Sequence

# ---- the preference data, as TRL will read it ----

PREFERENCE_FORMATS = "https://huggingface.co/docs/trl/dataset_formats"


def check_pair_columns(dataset: str, columns: Sequence[str], row: int | None = None) -> None:
    """TRL's DPO reads `chosen` and `rejected` from every row (`row`: the row read, in a stream whose rows can
    differ), and `prompt` unless the prompt is implicit (the start both completions share, TRL's `extract_prompt`)."""
    missing = [name for name in ("chosen", "rejected") if name not in columns]
    if missing:
        where = dataset if row is None else f"{dataset}, row {row},"
        raise ValueError(
            f"{where} has no {' and no '.join(repr(name) for name in missing)} column (its columns: "
            f"{sorted(columns)}). TRL's DPO reads preference pairs: 'chosen' and 'rejected', and 'prompt' unless both "
            f"completions start with it ({PREFERENCE_FORMATS}#preference). Rename or add the columns."
        )


def check_pair_value(
    dataset: str, row: int, column: str, found: str, expected: Sequence[str], format_set_by: str | None
) -> None:
    """A prompt or completion as TRL reads it: `found` (what the value is, in words) must be one of `expected` ("a
    string", "a list of messages"): the one the first row set (`format_set_by` says how), as TRL reads every row in
    the format of the first, or either where the first row set none."""
    if found in expected:
        return
    why = f" ({format_set_by}, and TRL reads every row in the format of the first)" if format_set_by else ""
    raise ValueError(
        f"{dataset}, row {row}, column {column!r}: {found}, where {' or '.join(expected)} is expected{why}; TRL would "
        "fail on it inside its tokenization. Fix the row or drop it (`dataset.filter(...)`): a prompt or completion "
        "is a string (plain text) or a list of {'role': ..., 'content': ...} messages (conversational), one of the "
        f"two in every row and column ({PREFERENCE_FORMATS})."
    )


def check_image_column(dataset: str, column: str, why_no_images: str | None) -> None:
    """A dataset with an image column (TRL's `image` or `images`) needs a model that takes images; `why_no_images`
    says why this one does not, or is None."""
    if why_no_images is not None:
        raise ValueError(
            f"{dataset} has an image column {column!r}, but the model takes no images: {why_no_images}. Train a "
            "vision-language model (with its processor), or drop the column "
            f"(`dataset.remove_columns({column!r})`) to train on the text."
        )


def check_image_columns_agree(dataset: str, column: str, training_images: bool) -> None:
    """TRL prepares every dataset as it prepares the training set: text-only unless the training set has images."""
    if not training_images:
        raise ValueError(
            f"{dataset} has an image column {column!r}, but train_dataset has none: TRL prepares every dataset the "
            "way it prepares train_dataset, as text, and would evaluate without these images. Give train_dataset its "
            f"images too, or drop the column (`dataset.remove_columns({column!r})`)."
        )
