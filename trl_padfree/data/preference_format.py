"""A preference dataset checked as TRL's `DPOTrainer` will read it, before it reads it, padding-free or not: the pair
columns, each prompt and completion a string or a list of messages (the format of the first row, which TRL reads every
row in), and an image column only where the model takes images. TRL itself would stop deep in its tokenization
(`KeyError: 'rejected'`, `'int' object has no attribute 'endswith'`) or evaluate without an evaluation set's images;
here the error names the data (its file or hub name and split, where known), the row, the column and what was
expected, and keeps TRL's exception type (`MissingColumnError` is a `KeyError`, `CompletionNotTextError` an
`AttributeError`, both `ValueError`s).

Every row is checked, each by the cheapest read that decides it:

    Dataset          row 0, then each pair column's first row off row 0's format, found on the Arrow column:
                     a string column can only hold None besides strings, a list column None, empty lists and
                     messages without a role; a `Json` column (datasets' type for a JSON column of mixed types)
                     is scanned whole, vectorised (milliseconds per million rows either way, measured in
                     tests/data/test_data_files.py)
    IterableDataset  row 0 before TRL reads it, then each row as TRL and training read it: never the stream ahead

TRL drops the pairs whose prompt alone fills `max_length`; `log_dropped_pairs` says how many.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from datasets import Dataset, IterableDataset

from ..refusals.data import check_image_column, check_image_columns_agree, check_pair_columns, check_pair_value

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
IMAGE_COLUMNS = ("image", "images")  # what makes TRL read a dataset as a vision dataset
TEXT, MESSAGES = "a string", "a list of messages"
ARROW_BATCH_ROWS = 100_000
# datasets' own builders (file formats, a generator): their name, a dataset's `info.dataset_name`, says nothing of it
BUILDER_NAMES = frozenset(
    {"json", "csv", "parquet", "arrow", "text", "pandas", "generator", "sql", "webdataset", "imagefolder"}
)

logger = logging.getLogger(__name__)


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
    for role, dataset in named.items():
        if not isinstance(dataset, (Dataset, IterableDataset)):
            checked[role] = dataset
            continue
        name = dataset_description(dataset, role)
        first_row = _first_row(dataset)
        if first_row is None:  # empty: the trainer's own check names it once TRL has prepared it
            checked[role] = dataset
            continue
        image_column = next((column for column in IMAGE_COLUMNS if column in first_row), None)
        if image_column is not None:
            check_image_column(name, image_column, why_no_images())
        if role == "train_dataset":
            training_images = image_column is not None
        elif image_column is not None:
            check_image_columns_agree(name, image_column, training_images is not False)
        checked[role] = _checked(dataset, name, first_row)
    if isinstance(eval_dataset, dict):
        eval_checked = {key: checked[f"eval_dataset[{key!r}]"] for key in eval_dataset}
    else:
        eval_checked = checked["eval_dataset"]
    return checked["train_dataset"], eval_checked


def dataset_description(dataset: Dataset | IterableDataset, role: str) -> str:
    """How an error names `dataset`: its file or hub name and split where the dataset knows them
    (`trl_padfree.sources` records the name a user gave), else the argument it came in (`role`, e.g. "train_dataset").
    """
    name = dataset.info.dataset_name
    if not name or name in BUILDER_NAMES:
        return role
    return name if dataset.split is None else f"{name}, split {str(dataset.split)!r}"


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
    for index in _rows_off_format(dataset, row_format):
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
        """The one rule for a row, whether read from a `Dataset` or a stream: `dataset` names the data."""
        check_pair_columns(dataset, list(row), index if index else None)
        for column in PAIR_COLUMNS:
            if column in row:
                value = row[column]
                kind = value_kind(value)
                check_pair_value(dataset, index, column, kind, self.expected, self.set_by, type(value).__name__)


def value_kind(value) -> str:
    """`TEXT`, `MESSAGES` (a non-empty list of dicts, each with a string "role"), or what else `value` is, in words."""
    if isinstance(value, str):
        return TEXT
    if isinstance(value, list) and value and all(_is_message(item) for item in value):
        return MESSAGES
    if value is None:
        return "None"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {type(value[0]).__name__} ({_shortened(value)})"
    return f"a value of type {type(value).__name__} ({_shortened(value)})"


def _is_message(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("role"), str)


def _shortened(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# Rows off the first row's format, found on the Arrow columns


def _rows_off_format(dataset: Dataset, row_format: RowFormat) -> list[int]:
    """Each pair column's first row that is not `row_format`'s kind (row 0 left out: it is checked already)."""
    expected = row_format.expected[0] if len(row_format.expected) == 1 else None
    columns = [column for column in PAIR_COLUMNS if column in dataset.column_names]
    # The table under the dataset first, as it is stored: a shuffled, selected or filtered dataset maps its rows onto
    # it (which costs a copy to follow), and a table holding no row off the format maps none
    columns = [column for column in columns if _first_off(dataset.data.column(column), expected) is not None]
    first_off: dict[str, int] = {}
    start = 0
    if not columns:
        return []
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
        for column in columns:
            if column not in first_off:
                index = _first_off(batch.column(column), expected)
                if index is not None:
                    first_off[column] = start + index
        if len(first_off) == len(columns):
            break
        start += batch.num_rows
    return sorted(set(first_off.values()) - {0})


def _first_off(values: pa.ChunkedArray, expected: str | None) -> int | None:
    """The first row of an Arrow column that is not `expected` (`TEXT`, `MESSAGES`, or None where row 0 set no
    format), as far as rows can differ within the column's type: None if there is none."""
    start = 0
    for chunk in values.chunks:
        off = _off_format(chunk, expected)
        if off is not None:
            index = pc.index(off, True).as_py()
            if index >= 0:
                return start + index
        start += len(chunk)
    return None


