"""Preference data as users write it, read through the loader `trl-padfree dpo --dataset_name <path>` uses
(`trl_padfree.sources.load_preference_dataset`) from real files on disk: JSON Lines, a JSON list, CSV, Parquet, a folder
of files and a hub-style folder (`data/train-*.jsonl`). A file that holds no row or is not what its extension says
stops at loading in one line naming it; a bad row stops before TRL reads it, naming the file, split, row and column,
whether its column is typed (a string column, a list of messages) or datasets reads it as `Json` (a column of mixed
types, checked row by row, vectorised). Pairs TRL drops for a prompt that fills `max_length` are counted in one line.
"""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import trl
from datasets import Dataset
from tiny_fixtures import make_model, make_preference_dataset, make_tokenizer
from trainer_utils import trainer_on

from trl_padfree.data import DEMO_DATASET_NAME
from trl_padfree.data.preference_format import checked_preference_datasets
from trl_padfree.refusals.data import CompletionNotTextError, MissingColumnError
from trl_padfree.sources import load_preference_dataset

PLAIN = make_preference_dataset(12).to_list()
USER = [{"role": "user", "content": "w1 w2"}]
ANSWER = [{"role": "assistant", "content": "w3"}]
CONVERSATIONAL = [{"prompt": USER, "chosen": ANSWER, "rejected": [{"role": "assistant", "content": "w4"}]}] * 12


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def with_row(rows: list[dict], index: int, **changes) -> list[dict]:
    return [{**row, **changes} if position == index else row for position, row in enumerate(rows)]


def checked_file(path: str, streaming: bool = False):
    """The file as `trl-padfree dpo` loads it and the trainer checks it (a stream read through, as training would)."""
    train = load_preference_dataset(path, streaming=streaming)["train"]
    checked, _ = checked_preference_datasets(train, None, why_no_images=lambda: None)
    return list(checked) if streaming else checked


# One case each: the rows of a JSON Lines file, TRL's exception type, and what the error must say
BAD_JSONL = {
    "a number for a completion": (
        with_row(PLAIN, 4, chosen=42),
        CompletionNotTextError,
        [
            "split 'train', row 4, column 'chosen': a value of type int (42), where a string is expected",
            "'int' object has no attribute 'endswith'",
        ],
    ),
    "a conversational row among plain rows": (
        with_row(PLAIN, 3, **CONVERSATIONAL[0]),
        ValueError,
        [
            "split 'train', row 3, column 'prompt': a list of messages, where a string is expected",
            "mixes plain text and conversational",
        ],
    ),
    "a conversational completion among plain rows": (
        with_row(PLAIN, 7, chosen=ANSWER),
        CompletionNotTextError,
        ["row 7, column 'chosen': a list of messages", "'list' object has no attribute 'endswith'"],
    ),
    "plain rows after a conversational first row": (
        [CONVERSATIONAL[0], *PLAIN[1:]],
        ValueError,
        [
            "split 'train', row 1, column 'prompt': a string, where a list of messages is expected",
            "mixes plain text and conversational (row 0's 'prompt' is a list of messages",
        ],
    ),
    "a plain row among conversational rows": (
        with_row(CONVERSATIONAL, 9, **PLAIN[9]),
        ValueError,
        ["row 9, column 'prompt': a string, where a list of messages is expected"],
    ),
    "a message without a role": (
        with_row(CONVERSATIONAL, 5, chosen=[{"content": "w3"}]),
        ValueError,
        ["row 5, column 'chosen': a list of dict ([{'content': 'w3'}]), where a list of messages is expected"],
    ),
    "a list of strings among messages": (
        with_row(CONVERSATIONAL, 6, rejected=["w3"]),
        ValueError,
        ["row 6, column 'rejected': a list of str (['w3'])"],
    ),
    "an empty list among messages": (
        with_row(CONVERSATIONAL, 2, prompt=[]),
        ValueError,
        ["row 2, column 'prompt': an empty list"],
    ),
    "a null completion": (
        with_row(PLAIN, 5, rejected=None),
        CompletionNotTextError,
        ["row 5, column 'rejected': None", "'NoneType' object has no attribute 'endswith'"],
    ),
    "a null in a column of mixed types": (
        with_row(with_row(PLAIN, 2, chosen=7), 1, chosen=None),
        CompletionNotTextError,
        ["row 1, column 'chosen': None"],
    ),
    "an object for a prompt": (
        with_row(PLAIN, 8, prompt={"text": "w1"}),
        ValueError,
        ["row 8, column 'prompt': a value of type dict ({'text': 'w1'})"],
    ),
}


