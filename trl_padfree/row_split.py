"""`RowSplit`: one packed row shared by several ranks, each running its chunk. Everything the trainer does for
sequence parallelism (DeepSpeed Ulysses, sequence_parallel.py) and context parallelism (all-gathered keys and values,
context_parallel.py), alone or together, in one object:

    set-up      the checks, the groups, rows padded to the ranks per row, DeepSpeed's micro-batch, TRL's token count
    batches     every rank of a row gets the same micro-batches (Ulysses: accelerate's dataloader hook; else wrapped)
    forward     each training micro-batch's PackedBatch learns its groups; forward.run_packed splits the row
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accelerate.utils import is_peft_model

from .checks import (
    check_context_parallel_setup,
    check_no_context_parallelism,
    check_prefix_sharing_without_sequence_parallel,
    check_sequence_parallel_setup,
    check_sequence_parallel_without_stateful_mixers,
)
from .context_parallel import context_parallel_groups
from .forward import PackedBatch
from .mixers import mixer_classes
from .sequence_parallel import (
    SameBatchOnEveryRank,
    SequenceParallelGroup,
    active_group,
    check_no_sequence_parallel_groups_yet,
    check_sequence_parallel,
    sequence_parallel_size,
)


@dataclass
class RowSplit:
    """How this rank shares its packed rows: Ulysses over `ulysses_size` ranks and context parallelism over
    `context`'s, `ranks_per_row` of them in all (consecutive ranks)."""

    accelerator: object
    ulysses_size: int
    context: SequenceParallelGroup | None  # None without context parallelism
    row: SequenceParallelGroup | None  # every rank of the row; None with Ulysses alone (DeepSpeed's group, later)

    @property
    def ranks_per_row(self) -> int:
        return self.ulysses_size * (self.context.size if self.context is not None else 1)

    @classmethod
    def set_up(cls, trainer) -> RowSplit | None:
        """Check and configure what `trainer`'s settings ask for; None when rows are not split."""
        accelerator, args = trainer.accelerator, trainer.args
        if trainer.padding_free_enabled and accelerator.parallelism_config is not None:
            check_no_context_parallelism(accelerator.parallelism_config.cp_size)
        ulysses_size = sequence_parallel_size(accelerator)
        context_size = getattr(args, "context_parallel_size", 1)
        if ulysses_size == 1 and context_size == 1:
            return None
        policy = accelerator.unwrap_model(trainer.model)
        policy = policy.get_base_model() if is_peft_model(policy) else policy
        if ulysses_size > 1:
            _check_ulysses(trainer, policy, ulysses_size)
        if context_size > 1:
            check_context_parallel_setup(
                context_size * ulysses_size,
                accelerator.num_processes,
                policy.config._attn_implementation,
                trainer.aux_loss_enabled,
            )
        check_sequence_parallel_without_stateful_mixers(mixer_classes(policy))
        split = cls(accelerator, ulysses_size, None, None)
        if ulysses_size > 1:
            split._set_up_ulysses(policy.config._attn_implementation)
        if context_size > 1:
            split.context, split.row = context_parallel_groups(context_size, ulysses_size)
        collator = trainer.data_collator
        collator.pad_to_multiple_of = math.lcm(collator.pad_to_multiple_of or 1, split.ranks_per_row)
        # Every rank of a row computes the whole batch's metrics: count its tokens once (TRL's own correction)
        trainer._tp_size *= split.ranks_per_row
        return split

    def _set_up_ulysses(self, attn_implementation: str) -> None:
        """accelerate's `ParallelismConfig(sp_backend="deepspeed", sp_size=N)`: the packing-aware attention handed
        to DeepSpeed Ulysses, whole batches on every rank of the row, DeepSpeed's batch sizes."""
        accelerator, size = self.accelerator, self.ulysses_size
        # accelerate only accepts the names of transformers' built-in kernels here; DeepSpeed wraps whichever
        # registered attention the model runs, ours included, and checks it matches the model
        accelerator.parallelism_config.sp_handler.sp_attn_implementation = attn_implementation
        accelerator.deepspeed_ulysses_dl_adapter = self.same_batch_on_every_rank
        # DeepSpeed shapes Ulysses' buffers by its micro-batch size: a packed micro-batch is one row
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed_config["train_micro_batch_size_per_gpu"] = 1
        deepspeed_config.pop("train_batch_size", None)
        # accelerate derives DeepSpeed's train_batch_size from the parallelism config's data-parallel size, which
        # `ParallelismConfig(sp_size=N)` leaves at 1: DeepSpeed's data parallelism is every rank outside an SP group
        accelerator.parallelism_config.dp_shard_size = accelerator.num_processes // size

    def same_batch_on_every_rank(self, dataloader, model=None):
        """Every rank of a row gets each of the row's ranks' micro-batches, whole. Under Ulysses accelerate calls
        this in place of DeepSpeed's adapter, which would slice the 1-D `cu_seq_lens` (sequence_parallel.py)."""
        group = self.row or active_group(self.accelerator)
        return SameBatchOnEveryRank(dataloader, group, self.accelerator.device)

    def train_dataloader(self, dataloader):
        """The trainer's training dataloader, made to hand every rank of a row the same micro-batches."""
        if self.ulysses_size > 1:
            return dataloader  # accelerate's dataloader hook did it (same_batch_on_every_rank)
        return self.same_batch_on_every_rank(dataloader)

    def mark(self, packed_batch: PackedBatch) -> None:
        """Tell a training micro-batch's row how it is split (forward.run_packed splits it)."""
        packed_batch.sequence_parallel = active_group(self.accelerator)
        packed_batch.context_parallel = self.context
        packed_batch.split = self.row or packed_batch.sequence_parallel


def _check_ulysses(trainer, policy, size: int) -> None:
    check_sequence_parallel_setup(
        size,
        trainer.is_deepspeed_enabled,
        trainer.padding_free_enabled,
        trainer.args.disable_dropout,
        trainer.aux_loss_enabled,
    )
    check_prefix_sharing_without_sequence_parallel(trainer.data_collator.prefix_sharing, True)
    check_no_sequence_parallel_groups_yet()
    check_sequence_parallel(policy.config, policy.config._attn_implementation, size)
