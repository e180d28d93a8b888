"""Sequence parallelism for packed rows on DeepSpeed Ulysses (ALST), set up by accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=N)`.

Every rank of a sequence-parallel group gets the same packed micro-batch. The row is padded to a multiple of N and
each rank feeds the model its own contiguous chunk; inside attention, DeepSpeed exchanges heads for sequence
(all-to-all), so each rank attends over the whole row for N-th of the heads, with the row's global `cu_seq_lens`
keeping sequences apart. The per-token outputs are then all-gathered (differentiably) back into the whole row, so
every rank computes the same per-sequence sums and the same DPO loss as without sequence parallelism:

    row    | chosen 1 | chosen 2 | rejected 1 | rejected 2 | pad |      padded to a multiple of N = 2
    rank 0 | ---- chunk 0 ----------|                                     input_ids, position_ids, shift_labels
    rank 1                          |---------- chunk 1 ------------|
    log-probs of both chunks all-gathered -> one row on every rank -> TRL's loss, unchanged

Gradients: each rank's loss reaches its own chunk through the all-gather, whose backward sums the N identical
contributions; DeepSpeed then averages gradients over all data- and sequence-parallel ranks, which divides them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Attention functions that read the row's `cu_seq_lens`/`position_ids`: exact on a packed row under Ulysses. Plain
# sdpa and flex attention get the whole row and attend across sequences.
PACKING_AWARE_UNDER_ULYSSES = ("padfree_varlen", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class SequenceParallelGroup:
    """The ranks that share one packed row, and this rank's place among them."""

    group: Any
    rank: int
    size: int

    def chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a `(1, T, ...)` row (T a multiple of `size`)."""
        length = tensor.shape[1] // self.size
        return tensor[:, self.rank * length : (self.rank + 1) * length]

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole row from every rank's chunk along `dim`, differentiable: the backward hands each rank its
        chunk's gradient summed over the group."""
        return _GatherChunks.apply(tensor.contiguous(), self.group, dim)


class _GatherChunks(torch.autograd.Function):
    """All-gather along a dimension whose backward sums each chunk's gradient over the group. Not
    `torch.distributed.nn.functional.all_gather`: on gloo its backward scatters from group ranks as if they were
    global ranks, which fails in any group that is not ranks 0..N-1."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        chunks = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, tensor, group=group)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunks = [chunk.contiguous() for chunk in grad.chunk(size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "gloo":
            # gloo has no reduce-scatter: each rank's chunk from every rank (the same bytes), then their sum
            received = [torch.empty_like(chunks[rank]) for _ in range(size)]
            dist.all_to_all(received, chunks, group=ctx.group)
            return torch.stack(received).sum(0), None, None
        mine = torch.empty_like(chunks[rank])
        dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine, None, None


def sequence_parallel_size(accelerator) -> int:
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.sp_backend != "deepspeed":
        return 1
    return config.sp_size


def active_group(accelerator) -> SequenceParallelGroup | None:
    """The sequence-parallel group of this rank once DeepSpeed has created it (at `accelerator.prepare`), else None."""
    if sequence_parallel_size(accelerator) == 1:
        return None
    # The module DeepSpeed's Ulysses registration initializes and returns as its `mpu`: the groups its attention uses
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return SequenceParallelGroup(
        parallel_state_sp.get_sequence_parallel_group(),
        parallel_state_sp.get_sequence_parallel_rank(),
        parallel_state_sp.get_sequence_parallel_world_size(),
    )


class SameBatchOnEveryRank:
    """Hands every rank of a sequence-parallel group the same whole micro-batches, in place of DeepSpeed's
    `UlyssesSPDataLoaderAdapter`, which slices every tensor on dim 1 (the packed batch has 1-D `cu_seq_lens`).

    Like DeepSpeed's adapter, each round collects one batch from every rank of the group and yields them one after
    the other, so the group goes through all of its ranks' data: N times as many micro-batches, each of them whole.
    """

    def __init__(self, dataloader, group: SequenceParallelGroup, device: torch.device):
        self.dataloader = dataloader
        self.group = group
        self.device = device

    def __len__(self) -> int:
        return len(self.dataloader) * self.group.size

    def __getattr__(self, name):
        # set_epoch, sampler, batch_size...: the wrapped dataloader's
        return getattr(self.dataloader, name)

    def __iter__(self):
        for batch in self.dataloader:
            batches = [None] * self.group.size
            dist.all_gather_object(batches, _to_cpu(batch), group=self.group.group)
            for each in batches:
                yield {key: value.to(self.device) if torch.is_tensor(value) else value for key, value in each.items()}


def _to_cpu(batch: dict) -> dict:
    return {key: value.cpu() if torch.is_tensor(value) else value for key, value in batch.items()}


def check_sequence_parallel(model_config, attn_implementation: str, sp_size: int) -> None:
    """Refuse what Ulysses cannot run exactly on a packed row, with what to change."""
    if attn_implementation not in PACKING_AWARE_UNDER_ULYSSES:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) cannot run attn_implementation={attn_implementation!r} "
            "exactly on packed rows: under DeepSpeed Ulysses it attends across the sequences of the row. Use "
            f"`packed_attn_implementation` 'auto' or one of {list(PACKING_AWARE_UNDER_ULYSSES)}."
        )
    text_config = model_config.get_text_config()
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise ValueError(
            f"Sequence parallelism splits attention heads over the group: {heads} attention heads are not divisible "
            f"by sp_size={sp_size}. Choose an sp_size that divides {heads}."
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(
            f"Sequence parallelism needs the {kv_heads} key-value heads to be divisible by sp_size={sp_size} (or "
            "sp_size by them, when DeepSpeed replicates them). Choose another sp_size."
        )
    if getattr(text_config, "attention_dropout", 0.0):
        raise ValueError(
            "Sequence parallelism runs the reference model's attention in training mode (DeepSpeed switches Ulysses "
            "off in eval mode, which would attend within each rank's chunk only), so attention dropout must be 0: "
            f"the model has attention_dropout={text_config.attention_dropout}. Set it to 0."
        )


def check_no_sequence_parallel_groups_yet() -> None:
    """DeepSpeed creates its sequence-parallel groups, and wraps the attention function for Ulysses, once per process
    (`parallel_state_sp.initialize_sequence_parallel` asserts it runs once): a second sequence-parallel trainer in the
    same process would fail deep inside `train()`, or wrap the attention twice. Say so before anything runs."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        raise RuntimeError(
            "DeepSpeed sets up sequence parallelism once per process, and an earlier trainer in this process already "
            "did. Run each sequence-parallel training in its own `accelerate launch`."
        )
