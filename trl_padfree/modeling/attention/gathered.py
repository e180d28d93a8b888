"""Attention over gathered keys: one varlen call in which each piece's queries attend to keys gathered by row position
from anywhere in the row. Three kinds of row attend this way, each laying out its pieces once per forward:

    prefix sharing       each segment against its own tokens, a rejected branch's prefix first
                         (packing/prefix_sharing.py; rows.py's `PackedRow.of_host_row`)
    image spans          a causal and a bidirectional call, the text runs' and the images' queries gathered too
                         (bidirectional.py)
    context parallelism  this rank's chunk against the row's keys, all-gathered over its group (parallel/context.py)

A piece is host integers: its queries (row positions) and the row ranges of its keys, in order. Every piece is
aligned to the bottom-right corner of its keys, as varlen kernels align a segment with more keys than queries:

    row      | p0 p1 p2 p3 c0 c1 | p3 r0 r1 r2 |
    piece    queries p3 r0 r1 r2 (6..10)    keys p0 p1 p2 (0..3), p3 r0 r1 r2 (6..10)

`GatheredKeys` makes the pieces' index and boundary tensors once (one copy to the device each, without a sync); an
attention call gathers and calls the kernel, and reads nothing of the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ...packing.layout import host_to_device
from .varlen import KernelSession, varlen_attention

# A piece's queries (row positions) and the row ranges of its keys, in order
Piece = tuple[range, Sequence[range]]


@dataclass(frozen=True)
class GatheredKeys:
    """One kernel call over pieces: the queries (as passed, or gathered at `query_index`) against the keys and values
    gathered at `key_index`, piece by piece; the pieces' boundaries on the device and on the host."""

    key_index: torch.Tensor  # (K,) row positions of the keys, piece after piece
    query_index: torch.Tensor | None  # (Q,) row positions of the queries; None: the queries as passed, in order
    cu_seq_lens_q: torch.Tensor  # int32
    cu_seq_lens_k: torch.Tensor  # int32
    bounds_q: tuple[int, ...]  # the same boundaries, on the host
    bounds_k: tuple[int, ...]
    max_length_q: int
    max_length_k: int
    causal: bool = True

    @classmethod
    def of_pieces(
        cls, pieces: Iterable[Piece], device: torch.device, causal: bool = True, gather_queries: bool = False
    ) -> GatheredKeys:
        """From host integers, on `device`. `gather_queries`: gather the queries at the pieces' row positions too
        (else the call's queries are the pieces' queries, one after another)."""
        pieces = list(pieces)
        lengths_q = [len(queries) for queries, _ in pieces]
        lengths_k = [sum(map(len, keys)) for _, keys in pieces]
        bounds_q = tuple(itertools.accumulate(lengths_q, initial=0))
        bounds_k = tuple(itertools.accumulate(lengths_k, initial=0))
        return cls(
            key_index=_positions([span for _, keys in pieces for span in keys], device),
            query_index=_positions([queries for queries, _ in pieces], device) if gather_queries else None,
            cu_seq_lens_q=host_to_device(torch.tensor(bounds_q, dtype=torch.int32), device),
            cu_seq_lens_k=host_to_device(torch.tensor(bounds_k, dtype=torch.int32), device),
            bounds_q=bounds_q,
            bounds_k=bounds_k,
            max_length_q=max(lengths_q, default=0),
            max_length_k=max(lengths_k, default=0),
            causal=causal,
        )

    def attend(self, query, key, value, session: KernelSession, options: dict) -> torch.Tensor:
        """`(1, pieces' queries, heads, dim)` for `(1, heads, T, dim)` inputs; `options`: scaling, sliding_window,
        dropout, softcap, sinks, module."""
        if self.query_index is not None:
            query = query.index_select(2, self.query_index)
        return varlen_attention(
            query,
            key.index_select(2, self.key_index),
            value.index_select(2, self.key_index),
            self.cu_seq_lens_q,
            self.cu_seq_lens_k,
            self.max_length_q,
            self.max_length_k,
            session=session,
            bounds=(self.bounds_q, self.bounds_k),
            causal=self.causal,
            **options,
        )


def _positions(spans: list[range], device: torch.device) -> torch.Tensor:
    """The row positions of `spans`, one after another: a long tensor on `device`."""
    parts = [torch.arange(span.start, span.stop) for span in spans if len(span)]
    return host_to_device(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long), device)
