"""Spans of a packed row whose tokens attend to each other both ways: Gemma 3's images.

Gemma 3 lets the tokens of one image see the whole image, later image tokens included, while everything else stays
causal; on sliding-window layers the window still bounds the keys before a query (transformers: causal OR same image,
AND the window). A packed row keeps that per segment: segments holding an image run with that explicit mask, every
other segment through the row's usual kernel.

    tokens    | t  t  i0 i0 i0 t  | t  i1 i1 t  t |
    span ids  | -1 -1 0  0  0  -1 | -1 1  1  -1 -1|     (an image's tokens share an id; -1: text)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .segments import explicit_attention


@dataclass
class BidirectionalSpans:
    """The spans of a row (`span_ids`, per token) and the segments that hold one."""

    span_ids: torch.Tensor  # (T,) long
    segments: frozenset[int]

    @classmethod
    def of_row(cls, marks: torch.Tensor, cu_seq_lens: torch.Tensor) -> BidirectionalSpans | None:
        """From a `(1, T)` row of marks (1 on the tokens of images), as Gemma 3 reads its `token_type_ids`: a span is a
        run of marked tokens. None when the row has none."""
        marked = marks.reshape(-1) == 1
        if not bool(marked.any()):
            return None
        starts = marked & ~torch.cat([marked.new_zeros(1), marked[:-1]])
        span_ids = torch.where(marked, starts.long().cumsum(0) - 1, torch.full_like(marks.reshape(-1), -1))
        positions = marked.nonzero().reshape(-1)
        segments = torch.searchsorted(cu_seq_lens.to(positions.device).long(), positions, right=True) - 1
        return cls(span_ids, frozenset(segments.unique().tolist()))

    def attend(
        self, query, key, value, cu_seq_lens: torch.Tensor, output: torch.Tensor, options: dict, bounds=None
    ) -> torch.Tensor:
        """`output` `(1, T, heads, dim)` with the segments holding spans computed again under their mask; `bounds`:
        `cu_seq_lens` on the host, when known."""
        bounds = cu_seq_lens.tolist() if bounds is None else bounds
        index, values = [], []
        for segment in sorted(self.segments):
            start, end = bounds[segment], bounds[segment + 1]
            mask = self._mask(start, end, options.get("sliding_window"))
            values.append(
                explicit_attention(
                    query[:, :, start:end],
                    key[:, :, start:end],
                    value[:, :, start:end],
                    mask,
                    options.get("scaling"),
                    options.get("dropout", 0.0),
                    options.get("softcap"),
                    options.get("sinks"),
                ).transpose(1, 2)
            )
            index.append(torch.arange(start, end, device=output.device))
        return output.index_copy(1, torch.cat(index), torch.cat(values, dim=1).to(output.dtype))

    def _mask(self, start: int, end: int, window: int | None) -> torch.Tensor:
        """Causal, or within the same span; then the sliding window's bound on earlier keys."""
        spans = self.span_ids[start:end]
        position = torch.arange(end - start, device=spans.device)
        query, key = position.unsqueeze(1), position.unsqueeze(0)
        same_span = (spans.unsqueeze(1) == spans.unsqueeze(0)) & (spans.unsqueeze(1) >= 0)
        mask = (key <= query) | same_span
        return mask if window is None else mask & (key > query - window)
