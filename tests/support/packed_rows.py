"""The packed row of the model tests, the two forwards compared on it (packed, and each sequence alone), and random
inputs with a naive reference for the `padfree_varlen` attention tests (tests/modeling/test_models.py,
tests/modeling/attention/test_attention.py, tests/integration/gpu/test_gpu.py)."""

import torch

from trl_padfree.packing.layout import segment_ids_from_lengths

EXAMPLES = [
    {"prompt_ids": [5, 9, 13, 17, 21, 25, 29], "chosen_ids": [33, 37, 41], "rejected_ids": [45]},
    {"prompt_ids": [6, 10], "chosen_ids": [14], "rejected_ids": [18, 22, 26, 30, 34, 38, 42, 46, 50]},
    {
        "prompt_ids": [7, 11, 15, 19],
        "chosen_ids": [23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63],
        "rejected_ids": [67, 71],
    },
]
PACKED_KEYS = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@torch.no_grad()
def packed_log_probs(model, batch):
    """One forward on the packed row, with no attention mask: log-probs of the real tokens, `(tokens, vocab)`."""
    num_real_tokens = int(batch["seq_lens"].sum())
    logits = model(**{key: batch[key] for key in PACKED_KEYS}, use_cache=False).logits
    return logits.float().log_softmax(-1)[0, :num_real_tokens]


@torch.no_grad()
def per_sequence_log_probs(model, batch):
    """One forward per sequence, each alone in its batch: log-probs concatenated in packed order."""
    num_real_tokens = int(batch["seq_lens"].sum())
    sequences = batch["input_ids"][0, :num_real_tokens].split(batch["seq_lens"].tolist())
    return torch.cat(
        [model(input_ids=ids.unsqueeze(0), use_cache=False).logits.float().log_softmax(-1)[0] for ids in sequences]
    )


def max_error(actual, expected):
    return (actual - expected).abs().max().item()


# Random inputs and a reference for the attention tests

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
ATTENTION_LENGTHS = [5, 1, 9]  # 15 tokens


def random_qkv(num_rows=1):
    length = sum(ATTENTION_LENGTHS)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(num_rows, NUM_HEADS, length, HEAD_DIM, generator=generator)
    key = torch.randn(num_rows, NUM_KV_HEADS, length, HEAD_DIM, generator=generator)
    value = torch.randn(num_rows, NUM_KV_HEADS, length, HEAD_DIM, generator=generator)
    return query, key, value


def block_diagonal_attention(query, key, value, lengths, sliding_window=None):
    """Naive softmax attention of a whole row under a block-diagonal causal mask: `(1, T, heads, dim)`."""
    key = key.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    value = value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    segment_ids = segment_ids_from_lengths(torch.tensor(lengths, device=query.device))
    positions = torch.arange(len(segment_ids), device=query.device)
    query_positions, key_positions = positions.unsqueeze(1), positions.unsqueeze(0)
    allowed = (segment_ids.unsqueeze(1) == segment_ids.unsqueeze(0)) & (key_positions <= query_positions)
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    scores = (query @ key.transpose(-1, -2)) * HEAD_DIM**-0.5
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ value).transpose(1, 2)
