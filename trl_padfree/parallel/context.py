"""Context parallelism for packed rows: each rank of a group holds a contiguous chunk of the row with all its heads,
and attention all-gathers the keys and values of the whole row (the all-gather variant Llama 3 trained with).

Every rank of a context-parallel group of C ranks gets the same packed micro-batch. The row is padded to a multiple of
C and each rank feeds the model its chunk of `input_ids`, `position_ids` and shifted labels. Everything but attention
is per token, so it runs on the chunk alone. In each attention layer the rank all-gathers the row's keys and values
over the group (differentiable: the backward sums each chunk's key and value gradients from every rank) and attends
its own queries to them, segment by segment:

    row (C = 2)   | ---- sequence A ---- | -- B -- | --- sequence C --- |pad|
    rank 0        | queries A[0:7]       |  B      | C[0:2] |                  keys: A[0:7], B, C[0:2]
    rank 1                                                  | C[2:9]   |pad|  keys: C[0:9], pad

A rank's part of a segment is a run of its queries and every key of the segment up to its last query, with causal
attention aligned to the bottom-right corner (flash attention's varlen convention, what `padfree_varlen` computes):
exactly what those queries see in the whole row. A sequence may span any number of chunks. No head-count limit: heads
are never split, only the row (padded to a multiple of C). With prefix sharing a rejected branch's keys are its prefix,
wherever in the row it lies, then itself (packing/prefix_sharing.py): one call still, gathered like every other key.

The per-token outputs (log-probs, ...) are all-gathered back into the whole row, as under Ulysses (ulysses.py), so
every rank computes the same per-sequence sums and TRL's loss, unchanged. `ContextParallelRow` is one kind of row of
modeling/attention/rows.py: the registered attention hands it its layer's segments like any other row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..modeling.attention.rows import PackedRow
from ..modeling.attention.varlen import varlen_attention
from ..packing.layout import host_to_device
from ..packing.prefix_sharing import SharedPrefixAttention
from ..refusals import check_processes_share_rows
from .groups import RowGroup


@dataclass(frozen=True)
class LocalSegments:
    """One attention call of a rank's chunk: its query segments and, for each, the row positions of its keys."""

    key_index: torch.Tensor  # (K,) row positions of the keys, segment after segment
    cu_seq_lens_q: torch.Tensor  # int32
    cu_seq_lens_k: torch.Tensor  # int32
    max_length_q: int
    max_length_k: int
    segments: tuple[int, ...]  # the row segment each local segment is part of
    bounds_q: tuple[int, ...] = ()  # cu_seq_lens_q and cu_seq_lens_k on the host
    bounds_k: tuple[int, ...] = ()


def localize(
    key_index: torch.Tensor,
    cu_seq_lens_k: list[int],
    query_ranges: list[tuple[int, int]],
    chunk: tuple[int, int],
) -> LocalSegments:
    """The part of each segment that the queries of `chunk` (row positions `[start, end)`) compute.

    Segment j has keys `key_index[cu_seq_lens_k[j]:cu_seq_lens_k[j + 1]]` (row positions), and its queries are the
    last of them, the contiguous row positions `query_ranges[j]`. Its local part: the queries inside the chunk, and
    the keys up to the last of them, so causal attention aligned to the bottom-right corner gives each query the keys
    it sees in the whole row.
    """
    chunk_start, chunk_end = chunk
    keys, lengths_q, lengths_k, segments = [], [], [], []
    for segment, (query_start, query_end) in enumerate(query_ranges):
        first, last = max(query_start, chunk_start), min(query_end, chunk_end)
        if first >= last:
            continue
        key_start, key_end = cu_seq_lens_k[segment], cu_seq_lens_k[segment + 1]
        kept_keys = key_end - key_start - (query_end - last)  # not the keys after this chunk's last query
        keys.append(key_index[key_start : key_start + kept_keys])
        lengths_q.append(last - first)
        lengths_k.append(kept_keys)
        segments.append(segment)
    device = key_index.device
    bounds_q, bounds_k = itertools.accumulate(lengths_q, initial=0), itertools.accumulate(lengths_k, initial=0)
    bounds_q, bounds_k = tuple(bounds_q), tuple(bounds_k)
    return LocalSegments(
        key_index=torch.cat(keys) if keys else key_index.new_zeros(0),
        cu_seq_lens_q=host_to_device(torch.tensor(bounds_q, dtype=torch.int32), device),
        cu_seq_lens_k=host_to_device(torch.tensor(bounds_k, dtype=torch.int32), device),
        max_length_q=max(lengths_q, default=0),
        max_length_k=max(lengths_k, default=0),
        segments=tuple(segments),
        bounds_q=bounds_q,
        bounds_k=bounds_k,
    )


