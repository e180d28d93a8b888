"""Spans of a packed row whose tokens attend to each other both ways: Gemma 3's images.

Gemma 3 lets the tokens of one image see the whole image, later image tokens included, while everything else stays
causal; on sliding-window layers the window still bounds the keys before a query (transformers: causal OR same image,
AND the window). Gemma 4 does so on its sliding-window layers alone, where its config sets
use_bidirectional_attention="vision" (`SpanAttention.sliding_layers_only`). Such a row attends in two calls over
gathered queries and keys (gathered.py), laid out once per forward from the collator's host integers
(`HostRow.image_spans`): causal pieces (each run of text, with its segment's keys up to the run's end) and
bidirectional pieces (each image, with its segment's keys up to the image's end), every piece aligned to the
bottom-right corner of its keys, as varlen kernels align a segment with more keys than queries:

    segment        | t0 t1 i0 i1 i2 t2 t3 |
    causal         queries t0 t1      keys t0 t1                   text before the image
                   queries t2 t3      keys t0 t1 i0 i1 i2 t2 t3    text after it, causal over all of it
    bidirectional  queries i0 i1 i2   keys t0 t1 i0 i1 i2          the image's tokens: the whole image, and before it

No score matrix is kept (torch's varlen kernel, or sdpa per piece, which on CUDA runs a kernel that keeps none), no
query is computed twice, and no call reads the device. With prefix sharing, a rejected branch reads its prompt's
images as keys, causally, as before; images lie in prompts, so their pieces are the shared segments' own tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...packing.layout import host_to_device
from .gathered import GatheredKeys, Piece
from .varlen import KernelSession


@dataclass(frozen=True)
class SpanAttention:
    """A row with image spans, attended in a causal and a bidirectional call; `output_index` puts each row position's
    output back in place from the two calls' outputs, concatenated."""

    calls: tuple[GatheredKeys, GatheredKeys]
    output_index: torch.Tensor
    sliding_layers_only: bool = False  # Gemma 4: its full-attention layers attend causally, as rows without spans

    def holds_on(self, options: dict) -> bool:
        """Whether the spans hold on the layer calling with `options`."""
        return not self.sliding_layers_only or options.get("sliding_window") is not None

    @classmethod
    def of_row(
        cls,
        segment_keys: list[list[tuple[int, int]]],
        bounds: tuple[int, ...],
        spans,
        device,
        sliding_layers_only: bool = False,
    ) -> SpanAttention | None:
        """From the row's segment boundaries (`bounds`), each segment's key ranges (`prefix_sharing.segment_keys`)
        and its image spans, all host integers; None without a span."""
        if not spans:
            return None
        pieces: dict[bool, list[Piece]] = {True: [], False: []}
        spans = sorted(spans)
        for (start, end), keys in zip(itertools.pairwise(bounds), segment_keys, strict=True):
            inside = [(a, b) for a, b in spans if start <= a < end]
            if not inside:
                if end > start:
                    pieces[True].append((range(start, end), [range(*key) for key in keys]))
                continue
            # Images lie in prompts: their segment's keys are its own tokens (never a prefix-sharing branch's)
            text_start = start
            for span_start, span_end in inside:
                if span_start > text_start:
                    pieces[True].append((range(text_start, span_start), [range(start, span_start)]))
                pieces[False].append((range(span_start, span_end), [range(start, span_end)]))
                text_start = span_end
            if end > text_start:
                pieces[True].append((range(text_start, end), [range(start, end)]))
        calls = tuple(
            GatheredKeys.of_pieces(pieces[causal], device, causal=causal, gather_queries=True)
            for causal in (True, False)
        )
        order = [position for call in (True, False) for queries, _ in pieces[call] for position in queries]
        output_index = [0] * len(order)
        for index, position in enumerate(order):
            output_index[position] = index
        output_index = host_to_device(torch.tensor(output_index, dtype=torch.long), device)
        return cls(calls, output_index, sliding_layers_only)

    def attend(self, query, key, value, session: KernelSession, options: dict) -> torch.Tensor:
        """`(1, T, heads, dim)` for `(1, heads, T, dim)` inputs."""
        outputs = [call.attend(query, key, value, session, options) for call in self.calls]
        return torch.cat(outputs, dim=1).index_select(1, self.output_index)