def _off_format(values: pa.Array, expected: str | None) -> pa.BooleanArray | None:
    """Which rows of one Arrow array are not `expected`; None where none can differ from row 0 (which is checked).

    Any type but JSON, string and list holds row 0's kind in every row but None: row 0's check covers them.
    """
    if _is_json(values.type):
        return _json_off_format(values.storage, expected)
    off = pc.is_null(values) if values.null_count else None
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        empty = pc.fill_null(pc.equal(pc.list_value_length(values), 0), False)
        off = empty if off is None else pc.or_(off, empty)
        items_off = _items_not_messages(values.flatten()) if expected == MESSAGES else None
        if items_off is not None:
            off = pc.or_(off, _rows_holding(values, items_off))
    return off


def _is_json(arrow_type: pa.DataType) -> bool:
    """datasets' `Json` feature: each value stored as its JSON text (a JSON column of mixed types, or list items)."""
    return isinstance(arrow_type, pa.BaseExtensionType) and arrow_type.extension_name == "arrow.json"


def _items_not_messages(items: pa.Array) -> pa.BooleanArray | None:
    """Which items of a list column are no message (an object with a string "role"), None if every item is one: a
    JSON file whose messages differ in their keys is read as one struct type (a key one lacks set to None), or as JSON
    items."""
    if _is_json(items.type):
        return _json_not_messages(items.storage)
    if pa.types.is_struct(items.type) and items.type.get_field_index("role") >= 0:
        role = items.field("role")
        if pa.types.is_string(role.type) or pa.types.is_large_string(role.type):
            if items.null_count == 0 and role.null_count == 0:
                return None
            return pc.or_(pc.is_null(items), pc.is_null(role))
    return pa.array(np.ones(len(items), dtype=bool))  # no item is a message: row 0 failed its check already


def _rows_holding(values: pa.Array, items_off: pa.BooleanArray) -> pa.BooleanArray:
    """Which rows of a list column hold an item `items_off` marks."""
    rows = np.zeros(len(values), dtype=bool)
    rows[pc.filter(pc.list_parent_indices(values), items_off).to_numpy()] = True
    return pa.array(rows)


def _json_off_format(texts: pa.StringArray, expected: str | None) -> pa.BooleanArray:
    """Rows of a JSON column (each row its value as JSON text) that are not `expected`: a JSON string is text, a list
    a list of messages only if every item is an object with a string "role"."""
    texts = pc.fill_null(texts, "null")  # datasets 5 stores a JSON null as a missing value, datasets 4 as "null"
    is_text = pc.starts_with(texts, '"')
    if expected == TEXT:
        return pc.invert(is_text)
    is_list = pc.starts_with(texts, "[")
    if expected is None:  # row 0 set no format: it fails its own check before any other row is read
        return pc.invert(pc.or_(is_text, is_list))
    lists = _read_json(pc.if_else(is_list, texts, "[]"), pa.list_(ROLE), lambda value: value_kind(value) != MESSAGES)
    if isinstance(lists, pa.BooleanArray):  # decoded row by row
        return pc.or_(pc.invert(is_list), lists)
    off = pc.or_(pc.invert(is_list), pc.equal(pc.list_value_length(lists), 0))
    items_off = _items_not_messages(lists.flatten())
    return off if items_off is None else pc.or_(off, _rows_holding(lists, items_off))


