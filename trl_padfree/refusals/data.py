"""Refusals of the preference data, as TRL will read it: the data files, its columns, the format of each row, its
image column."""

from __future__ import annotations

from collections.abc import Sequence

PREFERENCE_FORMATS = "https://huggingface.co/docs/trl/dataset_formats"


class MissingColumnError(ValueError, KeyError):
    """A pair column a row lacks: a `ValueError` like every refusal, and the `KeyError` TRL raises reading it, so
    code written against TRL's error still catches it."""

    __str__ = ValueError.__str__  # KeyError's would quote the whole message


class CompletionNotTextError(ValueError, AttributeError):
    """A completion that is no string in plain-text rows: a `ValueError` like every refusal, and the `AttributeError`
    TRL raises appending the EOS token to it (`'int' object has no attribute 'endswith'`)."""


# ---- the preference data, as TRL will read it ----


def check_data_file_has_rows(path: str, size: int, has_text: bool) -> None:
    """A data file with no row at all: datasets stops on it with a bare `StopIteration` or "corresponds to no data"."""
    if not has_text:
        what = "is empty" if size == 0 else "holds only blank lines"
        raise ValueError(
            f"Dataset file {path!r} {what}: it has no preference pair to train on. A data file holds one pair per row "
            f"({PREFERENCE_FORMATS}#preference); point --dataset_name at the file that holds them."
        )


def refuse_unreadable_data_file(path: str, file_format: str, problem: str) -> None:
    """A data file datasets cannot read as its extension says: `problem` names where (a line) and what is wrong."""
    raise ValueError(
        f"Dataset file {path!r} cannot be read as {file_format}: {problem}. Fix the file, or give it the extension of "
        "its format (.jsonl: one JSON object per line; .json: JSON lines or one list of objects; .csv; .parquet)."
    )


def check_pair_columns(dataset: str, columns: Sequence[str], row: int | None = None) -> None:
    """TRL's DPO reads `chosen` and `rejected` from every row (`row`: the row read, in a stream whose rows can
    differ), and `prompt` unless the prompt is implicit (the start both completions share, TRL's `extract_prompt`).
    `dataset` names the data: its file or hub name and split where known."""
    missing = [name for name in ("chosen", "rejected") if name not in columns]
    if missing:
        where = dataset if row is None else f"{dataset}, row {row},"
        raise MissingColumnError(
            f"{where} has no {' and no '.join(repr(name) for name in missing)} column (its columns: "
            f"{sorted(columns)}). TRL's DPO reads preference pairs: 'chosen' and 'rejected', and 'prompt' unless both "
            f"completions start with it ({PREFERENCE_FORMATS}#preference). Rename or add the columns."
        )


def check_pair_value(
    dataset: str,
    row: int,
    column: str,
    found: str,
    expected: Sequence[str],
    format_set_by: str | None,
    value_type: str,
) -> None:
    """A prompt or completion as TRL reads it: `found` (what the value is, in words; `value_type` its Python type)
    must be one of `expected` ("a string", "a list of messages"): the one the first row set (`format_set_by` says
    how), as TRL reads every row in the format of the first, or either where the first row set none."""
    if found in expected:
        return
    if found in ("a string", "a list of messages") and format_set_by:
        message = (
            f"{dataset}, row {row}, column {column!r}: {found}, where {' or '.join(expected)} is expected: the data "
            f"mixes plain text and conversational ({format_set_by}), and TRL reads every row in the format of the "
            "first. Make every prompt and completion one of the two, or drop the rows of the other "
            f"(`dataset.filter(...)`) ({PREFERENCE_FORMATS})."
        )
    else:
        why = f" ({format_set_by}, and TRL reads every row in the format of the first)" if format_set_by else ""
        message = (
            f"{dataset}, row {row}, column {column!r}: {found}, where {' or '.join(expected)} is expected{why}; TRL "
            "would fail on it inside its tokenization. Fix the row in the data or drop it (`dataset.filter(...)`): a "
            "prompt or completion is a string (plain text) or a list of {'role': ..., 'content': ...} messages "
            f"(conversational), one of the two in every row and column ({PREFERENCE_FORMATS})."
        )
    if column in ("chosen", "rejected") and tuple(expected) == ("a string",):
        # TRL appends the EOS token to each plain-text completion: its error is this one
        raise CompletionNotTextError(f"{message} TRL's own error: '{value_type}' object has no attribute 'endswith'.")
    raise ValueError(message)


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
