"""The preference data and tokenizer shipped in `trl_padfree.data`: loading, tokenizer, lengths, reproducibility."""

import filecmp

import numpy as np
import pytest
from datasets import Dataset, DatasetDict

from tools import generate_data as generator
from trl_padfree.data import (
    DATA_DIR,
    DEMO_DATASET_NAME,
    length_statistics,
    load_demo_dataset,
    load_demo_tokenizer,
)

COLUMNS = ["prompt", "chosen", "rejected"]


@pytest.fixture(scope="module")
def dataset():
    return load_demo_dataset()


@pytest.fixture(scope="module")
def tokenizer():
    return load_demo_tokenizer()


@pytest.fixture(scope="module")
def token_lengths(dataset, tokenizer):
    """Token counts of the train split, one row per pair: prompt, chosen, rejected."""
    train = dataset["train"]
    columns = [tokenizer(list(train[column]), add_special_tokens=False)["input_ids"] for column in COLUMNS]
    return np.array([[len(ids) for ids in column] for column in columns]).T


def test_both_splits_load_with_the_standard_preference_columns(dataset):
    assert DEMO_DATASET_NAME == "trl-padfree/demo-preferences"
    assert isinstance(dataset, DatasetDict) and sorted(dataset) == ["test", "train"]
    assert (dataset["train"].num_rows, dataset["test"].num_rows) == (generator.NUM_TRAIN, generator.NUM_TEST)
    for split in ("train", "test"):
        one_split = load_demo_dataset(split)
        assert isinstance(one_split, Dataset)
        assert one_split.column_names == COLUMNS
        assert one_split[0] == dataset[split][0]


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="Unknown split 'validation'"):
        load_demo_dataset("validation")


def test_no_empty_text_and_completions_start_on_a_boundary(dataset):
    for split in ("train", "test"):
        for row in dataset[split]:
            assert all(row[column].strip() for column in COLUMNS)
            assert row["prompt"].endswith("Assistant:")
            # a leading space or newline keeps the completion's first token apart from the prompt's last one
            assert row["chosen"][0] in " \n" and row["rejected"][0] in " \n"
            assert row["chosen"] != row["rejected"]


def test_special_tokens_have_ids_0_to_3(tokenizer):
    assert len(tokenizer) == generator.VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    )
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert (
        tokenizer("Hello", add_special_tokens=True)["input_ids"]
        == tokenizer("Hello", add_special_tokens=False)["input_ids"]
    )  # adds no BOS/EOS of its own: TRL appends the EOS to completions


def test_tokenizer_round_trips_and_never_emits_unk(dataset, tokenizer):
    texts = [
        row["prompt"] + row[completion] for split in dataset for row in dataset[split] for completion in COLUMNS[1:]
    ]
    texts.append("Text it never saw: naïve café, 3.14159, tabs\tand emoji 🤗 .")
    for text, ids in zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True):
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_prompt_tokens_are_a_prefix_of_prompt_plus_completion(dataset, tokenizer):
    # TRL takes the completion to start where these diverge; a merge across the boundary would eat prompt tokens
    for row in dataset["train"].select(range(40)):
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        for completion in ("chosen", "rejected"):
            ids = tokenizer(row["prompt"] + row[completion], add_special_tokens=False)["input_ids"]
            assert ids[: len(prompt_ids)] == prompt_ids


def test_length_statistics_matches_the_lengths_it_summarises(dataset, tokenizer, token_lengths):
    statistics = length_statistics(dataset["train"], tokenizer)
    assert sorted(statistics) == ["chosen", "pair", "prompt", "rejected"]
    pair = token_lengths.sum(axis=1)
    assert statistics["pair"]["max"] == pair.max()
    assert statistics["pair"]["mean"] == pytest.approx(pair.mean())
    assert statistics["prompt"]["median"] == np.median(token_lengths[:, 0])
    assert statistics["chosen"]["p90"] == pytest.approx(np.percentile(token_lengths[:, 1], 90))


def test_length_models_reproduce_the_published_figures():
    # docs/guides/quickstart.md: prefix-sharing paper (arXiv 2410.20305), UltraFeedback 409 / 0.42, Capybara 1160 / 1.59, and
    # Capybara's p95 = 3968 / 1.1; these are the figures the lognormals were fitted to, before the caps
    single, multi = (generator.simulate_length_model(model) for model in (generator.SINGLE_TURN, generator.MULTI_TURN))
    assert single["median_pair"] == pytest.approx(409, rel=0.03)
    assert single["median_prompt_to_completion"] == pytest.approx(0.42, rel=0.05)
    assert multi["median_pair"] == pytest.approx(1160, rel=0.03)
    assert multi["median_prompt_to_completion"] == pytest.approx(1.59, rel=0.05)
    assert multi["p95_over_median_pair"] == pytest.approx(3968 / 1.1 / 1160, rel=0.05)


def test_shipped_lengths_follow_the_modelled_mixture(dataset, token_lengths):
    multi_turn = np.array([generator.is_multi_turn(prompt) for prompt in dataset["train"]["prompt"]])
    assert 0.3 < multi_turn.mean() < 0.5  # 40% Capybara-like
    for model, rows in ((generator.SINGLE_TURN, ~multi_turn), (generator.MULTI_TURN, multi_turn)):
        medians = np.median(token_lengths[rows], axis=0)
        targets = (model.prompt_median, model.chosen_median, model.rejected_median)
        # loose: 320 draws of long-tailed lengths, and the cap cuts the longest multi-turn prompts
        np.testing.assert_allclose(medians, targets, rtol=0.25)
    sequences = token_lengths[:, :1] + token_lengths[:, 1:]
    assert sequences.max() <= generator.SEQUENCE_CAP
    assert 0.03 < (sequences > 1024).mean() < 0.25  # TRL's default max_length truncates a small tail
    assert token_lengths[:, 1:].min() >= generator.MIN_COMPLETION - 3


def test_padding_of_8_pair_batches_is_like_real_data(dataset, tokenizer):
    ratio = generator.padded_batch_ratio(dataset["train"], tokenizer, batch_size=8)
    assert 0.3 < ratio < 0.7


def test_padded_batch_ratio_by_hand():
    class CharTokenizer:  # one token per character
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(text) for text in texts]}

    # sequences (with EOS): 1+2+1=4, 1+1+1=3 | 3+1+1=5, 3+1+1=5 -> longest 5, real 17 of 20
    pairs = Dataset.from_dict({"prompt": ["a", "bbb"], "chosen": ["cc", "d"], "rejected": ["e", "f"]})
    assert generator.padded_batch_ratio(pairs, CharTokenizer(), batch_size=2, num_shuffles=3) == pytest.approx(3 / 20)
    assert generator.padded_batch_ratio(pairs, CharTokenizer(), batch_size=2, max_length=4) == pytest.approx(1 / 16)


def test_generator_rewrites_the_shipped_files_byte_for_byte(tmp_path):
    written = generator.generate(output_dir=tmp_path)
    assert sorted(path.name for path in written) == [
        "preferences_test.jsonl",
        "preferences_train.jsonl",
        "tokenizer.json",
    ]
    for path in written:
        assert filecmp.cmp(path, DATA_DIR / path.name, shallow=False), f"{path.name} differs from the shipped file"