def _json_not_messages(texts: pa.StringArray) -> pa.BooleanArray:
    """Which JSON texts are no message (an object with a string "role")."""
    messages = _read_json(pc.fill_null(texts, "null"), ROLE, lambda value: not _is_message(value))
    if isinstance(messages, pa.BooleanArray):  # decoded one by one
        return messages
    return pc.or_(pc.is_null(messages), pc.is_null(messages.field("role")))


ROLE = pa.struct([("role", pa.string())])  # what Arrow's JSON reader reads of a message


def _read_json(texts: pa.StringArray, value_type: pa.DataType, is_off: Callable[[object], bool]) -> pa.Array:
    """The JSON `texts` read as `value_type` by Arrow's JSON reader, in one call (keys `value_type` lacks left out);
    where a text does not read so (a list of something else, a role that is no string), `is_off` of each text
    decoded one by one, as a `BooleanArray`."""
    lines = pc.binary_join_element_wise('{"value":', texts, "}\n", "")
    longest = pc.max(pc.binary_length(lines)).as_py() or 0
    lines = pc.cast(lines, pa.large_string())
    list_of_lines = pa.LargeListArray.from_arrays(pa.array([0, len(lines)], pa.int64()), lines)
    document = pc.binary_join(list_of_lines, pa.scalar("", pa.large_string()))[0]
    try:
        read = pa_json.read_json(
            pa.BufferReader(document.as_buffer()),
            read_options=pa_json.ReadOptions(block_size=max(1 << 20, 2 * longest), use_threads=False),
            parse_options=pa_json.ParseOptions(
                explicit_schema=pa.schema([("value", value_type)]), unexpected_field_behavior="ignore"
            ),
        )
    except pa.ArrowInvalid:
        return pa.array([is_off(json.loads(text)) for text in texts.to_pylist()], pa.bool_())
    return read.column("value").combine_chunks()


def log_dropped_pairs(given: tuple, prepared: tuple, max_length: int | None) -> None:
    """Say how many pairs TRL dropped from each dataset, in one line each (a WARNING): `given` is the trainer's
    `(train_dataset, eval_dataset)` as passed, `prepared` as TRL prepared them. TRL's `_prepare_dataset` keeps a pair
    only if `len(prompt_ids) < max_length` under `truncation_mode="keep_start"`, since truncation would leave it no
    completion token; the rows it drops are the difference. A stream is filtered as it is read, uncounted here."""
    for role, before, after in _by_role(given, prepared):
        # None left: the set-up's refusal of an empty dataset says so, with the same way out, in one line
        if isinstance(before, Dataset) and isinstance(after, Dataset) and 0 < len(after) < len(before):
            logger.warning(dropped_pairs_line(dataset_description(before, role), len(before), len(after), max_length))


def _by_role(given: tuple, prepared: tuple):
    (train, evaluation), (prepared_train, prepared_evaluation) = given, prepared
    yield "train_dataset", train, prepared_train
    if isinstance(evaluation, dict) and isinstance(prepared_evaluation, dict):
        for key, dataset in evaluation.items():
            yield f"eval_dataset[{key!r}]", dataset, prepared_evaluation.get(key)
    else:
        yield "eval_dataset", evaluation, prepared_evaluation


def dropped_pairs_line(name: str, before: int, after: int, max_length: int | None) -> str:
    """The line that says how many of `before` pairs TRL dropped for a prompt that alone fills `max_length`."""
    return (
        f"{name}: {before - after:,} of {before:,} pairs dropped: prompt longer than max_length (TRL drops each pair "
        f"whose prompt alone fills max_length={max_length} tokens, leaving no completion token to train on); "
        '`truncation_mode="keep_end"` or a larger `max_length` keeps them.'
    )
