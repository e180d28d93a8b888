"""A preference dataset checked as TRL's `DPOTrainer` will read it, before it reads it, padding-free or not: the pair
columns, each prompt and completion a string or a list of messages (the format of the first row, which TRL reads every
row in), and an image column only where the model takes images. TRL itself would stop deep in its tokenization
(`KeyError: 'rejected'`, `'NoneType' object has no attribute 'endswith'`) or evaluate without an evaluation set's
images; here the error names the dataset, the row, the column and what was expected.

What is read, so that a large dataset costs little:

    Dataset          row 0, and each pair column's first row holding None or an empty list, found on the Arrow
                     columns (a column holds one type: no other row can break row 0's format); milliseconds for a
                     million rows when no value is missing
    IterableDataset  row 0 before TRL reads it, then each row as TRL and training read it: never the stream ahead
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, IterableDataset

from ..refusals import check_image_column, check_image_columns_agree, check_pair_columns, check_pair_value

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
IMAGE_COLUMNS = ("image", "images")  # what makes TRL read a dataset as a vision dataset
TEXT, MESSAGES = "a string", "a list of messages"
ARROW_BATCH_ROWS = 10_000


def checked_preference_datasets(train_dataset, eval_dataset, why_no_images: Callable[[], str | None]):
    """`train_dataset` and `eval_dataset` (one dataset or a dict of them, as TRL takes) checked as TRL will read them;
    an `IterableDataset` comes back wrapped, checking each row as it is read. `why_no_images()` says why the model
    takes no images (None if it does); it is called only for a dataset with an image column.

    Anything that is no dataset is returned as it is, for TRL to refuse.
    """
    why_no_images = functools.cache(why_no_images)  # it may load the model's processor: once
    named = {"train_dataset": train_dataset}
    if isinstance(eval_dataset, dict):
        named |= {f"eval_dataset[{key!r}]": dataset for key, dataset in eval_dataset.items()}
    else:
        named["eval_dataset"] = eval_dataset
    checked = {}
    training_images = None  # unknown until the training set is read (TRL refuses a missing one)
    for name, dataset in named.items():
        if not isinstance(dataset, (Dataset, IterableDataset)):
            checked[name] = dataset
            continue
        first_row = _first_row(dataset)
        if first_row is None:  # empty: the trainer's own check names it once TRL has prepared it
            checked[name] = dataset
            continue
        image_column = next((column for column in IMAGE_COLUMNS if column in first_row), None)
        if image_column is not None:
            check_image_column(name, image_column, why_no_images())
        if name == "train_dataset":
            training_images = image_column is not None
        elif image_column is not None:
            check_image_columns_agree(name, image_column, training_images is not False)
        checked[name] = _checked(dataset, name, first_row)
    if isinstance(eval_dataset, dict):
        eval_checked = {key: checked[f"eval_dataset[{key!r}]"] for key in eval_dataset}
    else:
        eval_checked = checked["eval_dataset"]
    return checked["train_dataset"], eval_checked


def _first_row(dataset) -> dict | None:
    if isinstance(dataset, Dataset):
        return dataset[0] if len(dataset) else None
    return next(iter(dataset), None)


def _checked(dataset, name: str, first_row: dict):
    row_format = RowFormat.of(first_row)
    row_format.check(name, 0, first_row)
    if isinstance(dataset, IterableDataset):

        def check_as_read(row: dict, index: int) -> dict:
            row_format.check(name, index, row)
            return {}  # the row as it is

        return dataset.map(check_as_read, with_indices=True, features=dataset.features)
    for index in _rows_that_can_differ(dataset):
        row_format.check(name, index, dataset[index])
    return dataset


class RowFormat:
    """The format TRL reads every row in: the first row's (plain text, or conversational)."""

    def __init__(self, expected: tuple[str, ...], set_by: str | None):
        self.expected = expected
        self.set_by = set_by

    @classmethod
    def of(cls, first_row: dict) -> RowFormat:
        for column in PAIR_COLUMNS:
            kind = value_kind(first_row.get(column))
            if kind in (TEXT, MESSAGES):
                rows = "plain text" if kind == TEXT else "conversational"
                return cls((kind,), f"row 0's {column!r} is {kind}: the rows are {rows}")
        return cls((TEXT, MESSAGES), None)

    def check(self, dataset: str, index: int, row: dict) -> None:
        check_pair_columns(dataset, list(row), index if index else None)
        for column in PAIR_COLUMNS:
            if column in row:
                check_pair_value(dataset, index, column, value_kind(row[column]), self.expected, self.set_by)


def value_kind(value) -> str:
    """`TEXT`, `MESSAGES` (a non-empty list of dicts with a "role"), or what else `value` is, in words."""
    if isinstance(value, str):
        return TEXT
    if isinstance(value, list) and value and all(isinstance(item, dict) and "role" in item for item in value):
        return MESSAGES
    if value is None:
        return "None"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {type(value[0]).__name__} ({_shortened(value)})"
    return f"a value of type {type(value).__name__} ({_shortened(value)})"


def _shortened(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rows_that_can_differ(dataset: Dataset) -> list[int]:
    """Each pair column's first row holding None or an empty list: with row 0, the only rows whose kinds can differ
    from row 0's, since an Arrow column holds one type."""
    columns = [column for column in PAIR_COLUMNS if column in dataset.column_names]
    # The table under the dataset first, as it is stored: a shuffled, selected or filtered dataset maps its rows onto
    # it (which costs a copy to follow), and a table holding no missing value maps none
    columns = [column for column in columns if _first_missing(dataset.data.column(column)) is not None]
    first_missing: dict[str, int] = {}
    start = 0
    if not columns:
        return []
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
        for column in columns:
            if column not in first_missing:
                index = _first_missing(batch.column(column))
                if index is not None:
                    first_missing[column] = start + index
        if len(first_missing) == len(columns):
            break
        start += batch.num_rows
    return sorted(set(first_missing.values()) - {0})


def _first_missing(values: pa.ChunkedArray) -> int | None:
    """The first None or empty list of an Arrow column, or None."""
    is_list = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    if values.null_count == 0 and not is_list:
        return None
    missing = pc.is_null(values)
    if is_list:
        missing = pc.or_(missing, pc.fill_null(pc.equal(pc.list_value_length(values), 0), False))
    index = pc.index(missing, True).as_py()
    return None if index < 0 else index
