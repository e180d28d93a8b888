"""Prompt groups with token budgets and balanced ranks: `group_by_prompt` with `max_tokens_per_batch` packs whole
groups (each sized as its grouped row) and trains as padded TRL on the same pairs; `batch_rebalance` under prefix
sharing keeps a step's pairs of one prompt on one process and micro-step; `prefix_sharing="auto"` prices the grouped
row. The samplers alone, then the trainer on one process."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from grouped_pairs import PAIRS_PER_PROMPT, PROMPTS, make_grouped_trainer
from shared_prefix_rows import shares_pay
from trainer_utils import FirstStepGradients, StepResult, assert_same_step

from trl_padfree.costs.flops import DecoderShape, Segment
from trl_padfree.features.pair_weighted_steps import PER_PAIR_METRICS
from trl_padfree.packing.balanced_batches import BalancedBatchSampler
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import HOST_ROW
from trl_padfree.packing.prefix_sharing import SharingCost
from trl_padfree.packing.token_budget import TokenBudgetBatchSampler, grouped_row_tokens
from trl_padfree.packing.units import PairUnits

# ---- the token budget's sampler ----


def random_groups(seed: int, count: int = 60) -> tuple[list[list[int]], list[int], object]:
    """Groups of 1 to 10 pairs (awkward sizes) whose pairs lie anywhere in the dataset, each pair 7 to 300 tokens past
    its 50-token prompt, a group's row sized as a grouped one: the prompt once, then each pair's own tokens."""
    rng = random.Random(seed)
    sizes = [rng.choice([1, 1, 2, 3, 6, 7, 10]) for _ in range(count)]
    lengths = [rng.randint(7, 300) for _ in range(sum(sizes))]
    order = list(range(len(lengths)))
    rng.shuffle(order)  # a group's pairs anywhere in the dataset
    groups, start = [], 0
    for size in sizes:
        groups.append(sorted(order[start : start + size]))
        start += size

    def tokens(pairs):
        return 50 + sum(lengths[index] for index in pairs)

    return groups, lengths, tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("processes", [1, 3, 4])
def test_the_budget_packs_whole_groups_every_pair_once_in_a_multiple_of_the_processes(seed, processes):
    groups, lengths, tokens = random_groups(seed)
    budget = 1000
    sampler = TokenBudgetBatchSampler(
        PairUnits(lengths, groups, tokens), budget, seed=seed, num_processes=processes, window=17
    )
    assert len(sampler) % processes == 0
    group_of = {index: number for number, group in enumerate(groups) for index in group}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        bins = list(sampler)
        assert Counter(index for each in bins for index in each) == Counter(range(len(lengths)))
        for each in bins:
            # each bin's groups laid out one after another fit the budget
            pieces = {}
            for index in each:
                pieces.setdefault(group_of[index], []).append(index)
            assert sum(tokens(piece) for piece in pieces.values()) <= budget
    bins_of = {
        number: {n for n, each in enumerate(sampler.bins) for i in each if group_of[i] == number}
        for number in range(len(groups))
    }
    fitting = [number for number, group in enumerate(groups) if tokens(group) <= budget]
    split = [number for number in fitting if len(bins_of[number]) > 1]
    # a group that fits is whole, but where the bin count must grow and every bin holds one group
    assert len(split) <= (processes - 1), split
    oversized = [number for number, group in enumerate(groups) if tokens(group) > budget]
    assert oversized and all(len(bins_of[number]) >= 2 for number in oversized)


def test_groups_of_one_pair_pack_as_the_pairs_do():
    lengths = [random.Random(4).randint(5, 400) for _ in range(300)]
    for processes in (1, 3):
        plain = TokenBudgetBatchSampler(PairUnits(lengths), 900, seed=5, num_processes=processes, window=50)
        grouped = TokenBudgetBatchSampler(
            PairUnits(lengths, [[i] for i in range(300)]), 900, seed=5, num_processes=processes, window=50
        )
        assert grouped.bins == plain.bins


def test_a_lone_group_is_cut_in_two_for_two_processes():
    sampler = TokenBudgetBatchSampler(PairUnits([10] * 6, [list(range(6))]), 100, seed=0, num_processes=2)
    assert sorted(map(sorted, sampler.bins)) == [[0, 1, 2], [3, 4, 5]]


def test_a_grouped_row_counts_the_prompt_once_and_each_distinct_completion():
    prompt = list(range(1, 11))
    a, b, c, d = [11], [12, 13], [14, 15, 16], [17]
    all_pairs = [(prompt, x, y) for x, y in [(a, b), (a, c), (a, d), (b, c), (b, d), (c, d)]]
    assert grouped_row_tokens(all_pairs, None) == 10 + 7 + 3  # the prompt, 7 completion tokens, 3 branches
    # the pairs alone: 6 x (prompt + both completions + 1)
    assert sum(grouped_row_tokens([pair], None) for pair in all_pairs) == 6 * 11 + 3 * 7


# ---- balanced ranks ----


def test_a_balanced_step_keeps_each_prompts_pairs_on_one_row():
    rng = random.Random(0)
    group_ids = [number for number in range(40) for _ in range(rng.choice([1, 2, 3, 6]))]
    costs = [float(rng.randint(10, 100)) for _ in group_ids]
    sampler = BalancedBatchSampler(PairUnits.by_group_id(group_ids, costs), 6, processes=4, micro_steps=2, seed=3)
    plain = BalancedBatchSampler(PairUnits(costs), 6, processes=4, micro_steps=2, seed=3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        plain.set_epoch(epoch)
        kept = cut = 0
        for bins, batch in zip(sampler.step_bins(), sampler.global_batches(), strict=True):
            rows = [row for step in bins for row in step]
            assert all(rows) and Counter(i for row in rows for i in row) == Counter(batch)
            row_of = {}
            for number, row in enumerate(rows):
                for index in row:
                    row_of.setdefault(group_ids[index], set()).add(number)
            repeated = Counter(group_ids[index] for index in batch)
            kept += sum(len(row_of[group]) == 1 for group, count in repeated.items() if count > 1)
            cut += sum(len(row_of[group]) > 1 for group, count in repeated.items() if count > 1)
        assert kept > 0 and cut == 0
        assert list(sampler.global_batches()) == list(plain.global_batches())  # the same pairs per step


def test_without_repeated_prompts_the_split_is_the_one_pair_by_pair():
    costs = [float(random.Random(1).randint(1, 50)) for _ in range(64)]
    grouped = BalancedBatchSampler(PairUnits.by_group_id(range(64), costs), 2, processes=4, micro_steps=2, seed=0)
    assert list(grouped) == list(BalancedBatchSampler(PairUnits(costs), 2, processes=4, micro_steps=2, seed=0))


# ---- prefix_sharing="auto" prices the grouped row ----


def test_auto_shares_a_k4_group_where_pair_by_pair_sharing_would_not_pay():
    prompt = list(range(1, 7))
    completions = [[20 + k] * (k + 1) for k in range(4)]
    examples = [
        {"prompt_ids": prompt, "chosen_ids": completions[i], "rejected_ids": completions[j]}
        for i in range(4)
        for j in range(i + 1, 4)
    ]
    shape = DecoderShape(
        linear_params=1000, hidden_size=8, vocab_size=32, attention_layers=2, num_attention_heads=2, head_dim=4
    )
    lengths = [(len(prompt) + len(e["chosen_ids"]), len(prompt) + len(e["rejected_ids"])) for e in examples]
    prefixes = [len(prompt) - 1] * len(examples)
    scored = sum(len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples)

    def margin(gather: float, grouped: bool) -> float:  # unshared minus shared cost: > 0 shares
        cost = SharingCost(shape, 8, gather)
        if grouped:
            row = concatenated_inputs(examples, prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)[HOST_ROW]
            segments = [Segment(row.seq_lens[s] - row.prefix_lens[s], prefix=row.prefix_lens[s]) for s in row.laid_out]
            unshared, shared = cost.row_costs(
                [n for pair in lengths for n in pair], segments, scored, row.scored_tokens
            )
        else:
            unshared, shared = cost.step_costs(lengths, prefixes, scored)
        return unshared - shared

    # The gather's price where pair by pair sharing stops paying, and where the grouped row does: pick one between
    per_pair, grouped = (margin(0.0, g) / (margin(0.0, g) - margin(1.0, g)) for g in (False, True))
    assert grouped > per_pair
    gather = (per_pair + grouped) / 2
    cost = SharingCost(shape, 8, gather)
    assert not shares_pay(cost, lengths, prefixes, scored)
    row = concatenated_inputs(examples, prefix_sharing="auto", prefix_sharing_cost=cost)[HOST_ROW]
    assert row.shared_pairs == len(examples)
    assert row.real_row_tokens == len(prompt) + sum(map(len, completions)) + 3


# ---- the trainer, one process ----


def padded_step_on(pairs: list[int]) -> StepResult:
    """TRL's padded loss, gradients and metrics of one batch holding exactly these pairs."""
    trainer = make_grouped_trainer(False, train_sampling_strategy="random", max_steps=1)
    trainer.model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[index] for index in pairs]))
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return StepResult(loss.item(), grads, {key: values[-1] for key, values in trainer._metrics["train"].items()})


