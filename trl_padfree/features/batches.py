"""`BatchPlan`: which micro-batches training draws, decided in one place from the resolved settings.

Grouping (`train_sampling_strategy="group_by_prompt"`), sizing (`max_tokens_per_batch`), balance
(`train_sampling_strategy="batch_rebalance"`, padding-free only) and the hand-out to processes give:

    strategy          max_tokens_per_batch   sampler (packing/)                                 pair weights
    any other         unset                  TRL's own                                          -
    any other         set                    TokenBudgetBatchSampler over pairs                 counted
    group_by_prompt   unset                  PromptGroupBatchSampler over prompt groups         -
    group_by_prompt   set                    TokenBudgetBatchSampler over prompt groups         counted
    batch_rebalance   unset                  BalancedBatchSampler (a step's prompt groups       counted, priced
                                             kept whole under prefix sharing)
    batch_rebalance   set                    BalancedBudgetBins: the budget's bins, balanced    counted, priced

With `dynamic_context_parallel=True` the budget's micro-batches are shared out over each context-parallel group's
ranks (`RowsOnRanksSampler`, packing/rank_shares.py). `batch_rebalance` on padded batches is transformers' own
sampler, as in TRL. Every sampler yields the micro-batches of
every process (`batch_sampler_dataloader` deals them); micro-batches of uneven pair counts train as one batch of the
step's pairs (`PairWeightedSteps`, features/pair_weighted_steps.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data import IterableDataset

from ..costs.context_parallel import link_of_group, split_row_cost
from ..costs.flops import DecoderShape
from ..packing.balanced_batches import BalancedBatchSampler, BalancedBudgetBins, grouped_pairs_cost, pair_costs
from ..packing.layout import row_multiple
from ..packing.pair_sizes import costs_of, lengths_of, training_set_pair_sizes
from ..packing.prompt_groups import PromptGroupBatchSampler, dataset_group_ids, extra_prompt_computations
from ..packing.rank_shares import RowRanksCollator, RowRanksDataset, RowsOnRanksSampler, UnitWork
from ..packing.token_budget import (
    TokenBudgetBatchSampler,
    grouped_row,
    grouped_row_tokens,
    pair_lengths,
    usable_budget,
)
from ..packing.units import PairUnits
from ..refusals.token_budget import (
    check_balanced_batches_setup,
    check_pairs_fit,
    check_prompt_groups_setup,
    check_token_budget_setup,
)
from ..settings import REBALANCE, Settings
from .pair_weighted_steps import PairWeightedSteps

logger = logging.getLogger(__name__)


@dataclass
class BatchPlan:
    """The training batches a trainer draws: its batch sampler (None: TRL's own), how its micro-batches are weighed
    (`pair_weights`, None when every micro-batch holds the same pairs) and what they were sized and priced by."""

    sampler: object | None = None
    pair_weights: PairWeightedSteps | None = None
    budget: int | None = None  # max_tokens_per_batch, which the packing metrics report fill against
    budget_sampler: TokenBudgetBatchSampler | None = None  # its bins (which `sampler` may balance)
    shape: DecoderShape | None = None  # batch_rebalance's pricing: the model's shape
    reference_forward: bool = True  # and whether a step runs the reference model
    costs: list[float] | None = None  # batch_rebalance's price of each pair

    @classmethod
    def set_up(cls, trainer, settings: Settings) -> BatchPlan:
        """The plan of the module's table for `trainer`'s tokenized training set."""
        dataset = trainer.train_dataset
        balanced = settings.batch_rebalance and settings.padding_free
        if dataset is None or not (settings.max_tokens_per_batch is not None or settings.group_by_prompt or balanced):
            return cls()
        args = trainer.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        units = _Units(trainer, settings)
        if settings.max_tokens_per_batch is None and not balanced:
            check_prompt_groups_setup(hasattr(dataset, "__len__") and not isinstance(dataset, IterableDataset))
            sampler = PromptGroupBatchSampler(
                PairUnits.by_group_id(units.group_ids),
                args.per_device_train_batch_size,
                seed=seed,
                drop_last=args.dataloader_drop_last,
            )
            if trainer.accelerator.is_main_process and logger.isEnabledFor(logging.INFO):
                _log_grouping(sampler, settings.padding_free and bool(settings.prefix_sharing))
            return cls(sampler)
        plan = cls(budget=settings.max_tokens_per_batch)
        if settings.dynamic_context_parallel:  # a rank's share of the budget: its fill is logged per rank
            plan.budget, plan.sampler = None, units.rows_on_ranks(seed)
            if trainer.accelerator.is_main_process and logger.isEnabledFor(logging.INFO):
                _log_rank_shares(plan.sampler, settings)
        elif settings.max_tokens_per_batch is not None:
            plan.sampler = plan.budget_sampler = units.token_budget_sampler(seed)
        if balanced:
            plan._balance(trainer, settings, units, seed)
        plan.pair_weights = PairWeightedSteps(
            trainer.accelerator, plan.shape, plan.reference_forward, rank_shares=settings.dynamic_context_parallel
        )
        return plan

    def loader_parts(self, dataset, collator):
        """The dataset and collator the training dataloader runs `sampler` with: with rows shared out over ranks,
        each index list's marker read as its row's ranks (`ROW_RANKS` in the batch)."""
        if isinstance(self.sampler, RowsOnRanksSampler):
            return RowRanksDataset(dataset), RowRanksCollator(collator)
        return dataset, collator

    def _balance(self, trainer, settings: Settings, units: _Units, seed: int) -> None:
        """Price every pair and balance: the token budget's bins, or micro-batches of `per_device_train_batch_size`."""
        args = trainer.args
        check_balanced_batches_setup(
            trainer.loss_types,
            trainer.aux_loss_enabled,
            settings.max_tokens_per_batch is not None and settings.ranks_per_row > 1,
            hasattr(trainer.train_dataset, "__len__"),
            args.accelerator_config.use_seedable_sampler,
        )
        self.shape = DecoderShape.of_model(trainer.accelerator.unwrap_model(trainer.model))
        self.reference_forward = not args.precompute_ref_log_probs
        self.costs = units.pair_costs(self.shape, self.reference_forward)
        processes, micro_steps = trainer.accelerator.num_processes, args.gradient_accumulation_steps
        if self.sampler is not None:
            self.sampler = BalancedBudgetBins(self.sampler, self.costs, processes=processes, micro_steps=micro_steps)
            return
        self.sampler = BalancedBatchSampler(
            units.priced(self.costs, self.shape, self.reference_forward),
            args.per_device_train_batch_size,
            processes=processes,
            micro_steps=micro_steps,
            seed=seed,
            drop_last=args.dataloader_drop_last,
            ranks_per_row=settings.ranks_per_row,
        )
        if trainer.accelerator.is_main_process and logger.isEnabledFor(logging.INFO):
            _log_expected_gain(self.sampler)


class _Units:
    """What the samplers deal (`PairUnits`), for one trainer: pairs, sized (tokens in the row) or priced (FLOPs),
    and prompt groups, with what sizes or prices a set of one prompt's pairs. Each is measured once, when first asked
    for."""

    def __init__(self, trainer, settings: Settings):
        self.trainer, self.settings = trainer, settings
        self.dataset, self.images = trainer.train_dataset, trainer.is_vision_dataset

    @functools.cached_property
    def group_ids(self) -> list[bytes]:
        """Each pair's prompt group id, read once."""
        return dataset_group_ids(self.dataset, self.images)

    @functools.cached_property
    def _pair_sizes(self):
        # A vision-language set is tokenized only when collated: each pair's row measured once, for sizing and pricing
        what = "max_tokens_per_batch" if self.settings.max_tokens_per_batch is not None else "batch_rebalance"
        verb = "Measuring" if self.settings.max_tokens_per_batch is not None else "Pricing"
        return training_set_pair_sizes(self.trainer, f"{verb} pairs for {what}")

    @functools.cached_property
    def _columns(self) -> list[tuple]:
        return list(
            zip(self.dataset["prompt_ids"], self.dataset["chosen_ids"], self.dataset["rejected_ids"], strict=True)
        )

    def pair_lengths(self) -> list[int]:
        """Each pair's tokens in the row. Text pairs count shared only under prefix_sharing=True ("auto" may lay a
        batch out unshared: sized unshared, the larger, every micro-batch fits either way)."""
        if self.images:
            return lengths_of(self._pair_sizes)
        args = self.trainer.args
        return pair_lengths(self.dataset, args.max_length, args.truncation_mode, self.settings.sized_min_prompt_tokens)

    def pair_costs(self, shape: DecoderShape, reference_forward: bool) -> list[float]:
        """Each pair's cost (FLOPs of its row), laid out as `pair_lengths` sizes it."""
        if self.images:
            return costs_of(self._pair_sizes, shape, reference_forward)
        args, minimum = self.trainer.args, self.settings.sized_min_prompt_tokens
        return pair_costs(self.dataset, shape, args.max_length, args.truncation_mode, minimum, reference_forward)

    def token_budget_sampler(self, seed: int) -> TokenBudgetBatchSampler:
        """Micro-batches of whole pairs, or whole prompt groups (cut into pieces that fit), up to the budget."""
        settings, trainer = self.settings, self.trainer
        return TokenBudgetBatchSampler(
            self._sized(),
            settings.max_tokens_per_batch,
            seed=seed,
            num_processes=trainer.accelerator.num_processes,
            window=settings.token_budget_window,
            pad_to_multiple_of=trainer.data_collator.pad_to_multiple_of,
        )

    def rows_on_ranks(self, seed: int) -> RowsOnRanksSampler:
        """Micro-steps of each context-parallel group packed as rows on 1, 2 ... C of its ranks, no rank holding more
        than max_tokens_per_batch / C tokens; free ranks given out by the cost model of the trainer's model
        (costs/context_parallel.py)."""
        settings, trainer = self.settings, self.trainer
        ranks, budget = settings.context_parallel_size, settings.max_tokens_per_batch
        multiple = row_multiple(trainer.data_collator.pad_to_multiple_of, ranks)
        shape = DecoderShape.of_model(trainer.accelerator.unwrap_model(trainer.model))
        reference_forward = not trainer.args.precompute_ref_log_probs
        recompute = bool(trainer.args.activation_checkpointing)  # the policy's forward again in its backward

        def capacity(share: int) -> int:
            return usable_budget(share * budget // ranks, multiple)

        def row_cost(units: Sequence[UnitWork], share: int) -> float:
            segments = [segment for unit in units for segment in unit.segments]
            tokens = -(-sum(unit.tokens for unit in units) // multiple) * multiple
            scored = sum(unit.scored_tokens for unit in units)
            link = link_of_group(share)  # a block inside a node gathers over NVLink
            return split_row_cost(shape, segments, scored, tokens, share, link, reference_forward, recompute)

        sized = self._sized()
        return RowsOnRanksSampler(
            sized,
            lambda pairs: UnitWork(int(sized.size(pairs)), *self._layout(pairs)),
            pairs=len(self.dataset),
            processes=trainer.accelerator.num_processes,
            ranks=ranks,
            capacity=capacity,
            row_cost=row_cost,
            seed=seed,
            window=settings.token_budget_window,
        )

    def _sized(self) -> PairUnits:
        """The pairs (or prompt groups) sized in row tokens, each checked to fit the budget."""
        settings, trainer, args = self.settings, self.trainer, self.trainer.args
        check_token_budget_setup(
            settings.padding_free, settings.sequence_parallel_size, isinstance(self.dataset, IterableDataset)
        )
        lengths = self.pair_lengths()
        pad_to_multiple_of = trainer.data_collator.pad_to_multiple_of
        _check_pairs_fit(lengths, settings.max_tokens_per_batch, pad_to_multiple_of, args.max_length, self.images)
        if settings.group_by_prompt:
            return PairUnits.by_group_id(self.group_ids, lengths, self._group_tokens(lengths))
        return PairUnits(lengths)

    def _layout(self, pairs: Sequence[int]) -> tuple[tuple, int]:
        """The attention spans and scored tokens of these pairs laid out together (a pair, or a piece of one prompt
        group): shared as the collator shares them, else each sequence whole."""
        args, minimum = self.trainer.args, self.settings.sized_min_prompt_tokens
        no_sharing = 1 << 62  # a prompt no sequence has: every sequence laid out alone
        segments, scored = grouped_row(
            [self._columns[index] for index in pairs],
            args.max_length,
            args.truncation_mode,
            no_sharing if minimum is None else minimum,
        )
        return tuple(segments), scored

    def _group_tokens(self, lengths: Sequence[int]):
        """What sizes a set of one prompt's pairs: its grouped row under prefix_sharing=True on text, else the sum of
        its pairs' rows (unshared; "auto", which may lay a batch out unshared; or a vision-language set's pairs, an
        upper bound of its grouped row)."""
        minimum = self.settings.sized_min_prompt_tokens
        if self.images or minimum is None:
            return lambda pairs: sum(lengths[index] for index in pairs)
        args = self.trainer.args
        tokens = functools.partial(
            grouped_row_tokens,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            min_prompt_tokens=minimum,
        )
        return lambda pairs: tokens([self._columns[index] for index in pairs])

    def priced(self, costs: list[float], shape: DecoderShape, reference_forward: bool) -> PairUnits:
        """The pairs at their `costs`, under prefix sharing in prompt groups priced as one row each, so that a step's
        pairs of one prompt are split as one item; without, pairs alone (grouping saves nothing). A text group is
        priced as its grouped row (under "auto" as the collator groups when sharing pays); a vision-language group as
        the sum of its pairs' costs."""
        minimum = self.settings.grouped_min_prompt_tokens
        if minimum is None:
            return PairUnits(costs)
        if self.images:
            return PairUnits.by_group_id(self.group_ids, costs)
        args = self.trainer.args
        cost = functools.partial(
            grouped_pairs_cost,
            shape,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            min_prompt_tokens=minimum,
            reference_forward=reference_forward,
        )
        return PairUnits.by_group_id(
            self.group_ids, costs, lambda pairs: cost([self._columns[index] for index in pairs])
        )


def _check_pairs_fit(
    lengths: Sequence[int], budget: int, pad_to_multiple_of: int | None, max_length, images: bool = False
) -> None:
    capacity = usable_budget(budget, pad_to_multiple_of)
    too_long = [index for index, length in enumerate(lengths) if length > capacity]
    longest = max(too_long, key=lambda i: lengths[i], default=0)
    longest_pair = (longest, lengths[longest] if lengths else 0)
    check_pairs_fit(len(too_long), longest_pair, budget, capacity, max_length, images)


def _log_grouping(sampler: PromptGroupBatchSampler, computes_prompts_once: bool) -> None:
    logger.info(
        "group_by_prompt: %d pairs of %d prompts in batches of %d; the first epoch's batches cut prompts' pairs %d "
        "time(s), each cut one more computation of a prompt (none when the pairs per prompt divide the batch size).",
        sampler.pairs,
        len(sampler.groups),
        sampler.batch_size,
        extra_prompt_computations(sampler.groups, sampler.epoch_batches(), sampler.batch_size),
    )
    if not computes_prompts_once:
        logger.info(
            "group_by_prompt only orders the batches here: a prompt's pairs are computed once per micro-batch with "
            "padding_free=True and prefix_sharing=True (or 'auto')."
        )


def _log_rank_shares(sampler: RowsOnRanksSampler, settings: Settings) -> None:
    rows = sampler.rows_by_ranks()
    ranks = settings.context_parallel_size
    logger.info(
        "dynamic_context_parallel: %d micro-steps an epoch for each of %d groups of %d ranks, at most %d tokens a rank; "
        "rows split over %s ranks: %s (static context parallelism splits every row over %d).",
        len(sampler.micro_steps) // (sampler.processes // ranks),
        sampler.processes // ranks,
        ranks,
        settings.max_tokens_per_batch // ranks,
        ", ".join(map(str, rows)),
        ", ".join(map(str, rows.values())),
        ranks,
    )


def _log_expected_gain(sampler: BalancedBatchSampler) -> None:
    dealt, balanced = sampler.epoch_imbalance()
    logger.info(
        f"{REBALANCE}: %d optimizer steps per epoch over %d row groups; estimated slowest over mean group cost per "
        "step %.3f dealt as usual, %.3f balanced (expected step-time gain %.2fx if a row's time is its FLOPs; logged "
        "each step as 'padfree/balance_cost_max_over_mean').",
        len(sampler.steps),
        sampler.groups,
        dealt,
        balanced,
        dealt / balanced,
    )
