"""Refusals of token-budget batching (`max_tokens_per_batch`), balanced batches (`batch_rebalance`) and prompt groups
(`group_by_prompt`), and of pair sizes counted from image sizes."""

from __future__ import annotations

from collections.abc import Sequence

# ---- token-budget batching ----


def check_token_budget_setup(padding_free: bool, sp_size: int, streamed: bool) -> None:
    if not padding_free:
        raise ValueError(
            "max_tokens_per_batch needs padding_free=True: a padded micro-batch costs pairs x longest sequence, "
            "not its tokens. Set padding_free=True."
        )
    if sp_size > 1:
        raise ValueError(
            "max_tokens_per_batch does not work with sequence parallelism yet. Unset one of them; with sequence "
            "parallelism, size rows with per_device_train_batch_size and max_length."
        )
    if streamed:
        raise ValueError("max_tokens_per_batch needs a training dataset with a length, not an IterableDataset.")


# TRL's loss types whose value for a pair depends on the other pairs of its micro-batch: balancing changes which pairs
# share a micro-batch, so these would train on other numbers than padded TRL's
COUPLED_LOSS_TYPES = {
    "aot": "sorts the micro-batch's log-ratios and pairs them by rank",
    "aot_unpaired": "sorts the micro-batch's chosen and rejected log-ratios and pairs them by rank",
    "sft": "is the mean over all of the micro-batch's chosen tokens, weighing a pair by its tokens",
}


def check_balanced_batches_setup(
    loss_types: Sequence[str], aux_loss: bool, budget_with_split_rows: bool, sized: bool, seedable: bool = True
) -> None:
    """`train_sampling_strategy="batch_rebalance"` under padding-free: what balancing cannot keep exact."""
    coupled = [loss_type for loss_type in loss_types if loss_type in COUPLED_LOSS_TYPES]
    if coupled:
        reasons = "; ".join(f"'{name}' {COUPLED_LOSS_TYPES[name]}" for name in coupled)
        raise ValueError(
            f"train_sampling_strategy='batch_rebalance' with padding_free=True cannot keep loss_type {coupled} equal "
            f"to padded TRL: {reasons}, and balancing changes which pairs share a micro-batch. Use "
            "train_sampling_strategy='random' (the default) with this loss, or a loss computed per pair."
        )
    if aux_loss:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' with padding_free=True cannot keep the router's auxiliary loss "
            "equal to padded TRL: it is a statistic of each micro-batch's tokens, and balancing changes which pairs "
            "share a micro-batch. Set output_router_logits=False in the model config, or use "
            "train_sampling_strategy='random'."
        )
    if budget_with_split_rows:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' does not deal max_tokens_per_batch's micro-batches to row "
            "groups (sequence or context parallelism) yet. Use one of them: batch_rebalance with "
            "per_device_train_batch_size, or max_tokens_per_batch with train_sampling_strategy='random'."
        )
    if not sized:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' needs a training dataset with a length, not an "
            "IterableDataset: each step's pairs are partitioned from their lengths."
        )
    if not seedable:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' trains each step on the pairs accelerate's seedable sampler "
            "would give it (seed + epoch); with accelerator_config.use_seedable_sampler=False the default order is "
            "another one. Leave use_seedable_sampler at its default (True)."
        )


def check_balanced_batches_split(pairs: int, pairs_per_round: int, any_step: bool) -> None:
    if not any_step:
        raise ValueError(
            f"train_sampling_strategy='batch_rebalance' with dataloader_drop_last=True: a training set of {pairs} "
            f"pairs holds no whole round of {pairs_per_round} pairs (per_device_train_batch_size on every process), "
            "so every pair would be dropped. Set dataloader_drop_last=False, or use more pairs."
        )


def check_prompt_groups_setup(sized: bool) -> None:
    """`train_sampling_strategy="group_by_prompt"`: what grouping needs of the training set."""
    if not sized:
        raise ValueError(
            "train_sampling_strategy='group_by_prompt' needs a training dataset with a length, not an "
            "IterableDataset: each epoch's batches are made from every pair's prompt."
        )


def check_tokenized_pairs(missing: Sequence[str]) -> None:
    if missing:
        raise ValueError(
            f"Token-budget batching needs the tokenized pairs, but the training dataset has no {sorted(missing)} "
            "column(s). Pass a prompt/chosen/rejected dataset and let DPOTrainer tokenize it."
        )


def check_pairs_fit(
    too_long: int, longest: tuple[int, int], budget: int, capacity: int, max_length, images: bool = False
) -> None:
    """`too_long` pairs exceed the row's `capacity`; `longest` is (pair index, its row tokens)."""
    if too_long:
        index, tokens = longest
        # A shorter max_length would cut images, which is refused: on image data, only the budget or the data can give
        shorter = (
            "drop the longest pairs or shrink their images (their image tokens count)"
            if images
            else f"set max_length to at most {capacity // 2} so that TRL truncates every sequence to fit"
        )
        raise ValueError(
            f"{too_long} pair(s) of the training set do not fit max_tokens_per_batch={budget} (the longest, pair "
            f"{index}, has {tokens} tokens in the packed row: prompt + chosen and prompt + rejected, cut to "
            f"max_length={max_length}). Raise max_tokens_per_batch, or {shorter}."
        )


def check_budget_bins_share(bins: int, processes: int, splittable: bool) -> None:
    if not splittable:
        raise ValueError(
            f"Token-budget batching made {bins} micro-batches of one pair each, which cannot be shared evenly by "
            f"{processes} processes. Raise max_tokens_per_batch so that pairs share micro-batches."
        )


def check_training_set_not_empty(pairs: int) -> None:
    if not pairs:
        raise ValueError("Token-budget batching got an empty training set.")


def check_counted_pair_sizes(processor: str, pair: int, counted: list[int], collated: list[int]) -> None:
    """A pair counted from its image sizes (packing/pair_sizes.py) must lay out as collating it does: checked on the
    first pair of each process's share."""
    if counted != collated:
        raise ValueError(
            f"Pair {pair}'s row counted from its image sizes (chosen tokens, rejected tokens, shared prefix, scored "
            f"tokens: {counted}) differs from the row {processor} collates ({collated}): trl-padfree's image token "
            "count does not hold for this processor, and batches would be built on wrong lengths. Please report it "
            "with the processor's name; until then pass a processor subclass of your own (any class not derived from "
            "the Qwen-VL or LLaVA processors is priced by collating each pair)."
        )
