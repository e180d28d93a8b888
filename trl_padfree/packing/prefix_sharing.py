"""Prefix sharing: each pair laid out once, its prompt computed once for both completions.

    unshared row   | p0 p1 p2 p3 c0 c1 | p0 p1 p2 p3 r0 r1 r2 |
    shared row     | p0 p1 p2 | p3 c0 c1 | p3 r0 r1 r2 |
    position_ids   | 0  1  2  | 3  4  5  | 3  4  5  6  |
                     prefix     chosen     rejected branch: attends to the prefix and to itself, never to the
                                branch     chosen branch; its positions continue from the prefix

Both branches open with the last prompt token. A causal LM scores each token from the position before it, and one
position scores one next token, so the rejected branch repeats p3 to score r0 from it. p3 sees the same prefix at the
same position in both branches, so its hidden states are equal: one token per pair is computed twice instead of the
whole prompt, and every token is scored exactly as in the unshared layout.

Attention for that layout (modeling/attention/rows.py) is two varlen calls: the row's segments (prefix + chosen branch, rejected
branch, ...) as usual, then every rejected branch again against its gathered prefix and branch keys, whose outputs
replace the first call's. `SharedPrefixAttention` holds the gather indices of that second call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .layout import cu_seq_lens_from_lengths, kept_prompt_and_completion, pair_tokens, ranges_index

logger = logging.getLogger(__name__)

# The prefix holds the prompt but its last token, which both branches repeat: shorter prompts share nothing
MIN_SHARED_PROMPT_TOKENS = 2
# Shorter prompts are laid out unshared by default: on 2 CPU cores (small demo Llama, 100-300 token completions) a
# shared pair was 0.95x as fast at 2 prompt tokens, 0.99x at 4, 1.01x at 8 and 1.16x at 64 (docs/prefix-sharing.md)
DEFAULT_MIN_PROMPT_TOKENS = 8


def shared_prefix_length(chosen_prompt: int, rejected_prompt: int, min_prompt_tokens: int) -> int:
    """Tokens of the shared prefix, from the prompt tokens each truncated sequence starts with; 0 lays the pair out
    unshared.

    Both sequences start with the same prompt tokens exactly when they kept the same number of them (truncation cuts
    the same prompt from one end), and a shorter prompt than `min_prompt_tokens` is not worth the second attention
    call.
    """
    if chosen_prompt != rejected_prompt or chosen_prompt < max(MIN_SHARED_PROMPT_TOKENS, min_prompt_tokens):
        return 0
    return chosen_prompt - 1


def pair_row_tokens(
    prompt: int,
    chosen: int,
    rejected: int,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
) -> int:
    """Tokens a pair adds to a prefix-sharing row: both truncated sequences, less the shared prefix."""
    prefix = shared_prefix_length(
        kept_prompt_and_completion(prompt, chosen, max_length, truncation_mode)[0],
        kept_prompt_and_completion(prompt, rejected, max_length, truncation_mode)[0],
        min_prompt_tokens,
    )
    return pair_tokens(prompt, chosen, rejected, max_length) - prefix


@dataclass
class SharedPrefixAttention:
    """The second attention call of a prefix-sharing row, passed to the model as the `shared_prefix` kwarg.

    Queries are the tokens of every rejected branch that reads a prefix; its keys are that pair's prefix, then the
    branch, so causal attention aligned to the bottom-right corner (flash attention's convention when a segment has
    more keys than queries) lets each query see the whole prefix and the branch up to itself.
    """

    query_index: torch.Tensor  # (Q,) row positions of the rejected-branch tokens
    key_index: torch.Tensor  # (K,) row positions of each pair's prefix, then of its rejected branch
    cu_seq_lens_q: torch.Tensor  # (pairs + 1,) int32
    cu_seq_lens_k: torch.Tensor  # (pairs + 1,) int32
    max_length_q: int
    max_length_k: int
    branch_segments: frozenset[int]  # the row segments these branches are, whose first-call outputs are replaced

    @classmethod
    def from_branches(
        cls,
        branch_starts: torch.Tensor,
        branch_lens: torch.Tensor,
        prefix_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        cu_seq_lens: torch.Tensor,
    ) -> SharedPrefixAttention:
        """From the row ranges of each rejected branch and of the prefix it reads (one entry per shared pair), and
        the row's segment boundaries."""
        branch_segments = torch.searchsorted(cu_seq_lens.long(), branch_starts)
        key_starts = torch.stack([prefix_starts, branch_starts], dim=1).reshape(-1)
        key_lens = torch.stack([prefix_lens, branch_lens], dim=1).reshape(-1)
        return cls(
            query_index=ranges_index(branch_starts, branch_lens),
            key_index=ranges_index(key_starts, key_lens),
            cu_seq_lens_q=cu_seq_lens_from_lengths(branch_lens.tolist()),
            cu_seq_lens_k=cu_seq_lens_from_lengths((prefix_lens + branch_lens).tolist()),
            max_length_q=int(branch_lens.max()),
            max_length_k=int((prefix_lens + branch_lens).max()),
            branch_segments=frozenset(branch_segments.tolist()),
        )

    def to(self, device: torch.device) -> SharedPrefixAttention:
        moved = {name: getattr(self, name).to(device) for name in ("query_index", "key_index")}
        moved |= {name: getattr(self, name).to(device) for name in ("cu_seq_lens_q", "cu_seq_lens_k")}
        return SharedPrefixAttention(
            **moved,
            max_length_q=self.max_length_q,
            max_length_k=self.max_length_k,
            branch_segments=self.branch_segments,
        )


def sharing_summary(
    pairs: list[tuple[int, int, int]], max_length: int | None, truncation_mode: str, min_prompt_tokens: int
) -> tuple[int, float]:
    """How many of these `(prompt, chosen, rejected)` token counts share their prompt, and the fraction of row
    tokens sharing saves."""
    shared_pairs = unshared_tokens = shared_tokens = 0
    for prompt, chosen, rejected in pairs:
        shared = pair_row_tokens(prompt, chosen, rejected, max_length, truncation_mode, min_prompt_tokens)
        unshared = pair_tokens(prompt, chosen, rejected, max_length)
        shared_pairs += shared < unshared
        unshared_tokens += unshared
        shared_tokens += shared
    return shared_pairs, 1.0 - shared_tokens / max(unshared_tokens, 1)


def log_sharing_summary(dataset, max_length: int | None, truncation_mode: str, min_prompt_tokens: int) -> None:
    """Say (INFO) how much of a training set TRL tokenized prefix sharing lays out shared; the rest falls back to
    unshared. Silent for a streamed dataset, which has no columns to read without consuming it."""
    import datasets

    if not logger.isEnabledFor(logging.INFO) or not isinstance(dataset, datasets.Dataset):
        return
    if not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names):
        return
    columns = (dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
    lengths = [(len(prompt), len(chosen), len(rejected)) for prompt, chosen, rejected in zip(*columns, strict=True)]
    shared_pairs, saved = sharing_summary(lengths, max_length, truncation_mode, min_prompt_tokens)
    logger.info(
        f"Prefix sharing: {shared_pairs} of {len(lengths)} training pairs share their prompt, {saved:.1%} fewer row "
        f"tokens; the other pairs (prompts under {min_prompt_tokens} tokens, or chosen and rejected truncated into "
        "the prompt differently) are laid out unshared."
    )
