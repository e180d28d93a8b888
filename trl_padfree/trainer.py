"""`DPOTrainer`: TRL's DPO trainer with `padding_free=True` honoured, packed and exact.

The trainer only wires features together, each one object in features/ with its own phases around TRL's `__init__`
and its own part of a step, all reading the config resolved once (`settings.Settings`):

    PaddingFree          padding_free.py          the packing collator, each model's attention, the packed forward
    ReferencePlacement   reference_placement.py   where the reference model lives (ZeRO-3 offload, FSDP2)
    RowSplit             row_split.py             one row over several ranks (Ulysses, context parallelism)
    BatchPlan            batches.py               which micro-batches training draws: prompt groups, token budgets,
                                                  balanced batches, and `PairWeightedSteps` (pair_weighted_steps.py)
                                                  for micro-batches of uneven pair counts

TRL's private names it builds on are behind `integrations.trl.TRLSeams`.
"""

from __future__ import annotations

import contextlib
import os

from torch.utils.data import DataLoader

from .data.preference_format import checked_preference_datasets, log_dropped_pairs
from .features import BatchPlan, PaddingFree, ReferencePlacement, RowSplit
from .features.pair_weighted_steps import EpochOfBatchSampler, batch_sampler_dataloader
from .integrations.trl import TRLSeams, bound_init_arguments
from .modeling.fused_lm_head import fused_lm_head_lookups
from .modeling.packed_forward import PACKED_BATCH_KWARG
from .modeling.vision import why_no_images
from .packing.collator import is_packed_batch
from .refusals.batches import check_datasets_not_empty
from .settings import Settings