@dataclass
class ContextParallelRow(PackedRow):
    """This rank's chunk of a packed row (`cu_seq_lens`: the whole row's segments, padding included), attending to the
    whole row's keys, gathered over `group` in every attention layer."""

    group: RowGroup | None = None
    row_length: int = 0
    shared_prefix: SharedPrefixAttention | None = None
    _layouts: dict[Any, tuple[torch.Tensor, LocalSegments]] = field(default_factory=dict, repr=False, compare=False)

    layout: ClassVar[str] = "context-parallel row"
    consequence: ClassVar[str] = "each rank would attend within its own chunk"
    way_out: ClassVar[str] = "context_parallel_size=1"

    @property
    def chunk(self) -> tuple[int, int]:
        length = self.row_length // self.group.size
        return self.group.rank * length, (self.group.rank + 1) * length

    def row_segments(self, cu_seq_lens: torch.Tensor) -> LocalSegments:
        """The local part of the row's segments (or of a chunked layer's finer ones), each with its keys (with prefix
        sharing, a rejected branch's prefix first): computed once per forward, from host integers."""
        cached = self._layouts.get(id(cu_seq_lens))
        if cached is not None and cached[0] is cu_seq_lens:
            return cached[1]
        bounds = self.host_bounds(cu_seq_lens) or tuple(cu_seq_lens.tolist())
        if self.shared_prefix is not None and cu_seq_lens is self.cu_seq_lens:
            key_index, bounds_k = self.shared_prefix.key_index, self.shared_prefix.bounds_k
        else:
            key_index, bounds_k = torch.arange(self.row_length, device=cu_seq_lens.device), bounds
        layout = localize(key_index, list(bounds_k), list(pairwise(bounds)), self.chunk)
        self._layouts[id(cu_seq_lens)] = (cu_seq_lens, layout)  # held, so the id stays this tensor's
        return layout

    def attend(self, query, key, value, cu_seq_lens, max_length, options: dict) -> torch.Tensor:
        """This chunk's attention output `(1, chunk, heads, dim)`: its queries against the gathered row, per segment;
        `cu_seq_lens` the row's segments as this layer cuts them (chunked layers cut finer)."""
        self.attention_calls += 1
        key, value = self.gather_keys_and_values(key, value)
        local = self.row_segments(cu_seq_lens)
        return varlen_attention(
            query,
            key.index_select(2, local.key_index),
            value.index_select(2, local.key_index),
            local.cu_seq_lens_q,
            local.cu_seq_lens_k,
            local.max_length_q,
            local.max_length_k,
            session=self.session,
            bounds=(local.bounds_q, local.bounds_k),
            **options,
        )

    def gather_keys_and_values(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole row's keys and values `(1, kv_heads, T, dim)` from every rank's chunk, differentiably."""
        # One collective for the two, token-major: the gather writes the row in place (no copy after it)
        both = torch.cat([key.transpose(1, 2), value.transpose(1, 2)], dim=-1)  # (1, chunk, kv_heads, k + v dim)
        gathered = self.group.gather(both, dim=1).transpose(1, 2)
        return gathered[..., : key.shape[-1]], gathered[..., key.shape[-1] :]


# ---- groups ----


_GROUPS: dict[tuple[int, int], tuple[RowGroup, RowGroup]] = {}


def context_parallel_groups(size: int, ulysses_size: int = 1) -> tuple[RowGroup, RowGroup]:
    """This rank's context-parallel group, and the group of every rank that shares its row.

    A row is shared by `size x ulysses_size` consecutive ranks, each feeding the model one chunk of it. Alone
    (`ulysses_size` 1) those ranks are the context-parallel group. With Ulysses, whose groups DeepSpeed makes of
    `ulysses_size` consecutive ranks, a Ulysses group gathers its ranks' adjacent chunks into one context-parallel
    chunk for `ulysses_size`-th of the heads; the context-parallel group is then the ranks at the same place in each
    Ulysses group of the row, which hold the same heads (row of 4 ranks, ulysses 2: context-parallel groups {0, 2} and
    {1, 3}). Created once per process: every rank creates every group, as `torch.distributed.new_group` requires.
    """
    if (size, ulysses_size) in _GROUPS:
        return _GROUPS[size, ulysses_size]
    world, rank = dist.get_world_size(), dist.get_rank()
    row_size = size * ulysses_size
    check_processes_share_rows(row_size, world)
    mine = {}
    for first in range(0, world, row_size):
        row_ranks = list(range(first, first + row_size))
        row_group = dist.new_group(row_ranks) if ulysses_size > 1 else None
        for place in range(ulysses_size):
            ranks = row_ranks[place::ulysses_size]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["context"] = RowGroup(group, ranks.index(rank), size)
                mine["row"] = RowGroup(row_group, rank - first, row_size) if row_group else mine["context"]
    _GROUPS[size, ulysses_size] = mine["context"], mine["row"]
    return _GROUPS[size, ulysses_size]
