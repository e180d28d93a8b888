"""The shipped preference pairs and tokenizer, their files and loaders (no download)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
DEMO_DATASET_NAME = "trl-padfree/demo-preferences"  # what recipes accept as `dataset_name` for the shipped data
SPLIT_FILES = {"train": "preferences_train.jsonl", "test": "preferences_test.jsonl"}
TOKENIZER_FILE = "tokenizer.json"


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
