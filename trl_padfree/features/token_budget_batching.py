"""`TokenBudgetBatching`: the trainer's feature for `max_tokens_per_batch`, micro-batches filled with whole pairs up to
a budget of tokens (the sampler and how it packs them: packing/token_budget.py). With
`train_sampling_strategy="group_by_prompt"` it packs whole prompt groups, each sized as its grouped row."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch.utils.data import IterableDataset

from ..packing.pair_sizes import lengths_of, training_set_pair_sizes
from ..packing.prefix_sharing import AUTO
from ..packing.token_budget import TokenBudgetBatchSampler, grouped_row_tokens, pair_lengths, usable_budget
from ..refusals import check_pairs_fit, check_token_budget_setup
from .prompt_group_batches import prompt_group_ids, vision_prompt_group_ids, wants_prompt_groups


class TokenBudgetBatching:
    """What the trainer sets up for `max_tokens_per_batch`: the pairs' row lengths, the refusals and the sampler
    (`set_up`). Its micro-batches hold different numbers of pairs: the trainer weighs their losses and metrics with
    `PairWeightedSteps` (features/pair_weighted_steps.py)."""

    def __init__(self, sampler: TokenBudgetBatchSampler, pair_sizes=None):
        self.sampler = sampler
        self.pair_sizes = pair_sizes  # a vision-language set's `packing.pair_sizes`, which balancing prices too

    @classmethod
    def set_up(cls, trainer) -> TokenBudgetBatching | None:
        """From `trainer`'s config and tokenized training set; None without `max_tokens_per_batch`."""
        args, collator = trainer.args, trainer.data_collator
        budget = getattr(args, "max_tokens_per_batch", None)
        if budget is None or trainer.train_dataset is None:
            return None
        check_token_budget_setup(
            trainer.padding_free_enabled,
            trainer.sequence_parallel_size,
            isinstance(trainer.train_dataset, IterableDataset),
        )
        sizes = None
        if trainer.is_vision_dataset:  # tokenized only when collated: each pair's row measured once per dataset
            sizes = training_set_pair_sizes(trainer, "Measuring pairs for max_tokens_per_batch")
            lengths = lengths_of(sizes)
        else:
            # "auto" lays a text batch out unshared when sharing would not pay: size pairs unshared, the larger row,
            # so every micro-batch fits the budget either way (vision batches always share under "auto")
            shares = collator.prefix_sharing and collator.prefix_sharing != AUTO
            lengths = pair_lengths(
                trainer.train_dataset,
                args.max_length,
                args.truncation_mode,
                collator.prefix_sharing_min_prompt_tokens if shares else None,
            )
        _check_pairs_fit(lengths, budget, collator.pad_to_multiple_of, args.max_length, trainer.is_vision_dataset)
        groups = group_tokens = None
        if wants_prompt_groups(args):
            groups, group_tokens = _prompt_groups(trainer, lengths)
        sampler = TokenBudgetBatchSampler(
            lengths,
            budget,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_processes=trainer.accelerator.num_processes,
            window=args.token_budget_window,
            pad_to_multiple_of=collator.pad_to_multiple_of,
            groups=groups,
            group_tokens=group_tokens,
        )
        return cls(sampler, sizes)


def _prompt_groups(trainer, lengths: Sequence[int]):
    """`group_by_prompt`'s groups (each a prompt's pair indices) and what sizes a set of one prompt's pairs: their
    grouped row under prefix sharing (`True`) on text, otherwise the sum of their pairs' rows (unshared, or
    `"auto"`, which may lay a batch out unshared, or a vision-language set's pairs: an upper bound of its grouped
    row)."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    vision = trainer.is_vision_dataset
    ids = vision_prompt_group_ids(dataset) if vision else prompt_group_ids(dataset)
    groups: dict[bytes, list[int]] = {}
    for index, group_id in enumerate(ids):
        groups.setdefault(group_id, []).append(index)
    if vision or not (collator.prefix_sharing and collator.prefix_sharing != AUTO):
        return list(groups.values()), lambda pairs: sum(lengths[index] for index in pairs)
    columns = list(zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True))
    args = trainer.args
    tokens = functools.partial(
        grouped_row_tokens,
        max_length=args.max_length,
        truncation_mode=args.truncation_mode,
        min_prompt_tokens=collator.prefix_sharing_min_prompt_tokens,
    )
    return list(groups.values()), lambda pairs: tokens([columns[index] for index in pairs])


def _check_pairs_fit(
    lengths: Sequence[int], budget: int, pad_to_multiple_of: int | None, max_length, images: bool = False
) -> None:
    capacity = usable_budget(budget, pad_to_multiple_of)
    too_long = [index for index, length in enumerate(lengths) if length > capacity]
    longest = max(too_long, key=lambda i: lengths[i], default=0)
    longest_pair = (longest, lengths[longest] if lengths else 0)
    check_pairs_fit(len(too_long), longest_pair, budget, capacity, max_length, images)
