"""The attention backends a packed row can run on, in one table: what each reads to keep sequences apart, and where
its architecture can be checked.

    backend              keeps sequences apart by             under Ulysses   checked on a CPU twin as
    padfree_varlen       cu_seq_lens (this package's)         exact           itself
    flash_attention_2/3  cu_seq_lens (flash-attn, CUDA only)  exact           padfree_varlen (same varlen semantics)
    sdpa, eager          a block-diagonal mask built from     leaks           itself
                         position_ids (no mask, no cache)
"""

from __future__ import annotations

from dataclasses import dataclass

ATTN_IMPLEMENTATION = "padfree_varlen"  # the attention this package registers with transformers


@dataclass(frozen=True)
class Backend:
    name: str
    reads_boundaries: bool  # keeps sequences apart from cu_seq_lens: exact on a row split by Ulysses too
    runs_on_cpu: bool  # so a twin can run it; else its architecture is checked on `padfree_varlen`


BACKENDS = (
    Backend(ATTN_IMPLEMENTATION, reads_boundaries=True, runs_on_cpu=True),
    Backend("flash_attention_2", reads_boundaries=True, runs_on_cpu=False),
    Backend("flash_attention_3", reads_boundaries=True, runs_on_cpu=False),
    Backend("sdpa", reads_boundaries=False, runs_on_cpu=True),
    Backend("eager", reads_boundaries=False, runs_on_cpu=True),
)
# Every backend that keeps packed sequences apart when the architecture allows
PACKING_AWARE = tuple(backend.name for backend in BACKENDS)
# Varlen kernels of the flash-attn package, which 'auto' keeps when a model already runs one
FLASH_VARLEN = tuple(backend.name for backend in BACKENDS if backend.reads_boundaries and not backend.runs_on_cpu)
# What a CPU twin can run, in the order advice offers them
CHECKED_ON_CPU = tuple(backend.name for backend in BACKENDS if backend.runs_on_cpu)
# What stays exact when DeepSpeed Ulysses hands attention the whole row's keys
EXACT_UNDER_ULYSSES = tuple(backend.name for backend in BACKENDS if backend.reads_boundaries)


def checked_backend(attn_implementation: str) -> str:
    """The backend a twin runs for `attn_implementation`: flash kernels need a GPU and half precision, so their
    architecture is checked on `padfree_varlen`, which reads the same `cu_seq_lens` with the same varlen semantics."""
    return ATTN_IMPLEMENTATION if attn_implementation in FLASH_VARLEN else attn_implementation
