"""`DPOTrainer`: TRL's DPO trainer with `padding_free=True` honoured, packed and exact."""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
import trl
from accelerate.utils import is_peft_model
from torch.utils.data import DataLoader

from .checks import (
    check_attention_switched,
    check_batches_not_dispatched,
    check_moe_aux_loss_without_row_padding,
    check_no_liger_kernel,
    check_not_prompt_learning,
    check_packable,
    check_packing_collator,
    check_prefix_sharing_without_moe_aux_loss,
    choose_packed_attention,
    refuse_vision_datasets,
)
from .collator import PaddingFreePreferenceCollator, is_packed_batch
from .forward import PACKED_BATCH_KWARG, PackedBatch, add_packed_forward
from .fused_lm_head import fused_lm_head_lookups
from .packing import pad_length_to_multiple
from .prefix_sharing import log_sharing_summary
from .reference import ReferencePlacement
from .row_split import RowSplit
from .token_budget import TokenBudgetBatching

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _padding_free_hidden_from_trl(args):
    # TRL 1.16 warns that padding_free is "temporarily unavailable" and switches it off; this trainer honours it
    # instead, so TRL's constructor must not see it
    padding_free = args.padding_free
    args.padding_free = False
    try:
        yield
    finally:
        args.padding_free = padding_free


def _bound_argument(name: str, *args, **kwargs):
    # The value `trl.DPOTrainer.__init__` would receive for `name`, however it was passed
    bound = inspect.signature(trl.DPOTrainer.__init__).bind(None, *args, **kwargs)
    return bound.arguments.get(name)


