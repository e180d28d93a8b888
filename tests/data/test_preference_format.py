"""Bad preference data stops before the first step, padding-free or not, with the dataset, row, column and what was
expected named (trl_padfree/data/preference_format.py): where TRL itself fails deep in its tokenization (`KeyError:
'rejected'`, `AttributeError: 'NoneType' object has no attribute 'endswith'`) or drops an evaluation set's images. A
large dataset is not read whole: a `Dataset` through its Arrow columns, a stream row by row as training reads it."""

import itertools
import re
import types

import pytest
from datasets import Dataset, IterableDataset
from PIL import Image
from tiny_fixtures import make_preference_dataset
from trainer_utils import trainer_on
from transformers import Gemma4Config

from trl_padfree.data.preference_format import checked_preference_datasets, value_kind
from trl_padfree.modeling.vision import why_no_images

PLAIN = make_preference_dataset(12).to_list()
USER = [{"role": "user", "content": "w1 w2"}]
ANSWER = [{"role": "assistant", "content": "w3"}]


def with_row(index: int, **changes) -> list[dict]:
    return [{**row, **changes} if position == index else row for position, row in enumerate(PLAIN)]


def streamed(rows: list[dict]) -> IterableDataset:
    return IterableDataset.from_generator(lambda: iter(rows))


# One case each: the rows, and what the error must say (the dataset, row, column, what was found and expected)
BAD_DATA = {
    "no rejected column": (
        [{"prompt": row["prompt"], "chosen": row["chosen"]} for row in PLAIN],
        ["train_dataset has no 'rejected' column", "'chosen' and 'rejected'"],
    ),
    "a None completion": (with_row(3, chosen=None), ["train_dataset, row 3, column 'chosen': None", "a string"]),
    "a number for a prompt": (
        [{**row, "prompt": 7} for row in PLAIN],
        ["row 0, column 'prompt': a value of type int (7), where a string is expected (row 0's 'chosen' is a string"],
    ),
    "strings where messages are expected": (
        [{"prompt": USER, "chosen": ["w3"], "rejected": ANSWER}] * 4,
        ["row 0, column 'chosen': a list of str (['w3'])", "a list of messages is expected", "conversational"],
    ),
    "conversational prompts, plain completions": (
        [{**row, "prompt": USER} for row in PLAIN],
        ["row 0, column 'chosen': a string, where a list of messages is expected", "conversational"],
    ),
    "an image column for a text model": (
        [{**row, "images": [Image.new("RGB", (4, 4))]} for row in PLAIN],
        ["train_dataset has an image column 'images', but the model takes no images", "a tokenizer"],
    ),
}


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_stops_at_construction_naming_the_row_and_column(case, padding_free):
    rows, expected = BAD_DATA[case]
    with pytest.raises(ValueError) as error:
        trainer_on(Dataset.from_list(rows), padding_free)
    for text in expected:
        assert text in str(error.value), str(error.value)


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_bad_evaluation_row_is_named_too(padding_free):
    with pytest.raises(ValueError, match=re.escape("eval_dataset['held_out'], row 5, column 'rejected': None")):
        held_out = Dataset.from_list(with_row(5, rejected=None))
        trainer_on(Dataset.from_list(PLAIN), padding_free, eval_dataset={"held_out": held_out})


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize(
    "rows, expected",
    [
        (with_row(5, rejected=None), "train_dataset, row 5, column 'rejected': None, where a string is expected"),
        (with_row(2, prompt=USER), "train_dataset, row 2, column 'prompt': a list of messages, where a string is"),
        ([*PLAIN[:6], {"prompt": "w1", "chosen": " w2"}, *PLAIN[6:]], "train_dataset, row 6, has no 'rejected'"),
    ],
    ids=["None", "mixed rows", "missing key"],
)
def test_a_stream_is_checked_row_by_row_as_training_reads_it(rows, expected, padding_free):
    # Rows a stream can hold and an Arrow table cannot (a mixed format, a missing key): found as the first step reads
    # its batch, before the step
    trainer = trainer_on(streamed(rows), padding_free, max_steps=1)
    with pytest.raises(ValueError, match=re.escape(expected)):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_good_stream_trains_on_the_same_rows():
    trainer = trainer_on(streamed(PLAIN), True, max_steps=2, logging_steps=1)
    trainer.train()
    assert trainer.state.global_step == 2


def test_the_checked_stream_yields_the_same_rows_and_reads_none_ahead():
    produced = []

    def rows():
        for index in itertools.count():
            produced.append(index)
            yield PLAIN[index % len(PLAIN)]

    stream = IterableDataset.from_generator(rows)
    checked, _ = checked_preference_datasets(stream, None, why_no_images=lambda: None)
    assert len(produced) < 10, "the check read the stream ahead"
    assert list(itertools.islice(checked, 30)) == [PLAIN[index % len(PLAIN)] for index in range(30)]


def test_a_dataset_is_read_at_row_0_and_at_each_columns_first_missing_value(monkeypatch):
    # 50,000 rows, shuffled (an indices mapping over the Arrow table): the rows read are row 0 and the first None
    rows = PLAIN * 4167
    rows[31_337] = {**rows[31_337], "rejected": None}
    dataset = Dataset.from_list(rows[:50_000]).shuffle(seed=0)
    bad = list(dataset["rejected"]).index(None)
    read = []
    original = Dataset.__getitem__
    monkeypatch.setattr(Dataset, "__getitem__", lambda self, key: read.append(key) or original(self, key))
    with pytest.raises(ValueError, match=f"row {bad}, column 'rejected': None"):
        checked_preference_datasets(dataset, None, why_no_images=lambda: None)
    assert read == [0, bad]  # row 0 (its columns, its format), then the one row that can differ


def test_valid_formats_pass_unchanged():
    conversational = [{"prompt": USER, "chosen": ANSWER, "rejected": ANSWER}] * 3
    implicit_prompt = [{"chosen": USER + ANSWER, "rejected": USER + ANSWER}] * 3  # TRL extracts the shared start
    for rows in (PLAIN, conversational, implicit_prompt):
        dataset = Dataset.from_list(rows)
        assert checked_preference_datasets(dataset, dataset, why_no_images=lambda: None) == (dataset, dataset)


def test_evaluation_images_need_training_images():
    images = Dataset.from_list([{**row, "images": [Image.new("RGB", (4, 4))]} for row in PLAIN[:3]])
    with pytest.raises(ValueError, match="eval_dataset has an image column 'images', but train_dataset has none"):
        checked_preference_datasets(Dataset.from_list(PLAIN), images, why_no_images=lambda: None)
    assert checked_preference_datasets(images, images, why_no_images=lambda: None) == (images, images)


def test_a_vision_language_config_without_its_vision_tower_takes_no_images():
    # transformers' default Gemma4Config() leaves its vision tower out: the model is its language model alone
    model = types.SimpleNamespace(config=Gemma4Config())
    assert "has no vision tower (vision_config=None)" in why_no_images(model, None, None)


def test_value_kinds():
    assert value_kind("w1") == "a string" and value_kind(USER) == "a list of messages"
    assert value_kind(None) == "None" and value_kind([]) == "an empty list"
    assert value_kind([{"content": "w1"}]).startswith("a list of dict")  # a message needs its role
