"""What a packed row costs its slowest rank when context parallelism splits it over `ranks` ranks: the cost model the
dynamic split (packing/rank_shares.py) minimises and `trl-padfree balance --context-parallel` simulates with.

Pure arithmetic on plain integers, in FLOPs (costs/flops.py's units), communication converted at a link's exchange
rate (`Link`):

    compute     each rank holds a contiguous chunk of the row (parallel/context.py): its tokens through the linear
                layers and the LM head, and attention of its queries over every key of their segment up to them.
                Causal attention makes later chunks dearer: the slowest chunk sets the row's time, not the mean.
    gathered    per attention layer and forward the rank receives the keys and values of the rest of the row,
                (ranks - 1) / ranks x row tokens x key-value heads x (key + value dims) x bytes; the backward
                reduce-scatters as many. Policy forward + backward and the reference forward: 3 exchanges a layer;
                with activation checkpointing (TRL's default) the backward runs the policy's forward again: 4, and
                that forward's compute too.
    latency     each of those exchanges also costs a fixed time (a collective's launch and synchronisation),
                whatever its size: what makes a short row on many ranks slower than on one.

A row on one rank gathers nothing. Assumed, not modelled: compute and communication do not overlap (the all-gather
variant waits for its keys); every FLOP runs at the same rate (no small-kernel inefficiency); norms, activations and
the loss are free (costs/flops.py). The CPU benchmark states the model's measured error (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .flops import BatchWork, DecoderShape, Segment, forward_flops, training_step_flops

# Policy forward (gather), its backward (reduce-scatter of the gathered gradients), the reference's forward (gather)
EXCHANGES_PER_LAYER = 3


def exchanges_per_layer(reference_forward: bool = True, recompute: bool = False) -> int:
    """Collectives an attention layer of a split row makes in a training step: the policy's forward and backward, the
    reference's forward (unless precomputed), the policy's forward again under activation checkpointing."""
    return 2 + reference_forward + recompute


@dataclass(frozen=True)
class Link:
    """How dear communication is next to compute, in FLOPs of one rank's compute time.

    Args:
        byte_flops: FLOPs a rank could have run in the time it receives one byte of an all-gather.
        exchange_flops: FLOPs of a collective's fixed time (launch, synchronisation), paid per exchange.
        element_bytes: bytes of one key or value element (2: bf16).
    """

    byte_flops: float
    exchange_flops: float
    element_bytes: int = 2

    @classmethod
    def of_rates(cls, flops_per_second: float, bytes_per_second: float, exchange_seconds: float, element_bytes=2):
        """The link of a device that computes `flops_per_second` (achieved, not peak) and receives
        `bytes_per_second` per rank in an all-gather, each collective costing `exchange_seconds` at least."""
        return cls(flops_per_second / bytes_per_second, flops_per_second * exchange_seconds, element_bytes)


# Assumed for the simulation (docs/benchmarks.md says so next to each figure): an H100 at 400 TFLOP/s achieved (40% of
# dense bf16 peak), all-gathers at 360 GB/s per GPU inside an NVLink node and 45 GB/s across InfiniBand nodes (400
# Gb/s per GPU), 25 us and 60 us per collective
NVLINK = Link.of_rates(400e12, 360e9, 25e-6)
INFINIBAND = Link.of_rates(400e12, 45e9, 60e-6)
GPUS_PER_NODE = 8


def link_of_group(ranks: int) -> Link:
    """The link a group of `ranks` consecutive GPUs gathers over: NVLink within a node, InfiniBand across."""
    return NVLINK if ranks <= GPUS_PER_NODE else INFINIBAND


def chunk_works(segments: Sequence[Segment], scored_tokens: int, row_tokens: int, ranks: int) -> list[BatchWork]:
    """The work of each rank's chunk of a row of `row_tokens` (a multiple of `ranks`; the segments laid out in order
    from the start, padding after them): its tokens, its share of the scored tokens (by tokens), and the (query, key)
    pairs of its queries, each over its segment's prefix and keys up to itself."""
    chunk = row_tokens // ranks
    pairs = [0] * ranks
    start = 0
    for segment in segments:
        end = start + segment.length
        for rank in range(start // chunk, min(ranks, -(-end // chunk))):
            first, last = max(start, rank * chunk) - start, min(end, (rank + 1) * chunk) - start
            # queries first..last-1 of the segment: each reads the prefix and itself and every query before it
            pairs[rank] += (last - first) * segment.prefix + (last * (last + 1) - first * (first + 1)) // 2
        start = end
    tokens = sum(segment.length for segment in segments)
    return [
        BatchWork(chunk, scored_tokens * min(chunk, max(0, tokens - rank * chunk)) // max(tokens, 1), pairs[rank])
        for rank in range(ranks)
    ]


def gathered_bytes(
    shape: DecoderShape, row_tokens: int, ranks: int, element_bytes: int = 2, exchanges: int = EXCHANGES_PER_LAYER
) -> int:
    """Bytes one rank receives in a training step of a row split over `ranks` (0 on one rank): the keys and values of
    the other ranks' chunks, every attention layer, `exchanges` times (`exchanges_per_layer`)."""
    others = row_tokens - row_tokens // ranks
    per_layer = others * shape.key_value_heads * 2 * shape.head_dim * element_bytes
    return exchanges * shape.attention_layers * per_layer


def split_row_cost(
    shape: DecoderShape,
    segments: Sequence[Segment],
    scored_tokens: int,
    row_tokens: int,
    ranks: int,
    link: Link,
    reference_forward: bool = True,
    recompute: bool = False,
) -> float:
    """The training-step cost of the slowest rank of a row split over `ranks` (1: the row alone on one rank), in
    FLOPs: its chunk's compute (`recompute`: activation checkpointing's second policy forward too), and on more than
    one rank what it gathers and how many times."""
    compute = max(
        training_step_flops(shape, work, reference_forward) + (forward_flops(shape, work) if recompute else 0)
        for work in chunk_works(segments, scored_tokens, row_tokens, ranks)
    )
    if ranks == 1:
        return float(compute)
    exchanges = exchanges_per_layer(reference_forward, recompute)
    gathered = gathered_bytes(shape, row_tokens, ranks, link.element_bytes, exchanges)
    return compute + gathered * link.byte_flops + exchanges * shape.attention_layers * link.exchange_flops
