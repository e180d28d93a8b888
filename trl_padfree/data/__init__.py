"""The preference data and tokenizer shipped in the package, for the demo, the recipes and the tests (no download).

The files are written by tools/generate_data.py in the repository (see docs/guides/quickstart.md): English-like chats composed from
phrase banks, with token lengths modelled on UltraFeedback and Capybara (`length_models`), and a byte-level BPE
tokenizer trained on them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent
DEMO_DATASET_NAME = "trl-padfree/demo-preferences"  # what recipes accept as `dataset_name` for the shipped data
SPLIT_FILES = {"train": "preferences_train.jsonl", "test": "preferences_test.jsonl"}
TOKENIZER_FILE = "tokenizer.json"

__all__ = ["DATA_DIR", "DEMO_DATASET_NAME", "length_statistics", "load_demo_dataset", "load_demo_tokenizer"]


def load_demo_dataset(split: str | None = None, streaming: bool = False):
    """Load the shipped preference pairs, in TRL's standard (non-conversational) preference format.

    Args:
        split (`str`, *optional*):
            `"train"` (320 pairs) or `"test"` (40 pairs). If `None`, both.
        streaming (`bool`, *optional*, defaults to `False`):
            Read the files as they are iterated (`IterableDataset`s), as `load_dataset(..., streaming=True)` does.

    Returns:
        `datasets.DatasetDict` with `"train"` and `"test"` when `split` is `None`, else that split's
        `datasets.Dataset` (`IterableDatasetDict` and `IterableDataset` when streaming). Columns: `prompt`, `chosen`,
        `rejected` (strings; completions start with a space).

    Example:

    ```python
    >>> from trl_padfree.data import load_demo_dataset
    >>> load_demo_dataset("test").column_names
    ['prompt', 'chosen', 'rejected']

    ```
    """
    from datasets import load_dataset  # datasets is heavy to import; only the loaders need it

    if split is not None and split not in SPLIT_FILES:
        raise ValueError(f"Unknown split {split!r} of {DEMO_DATASET_NAME}: use one of {sorted(SPLIT_FILES)} or None.")
    data_files = {name: str(DATA_DIR / file) for name, file in SPLIT_FILES.items()}
    dataset = load_dataset("json", data_files=data_files, streaming=streaming)
    return dataset if split is None else dataset[split]


def load_demo_tokenizer():
    """Load the shipped tokenizer: byte-level BPE, vocabulary of 2048, trained on the shipped data.

    Returns:
        `transformers.PreTrainedTokenizerFast` with `pad_token="<pad>"` (id 0), `bos_token="<s>"` (1),
        `eos_token="</s>"` (2) and `unk_token="<unk>"` (3). It adds no special tokens by itself (TRL appends the EOS
        to completions), and `decode(encode(text))` gives `text` back exactly.

    Example:

    ```python
    >>> from trl_padfree.data import load_demo_tokenizer
    >>> tokenizer = load_demo_tokenizer()
    >>> tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id
    (0, 1, 2, 3)

    ```
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(DATA_DIR / TOKENIZER_FILE),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        # The byte-level decoder already restores every space; the cleanup would remove the one before "." or "'s"
        clean_up_tokenization_spaces=False,
    )


def _summary(lengths: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(lengths.mean()),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
    }


def length_statistics(dataset, tokenizer) -> dict[str, dict[str, float]]:
    """Token-length statistics of a preference dataset.

    Args:
        dataset (`datasets.Dataset`):
            Standard preference pairs with string columns `prompt`, `chosen` and `rejected`.
        tokenizer (`transformers.PreTrainedTokenizerBase`):
            Tokenizer that measures the lengths; no special tokens are added.

    Returns:
        `dict[str, dict[str, float]]`: for each of `"prompt"`, `"chosen"`, `"rejected"` and `"pair"` (prompt, chosen
        and rejected tokens together), the `"mean"`, `"median"`, `"p90"` and `"max"` token counts.

    Example:

    ```python
    >>> from trl_padfree.data import length_statistics, load_demo_dataset, load_demo_tokenizer
    >>> statistics = length_statistics(load_demo_dataset("test"), load_demo_tokenizer())
    >>> sorted(statistics), sorted(statistics["pair"])
    (['chosen', 'pair', 'prompt', 'rejected'], ['max', 'mean', 'median', 'p90'])

    ```
    """
    lengths = {
        column: np.array([len(ids) for ids in tokenizer(list(dataset[column]), add_special_tokens=False)["input_ids"]])
        for column in ("prompt", "chosen", "rejected")
    }
    lengths["pair"] = lengths["prompt"] + lengths["chosen"] + lengths["rejected"]
    return {name: _summary(values) for name, values in lengths.items()}
