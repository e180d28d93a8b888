"""Preference pairs from prompts with K scored completions (UltraFeedback's layout, or K samples of an on-policy run
rated by a reward model), as TRL's data utilities turn one dataset layout into another (`unpair_preference_dataset`):

    prompt   completions             scores            prompt  chosen  rejected  prompt_id  score_chosen  score_rejected
    "2+2="   ["4", "5", "22", "8"]   [9, 3, 5, 1]  ->  "2+2="  "4"     "8"       0          9.0           1.0

`pairing="best_vs_worst"` makes one pair per prompt, its highest-scored completion against its lowest;
`pairing="all_pairs"` makes every pair whose chosen completion scores strictly higher than its rejected one (K = 4
distinct scores: 6 pairs, best first: 9-5, 9-3, 9-1, 5-3, 5-1, 3-1). Equal scores make no pair. A prompt's pairs are
rows next to each other and carry the same `prompt_id`, so that `packing.prompt_groups` can bring them into one batch.

Prompts and completions are copied as they are: strings (standard) or lists of messages (conversational). Other
columns are repeated on each of the row's pairs.

UltraFeedback as published (`openbmb/UltraFeedback`: `instruction`, and `completions[i]["response"]`,
`completions[i]["overall_score"]`) is read by `pair_ultrafeedback`. Its rows with fewer than 2 completions are
refused like any other; drop them first: `dataset.filter(lambda row: len(row["completions"]) >= 2)`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from datasets import Dataset, DatasetDict

PAIRINGS = ("best_vs_worst", "all_pairs")
PAIR_COLUMNS = ("prompt", "chosen", "rejected", "prompt_id", "score_chosen", "score_rejected")


@dataclass(frozen=True)
class ScoredLayout:
    """Where a row keeps its prompt, its completions and their scores: `read(batch, row)` returns the three of row
    `row` of a batch of columns; `columns` are the columns it reads (dropped from the output)."""

    columns: tuple[str, ...]
    read: Callable[[dict, int], tuple]
    what: str  # the layout, as an error message names it


def _column_layout(prompt_column: str, completions_column: str, scores_column: str) -> ScoredLayout:
    return ScoredLayout(
        columns=(prompt_column, completions_column, scores_column),
        read=lambda batch, row: (batch[prompt_column][row], batch[completions_column][row], batch[scores_column][row]),
        what=f"{completions_column!r} and {scores_column!r}",
    )


def _read_ultrafeedback(batch: dict, row: int) -> tuple:
    completions = batch["completions"][row]
    if not isinstance(completions, list):
        return batch["instruction"][row], completions, []  # refused by `_checked_scores`
    responses = [completion["response"] for completion in completions]
    return batch["instruction"][row], responses, [completion["overall_score"] for completion in completions]


ULTRAFEEDBACK = ScoredLayout(("instruction", "completions"), _read_ultrafeedback, "UltraFeedback's 'completions'")


def pair_scored_completions(
    dataset: Dataset | DatasetDict,
    pairing: str = "best_vs_worst",
    *,
    prompt_column: str = "prompt",
    completions_column: str = "completions",
    scores_column: str = "scores",
    prompt_id_column: str | None = None,
    num_proc: int | None = None,
    desc: str | None = None,
) -> Dataset | DatasetDict:
    r"""
    Turn prompts with K scored completions into preference pairs, a prompt's pairs next to each other.

    Args:
        dataset ([`~datasets.Dataset`] or [`~datasets.DatasetDict`]):
            One row per prompt: the prompt, a list of K >= 2 completions and a list of their K scores (real, finite;
            higher is better). Standard (strings) or conversational (lists of messages).
        pairing (`str`, *optional*, defaults to `"best_vs_worst"`):
            `"best_vs_worst"`: one pair per prompt, the highest score against the lowest (the first of equals).
            `"all_pairs"`: every pair whose chosen completion scores strictly higher, best chosen first.
            A prompt whose scores are all equal makes no pair.
        prompt_column, completions_column, scores_column (`str`, *optional*):
            The columns holding them; default `"prompt"`, `"completions"`, `"scores"`.
        prompt_id_column (`str`, *optional*):
            A column identifying each prompt, copied to `prompt_id`. By default `prompt_id` is the row's index (in
            its split).
        num_proc (`int`, *optional*):
            Number of processes for [`~datasets.Dataset.map`].
        desc (`str`, *optional*):
            Description shown with the progress bar.

    Returns:
        [`~datasets.Dataset`] or [`~datasets.DatasetDict`]: columns `prompt`, `chosen`, `rejected`, `prompt_id`,
        `score_chosen`, `score_rejected`, and the input's other columns, repeated on each of a row's pairs.

    Example:

    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict(
    ...     {
    ...         "prompt": ["2+2=", "The sky is"],
    ...         "completions": [["4", "5", "22"], [" blue.", " green."]],
    ...         "scores": [[9, 3, 1], [8, 2]],
    ...     }
    ... )
    >>> pairs = pair_scored_completions(dataset, "all_pairs")
    >>> pairs.select_columns(["prompt_id", "chosen", "rejected"])[:]
    {'prompt_id': [0, 0, 0, 1], 'chosen': ['4', '4', '5', ' blue.'], 'rejected': ['5', '22', '22', ' green.']}

    ```
    """
    layout = _column_layout(prompt_column, completions_column, scores_column)
    return _pairs_of_each(dataset, pairing, layout, prompt_id_column, num_proc, desc)


def pair_ultrafeedback(
    dataset: Dataset | DatasetDict,
    pairing: str = "best_vs_worst",
    *,
    num_proc: int | None = None,
    desc: str | None = None,
) -> Dataset | DatasetDict:
    """`pair_scored_completions` of UltraFeedback as published: the prompt is `instruction`, the completions are
    `completions[i]["response"]` scored `completions[i]["overall_score"]`; `prompt_id` is the row's index.

    >>> from datasets import Dataset
    >>> completions = [{"response": "4", "overall_score": 9.0}, {"response": "5", "overall_score": 2.5}]
    >>> pair_ultrafeedback(Dataset.from_dict({"instruction": ["2+2="], "completions": [completions]}))[0]
    {'prompt': '2+2=', 'chosen': '4', 'rejected': '5', 'prompt_id': 0, 'score_chosen': 9.0, 'score_rejected': 2.5}
    """
    return _pairs_of_each(dataset, pairing, ULTRAFEEDBACK, None, num_proc, desc)


def _pairs_of_each(dataset, pairing, layout, prompt_id_column, num_proc, desc):
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not one of {PAIRINGS}.")
    if isinstance(dataset, DatasetDict):
        return DatasetDict(
            {
                split: _pairs(part, f"split {split!r}", pairing, layout, prompt_id_column, num_proc, desc)
                for split, part in dataset.items()
            }
        )
    if isinstance(dataset, Dataset):
        return _pairs(dataset, "the dataset", pairing, layout, prompt_id_column, num_proc, desc)
    raise TypeError(f"Expected a datasets.Dataset or DatasetDict, got {type(dataset).__name__}.")


def _pairs(dataset, name, pairing, layout, prompt_id_column, num_proc, desc) -> Dataset:
    read = [*layout.columns, *([prompt_id_column] if prompt_id_column else [])]
    missing = [column for column in read if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{name} has no column {missing[0]!r} (its columns: {dataset.column_names}).")
    extra = [column for column in dataset.column_names if column not in read]
    clashing = [column for column in extra if column in PAIR_COLUMNS]
    if clashing:
        advice = " Pass prompt_id_column='prompt_id' to keep it as the id." if clashing == ["prompt_id"] else ""
        raise ValueError(f"{name}'s column {clashing[0]!r} would be overwritten by the pairs' own.{advice}")

    def pairs_of_batch(batch: dict, indices: list[int]) -> dict:
        out = {column: [] for column in (*PAIR_COLUMNS, *extra)}
        for row, index in enumerate(indices):
            prompt, completions, scores = layout.read(batch, row)
            where = f"{name}, row {index}"
            scores = _checked_scores(where, layout.what, completions, scores)
            prompt_id = batch[prompt_id_column][row] if prompt_id_column else index
            for chosen, rejected in _chosen_and_rejected(scores, pairing):
                pair = (
                    prompt,
                    completions[chosen],
                    completions[rejected],
                    prompt_id,
                    scores[chosen],
                    scores[rejected],
                )
                for column, value in zip(PAIR_COLUMNS, pair, strict=True):
                    out[column].append(value)
                for column in extra:
                    out[column].append(batch[column][row])
        return out

    paired = dataset.map(
        pairs_of_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=desc,
    )
    if len(paired) == 0:  # the Arrow table would keep the input's columns: refuse rather than return a wrong schema
        raise ValueError(f"{name} makes no pair: it has no row, or every row's completions score the same.")
    return paired


def _checked_scores(where: str, what: str, completions: Sequence, scores: Sequence) -> list[float]:
    if not isinstance(completions, list) or not isinstance(scores, list):
        raise ValueError(
            f"{where}: {what} must be lists, got {type(completions).__name__} and {type(scores).__name__}."
        )
    if len(completions) != len(scores):
        raise ValueError(f"{where}: {len(completions)} completions but {len(scores)} scores; give one score each.")
    if len(completions) < 2:
        raise ValueError(
            f"{where}: {len(completions)} completion(s); a pair needs at least 2. Drop such rows first (`dataset.filter`)."
        )
    for score in scores:
        if not isinstance(score, numbers.Real) or isinstance(score, bool) or not math.isfinite(score):
            raise ValueError(f"{where}: score {score!r} is not a finite number (scores: {scores}).")
    return [float(score) for score in scores]


def _chosen_and_rejected(scores: list[float], pairing: str) -> list[tuple[int, int]]:
    """Positions (chosen, rejected) of the pairs of one prompt's scores, best chosen first; equal scores make none."""
    if pairing == "best_vs_worst":
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equals
        worst = min(range(len(scores)), key=scores.__getitem__)
        return [(best, worst)] if scores[best] > scores[worst] else []
    ranked = sorted(range(len(scores)), key=lambda position: -scores[position])  # stable: equals keep their order
    return [
        (better, worse)
        for rank, better in enumerate(ranked)
        for worse in ranked[rank + 1 :]
        if scores[better] > scores[worse]
    ]
