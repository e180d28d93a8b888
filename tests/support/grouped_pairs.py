"""Pairs of prompts with 4 scored completions each, paired all ways, and a trainer over them that batches a prompt's
6 pairs (tests/integration/prompt_groups/)."""

from __future__ import annotations

import random

from datasets import Dataset
from tiny_fixtures import WORDS, make_model, make_tokenizer

from trl_padfree import DPOConfig, DPOTrainer, pair_scored_completions

COMPLETIONS = 4  # per prompt, paired all ways: 6 pairs
PAIRS_PER_PROMPT = 6
PROMPTS = 6


def scored_pairs(prompts: int = PROMPTS, seed: int = 0) -> Dataset:
    """`prompts` prompts of awkward lengths (one of a single word, one of 31) with 4 completions each (one of a single
    word), scored distinctly and paired all ways by `pair_scored_completions`."""
    rng = random.Random(seed)

    def sentence(length: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(length))

    prompt_lengths = [1, 31, *(rng.randint(2, 14) for _ in range(prompts - 2))]
    rows = {
        "prompt": [sentence(length) for length in prompt_lengths],
        "completions": [
            [" " + sentence(1 if k == 0 else rng.randint(1, 11)) for k in range(COMPLETIONS)] for _ in range(prompts)
        ],
        "scores": [rng.sample(range(10), COMPLETIONS) for _ in range(prompts)],
    }
    return pair_scored_completions(Dataset.from_dict(rows), "all_pairs")


def make_grouped_trainer(
    padding_free: bool = True,
    dataset: Dataset | None = None,
    config_class=DPOConfig,
    trainer_class=DPOTrainer,
    trainer_options: dict | None = None,
    **options,
):
    """A trainer on a tiny Llama (its reference of other weights) over `scored_pairs()`, batches of a prompt's 6
    pairs; `options` go to the config, `trainer_options` to the trainer."""
    options.setdefault("train_sampling_strategy", "group_by_prompt")
    options.setdefault("per_device_train_batch_size", PAIRS_PER_PROMPT)
    defaults = dict(output_dir="/tmp/trl-padfree-tests", report_to=[], save_strategy="no", bf16=False, use_cpu=True)
    args = config_class(padding_free=padding_free, seed=0, **(defaults | options))
    return trainer_class(
        model=make_model(seed=0),
        ref_model=make_model(seed=1),
        args=args,
        train_dataset=scored_pairs() if dataset is None else dataset,
        processing_class=make_tokenizer(),
        **(trainer_options or {}),
    )
