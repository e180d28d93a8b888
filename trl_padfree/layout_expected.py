"""A layout every attention call of a forward must read (prefix sharing's second call, prefix_sharing.py; the gathered
row of context parallelism, context_parallel.py). While the forward runs the layout is set, so an attention call that
did not receive it can tell and fail; and it counts its readers, so a forward in which no attention call read it
fails too: a model whose attention does not take transformers' keyword arguments, or mixes tokens elsewhere."""

from __future__ import annotations

import contextlib
import contextvars


@contextlib.contextmanager
def expected_by_attention(variable: contextvars.ContextVar, layout, unread: str):
    """Set `variable` to `layout` (which counts its readers in `attention_calls`) around a forward; raise
    `ValueError(unread)` if no attention call read it."""
    token = variable.set(layout)
    try:
        yield layout
    finally:
        variable.reset(token)
    if layout.attention_calls == 0:
        raise ValueError(unread)
