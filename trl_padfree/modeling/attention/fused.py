"""The fused kernels for the layers torch's varlen kernel cannot compute (plan.py chooses): one call over the whole
packed row each, no loop over its segments and no score matrix kept. Inputs `(1, heads, T, dim)`, fitted to the
kernel as the plan says (cast, padded); each returns `(1, T_q, heads, dim)`.

    sinks       torch's varlen kernel with the sink correction: sinks.py.
    softcap     flash-attn's `flash_attn_varlen_func(softcap=)`, or FlexAttention with a score_mod `c * tanh(s / c)`
                over the row's document mask (its block mask built once per forward from the host boundaries, no
                T x T evaluation: `DocumentTiles`).
    wide heads  ATen's memory-efficient kernel with `cu_seqlens`, behind an op of our own so that the compiler
                never traces ATen's backward (integrations.torch.wide_head_attention_op): grouped keys and values
                expanded to the query heads first (it takes equal head counts); causal from each segment's
                bottom-right corner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def flash_attn_softcap(query, key, value, boundaries, max_lengths, function, options) -> torch.Tensor:
    """flash-attn's varlen kernel, `(T, heads, dim)` in and out; grouped heads shared by the kernel."""
    return function(query, key, value, *boundaries, *max_lengths, dropout_p=0.0, **options)


def efficient_wide_heads(query, key, value, boundaries, max_lengths, function, options) -> torch.Tensor:
    """ATen's memory-efficient kernel (as `integrations.torch.wide_head_attention_op`) on `(T, heads, dim)` inputs
    (keys and values expanded to the query heads first); returns `(T, heads, dim)`."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output, _ = function(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        *boundaries,
        *max_lengths,
        options["custom_mask_type"],
        options["scale"],
        torch.is_grad_enabled(),  # the log-sum-exp its backward needs
    )
    return output[0]


# ---- FlexAttention: the row's document mask, once per forward ----

# FlexAttention's tile (its default block size): the block mask lists, per 128 queries, the 128-key blocks they read
FLEX_BLOCK = 128


def key_ranges(bounds_q, bounds_k, sliding_window, causal) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's keys, one range `[first, end)` of the row's key indices (host int64 tensors of length T_q): its
    segment's keys, causal from the segment's bottom-right corner (a segment with more keys than queries reads them
    first), within the window.

        keys:     |-- segment 0 --|--- segment 1 ---|
        query i of segment 1, causal, window 3:  first = end - 3, end = its own key + 1
    """
    total_q = bounds_q[-1]
    bounds_q, bounds_k = torch.tensor(bounds_q), torch.tensor(bounds_k)
    lengths_q, lengths_k = bounds_q.diff(), bounds_k.diff()
    segment = torch.repeat_interleave(torch.arange(len(lengths_q)), lengths_q, output_size=total_q)
    key_start, key_end = bounds_k[:-1][segment], bounds_k[1:][segment]
    # The key each query sits at: its offset in the segment, shifted by the keys the segment has beyond its queries
    position = key_start + torch.arange(total_q) - bounds_q[:-1][segment] + (lengths_k - lengths_q)[segment]
    end = (position + 1).clamp(key_start, key_end) if causal else key_end
    first = key_start if sliding_window is None else (position - sliding_window + 1).clamp_min(key_start)
    return first, end


