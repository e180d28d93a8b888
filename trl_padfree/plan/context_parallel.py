"""Context parallelism (`context_parallel_size=C`, trl_padfree/parallel/context.py): what one GPU holds when a group of
C GPUs shares each packed row.

    row of T tokens, padded to C t       | rank 0: t tokens | rank 1: t tokens | ... | rank C-1: t tokens |
    norms, projections, MLP, LM head      each rank its own t = ceil(T / C) tokens: the activation estimate at t
    attention, in every layer             each rank all-gathers the keys and values of the whole row

`--tokens` stays the whole row (the micro-batch's chosen + rejected tokens), as the trainer's batches define it; each
GPU of the group runs t of them. On top of the activations of t tokens, attention holds buffers as long as the whole
row. One *row buffer* is the row's keys and values, 2 C t kv b bytes (kv: key-value heads x head dim, b: bytes per
value). In one layer's attention, in row buffers:

    forward    2   the all-gather's chunks and their concatenation (K and V along head_dim: one collective for both);
                   then the gathered row and the keys and values indexed out of it for the kernel
    kept       1   the indexed copies, which the kernel saves for its backward. Each sequence the chunk touches, up to
                   its last query there: counted as one key per row token, the worst case (one sequence filling the
                   row; in a one-pair row no rank needs more than about half)
    backward   3   the gathered row's gradient: autograd builds its K and V halves as two zero-filled row-sized
                   tensors and adds them (the saved copies are freed by then), then reduce-scatters it

The peak is a layer's backward, 3, plus the copies every other layer keeps until its backward: none with activation
checkpointing (only the layer being recomputed has any), L - 1 without. These counts were checked against the live
tensors of one attention call on CPU, with stand-ins for the kernel and the collective (docs/concepts/memory-planning.md). They
assume torch's varlen kernel takes grouped key-value heads (`enable_gqa`, torch >= 2.12); an older torch expands them
to every query head, heads / kv-heads times larger copies. Left to the reserve: the per-token outputs all-gathered back
(a few bytes per row token) and the chunk-sized copies on the way. docs/concepts/memory-planning.md#context-parallelism---context-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .setup import Setup
from .units import BYTES_PER_PARAM

if TYPE_CHECKING:
    from .shapes import ModelShape

BACKWARD_PEAK_ROW_BUFFERS = 3  # the row gradient's K and V halves, zero-filled to the row's size, and their sum
SAVED_ROW_BUFFERS_PER_LAYER = 1  # the indexed copies the kernel saves, kept until the layer's backward


def check_context_parallel(setup: Setup) -> None:
    """Refuse a group size the trainer would refuse: groups of consecutive GPUs must tile all of them."""
    size = setup.context_parallel_size
    if size < 1:
        raise ValueError(f"--context-parallel must be at least 1 (1: every GPU its own rows), not {size}.")
    if setup.total_gpus % size:
        raise ValueError(
            f"--context-parallel {size} must divide the number of GPUs, {setup.total_gpus} (nodes x GPUs per node): "
            f"each group of {size} consecutive GPUs shares one packed row."
        )


def local_tokens(setup: Setup) -> int:
    """The tokens each GPU of a group runs through the model: its chunk of the row, padded to a multiple of the group."""
    return -(-setup.tokens // setup.context_parallel_size)


def row_buffer_bytes(shape: ModelShape, setup: Setup) -> int:
    """The whole (padded) row's keys and values in the training precision: 2 x row x kv x b."""
    row = local_tokens(setup) * setup.context_parallel_size
    return 2 * row * shape.kv_dim * BYTES_PER_PARAM[setup.precision]


def row_buffers(shape: ModelShape, setup: Setup) -> int:
    """How many row buffers a GPU holds at its peak, a layer's backward: 3 with activation checkpointing, L + 2
    without (the L - 1 other layers' saved copies)."""
    waiting_layers = 0 if setup.activation_checkpointing else shape.num_layers - 1
    return BACKWARD_PEAK_ROW_BUFFERS + SAVED_ROW_BUFFERS_PER_LAYER * waiting_layers


def buffer_bytes(shape: ModelShape, setup: Setup) -> int | None:
    """Per GPU, the attention buffers as long as the whole row: 0 without context parallelism, None where the
    activations are not estimated (no layer shape)."""
    if setup.context_parallel_size == 1:
        return 0
    if shape.no_activations_reason is not None:
        return None
    return row_buffers(shape, setup) * row_buffer_bytes(shape, setup)
