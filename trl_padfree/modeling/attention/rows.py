"""How a packed row's tokens attend: one object per kind of row, handed to every attention layer as the `packed_row`
keyword (transformers passes a model's keyword arguments down to its attention functions).

    PackedRow           each segment attends to itself; with prefix sharing (packing/prefix_sharing.py) each
                        rejected branch to its prompt too, in one call over gathered keys; with image spans
                        (bidirectional.py), in a causal and a bidirectional call (Gemma 3's images see themselves
                        both ways)
    ContextParallelRow  (parallel/context.py) this rank's chunk of the row against the row's gathered keys

Prefix sharing, image spans and context parallelism attend over gathered keys (gathered.py): one type, laid out by
each from host integers. A row is made from the collator's host integers (`PackedRow.of_host_row`: the packed batch
asks for the row of its `HostRow`, and prefix sharing's rules give each segment's keys) for one forward, and carries
what its attention calls share (`KernelSession`: the kernel and its plans, decided once) and its boundaries as host
integers (`bounds`), so no call reads the device.

The registered attention (interface.py) validates a call, asks the row for its segments as the layer cuts them
(chunked layers cut finer, once per forward) and lets the row attend: no attention code knows which kind of row it
has, and a new kind of row edits none of it.

A row that must be read (prefix sharing, image spans, context parallelism) is in flight while its forward runs
(`row_in_flight`): an attention call that did not receive it raises, and so does a forward in which no attention call
read it (a model whose attention is not `padfree_varlen`, does not take transformers' keyword arguments, or mixes
tokens elsewhere). The plain row needs neither: a layer that reads `cu_seq_lens` itself keeps sequences apart as well.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...packing.layout import HostRow, chunked_bounds, chunked_cu_seq_lens, host_to_device
from ...packing.prefix_sharing import segment_keys, shared_prefix_keys
from ...refusals.forward import (
    refuse_image_spans_with_chunked_layers,
    refuse_layout_not_read,
    refuse_layout_not_received,
    refuse_prefix_sharing_with_chunked_layers,
)
from .bidirectional import SpanAttention
from .gathered import GatheredKeys
from .varlen import KernelSession, varlen_attention

PACKED_ROW_KWARG = "packed_row"
# What a row with prefix sharing's or image spans' gathered keys needs of every attention call, as `must_be_read` says
SHARED_PREFIX_LAYOUT = ("prefix-sharing layout", "rejected tokens would not see their prompt", "prefix_sharing=False")
SPANS_LAYOUT = (
    "image spans (images whose tokens attend to the whole image both ways: Gemma 3's, Gemma 4's)",
    "image tokens would attend causally, unlike the model's own forward",
    "padding_free=False",
)


@dataclass
class PackedRow:
    """A packed row whose segments each attend to themselves, causally; with prefix sharing's keys (`shared`), each
    rejected branch after its prompt."""

    cu_seq_lens: torch.Tensor  # int32, the padding segment included
    max_length: int | None  # the longest segment; None: read from the boundaries when a kernel needs it
    attention_calls: int = field(default=0, compare=False)
    _chunked: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    spans: SpanAttention | None = field(default=None, kw_only=True, repr=False)  # image tokens that see each other
    # Prefix sharing: the row's queries against keys gathered so that each rejected branch reads its prompt first;
    # causal alignment to the bottom-right corner does the rest
    shared: GatheredKeys | None = field(default=None, kw_only=True, repr=False, compare=False)
    bounds: tuple[int, ...] | None = field(default=None, kw_only=True)  # `cu_seq_lens` on the host, when known
    session: KernelSession = field(default_factory=KernelSession, kw_only=True, repr=False, compare=False)
    _chunked_bounds: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    # Set on rows that every attention call must read: their name, what a layer without them would do, the way out
    layout: ClassVar[str | None] = None
    consequence: ClassVar[str] = ""
    way_out: ClassVar[str] = ""

    @classmethod
    def of_host_row(
        cls,
        host: HostRow,
        cu_seq_lens: torch.Tensor,
        max_length: int | None,
        image_spans: tuple[tuple[int, int], ...] | None = None,
        sliding_layers_only: bool = False,
    ) -> PackedRow:
        """The row of the collator's host integers (`cu_seq_lens`: its boundaries on the device), for one forward:
        each segment's keys as prefix sharing lays them out (packing/prefix_sharing.py), gathered when a rejected
        branch reads its prompt; with `image_spans`, each image's tokens attending to the whole image (with
        `sliding_layers_only`, on sliding-window layers alone: Gemma 4). Copies to the device, reads nothing back."""
        device = cu_seq_lens.device
        spans = None
        if image_spans is not None:
            spans = SpanAttention.of_row(
                segment_keys(host), host.cu_seq_lens, image_spans, device, sliding_layers_only=sliding_layers_only
            )
        pieces = shared_prefix_keys(host)
        shared = None if pieces is None else GatheredKeys.of_pieces(pieces, device)
        return cls(cu_seq_lens, max_length, spans=spans, shared=shared, bounds=host.cu_seq_lens)

    def must_be_read(self) -> tuple[str, str, str] | None:
        """(layout, consequence, way out) when every attention call must read this row, else None."""
        if self.layout is not None:
            return self.layout, self.consequence, self.way_out
        if self.shared is not None:
            return SHARED_PREFIX_LAYOUT
        if self.spans is not None:
            return SPANS_LAYOUT
        return None

    def segments(self, chunk_size: int | None) -> tuple[torch.Tensor, int | None]:
        """The row's segments as a layer cuts them: a chunked layer (Llama 4's local layers) cuts each segment every
        `chunk_size` tokens from its start, computed once per forward (one host sync), not per layer."""
        if chunk_size is None:
            return self.cu_seq_lens, self.max_length
        if self.shared is not None:
            refuse_prefix_sharing_with_chunked_layers()
        if self.spans is not None:
            refuse_image_spans_with_chunked_layers()
        if chunk_size not in self._chunked:
            if self.bounds is None:
                self._chunked[chunk_size] = chunked_cu_seq_lens(self.cu_seq_lens, chunk_size)
            else:  # from the host integers: no read of the device
                bounds = chunked_bounds(self.bounds, chunk_size)
                self._chunked_bounds[chunk_size] = tuple(bounds)
                chunked = torch.tensor(bounds, dtype=torch.int32)
                self._chunked[chunk_size] = host_to_device(chunked, self.cu_seq_lens.device)
        # Still the longest segment: a segment longer than a chunk leaves a whole chunk
        max_length = None if self.max_length is None else min(self.max_length, chunk_size)
        return self._chunked[chunk_size], max_length

    def host_bounds(self, cu_seq_lens: torch.Tensor) -> tuple[int, ...] | None:
        """The host integers of `cu_seq_lens` (the row's, or a chunked layer's), if known."""
        if cu_seq_lens is self.cu_seq_lens:
            return self.bounds
        size = next((size for size, cut in self._chunked.items() if cut is cu_seq_lens), None)
        return self._chunked_bounds.get(size)

    def attend(self, query, key, value, cu_seq_lens, max_length, options: dict) -> torch.Tensor:
        """`(1, T_q, heads, dim)` for `(1, heads, T, dim)` inputs; `options`: scaling, sliding_window, dropout,
        softcap, sinks, module."""
        self.attention_calls += 1
        # (A chunked layer refused spans and shared prefixes: `segments`.) Spans are laid out with each branch's
        # prefix keys too (bidirectional.py)
        if self.spans is not None and self.spans.holds_on(options):
            return self.spans.attend(query, key, value, self.session, options)
        if self.shared is not None:
            return self.shared.attend(query, key, value, self.session, options)
        bounds = self.host_bounds(cu_seq_lens)
        return varlen_attention(
            query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length,
            session=self.session, bounds=bounds and (bounds, bounds), **options,
        )  # fmt: skip


# The row of the forward in flight, when every attention call must read it
_ROW_IN_FLIGHT: contextvars.ContextVar[PackedRow | None] = contextvars.ContextVar(
    "trl_padfree_row_in_flight", default=None
)


@contextlib.contextmanager
def row_in_flight(row: PackedRow) -> Iterator[None]:
    """Around a forward on `row`: if it must be read, attention calls without it raise, and so does a forward in which
    no attention call read it."""
    required = row.must_be_read()
    if required is None:
        yield
        return
    token = _ROW_IN_FLIGHT.set(row)
    try:
        yield
    finally:
        _ROW_IN_FLIGHT.reset(token)
    if row.attention_calls == 0:
        refuse_layout_not_read(*required)


def check_row_received(row: PackedRow | None) -> None:
    """An attention call's row is the one in flight (if one is)."""
    in_flight = _ROW_IN_FLIGHT.get()
    if in_flight is not None and row is not in_flight:
        layout, consequence, way_out = in_flight.must_be_read()
        refuse_layout_not_received(layout, PACKED_ROW_KWARG, consequence, way_out)