@dataclass(frozen=True)
class DocumentTiles:
    """A packed row's document mask for FlexAttention, as host tensors: each query's key range (`key_ranges`) and
    the 128 x 128 tiles it reads, classified from the boundaries without evaluating any of the T_q x T_k pairs
    (FlexAttention's `create_block_mask` evaluates every one). A tile is full when all its 128 queries read all its
    128 keys; partial (the mask decides each pair) when some query reads some key; skipped otherwise."""

    first: torch.Tensor  # (T_q,) each query's first key
    end: torch.Tensor  # (T_q,) past its last key
    total_k: int
    partial: torch.Tensor  # (query blocks, key blocks) booleans
    full: torch.Tensor

    @classmethod
    def of_row(cls, bounds_q, bounds_k, sliding_window, causal) -> DocumentTiles:
        first, end = key_ranges(bounds_q, bounds_k, sliding_window, causal)
        total_q, total_k = len(first), bounds_k[-1]
        # At least 2 tiles each way, the extra ones empty: compiled with dynamic shapes, a dimension of size 1 would be
        # specialised, each short row a graph more (the kernel reads the tiles of its rows only)
        query_blocks, key_blocks = max(-(-total_q // FLEX_BLOCK), 2), max(-(-total_k // FLEX_BLOCK), 2)
        # Read tiles: each query adds +1 at the key block of its first key and -1 past the block of its last
        reads = torch.zeros(query_blocks, key_blocks + 1, dtype=torch.int32)
        block, reading = torch.arange(total_q) // FLEX_BLOCK, (end > first).to(torch.int32)  # (no empty ranges read)
        reads.index_put_((block, first // FLEX_BLOCK), reading, accumulate=True)
        reads.index_put_((block, -(-end // FLEX_BLOCK)), -reading, accumulate=True)
        read = reads.cumsum(1)[:, :-1] > 0
        # Full tiles: from the last query's first key to the first query's end, over 128 queries that all exist
        padding = query_blocks * FLEX_BLOCK - total_q
        last_first = F.pad(first, (0, padding), value=total_k).view(query_blocks, FLEX_BLOCK).amax(1, keepdim=True)
        first_end = F.pad(end, (0, padding), value=0).view(query_blocks, FLEX_BLOCK).amin(1, keepdim=True)
        key_block_start = torch.arange(key_blocks) * FLEX_BLOCK
        full = (key_block_start >= last_first) & (key_block_start + FLEX_BLOCK <= first_end)
        return cls(first, end, total_k, read & ~full, full)

    def block_mask(self, from_kv_blocks, device):
        """FlexAttention's `BlockMask` on `device` (`from_kv_blocks`: `BlockMask.from_kv_blocks`), one copy per
        index tensor; the mask_mod decides the partial tiles' pairs from each query's key range."""
        first, end = (tensor.to(device, torch.int32, non_blocking=True) for tensor in (self.first, self.end))

        def mask_mod(batch, head, q_index, k_index):
            return (k_index >= first[q_index]) & (k_index < end[q_index])

        tiles = (*_ordered(self.partial, device), *_ordered(self.full, device))
        lengths = (len(self.first), self.total_k)
        return from_kv_blocks(*tiles, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=lengths)


def document_block_mask(from_kv_blocks, bounds_q, bounds_k, sliding_window, causal, device):
    """The block mask of a packed row for FlexAttention, built from its host boundaries (`DocumentTiles`)."""
    return DocumentTiles.of_row(bounds_q, bounds_k, sliding_window, causal).block_mask(from_kv_blocks, device)


def _ordered(tiles: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(query blocks, key blocks)` booleans -> per query block the count of its key blocks `(1, 1, query blocks)`
    and their indices first, ascending `(1, 1, query blocks, key blocks)`: the layout `BlockMask` reads."""
    counts = tiles.sum(1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
    return tuple(tensor[None, None].to(device, non_blocking=True) for tensor in (counts, indices))


@functools.cache  # one function per cap and device: a compiled FlexAttention is not compiled again per layer
def softcap_score_mod(softcap: float, device: torch.device):
    # The cap is a tensor, not a Python float: compiled with dynamic shapes, a float would be a symbol FlexAttention's
    # score_mod cannot take; float32, as the scores it caps
    cap = torch.tensor(softcap, dtype=torch.float32, device=device)

    def score_mod(score, batch, head, q_index, k_index):
        return cap * torch.tanh(score / cap)

    return score_mod


def flex_softcap(query, key, value, block_mask, score_mod, attention, options) -> torch.Tensor:
    """FlexAttention on `(1, heads, T, dim)` inputs; returns `(1, T_q, heads, dim)`."""
    output = attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=options["scale"],
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2)