@pytest.mark.parametrize("streaming", [False, True], ids=["dataset", "stream"])
@pytest.mark.parametrize("case", BAD_JSONL)
def test_a_bad_row_in_a_jsonl_file_names_the_file_split_row_and_column(case, streaming, tmp_path):
    rows, error_type, expected = BAD_JSONL[case]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(error_type) as error:
        checked_file(path, streaming)
    assert isinstance(error.value, ValueError)  # one line from `trl-padfree dpo`, as every user error
    assert str(error.value).startswith(f"{path}, split 'train', row "), str(error.value)
    for text in expected:
        assert text in str(error.value), str(error.value)


def test_a_row_that_lacks_a_column_is_named(tmp_path):
    # datasets 5 reads the missing key as None; datasets 4 stops reading the file on it (KeyError): either way, named
    path = write_jsonl(tmp_path / "pairs.jsonl", [*PLAIN[:5], {"prompt": "w1", "chosen": " w2"}, *PLAIN[5:]])
    with pytest.raises(ValueError, match=r"pairs\.jsonl, (split 'train', )?row 5,? (has no 'rejected'|column 'rej)"):
        checked_file(path)


def test_errors_keep_trls_exception_types():
    # Code written against TRL's errors (`except KeyError`, `except AttributeError`) still catches ours
    assert issubclass(MissingColumnError, KeyError) and issubclass(MissingColumnError, ValueError)
    assert issubclass(CompletionNotTextError, AttributeError) and issubclass(CompletionNotTextError, ValueError)
    assert str(MissingColumnError("no 'rejected' column")) == "no 'rejected' column"  # not KeyError's quoted repr


@pytest.mark.parametrize("padding_free", [True, False])
def test_the_trainer_stops_on_a_jsonl_file_where_trl_fails_inside_its_tokenization(padding_free, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", with_row(PLAIN, 4, chosen=42))
    train = load_preference_dataset(path)["train"]
    with pytest.raises(AttributeError, match="'int' object has no attribute 'endswith'"):  # TRL's own error...
        trl.DPOTrainer(
            model=make_model(seed=0), ref_model=make_model(seed=1), train_dataset=train,
            args=trl.DPOConfig(output_dir="/tmp/trl-padfree-tests", report_to=[], use_cpu=True, bf16=False),
            processing_class=make_tokenizer(),
        )  # fmt: skip
    with pytest.raises(AttributeError, match=re.escape(f"{path}, split 'train', row 4, column 'chosen'")):  # ...ours
        trainer_on(train, padding_free)


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "is empty"),
        ("\n\n   \n", "holds only blank lines"),
        ('{"prompt": "w1", "chosen": " w2", "rejected": " w3"}\nnot json at all\n', "line 2 is not JSON"),
        ("hello\n", "line 1 is not JSON"),
    ],
    ids=["empty", "blank lines", "a line not JSON", "not JSON"],
)
@pytest.mark.parametrize("streaming", [False, True], ids=["dataset", "stream"])
def test_a_file_without_rows_or_not_json_is_one_line_naming_it(content, expected, streaming, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        load_preference_dataset(str(path), streaming=streaming)
    message = str(error.value)
    assert message.startswith(f"Dataset file {str(path)!r} ") and expected in message, message
    assert "\n" not in message


def test_a_json_file_holding_a_list_of_rows(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(PLAIN))
    assert checked_file(str(path)).to_list() == PLAIN
    path.write_text(json.dumps(with_row(PLAIN, 6, rejected=[1, 2])))
    with pytest.raises(AttributeError, match=re.escape(f"{path}, split 'train', row 6, column 'rejected': a list")):
        checked_file(str(path))


def test_csv_an_empty_cell_is_named(tmp_path):
    path = tmp_path / "pairs.csv"
    Dataset.from_list(PLAIN).to_csv(path, index=False)
    assert checked_file(str(path)).to_list() == PLAIN
    Dataset.from_list(with_row(PLAIN, 10, chosen=None)).to_csv(path, index=False)
    with pytest.raises(ValueError, match=re.escape(f"{path}, split 'train', row 10, column 'chosen': None")):
        checked_file(str(path))


def test_parquet_typed_and_json_columns(tmp_path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(with_row(PLAIN, 3, prompt=None)), path)
    with pytest.raises(ValueError, match=re.escape(f"{path}, split 'train', row 3, column 'prompt': None")):
        checked_file(str(path))
    # A column of mixed types, as datasets writes it (its `Json` type) and reads it back
    load_preference_dataset(write_jsonl(tmp_path / "mixed.jsonl", with_row(PLAIN, 9, chosen=3.5)))["train"].to_parquet(
        path
    )
    with pytest.raises(AttributeError, match=re.escape(f"{path}, split 'train', row 9, column 'chosen': a value of")):
        checked_file(str(path))
    path.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=re.escape(f"Dataset file {str(path)!r} cannot be read as Parquet")):
        load_preference_dataset(str(path))


