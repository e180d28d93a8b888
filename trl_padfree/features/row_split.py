"""`RowSplit`: one packed row shared by several ranks, each running its chunk. Everything the trainer does for
sequence parallelism (DeepSpeed Ulysses, parallel/ulysses.py) and context parallelism (all-gathered keys and values,
parallel/context.py), alone or together, in one object:

    set-up      the checks, the groups, rows padded to the ranks per row, DeepSpeed's micro-batch, TRL's token count
    batches     every rank of a row gets the same micro-batches (Ulysses: accelerate's dataloader hook; else wrapped)
    forward     each training micro-batch's PackedBatch gets a `SplitRowRun` (parallel/row_split.py), which the
                packed forward hands the run: this rank's chunk in, the whole row's per-token outputs back

With `dynamic_context_parallel=True` a row takes 1, 2, 4 ... C ranks of its group, as the batch plan decided
(packing/rank_shares.py): each rank collates its own block's row, which says over how many ranks it is split
(`ROW_RANKS`), and runs it on that block, or alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelerate.utils import is_peft_model

from ..integrations.transformers import attn_implementation, label_top_level_attention
from ..modeling.backends import EXACT_UNDER_ULYSSES
from ..modeling.mixers import mixer_classes
from ..modeling.packed_forward import PackedBatch
from ..modeling.vision import bidirectional_image_marks
from ..packing.rank_shares import ROW_RANKS
from ..parallel.batch_hand_out import SameBatchOnEveryRank
from ..parallel.groups import RowGroup, context_parallel_blocks, context_parallel_groups
from ..parallel.row_split import SplitRowRun
from ..parallel.ulysses import active_group, check_groups_not_created, check_ulysses_model
from ..refusals.parallel import (
    check_context_parallel_attention,
    check_dynamic_context_parallel_setup,
    check_no_context_parallelism,
    check_prefix_sharing_without_sequence_parallel,
    check_processes_share_rows,
    check_sequence_parallel_engine,
    check_split_image_spans,
    check_split_rows_without_moe_aux_loss,
    check_split_rows_without_stateful_mixers,
    check_ulysses_without_dropout,
)
from ..settings import Settings


@dataclass
class RowSplit:
    """How this rank shares its packed rows: Ulysses over `ulysses_size` ranks and context parallelism over
    `context`'s, `ranks_per_row` of them in all (consecutive ranks)."""

    accelerator: object
    ulysses_size: int
    context: RowGroup | None  # None without context parallelism
    row: RowGroup | None  # every rank of the row; None with Ulysses alone (DeepSpeed's group, later)
    deal_images: bool = True
    # Training rows with images this rank ran, by how their vision tower ran: dealt over the row's ranks, or whole
    image_rows: dict[str, int] = field(default_factory=lambda: {"dealt": 0, "whole": 0})
    # Dynamic context parallelism: this rank's block of each size 2 ... C (None: every row on the whole group)
    blocks: dict[int, RowGroup] | None = None

    @property
    def ranks_per_row(self) -> int:
        return self.ulysses_size * (self.context.size if self.context is not None else 1)

    @classmethod
    def set_up(cls, trainer, settings: Settings) -> RowSplit | None:
        """Check and configure what `settings` ask of `trainer`; None when rows are not split. The trainer then pads
        its rows to a multiple of `ranks_per_row`."""
        accelerator = trainer.accelerator
        if trainer.padding_free_enabled and accelerator.parallelism_config is not None:
            check_no_context_parallelism(accelerator.parallelism_config.cp_size)
        ulysses_size, context_size = settings.sequence_parallel_size, settings.context_parallel_size
        if ulysses_size == 1 and context_size == 1:
            return None
        policy = accelerator.unwrap_model(trainer.model)
        policy = policy.get_base_model() if is_peft_model(policy) else policy
        attention = attn_implementation(policy)
        if ulysses_size > 1:
            _check_ulysses(trainer, settings, policy, attention)
        if context_size > 1:
            check_split_image_spans(trainer.is_vision_dataset and bidirectional_image_marks(policy) is not None, True)
            check_processes_share_rows(context_size * ulysses_size, accelerator.num_processes)
            check_context_parallel_attention(attention)
            check_split_rows_without_moe_aux_loss(
                "Context parallelism", "context_parallel_size=1", trainer.aux_loss_enabled
            )
            if settings.dynamic_context_parallel:
                check_dynamic_context_parallel_setup(ulysses_size, trainer.is_vision_dataset)
        check_split_rows_without_stateful_mixers(mixer_classes(policy))
        # Under ZeRO-3, per-image loops refuse `deal_images` (padding_free.py)
        split = cls(accelerator, ulysses_size, None, None, deal_images=settings.deal_images)
        if ulysses_size > 1:
            if policy.config.get_text_config() is not policy.config:
                # Ulysses wraps the language model's attention (the vision tower runs whole images on every rank)
                label_top_level_attention(policy.config, attention)
            split._set_up_ulysses(attention)
        if context_size > 1:
            split.context, split.row = context_parallel_groups(context_size, ulysses_size)
        if settings.dynamic_context_parallel:
            split.blocks = context_parallel_blocks(context_size)
        else:  # every rank of a row computes the whole batch's metrics: count its tokens once
            trainer.count_tokens_once_per(split.ranks_per_row)
        return split

    def _set_up_ulysses(self, attention: str) -> None:
        """accelerate's `ParallelismConfig(sp_backend="deepspeed", sp_size=N)`: the packing-aware attention handed
        to DeepSpeed Ulysses, whole batches on every rank of the row, DeepSpeed's batch sizes."""
        accelerator, size = self.accelerator, self.ulysses_size
        # accelerate only accepts the names of transformers' built-in kernels here; DeepSpeed wraps whichever
        # registered attention the model runs, ours included, and checks it matches the model
        accelerator.parallelism_config.sp_handler.sp_attn_implementation = attention
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
        this in place of DeepSpeed's adapter, which would slice the 1-D `cu_seq_lens` (parallel/batch_hand_out.py)."""
        group = self.row or active_group(self.accelerator)
        return SameBatchOnEveryRank(dataloader, group, self.accelerator.device)

    def train_dataloader(self, dataloader):
        """The trainer's training dataloader, made to hand every rank of a row the same micro-batches."""
        if self.ulysses_size > 1 or self.blocks is not None:
            # Ulysses: accelerate's dataloader hook did it (same_batch_on_every_rank). Dynamic: the batch plan deals
            # each rank its block's row, which every rank of the block collates alike
            return dataloader
        return self.same_batch_on_every_rank(dataloader)

    def ranks_of(self, batch: dict) -> int:
        """Over how many ranks a collated training micro-batch's row is split."""
        if self.blocks is None:
            return self.ranks_per_row
        if ROW_RANKS not in batch:
            raise ValueError(
                "dynamic_context_parallel=True: this training micro-batch does not say over how many ranks its row "
                "is split. Its batches come from the trainer's own batch plan (max_tokens_per_batch); a dataloader "
                "built another way (an overridden get_train_dataloader) cannot say it. Set "
                "dynamic_context_parallel=False to split every row over the whole group."
            )
        return batch[ROW_RANKS]

    def mark(self, packed_batch: PackedBatch, row_ranks: int) -> None:
        """Tell a training micro-batch's row how it is split (the packed forward hands the run to it); `row_ranks`:
        `ranks_of` its batch."""
        if self.blocks is not None:  # its block's ranks, or this rank alone
            if row_ranks == 1:
                packed_batch.split = None
            else:
                block = self.blocks[row_ranks]
                packed_batch.split = SplitRowRun(block, None, block, self.deal_images, self.image_rows)
            return
        ulysses = active_group(self.accelerator)
        packed_batch.split = SplitRowRun(self.row or ulysses, ulysses, self.context, self.deal_images, self.image_rows)

    def counts_metrics(self, packed_batch: PackedBatch) -> bool:
        """Whether TRL's metric gathers take this rank's copy of its training row. Under the static split every rank
        of a group holds the group's row, so every copy counts: TRL's means are unchanged, and its token count is
        divided by the ranks per row (`count_tokens_once_per`). Rows of different rank counts (dynamic) would weigh
        a row by its ranks: only a row's first rank counts it."""
        split = packed_batch.split
        return self.blocks is None or split is None or split.row.rank == 0


def _check_ulysses(trainer, settings: Settings, policy, attention: str) -> None:
    size = settings.sequence_parallel_size
    plugin = trainer.accelerator.state.deepspeed_plugin
    zero_stage = None if plugin is None else plugin.zero_stage
    check_sequence_parallel_engine(size, trainer.is_deepspeed_enabled, trainer.padding_free_enabled, zero_stage)
    attention_dropout = getattr(policy.config.get_text_config(), "attention_dropout", 0.0)
    check_ulysses_without_dropout(trainer.args.disable_dropout, attention_dropout)
    check_split_rows_without_moe_aux_loss("Sequence parallelism", "sp_size=1", trainer.aux_loss_enabled)
    check_prefix_sharing_without_sequence_parallel(settings.prefix_sharing.value, True)
    check_groups_not_created()
    check_ulysses_model(policy.config, attention, size, EXACT_UNDER_ULYSSES)