class DPOTrainer(TRLSeams):
    """
    Drop-in replacement for [`trl.DPOTrainer`] that honours `padding_free=True`.

    With `padding_free=True` (in [`trl_padfree.DPOConfig`] or a plain [`trl.DPOConfig`]) each batch is one packed row
    from [`PaddingFreePreferenceCollator`]: the policy and the reference model run on that row with no padding and no
    attention mask, and their per-token outputs are gathered back into the per-sequence layout TRL's loss reads, so
    every loss type, option and logged metric is TRL's own code on the same numbers. With `padding_free=False` and
    this package's options left unset it is TRL's trainer, unchanged: the same numbers and metrics (`fp32_log_probs`
    is then off, and FSDP2 shards the reference as TRL does). Its model card records the padding-free settings.

    Models are checked at construction: a model or attention implementation whose packed forward would let sequences
    see each other is refused with an error that says what to change.
    """

    def __init__(self, model, ref_model=None, args=None, data_collator=None, *more_args, **kwargs):
        arguments = bound_init_arguments(model, ref_model, args, data_collator, *more_args, **kwargs)
        self.settings = settings = Settings.resolve(args, data_collator)
        # Padding-free or not, before TRL reads them: bad data stops here with its row and column named
        arguments["train_dataset"], arguments["eval_dataset"] = checked_preference_datasets(
            arguments.get("train_dataset"),
            arguments.get("eval_dataset"),
            why_no_images=lambda: why_no_images(
                model, arguments.get("processing_class"), settings.trust_remote_code, settings.model_revision
            ),
        )
        self._padding_free = PaddingFree.before_init(settings, args, model, data_collator)
        self._row_split = None  # rows shared by several ranks
        self._batches = BatchPlan()  # TRL's own batches until the data is tokenized
        self._reference, arguments["ref_model"] = ReferencePlacement.before_init(
            settings, args, model, ref_model, arguments.get("peft_config")
        )
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(self._padding_free.around_init(args))
            scopes.enter_context(self._reference.preparing(args))
            scopes.enter_context(fused_lm_head_lookups(self, settings.fp32_log_probs, settings.cast_lm_head_to_fp32))
            super().__init__(**arguments)
        if self.accelerator.is_main_process:  # TRL drops pairs whose prompt fills max_length: say how many
            given = (arguments.get("train_dataset"), arguments.get("eval_dataset"))
            log_dropped_pairs(given, (self.train_dataset, self.eval_dataset), self.args.max_length)
        self._reference.check(self)
        self._padding_free.after_init(self)
        for set_up in self.SET_UPS_AFTER_INIT:
            getattr(self, set_up)()
        if self._batches.sampler is not None:
            self.add_callback(EpochOfBatchSampler(self._batches.sampler))
        self._reference.release_after_precompute(self)
        self._check_datasets_not_empty()

    # Each reads the settings and the tokenized data, none another's state: in any order, the same trainer
    SET_UPS_AFTER_INIT = ("_split_rows", "_plan_batches")

    def _split_rows(self) -> None:
        self._row_split = RowSplit.set_up(self, self.settings)
        if self._row_split is not None:
            self._padding_free.pad_rows_to(self, self._row_split.ranks_per_row)

    def _plan_batches(self) -> None:
        self._batches = BatchPlan.set_up(self, self.settings)

    @property
    def padding_free_enabled(self) -> bool:
        """Whether this trainer packs its batches. Its own state: TRL's `self.padding_free`, which TRL 1.16 sets to
        False, stays TRL's, so a padding-free path TRL brings back cannot run alongside this one unnoticed."""
        return self._padding_free.enabled

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks of a DeepSpeed Ulysses group (1 without sequence parallelism)."""
        return self.settings.sequence_parallel_size

    def before_reference_precompute(self) -> None:
        # TRL precomputes reference log-probs inside its own __init__: packing must be on by then
        self._padding_free.enable(self)

    def _check_datasets_not_empty(self) -> None:
        datasets = {"train": self.train_dataset}
        datasets |= self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        sizes = {name: len(data) for name, data in datasets.items() if data is not None and hasattr(data, "__len__")}
        check_datasets_not_empty(sizes, self.args.max_length)

    def get_train_dataloader(self) -> DataLoader:
        batch_sampler = self._batches.sampler
        if batch_sampler is not None:
            dataset = self.columns_the_model_takes(self.train_dataset, description="Training")
            dataset, collator = self._batches.loader_parts(dataset, self.data_collator)
            dataloader = batch_sampler_dataloader(batch_sampler, dataset, collator, self.args, self.accelerator)
        else:
            dataloader = super().get_train_dataloader()
        return dataloader if self._row_split is None else self._row_split.train_dataloader(dataloader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.padding_free_enabled:  # an optimizer step starts: its micro-batches are fetched and collated
            self._padding_free.throughput.step_starting()
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._batches.pair_weights is not None:
            self._batches.pair_weights.count_step(batch_samples, self._ranks_of)
        return batch_samples, num_items_in_batch

    def _ranks_of(self, batch: dict) -> int:
        """Over how many ranks a training micro-batch's row is split."""
        return 1 if self._row_split is None else self._row_split.ranks_of(batch)

    def _packed(self, inputs: dict, training: bool) -> dict:
        """A packed batch as TRL's loss code reads it, its packing metrics logged; a training row split over ranks is
        marked so."""
        ranks = self._ranks_of(inputs) if training else 1
        inputs = self._padding_free.padded_inputs(self, inputs)
        if training and self._row_split is not None:
            self._row_split.mark(inputs[PACKED_BATCH_KWARG], ranks)
        self._padding_free.log_metrics(self, inputs[PACKED_BATCH_KWARG], self._batches.budget)
        return inputs

    def compute_ref_log_probs(self, model, inputs):
        if is_packed_batch(inputs):
            inputs = self._padding_free.padded_inputs(self, inputs)
        return super().compute_ref_log_probs(model, inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # TRL returns `inputs["input_ids"]` as labels next to the logits: give it the padded layout of both
        if is_packed_batch(inputs):
            inputs = self._packed(self.on_device(inputs), training=False)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ranks = self._ranks_of(inputs) if model.training and is_packed_batch(inputs) else 1
        if is_packed_batch(inputs):
            inputs = self._packed(inputs, training=model.training)
        if self._batches.pair_weights is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        packed_batch = inputs[PACKED_BATCH_KWARG]
        return self._batches.pair_weights.weighted_loss(
            lambda: super(DPOTrainer, self).compute_loss(model, inputs, return_outputs, num_items_in_batch),
            pairs=len(packed_batch.seq_lens) // 2 / ranks,  # this rank's share of its row's pairs
            accumulation_steps=self.current_gradient_accumulation_steps,
            counted=self._row_split is None or self._row_split.counts_metrics(packed_batch),
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._batches.pair_weights is not None and self.model.training:
            self._batches.pair_weights.reweigh_metrics(self.logged_metrics("train"))
        if self.padding_free_enabled and self.model.training:
            self._padding_free.log_tokens_per_second(self)
        super().log(logs, start_time)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (README.md in `output_dir`), with a section recording the padding-free settings and the
        padding the packed batches removed."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        card = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.isfile(card):
            with open(card, "a", encoding="utf-8") as readme:
                readme.write("\n" + self._padding_free.model_card_section(self))
