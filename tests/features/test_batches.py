"""The batch plan (features/batches.py): its table of which strategy and budget give which sampler and weighting, and
the trainer's set-ups after TRL's `__init__`, which give the same trainer in any order."""

import itertools

import pytest
from trainer_utils import make_trainer

from trl_padfree import DPOTrainer
from trl_padfree.packing.balanced_batches import BalancedBatchSampler, BalancedBudgetBins
from trl_padfree.packing.prompt_groups import PromptGroupBatchSampler
from trl_padfree.packing.token_budget import TokenBudgetBatchSampler

BUDGET = 256

# (train_sampling_strategy, max_tokens_per_batch) -> (sampler type, pair weights, priced): the module's table
TABLE = {
    ("random", None): (type(None), False, False),
    ("random", BUDGET): (TokenBudgetBatchSampler, True, False),
    ("group_by_prompt", None): (PromptGroupBatchSampler, False, False),
    ("group_by_prompt", BUDGET): (TokenBudgetBatchSampler, True, False),
    ("batch_rebalance", None): (BalancedBatchSampler, True, True),
    ("batch_rebalance", BUDGET): (BalancedBudgetBins, True, True),
}


@pytest.mark.parametrize(("strategy", "budget"), list(TABLE))
def test_each_strategy_and_budget_give_the_tables_sampler(strategy, budget):
    trainer = make_trainer(True, train_sampling_strategy=strategy, max_tokens_per_batch=budget, batch_size=2)
    sampler_type, weighted, priced = TABLE[strategy, budget]

    plan = trainer._batches
    assert type(plan.sampler) is sampler_type
    assert (plan.pair_weights is not None, plan.shape is not None) == (weighted, priced)
    assert plan.budget == budget and (plan.budget_sampler is not None) == (budget is not None)
    if priced:
        assert plan.pair_weights.shape is plan.shape and len(plan.costs) == len(trainer.train_dataset)


def test_batch_rebalance_on_padded_batches_is_left_to_transformers():
    trainer = make_trainer(False, train_sampling_strategy="batch_rebalance", batch_size=2)
    assert trainer._batches.sampler is None and trainer._batches.pair_weights is None


@pytest.mark.parametrize("order", list(itertools.permutations(DPOTrainer.SET_UPS_AFTER_INIT)))
def test_the_set_ups_after_init_give_the_same_trainer_in_any_order(order, monkeypatch):
    monkeypatch.setattr(DPOTrainer, "SET_UPS_AFTER_INIT", order)
    options = dict(train_sampling_strategy="group_by_prompt", max_tokens_per_batch=BUDGET, pad_to_multiple_of=8)
    trainer = make_trainer(True, batch_size=2, **options)
    expected = make_trainer(True, batch_size=2, **options)  # the default order

    sampler, reference = trainer._batches.sampler, expected._batches.sampler
    assert list(sampler) == list(reference) and sampler.lengths == reference.lengths
    assert trainer.data_collator == expected.data_collator and trainer._row_split is expected._row_split is None
