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
modeling/attention/rows.py: the registered attention hands it its layer's segments like any other row, and it attends
over gathered keys (modeling/attention/gathered.py). Its groups are made in groups.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, ClassVar

import torch

from ..modeling.attention.gathered import GatheredKeys, Piece
from ..modeling.attention.rows import PackedRow
from .groups import RowGroup


def localize(pieces: Sequence[Piece], chunk: tuple[int, int]) -> dict[int, Piece]:
    """The part of each segment of the row that the queries of `chunk` (row positions `[start, end)`) compute, by
    segment.

    `pieces`: per segment of the row, its queries (contiguous row positions) and the row ranges of its keys, which end
    with those queries. Its local part: the queries inside the chunk, and the keys up to the last of them, so causal
    attention aligned to the bottom-right corner gives each query the keys it sees in the whole row.
    """
    chunk_start, chunk_end = chunk
    local = {}
    for segment, (queries, keys) in enumerate(pieces):
        first, last = max(queries.start, chunk_start), min(queries.stop, chunk_end)
        if first < last:  # not the keys after this chunk's last query, the end of the segment's own
            local[segment] = range(first, last), (*keys[:-1], range(keys[-1].start, last))
    return local


@dataclass
class ContextParallelRow(PackedRow):
    """This rank's chunk of a packed row (`cu_seq_lens`: the whole row's segments, padding included), attending to the
    whole row's keys, gathered over `group` in every attention layer."""

    group: RowGroup | None = None
    row_length: int = 0
    shared_prefix: tuple[Piece, ...] | None = None  # prefix sharing's keys (packing/prefix_sharing.py)
    _layouts: dict[Any, tuple[torch.Tensor, GatheredKeys]] = field(default_factory=dict, repr=False, compare=False)

    layout: ClassVar[str] = "context-parallel row"
    consequence: ClassVar[str] = "each rank would attend within its own chunk"
    way_out: ClassVar[str] = "context_parallel_size=1"

    @property
    def chunk(self) -> tuple[int, int]:
        length = self.row_length // self.group.size
        return self.group.rank * length, (self.group.rank + 1) * length

    def local_keys(self, cu_seq_lens: torch.Tensor) -> GatheredKeys:
        """The local part of the row's segments (or of a chunked layer's finer ones), each with its keys (with prefix
        sharing, a rejected branch's prefix first): laid out once per forward, from host integers."""
        cached = self._layouts.get(id(cu_seq_lens))
        if cached is not None and cached[0] is cu_seq_lens:
            return cached[1]
        if self.shared_prefix is not None and cu_seq_lens is self.cu_seq_lens:
            pieces = self.shared_prefix
        else:
            bounds = self.host_bounds(cu_seq_lens) or tuple(cu_seq_lens.tolist())
            pieces = [(range(start, end), (range(start, end),)) for start, end in pairwise(bounds)]
        layout = GatheredKeys.of_pieces(localize(pieces, self.chunk).values(), cu_seq_lens.device)
        self._layouts[id(cu_seq_lens)] = (cu_seq_lens, layout)  # held, so the id stays this tensor's
        return layout

    def attend(self, query, key, value, cu_seq_lens, max_length, options: dict) -> torch.Tensor:
        """This chunk's attention output `(1, chunk, heads, dim)`: its queries against the gathered row, per segment;
        `cu_seq_lens` the row's segments as this layer cuts them (chunked layers cut finer)."""
        self.attention_calls += 1
        key, value = self.gather_keys_and_values(key, value)
        return self.local_keys(cu_seq_lens).attend(query, key, value, self.session, options)

    def gather_keys_and_values(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole row's keys and values `(1, kv_heads, T, dim)` from every rank's chunk, differentiably."""
        # One collective for the two, token-major: the gather writes the row in place (no copy after it)
        both = torch.cat([key.transpose(1, 2), value.transpose(1, 2)], dim=-1)  # (1, chunk, kv_heads, k + v dim)
        gathered = self.group.gather(both, dim=1).transpose(1, 2)
        return gathered[..., : key.shape[-1]], gathered[..., key.shape[-1] :]
