"""`padfree_varlen`, the attention for packed rows, registered with transformers when this package is imported:
interface.py (the registered function), rows.py (how each kind of row attends), gathered.py (keys gathered by index),
plan.py (which kernel computes a layer), varlen.py and fused.py (the kernel calls), segments.py (exact attention one
segment at a time)."""

from ...integrations.transformers import register_attention
from ..backends import ATTN_IMPLEMENTATION
from .interface import padfree_varlen_attention, padfree_varlen_mask

register_attention(ATTN_IMPLEMENTATION, padfree_varlen_attention, padfree_varlen_mask)

__all__ = ["ATTN_IMPLEMENTATION", "padfree_varlen_attention", "padfree_varlen_mask"]
