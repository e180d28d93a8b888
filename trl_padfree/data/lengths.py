"""Token-length statistics of a preference dataset: what docs/guides/quickstart.md and tools/generate_data.py
report of the shipped data."""

from __future__ import annotations

import numpy as np


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
