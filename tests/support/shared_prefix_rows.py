"""Rows with shared prompts and their reference attention, and whether "auto" shares a batch, for the prefix-sharing
tests (tests/packing/test_prefix_sharing.py, tests/packing/test_prompt_group_rows.py, tests/integration/gpu/test_gpu.py,
tests/integration/prompt_groups/test_prompt_group_batching.py)."""

import random

import torch
import torch.nn.functional as F

from trl_padfree.modeling.packed_forward import PackedBatch
from trl_padfree.packing.prefix_sharing import SharingCost, layout_pays, pair_segments

# Share every prompt that can be shared; the default (8 tokens) lays short prompts out unshared
SHARE = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)


def random_examples(shapes, seed=0, vocab_size=60):
    rng = random.Random(seed)

    def tokens(count):
        return [rng.randrange(4, vocab_size) for _ in range(count)]

    return [{"prompt_ids": tokens(p), "chosen_ids": tokens(c), "rejected_ids": tokens(r)} for p, c, r in shapes]


# Awkward on purpose: one-token prompt (not shareable) and completions, a long prompt, rows longer than the sliding
# window (6) of the mistral and gemma3_text configs
EXAMPLES = random_examples([(7, 3, 1), (2, 1, 9), (12, 11, 2), (1, 4, 4), (9, 1, 1)])


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_attention(query, key, value, allowed):
    """Reference: attention over the whole row with an explicit `(T, T)` mask of which keys each query sees."""
    key, value = (tensor.repeat_interleave(HEADS // KV_HEADS, dim=1) for tensor in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed).transpose(1, 2)


def row_qkv(length: int):
    """Seeded queries, keys and values of a row of `length` tokens, `(1, heads, length, head dim)`, with gradients."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator, requires_grad=True)
    key = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator, requires_grad=True)
    value = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator, requires_grad=True)
    return query, key, value


def layout_mask(batch, sliding_window=None):
    """Which row positions each position attends to in the shared layout: built token by token from the sequences."""
    packed = PackedBatch.from_collated(batch)
    length = packed.row_length
    allowed = torch.zeros(length, length, dtype=torch.bool)
    positions = batch["position_ids"][0]
    for index, valid in zip(packed.token_index, packed.token_valid, strict=True):
        row_positions = index[valid]
        for q in row_positions:
            for k in row_positions:
                distance = positions[q] - positions[k]
                if 0 <= distance and (sliding_window is None or distance < sliding_window):
                    allowed[q, k] = True
    start = packed.real_row_tokens  # the padding segment attends causally among itself
    padding = torch.ones(length - start, length - start, dtype=torch.bool).tril()
    allowed[start:, start:] = padding if sliding_window is None else padding.triu(1 - sliding_window)
    return allowed


def shares_pay(cost: SharingCost | None, lengths: list[tuple[int, int]], prefixes: list[int], scored: int) -> bool:
    """Whether `prefix_sharing="auto"` lays this batch out shared, pair by pair (`layout_pays`)."""
    sequence_lengths = [length for pair in lengths for length in pair]
    return layout_pays(cost, sequence_lengths, pair_segments(lengths, prefixes), scored, scored)
