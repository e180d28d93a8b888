"""`DPOTrainer`: TRL's DPO trainer with `padding_free=True` honoured, packed and exact.

The trainer only wires features together, each one object in features/ with its own phases around TRL's `__init__`
and its own part of a step:

    PaddingFree          padding_free.py           the packing collator, each model's attention, the packed forward
    ReferencePlacement   reference_placement.py    where the reference model lives (ZeRO-3 offload, FSDP2)
    RowSplit             row_split.py              one row over several ranks (Ulysses, context parallelism)
    TokenBudgetBatching  token_budget_batching.py  micro-batches filled by tokens
    BalancedBatches      balanced_batches.py       each step's pairs split so every process's row costs the same
    PromptGroupBatches   prompt_group_batches.py   a prompt's pairs in the same micro-batch (padded or not)
    PairWeightedSteps    pair_weighted_steps.py    the loss and metrics of micro-batches of uneven pair counts

TRL's private names it builds on are behind `integrations.trl.TRLSeams`.
"""

from __future__ import annotations

import contextlib
import os

from torch.utils.data import DataLoader

from .config import fp32_log_probs_enabled
from .data.preference_format import checked_preference_datasets, log_dropped_pairs
from .features import (
    BalancedBatches,
    PaddingFree,
    PromptGroupBatches,
    ReferencePlacement,
    RowSplit,
    TokenBudgetBatching,
)
from .features.pair_weighted_steps import EpochOfBatchSampler, PairWeightedSteps, batch_sampler_dataloader
from .integrations.trl import TRLSeams, bound_init_arguments
from .modeling.fused_lm_head import fused_lm_head_lookups
from .modeling.packed_forward import PACKED_BATCH_KWARG
from .modeling.vision import why_no_images
from .packing.collator import is_packed_batch
from .parallel.ulysses import sequence_parallel_size
from .refusals import check_datasets_not_empty


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
        # Padding-free or not, before TRL reads them: bad data stops here with its row and column named
        arguments["train_dataset"], arguments["eval_dataset"] = checked_preference_datasets(
            arguments.get("train_dataset"),
            arguments.get("eval_dataset"),
            why_no_images=lambda: why_no_images(model, arguments.get("processing_class"), args),
        )
        self._padding_free = PaddingFree.before_init(args, model, data_collator)
        self._token_budget = None  # max_tokens_per_batch, once TRL has tokenized the data
        self._balanced = None  # train_sampling_strategy="batch_rebalance", once TRL has tokenized the data
        self._pair_weights = None  # either of them: micro-batches of uneven pair counts
        self._prompt_groups = None  # train_sampling_strategy="group_by_prompt", once TRL has tokenized the data
        self._row_split = None  # rows shared by several ranks
        self._reference, arguments["ref_model"] = ReferencePlacement.before_init(
            args, model, ref_model, arguments.get("peft_config")
        )
        fp32_log_probs = fp32_log_probs_enabled(args, self._padding_free.requested)
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(self._padding_free.around_init(args))
            scopes.enter_context(self._reference.preparing(args))
            scopes.enter_context(
                fused_lm_head_lookups(self, fp32_log_probs, getattr(args, "cast_lm_head_to_fp32", False))
            )
            super().__init__(**arguments)
        if self.accelerator.is_main_process:  # TRL drops pairs whose prompt fills max_length: say how many
            given = (arguments.get("train_dataset"), arguments.get("eval_dataset"))
            log_dropped_pairs(given, (self.train_dataset, self.eval_dataset), self.args.max_length)
        self._reference.check(self)
        self._padding_free.after_init(self)
        self._row_split = RowSplit.set_up(self)
        if self._row_split is not None:
            self._padding_free.pad_rows_to(self, self._row_split.ranks_per_row)
        self._token_budget = TokenBudgetBatching.set_up(self)
        self._balanced = BalancedBatches.set_up(self)
        self._prompt_groups = PromptGroupBatches.set_up(self)
        if self._token_budget is not None or self._balanced is not None:
            shape, reference_forward = (None, True) if self._balanced is None else self._balanced.pricing
            self._pair_weights = PairWeightedSteps(self.accelerator, shape, reference_forward)
        if self._train_batch_sampler() is not None:
            self.add_callback(EpochOfBatchSampler(self._train_batch_sampler()))
        self._reference.release_after_precompute(self)
        self._check_datasets_not_empty()

    @property
    def padding_free_enabled(self) -> bool:
        """Whether this trainer packs its batches. Its own state: TRL's `self.padding_free`, which TRL 1.16 sets to
        False, stays TRL's, so a padding-free path TRL brings back cannot run alongside this one unnoticed."""
        return self._padding_free.enabled

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks of a DeepSpeed Ulysses group (1 without sequence parallelism)."""
        return sequence_parallel_size(self.accelerator)

    def before_reference_precompute(self) -> None:
        # TRL precomputes reference log-probs inside its own __init__: packing must be on by then
        self._padding_free.enable(self)

    def _check_datasets_not_empty(self) -> None:
        datasets = {"train": self.train_dataset}
        datasets |= self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        sizes = {name: len(data) for name, data in datasets.items() if data is not None and hasattr(data, "__len__")}
        check_datasets_not_empty(sizes, self.args.max_length)

    def get_train_dataloader(self) -> DataLoader:
        batch_sampler = self._train_batch_sampler()
        if batch_sampler is not None:
            dataset = self.columns_the_model_takes(self.train_dataset, description="Training")
            dataloader = batch_sampler_dataloader(
                batch_sampler, dataset, self.data_collator, self.args, self.accelerator
            )
        else:
            dataloader = super().get_train_dataloader()
        return dataloader if self._row_split is None else self._row_split.train_dataloader(dataloader)

    def _train_batch_sampler(self):
        """The balanced micro-batches (or the token budget's bins dealt balanced), the token budget's bins, or the
        prompt groups' batches; None for TRL's own sampler."""
        for feature in (self._balanced, self._token_budget, self._prompt_groups):
            if feature is not None:
                return feature.sampler
        return None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.padding_free_enabled:  # an optimizer step starts: its micro-batches are fetched and collated
            self._padding_free.throughput.step_starting()
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._pair_weights is not None:
            self._pair_weights.count_step(batch_samples)
        return batch_samples, num_items_in_batch

    def _packed(self, inputs: dict, training: bool) -> dict:
        """A packed batch as TRL's loss code reads it, its packing metrics logged; a training row split over ranks is
        marked so."""
        inputs = self._padding_free.padded_inputs(self, inputs)
        if training and self._row_split is not None:
            self._row_split.mark(inputs[PACKED_BATCH_KWARG])
        budget = None if self._token_budget is None else self._token_budget.sampler.budget
        self._padding_free.log_metrics(self, inputs[PACKED_BATCH_KWARG], budget)
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
        if is_packed_batch(inputs):
            inputs = self._packed(inputs, training=model.training)
        if self._pair_weights is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._pair_weights.weighted_loss(
            lambda: super(DPOTrainer, self).compute_loss(model, inputs, return_outputs, num_items_in_batch),
            pairs=len(inputs[PACKED_BATCH_KWARG].seq_lens) // 2,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._pair_weights is not None and self.model.training:
            self._pair_weights.reweigh_metrics(self.logged_metrics("train"))
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
