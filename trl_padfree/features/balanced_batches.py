"""`BalancedBatches`: the trainer's feature for `train_sampling_strategy="batch_rebalance"` under padding-free, each
optimizer step's pairs split by cost so every process's row costs about the same, a step's pairs of one prompt kept
on one process and micro-step under prefix sharing (the samplers and the split: packing/balanced_batches.py,
packing/balance.py)."""

from __future__ import annotations

import functools
import logging

from ..costs.flops import DecoderShape
from ..packing.balanced_batches import BalancedBatchSampler, BalancedBudgetBins, grouped_pairs_cost, pair_costs
from ..packing.pair_sizes import costs_of, training_set_pair_sizes
from ..packing.prefix_sharing import AUTO, MIN_SHARED_PROMPT_TOKENS
from ..refusals import check_balanced_batches_setup
from .prompt_group_batches import prompt_group_ids, vision_prompt_group_ids

logger = logging.getLogger(__name__)

REBALANCE = "batch_rebalance"  # transformers' `train_sampling_strategy` that turns balancing on


def wants_balanced_batches(args) -> bool:
    return getattr(args, "train_sampling_strategy", None) == REBALANCE


class BalancedBatches:
    """What the trainer sets up for `train_sampling_strategy="batch_rebalance"` under padding-free (`set_up`): the
    pairs' costs, the refusals, and the batch sampler (`sampler`: the balanced micro-batches, or the token budget's
    bins dealt balanced). The loss weighting and the logged cost ratio are `PairWeightedSteps`'s
    (features/pair_weighted_steps.py)."""

    def __init__(self, shape: DecoderShape, reference_forward: bool, costs: list[float], sampler):
        self.shape = shape
        self.reference_forward = reference_forward
        self.costs = costs
        self.sampler: BalancedBatchSampler | BalancedBudgetBins = sampler

    @classmethod
    def set_up(cls, trainer) -> BalancedBatches | None:
        """From `trainer`'s config, model, tokenized training set, token budget and row split; None unless asked
        for."""
        args = trainer.args
        if not (wants_balanced_batches(args) and trainer.padding_free_enabled) or trainer.train_dataset is None:
            return None  # padded: transformers' own BatchRebalanceSampler, as in TRL
        budget, row_split = trainer._token_budget, trainer._row_split
        check_balanced_batches_setup(
            trainer.loss_types,
            trainer.aux_loss_enabled,
            budget is not None and row_split is not None,
            hasattr(trainer.train_dataset, "__len__"),
            getattr(args.accelerator_config, "use_seedable_sampler", True),
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        shape = DecoderShape.of_model(model)
        reference_forward = not args.precompute_ref_log_probs
        collator = trainer.data_collator
        if trainer.is_vision_dataset:  # tokenized only when collated: each pair's row priced once per dataset
            sizes = budget.pair_sizes if budget is not None else None
            if sizes is None:
                sizes = training_set_pair_sizes(trainer, "Pricing pairs for batch_rebalance")
            costs = costs_of(sizes, shape, reference_forward)
        else:
            # "auto" shares a batch or not by its own cost: price pairs as laid out unshared, the larger estimate
            shares = collator.prefix_sharing and collator.prefix_sharing != AUTO
            costs = pair_costs(
                trainer.train_dataset,
                shape,
                args.max_length,
                args.truncation_mode,
                collator.prefix_sharing_min_prompt_tokens if shares else None,
                reference_forward,
            )
        processes, micro_steps = trainer.accelerator.num_processes, args.gradient_accumulation_steps
        if budget is not None:
            sampler = BalancedBudgetBins(budget.sampler, costs, processes=processes, micro_steps=micro_steps)
        else:
            group_ids, group_cost = _prompt_groups(trainer, shape, reference_forward)
            sampler = BalancedBatchSampler(
                costs,
                args.per_device_train_batch_size,
                processes=processes,
                micro_steps=micro_steps,
                seed=args.data_seed if args.data_seed is not None else args.seed,
                drop_last=args.dataloader_drop_last,
                ranks_per_row=1 if row_split is None else row_split.ranks_per_row,
                group_ids=group_ids,
                group_cost=group_cost,
            )
            if trainer.accelerator.is_main_process and logger.isEnabledFor(logging.INFO):
                _log_expected_gain(sampler)
        return cls(shape, reference_forward, costs, sampler)

    @property
    def pricing(self) -> tuple[DecoderShape, bool]:
        """What prices a row: the model's shape and whether the reference runs in the step."""
        return self.shape, self.reference_forward


def _prompt_groups(trainer, shape: DecoderShape, reference_forward: bool):
    """Under prefix sharing, each pair's prompt group and the cost of a set of one prompt's pairs, so that a step's
    pairs of one prompt are split as one item (`BalancedBatchSampler`); (None, None) without prefix sharing, where
    grouping saves nothing. A text group is priced as its grouped row (`grouped_pairs_cost`; under "auto" as the
    collator groups when sharing pays); a vision-language group as the sum of its pairs' costs."""
    args, collator, dataset = trainer.args, trainer.data_collator, trainer.train_dataset
    if not collator.prefix_sharing:
        return None, None
    if trainer.is_vision_dataset:
        return vision_prompt_group_ids(dataset), None
    minimum = (
        MIN_SHARED_PROMPT_TOKENS if collator.prefix_sharing == AUTO else collator.prefix_sharing_min_prompt_tokens
    )
    columns = list(zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True))
    cost = functools.partial(
        grouped_pairs_cost,
        shape,
        max_length=args.max_length,
        truncation_mode=args.truncation_mode,
        min_prompt_tokens=minimum,
        reference_forward=reference_forward,
    )
    return prompt_group_ids(dataset), lambda pairs: cost([columns[index] for index in pairs])


def _log_expected_gain(sampler: BalancedBatchSampler) -> None:
    dealt, balanced = sampler.epoch_imbalance()
    logger.info(
        "batch_rebalance: %d optimizer steps per epoch over %d row groups; estimated slowest over mean group cost per "
        "step %.3f dealt as usual, %.3f balanced (expected step-time gain %.2fx if a row's time is its FLOPs; logged "
        "each step as 'padfree/balance_cost_max_over_mean').",
        len(sampler.steps),
        sampler.groups,
        dealt,
        balanced,
        dealt / balanced,
    )