def test_a_folder_of_files_and_a_hub_style_folder(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", with_row(PLAIN[:6], 2, chosen=False))
    write_jsonl(folder / "part-1.jsonl", PLAIN[6:])
    with pytest.raises(AttributeError, match=re.escape(f"{folder}, split 'train', row 2, column 'chosen': a value")):
        checked_file(str(folder))
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    write_jsonl(hub / "data" / "train-00000-of-00001.jsonl", with_row(PLAIN, 4, chosen=42))
    write_jsonl(hub / "data" / "test-00000-of-00001.jsonl", PLAIN[:3])
    dataset = load_preference_dataset(str(hub))
    assert sorted(dataset) == ["test", "train"]
    with pytest.raises(AttributeError, match=re.escape(f"{hub}, split 'train', row 4, column 'chosen': a value")):
        checked_preference_datasets(dataset["train"], dataset["test"], why_no_images=lambda: None)
    (hub / "data" / "test-00000-of-00001.jsonl").write_text("")
    with pytest.raises(ValueError, match=re.escape("test-00000-of-00001.jsonl' is empty")):
        load_preference_dataset(str(hub))
    parquet_hub = tmp_path / "parquet_hub"
    (parquet_hub / "data").mkdir(parents=True)
    Dataset.from_list(with_row(PLAIN, 11, rejected=None)).to_parquet(parquet_hub / "data" / "train.parquet")
    with pytest.raises(AttributeError, match=re.escape(f"{parquet_hub}, split 'train', row 11, column 'rejected'")):
        checked_file(str(parquet_hub))


def test_a_bad_row_in_a_later_file_of_a_folder_is_not_cast_to_a_string(tmp_path):
    # datasets reads every file of a folder as the first file's types: the `false` would be trained on as "false"
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", PLAIN[:6])
    write_jsonl(folder / "part-1.jsonl", with_row(PLAIN[6:], 2, chosen=False))
    with pytest.raises(AttributeError, match=re.escape("part-1.jsonl, row 2, column 'chosen': a value of type bool")):
        load_preference_dataset(str(folder))


@pytest.mark.parametrize("rows", [PLAIN, CONVERSATIONAL], ids=["plain", "conversational"])
def test_good_files_pass_unchanged(rows, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    dataset = load_preference_dataset(path)["train"]
    assert checked_preference_datasets(dataset, None, why_no_images=lambda: None)[0] is dataset
    assert dataset.to_list() == rows


def test_a_bad_row_past_the_first_10_mib_of_a_file_is_not_cast_to_a_string(tmp_path):
    # datasets types a JSON file's columns from its first 10 MiB: the 42 would be trained on as "42"
    rows = PLAIN * 2 + [{"prompt": "w1 " * 2000, "chosen": " w2", "rejected": " w3"}] * 2000
    path = write_jsonl(tmp_path / "pairs.jsonl", [*rows, {**PLAIN[0], "chosen": 42}])
    with pytest.raises(
        AttributeError, match=re.escape(f"{path}, row {len(rows)}, column 'chosen': a value of type int")
    ):
        load_preference_dataset(path)


# ---------------------------------------------------------------------------------------------------------------------
# Pairs TRL drops for a prompt that fills max_length


def test_dropped_pairs_are_counted_as_trl_drops_them(caplog):
    # A subset of the shipped data, max_length set inside its prompts' lengths: the count is TRL's own filtering
    train = load_preference_dataset(DEMO_DATASET_NAME)["train"].select(range(64))
    tokenizer = make_tokenizer()
    args = trl.DPOConfig(output_dir="/tmp/trl-padfree-tests", report_to=[], use_cpu=True, bf16=False, max_length=None)
    unfiltered = trl.DPOTrainer(
        model=make_model(seed=0), ref_model=make_model(seed=1), args=args, train_dataset=train,
        processing_class=tokenizer,
    )  # fmt: skip
    prompt_lengths = sorted(len(ids) for ids in unfiltered.train_dataset["prompt_ids"])
    max_length = prompt_lengths[len(prompt_lengths) * 3 // 4]
    dropped = sum(length >= max_length for length in prompt_lengths)
    assert 0 < dropped < len(train)
    with caplog.at_level(logging.WARNING, logger="trl_padfree"):
        trainer = trainer_on(train, max_length=max_length)
    assert len(trainer.train_dataset) == len(train) - dropped  # TRL's own filtering, under our trainer
    lines = [record.getMessage() for record in caplog.records if "pairs dropped" in record.getMessage()]
    assert lines == [
        f"{DEMO_DATASET_NAME}, split 'train': {dropped} of 64 pairs dropped: prompt longer "
        f"than max_length (TRL drops each pair whose prompt alone fills max_length={max_length} tokens, leaving no "
        'completion token to train on); `truncation_mode="keep_end"` or a larger `max_length` keeps them.'
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_padfree"):
        trainer_on(train, padding_free=False, max_length=max_length, truncation_mode="keep_end")  # TRL keeps all
    assert not [record for record in caplog.records if "pairs dropped" in record.getMessage()]