def test_group_by_prompt_with_a_token_budget_trains_as_padded_trl_on_the_same_pairs():
    trainer = make_grouped_trainer(
        prefix_sharing=True, max_tokens_per_batch=80, gradient_accumulation_steps=3, max_steps=1, max_grad_norm=0.0,
        logging_steps=1,
    )  # fmt: skip
    sampler = trainer._batches.sampler
    assert sampler is trainer._batches.budget_sampler
    dataset = trainer.train_dataset
    micro_batches = list(sampler)
    assert Counter(i for batch in micro_batches for i in batch) == Counter(range(PROMPTS * PAIRS_PER_PROMPT))
    groups: dict[tuple, list[int]] = {}
    for index, row in enumerate(dataset):
        groups.setdefault(tuple(row["prompt_ids"]), []).append(index)
    spans = []  # (whether the group's grouped row fits the budget, micro-batches holding its pairs)
    for pairs in groups.values():
        rows = [tuple(dataset[index][key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")) for index in pairs]
        fits = grouped_row_tokens(rows, trainer.args.max_length, min_prompt_tokens=8) <= 80
        spans.append((fits, sum(1 for batch in micro_batches if set(pairs) & set(batch))))
    assert {fits for fits, _ in spans} == {True, False}  # whole groups, and one over the budget
    assert all(count == 1 for fits, count in spans if fits) and all(count > 1 for fits, count in spans if not fits)
    assert len({len(batch) for batch in micro_batches}) > 1
    gradients = FirstStepGradients()
    trainer.add_callback(gradients)
    trainer.train()
    sampler.set_epoch(0)
    pairs = [index for batch in list(sampler)[:3] for index in batch]
    padded = padded_step_on(pairs)
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    # TRL's per-pair metrics are weighed by pairs (PairWeightedSteps); per-token ones (entropy) are means of the
    # micro-batches' means under any token budget, as tests/integration/token_budget/test_token_budget.py checks them
    per_pair = {key: padded.metrics[key] for key in PER_PAIR_METRICS}
    packed = StepResult(logged["loss"], gradients.grads, {key: logged[key] for key in PER_PAIR_METRICS})
    assert_same_step(StepResult(padded.loss, padded.grads, per_pair), packed)


def test_a_balanced_step_with_repeated_prompts_trains_as_padded_trl_on_its_pairs():
    """batch_rebalance with prefix sharing on prompt-group data (6 prompts' 36 pairs: a step's 6 pairs repeat
    prompts): each repeated prompt's pairs share one micro-batch, and the step equals padded TRL on its 6 pairs."""
    trainer = make_grouped_trainer(
        prefix_sharing=True, train_sampling_strategy="batch_rebalance", per_device_train_batch_size=2,
        gradient_accumulation_steps=3, max_steps=1, max_grad_norm=0.0, logging_steps=1,
    )  # fmt: skip
    sampler = trainer._batches.sampler
    assert isinstance(sampler, BalancedBatchSampler)
    prompts = [tuple(row["prompt_ids"]) for row in trainer.train_dataset]
    micro_batches = list(sampler)[:3]
    step = [index for batch in micro_batches for index in batch]
    repeated = [prompt for prompt, count in Counter(prompts[index] for index in step).items() if count > 1]
    assert repeated  # the step repeats a prompt, and keeps its pairs together
    for prompt in repeated:
        assert sum(1 for batch in micro_batches if any(prompts[index] == prompt for index in batch)) == 1
    gradients = FirstStepGradients()
    trainer.add_callback(gradients)
    trainer.train()
    padded = padded_step_on(step)
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    per_pair = {key: padded.metrics[key] for key in PER_PAIR_METRICS}
    packed = StepResult(logged["loss"], gradients.grads, {key: logged[key] for key in PER_PAIR_METRICS})
    assert_same_step(StepResult(padded.loss, padded.grads, per_pair), packed)