class DPOTrainer(trl.DPOTrainer):
    """
    Drop-in replacement for [`trl.DPOTrainer`] that honours `padding_free=True`.

    With `padding_free=True` (in [`trl_padfree.DPOConfig`] or a plain [`trl.DPOConfig`]) each batch is one packed row
    from [`PaddingFreePreferenceCollator`]: the policy and the reference model run on that row with no padding and no
    attention mask, and their per-token outputs are gathered back into the per-sequence layout TRL's loss reads, so
    every loss type, option and logged metric is TRL's own code on the same numbers. With `padding_free=False` it is
    TRL's trainer, unchanged.

    Models are checked at construction: a model or attention implementation whose packed forward would let sequences
    see each other is refused with an error that says what to change.
    """

    _tag_names = [*trl.DPOTrainer._tag_names, "trl-padfree"]

    def __init__(self, model, ref_model=None, args=None, data_collator=None, *more_args, **kwargs):
        self._padding_free_requested = bool(args is not None and args.padding_free)
        self._token_budget = None  # max_tokens_per_batch, once TRL has tokenized the data: token_budget.py
        self._row_split = None  # rows shared by several ranks (sequence or context parallelism): row_split.py
        self._padding_free_ready = False
        if self._padding_free_requested and data_collator is not None:
            check_packing_collator(data_collator)
        if self._padding_free_requested:
            check_no_liger_kernel(bool(getattr(args, "use_liger_kernel", False)))
        peft_config = None
        if getattr(args, "ref_offload", False):  # the only setting that reads it before TRL's __init__
            peft_config = _bound_argument("peft_config", model, ref_model, args, data_collator, *more_args, **kwargs)
        self._reference, ref_model = ReferencePlacement.before_init(args, model, ref_model, peft_config)

        with contextlib.ExitStack() as scopes:
            if self._padding_free_requested:
                scopes.enter_context(_padding_free_hidden_from_trl(args))
            scopes.enter_context(self._reference.preparing(args))
            scopes.enter_context(fused_lm_head_lookups(self))
            super().__init__(model, ref_model, args, data_collator, *more_args, **kwargs)
        self._reference.check(self)
        if self._padding_free_requested:
            self._enable_padding_free()
            self._keep_batches_whole()
        self._row_split = RowSplit.set_up(self)
        self._token_budget = TokenBudgetBatching.set_up(self)
        if self._padding_free_ready and self.data_collator.prefix_sharing:
            collator = self.data_collator
            log_sharing_summary(
                self.train_dataset, args.max_length, args.truncation_mode, collator.prefix_sharing_min_prompt_tokens
            )
        self._reference.release_after_precompute(self)
        self._check_datasets_not_empty()

    @property
    def padding_free_enabled(self) -> bool:
        """Whether this trainer packs its batches. Its own state: TRL's `self.padding_free`, which TRL 1.16 sets to
        False, stays TRL's, so a padding-free path TRL brings back cannot run alongside this one unnoticed."""
        return self._padding_free_ready

    def _check_datasets_not_empty(self) -> None:
        # TRL drops examples whose prompt alone fills `max_length`; with none left, torch's sampler fails obscurely
        datasets = {"train": self.train_dataset}
        datasets |= self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        for name, dataset in datasets.items():
            if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
                raise ValueError(
                    f"The {name} dataset has no examples left: it was empty, or TRL dropped every example because "
                    f"its prompt alone fills max_length={self.args.max_length}. Check the data, or increase "
                    "`max_length` (or shorten the prompts)."
                )

    def _enable_padding_free(self) -> None:
        """Packed collator, packing-aware attention and packed forward on every model. Runs once, before the first
        forward: at the end of `__init__`, or earlier when TRL's `__init__` precomputes reference log-probs."""
        if self._padding_free_ready:
            return
        if self._is_vision_dataset:
            refuse_vision_datasets()
        if not isinstance(self.data_collator, PaddingFreePreferenceCollator):
            self.data_collator = PaddingFreePreferenceCollator.from_padded(self.data_collator)
        check_moe_aux_loss_without_row_padding(self.aux_loss_enabled, self.data_collator.pad_to_multiple_of)
        # Set in the config, or on a collator passed in: either way every check below must see it
        configured = bool(getattr(self.args, "prefix_sharing", False))
        if configured:
            self.data_collator.prefix_sharing = True
            self.data_collator.prefix_sharing_min_prompt_tokens = self.args.prefix_sharing_min_prompt_tokens
        prefix_sharing = self.data_collator.prefix_sharing
        check_prefix_sharing_without_moe_aux_loss(prefix_sharing, self.aux_loss_enabled)

        policy = self.accelerator.unwrap_model(self.model)
        if is_peft_model(policy):
            check_not_prompt_learning(policy.peft_config[policy.active_adapter])
            policy = policy.get_base_model()
        models = [policy]
        if self.ref_model is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))

        requested = getattr(self.args, "packed_attn_implementation", "auto")
        # Prefix sharing and context parallelism run in `padfree_varlen`: 'auto' picks it for them
        needs_padfree_varlen = prefix_sharing or getattr(self.args, "context_parallel_size", 1) > 1
        for model in models:
            attn_implementation = choose_packed_attention(model, requested, needs_padfree_varlen)
            check_packable(model, prefix_sharing, attn_implementation)
            if attn_implementation != model.config._attn_implementation:
                model.set_attn_implementation(attn_implementation)
                check_attention_switched(model, attn_implementation)
            add_packed_forward(model)
        self._padding_free_ready = True
        # What TRL's padded collator would pad to, for the padding-saved metrics (sequence parallelism pads the row)
        self._padded_pad_to_multiple_of = self.data_collator.pad_to_multiple_of

    def _keep_batches_whole(self) -> None:
        """Each process builds its own packed rows: accelerate's dispatcher, which it picks by default for streamed
        (iterable) datasets, would slice them (checks.check_batches_not_dispatched)."""
        dataloader_config = self.accelerator.dataloader_config
        check_batches_not_dispatched(dataloader_config.dispatch_batches, dataloader_config.split_batches)
        dataloader_config.dispatch_batches = False

    def get_train_dataloader(self) -> DataLoader:
        if self._token_budget is not None:
            dataset = self._remove_unused_columns(self.train_dataset, description="Training")
            dataloader = self._token_budget.train_dataloader(dataset, self.data_collator, self.args)
        else:
            dataloader = super().get_train_dataloader()
        return dataloader if self._row_split is None else self._row_split.train_dataloader(dataloader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._token_budget is not None:
            self._token_budget.count_step(batch_samples)
        return batch_samples, num_items_in_batch

    def _packed_inputs(self, inputs: dict) -> dict:
        """The padded-layout inputs TRL's loss code reads, carrying the packed row the forward really runs on."""
        if not self._padding_free_ready:
            raise ValueError(
                "Got a packed batch (from PaddingFreePreferenceCollator) but padding_free=False. Set "
                "`padding_free=True` in the config, or use TRL's padded collator."
            )
        packed_batch = PackedBatch.from_collated(inputs)
        # A processor pads with its tokenizer, as TRL's collator does
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        padded = packed_batch.padded_inputs(tokenizer.pad_token_id)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in inputs:
                padded[key] = inputs[key]
        padded[PACKED_BATCH_KWARG] = packed_batch
        return padded

    def _log_packing_metrics(self, packed_batch: PackedBatch) -> None:
        """Log what packing saved on this micro-batch, next to TRL's metrics (so every `report_to` sees them).

        `padfree/real_tokens` and `padfree/padded_tokens` are summed over processes: the tokens of the batch's
        sequences, and the tokens TRL's padded collator would have made of them (2 x pairs x longest). With prefix
        sharing, `padfree/shared_tokens` (summed) are the prompt tokens computed once instead of twice, and
        `padfree/shared_pairs` the fraction of pairs laid out shared. With token-budget batching,
        `padfree/pairs_per_micro_batch` and `padfree/budget_fill` (row tokens / budget) are averaged over processes.
        """
        sequences = len(packed_batch.seq_lens)
        padded_width = pad_length_to_multiple(packed_batch.width, self._padded_pad_to_multiple_of)
        shared_pairs = (
            0 if packed_batch.shared_prefix_lens is None else int((packed_batch.shared_prefix_lens > 0).sum())
        )
        counts = [
            packed_batch.seq_lens.sum().item(),
            sequences * padded_width,
            packed_batch.row_length,
            sequences // 2,
            packed_batch.real_row_tokens,
            shared_pairs,
        ]
        counts = torch.tensor(counts, dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(counts).view(-1, len(counts))
        split = packed_batch.split
        if split is not None:  # every rank of a group holds the same row: count it once
            gathered = gathered[:: split.size]
        real_tokens, padded_tokens, row_length, pairs, row_tokens, shared_pairs = gathered.sum(0).tolist()
        processes = len(gathered)
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["padfree/real_tokens"].append(real_tokens)
        metrics["padfree/padded_tokens"].append(padded_tokens)
        metrics["padfree/padding_removed"].append(1.0 - real_tokens / padded_tokens)
        metrics["padfree/row_length"].append(row_length / processes)
        if packed_batch.shared_prefix_lens is not None:  # a prefix-sharing collator made the row
            metrics["padfree/shared_tokens"].append(real_tokens - row_tokens)
            metrics["padfree/shared_pairs"].append(shared_pairs / pairs)
        if self._token_budget is not None and self.model.training:
            metrics["padfree/pairs_per_micro_batch"].append(pairs / processes)
            metrics["padfree/budget_fill"].append(row_tokens / processes / self._token_budget.sampler.budget)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        # Called from TRL's __init__, before this class could enable packing
        if self._padding_free_requested:
            self._enable_padding_free()
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_ref_log_probs(self, model, inputs):
        if is_packed_batch(inputs):
            inputs = self._packed_inputs(inputs)
        return super().compute_ref_log_probs(model, inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # TRL returns `inputs["input_ids"]` as labels next to the logits: give it the padded layout of both
        if is_packed_batch(inputs):
            inputs = self._packed_inputs(self._prepare_inputs(inputs))
            self._log_packing_metrics(inputs[PACKED_BATCH_KWARG])
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if is_packed_batch(inputs):
            inputs = self._packed_inputs(inputs)
            if model.training and self._row_split is not None:
                self._row_split.mark(inputs[PACKED_BATCH_KWARG])
            self._log_packing_metrics(inputs[PACKED_BATCH_KWARG])
        if self._token_budget is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._token_budget.weighted_loss(
            lambda: super(DPOTrainer, self).compute_loss(model, inputs, return_outputs, num_items_in_batch),
            pairs=len(inputs[PACKED_BATCH_KWARG].seq_lens) // 2,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._token_budget is not None and self.model.training:
            self._token_budget.reweigh_metrics(self._metrics["train"])
        super().log(logs, start_time)
