"""What the tests build in memory, with no download: a word-level tokenizer over `w0` ... `w89`, tiny models over its
vocabulary (`trl_padfree.tiny`'s configs) and preference pairs with awkward lengths over its words."""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trl_padfree import tiny

WORDS = [f"w{index}" for index in range(90)]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: the tiny models' pad, bos and eos ids
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(WORDS)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `WORDS`, built in memory."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def make_model(
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = VOCAB_SIZE,
    **overrides,
):
    """`trl_padfree.tiny.make_model` over `make_tokenizer()`'s vocabulary unless `vocab_size` says otherwise."""
    return tiny.make_model(model_type, attn_implementation, seed, dtype, vocab_size=vocab_size, **overrides)


def _sentence(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(length))


def make_preference_dataset(num_pairs: int = 16, seed: int = 0, max_words: int = 40) -> Dataset:
    """Pairs with awkward lengths: one-word completions, a single long prompt, lengths that differ a lot."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_pairs):
        prompt_words = max_words if index == 1 else rng.randint(1, max_words // 3)
        chosen_words = 1 if index % 5 == 0 else rng.randint(1, max_words // 2)
        rejected_words = 1 if index % 7 == 3 else rng.randint(1, max_words // 2)
        rows.append(
            {
                "prompt": _sentence(rng, prompt_words),
                "chosen": " " + _sentence(rng, chosen_words),
                "rejected": " " + _sentence(rng, rejected_words),
            }
        )
    return Dataset.from_list(rows)
