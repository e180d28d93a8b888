"""Balanced batches (`train_sampling_strategy="batch_rebalance"` with `padding_free=True`): the sampler deals the
default sampler's global batches split by cost, and training on them equals padded TRL on the same global batches,
in one process and in 2 and 4 processes under DDP, ZeRO-3 and FSDP2 with gradient accumulation.

The multi-process runs are compared with TRL's padded trainer in one process whose micro-batch is the whole global
batch (`row groups x accumulation x per_device_train_batch_size` pairs): the same pairs per optimizer step, in one
micro-batch, so every logged metric is the step's. Measured over DDP, ZeRO-3 and FSDP2 on 2 and 4 processes and 2
row groups of 2 ranks (context parallelism, Ulysses): losses within 1.9e-6 of the padded run, grad_norm 6.8e-6
relative, the per-pair metrics 1.2e-5 relative; the bounds are tolerances.DISTRIBUTED_* (loss 1e-5, metrics 5e-5
relative). TRL's token means (entropy, logits/*, mean_token_accuracy) average each micro-step's token mean equally, so
with several micro-steps they depend on how a step is grouped, in TRL too: they are compared with one micro-step
only."""

import math

import pytest
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
from distributed_runs import assert_same_training, launch, train_in_this_process
from tolerances import (
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_METRIC_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    FIRST_LOSS_ATOL,
    LOSS_ATOL,
    RESUMED_LOSS_ATOL,
)
from torch.utils.data import BatchSampler
from trainer_utils import make_trainer

from trl_padfree.cli.balance import load_decoder_shape, pool_costs
from trl_padfree.cli.bench.harness import shipped_lengths
from trl_padfree.costs.flops import DecoderShape
from trl_padfree.packing.balance import pair_cost, row_cost
from trl_padfree.packing.balanced_batches import (
    BalancedBatchSampler,
    BalancedBudgetBins,
    epoch_order,
    epoch_steps,
    pair_costs,
)
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.token_budget import TokenBudgetBatchSampler
from trl_padfree.packing.units import PairUnits
from trl_padfree.refusals.token_budget import check_balanced_batches_setup

SHAPE = DecoderShape(
    linear_params=1000, hidden_size=8, vocab_size=50, attention_layers=2, num_attention_heads=2, head_dim=4
)
# The shipped pairs priced for an 8B model, as `trl-padfree balance` prices them
SHIPPED_COSTS = pool_costs([(p, min(c, 1024 - p), min(r, 1024 - p)) for p, c, r in shipped_lengths() if p < 1024],
                           load_decoder_shape("llama3.1-8b")).tolist()  # fmt: skip

# ---------------------------------------------------------------------------------------------------------------------
# The sampler


def test_the_epoch_order_is_the_default_samplers():
    """transformers' RandomSampler, which accelerate turns into its SeedableRandomSampler seeded with the seed."""
    default = SeedableRandomSampler(range(50), data_seed=7)
    for epoch in (0, 3):
        default.set_epoch(epoch)
        assert list(default) == epoch_order(50, seed=7, epoch=epoch)


def test_steps_are_grouped_as_accelerate_deals_and_trainer_accumulates():
    # 2 ranks x 3 pairs a round, 2 micro-steps a step: 30 pairs are 5 rounds, steps of 2, 2 and 1 micro-steps; 31
    # pairs a 6th round (filled up with the epoch's first pairs), which drop_last drops
    assert epoch_steps(30, 3, 2, 2) == [2, 2, 1]
    assert epoch_steps(31, 3, 2, 2) == [2, 2, 2]
    assert epoch_steps(31, 3, 2, 2, drop_last=True) == [2, 2, 1]
    assert epoch_steps(5, 3, 2, 2, drop_last=True) == []
    # Rows split over 2 ranks: a group runs its 2 ranks' batches per round; 3 rounds = 6 micro-steps of each group
    assert epoch_steps(40, 2, 8, 4, ranks_per_row=2) == [4, 2]
    assert epoch_steps(40, 2, 8, 1, ranks_per_row=2) == [1] * 6


def accelerate_rank_batches(pairs: int, batch_size: int, ranks: int, seed: int, epoch: int, drop_last: bool):
    """Each rank's batches of an epoch as accelerate deals the default sampler's: its seeded sampler, batched, and
    (several processes) sharded round-robin with the last round filled up."""
    batches = []
    for rank in range(ranks):
        sampler = SeedableRandomSampler(range(pairs), data_seed=seed)
        sampler.set_epoch(epoch)
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        batches.append(list(batch_sampler if ranks == 1 else BatchSamplerShard(batch_sampler, ranks, rank)))
    return batches


@pytest.mark.parametrize(
    "ranks, ranks_per_row, micro_steps, batch_size, pairs, drop_last",
    [
        (2, 1, 1, 4, 40, False),
        (4, 1, 2, 2, 45, False),  # the last round filled up with the epoch's first pairs
        (4, 1, 2, 2, 45, True),
        (8, 1, 3, 1, 101, False),
        (1, 1, 3, 2, 25, False),  # one process: the last batch short, no refill
        (4, 2, 2, 2, 47, False),
        (8, 4, 1, 2, 61, False),
        (4, 2, 3, 2, 50, False),
        (8, 2, 16, 1, 70, False),  # the Ulysses recipe's shape
    ],
)
def test_every_step_trains_the_pairs_accelerate_and_trainer_give_it(
    ranks, ranks_per_row, micro_steps, batch_size, pairs, drop_last
):
    """Against accelerate's own sampler and shard: each optimizer step trains the pairs (repeats included) of the
    batches Trainer runs in it, where a row group runs its ranks' batches one after the other; every row at every
    micro-step has a pair, and each group's micro-batches land where accelerate deals its ranks' batches."""
    costs = SHIPPED_COSTS[:pairs]
    groups = ranks // ranks_per_row
    sampler = BalancedBatchSampler(
        PairUnits(costs), batch_size, processes=ranks, micro_steps=micro_steps, seed=3, drop_last=drop_last,
        ranks_per_row=ranks_per_row,
    )  # fmt: skip
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        default = accelerate_rank_batches(pairs, batch_size, ranks, 3, epoch, drop_last)
        balanced = [[] for _ in range(ranks)]  # what accelerate's round-robin deal gives each rank of ours
        for number, row in enumerate(sampler):
            balanced[number % ranks].append(row)
        assert [len(batches) for batches in balanced] == [len(batches) for batches in default]

        def runs(per_rank):  # each group's micro-batches in the order it runs them (the row split's wrapper)
            return [[per_rank[g * ranks_per_row + k % ranks_per_row][k // ranks_per_row]
                     for k in range(len(per_rank[0]) * ranks_per_row)] for g in range(groups)]  # fmt: skip

        ours, theirs, first = runs(balanced), runs(default), 0
        for micro, bins in zip(sampler.steps, sampler.step_bins(), strict=True):
            steps = range(first, first + micro)
            assert [[ours[g][k] for g in range(groups)] for k in steps] == bins
            assert all(row for k in steps for g in range(groups) for row in [ours[g][k]])
            step_pairs = sorted(i for g in range(groups) for k in steps for i in theirs[g][k])
            assert sorted(i for step in bins for row in step for i in row) == step_pairs
            first += micro
        assert first == len(ours[0])


def test_balanced_rows_cost_less_than_the_dealt_ones_on_the_shipped_pairs():
    for processes, batch_size in ((4, 2), (8, 4)):
        sampler = BalancedBatchSampler(
            PairUnits(SHIPPED_COSTS), batch_size, processes=processes, micro_steps=2, seed=0
        )
        dealt, balanced = sampler.epoch_imbalance()
        # 4 x 2 pairs: 1.55 dealt, 1.19 balanced (the largest pairs bound it); 8 x 4 pairs: see the message
        assert balanced < 0.85 * dealt, (processes, dealt, balanced)


def test_the_sampler_is_deterministic_and_refuses_to_drop_every_pair():
    first, again = (
        BalancedBatchSampler(PairUnits(SHIPPED_COSTS[:64]), 2, processes=4, micro_steps=2, seed=5) for _ in range(2)
    )
    assert list(first) == list(again)
    # Fewer pairs than rows: accelerate repeats them, and so does the balanced sampler
    assert sorted(map(len, BalancedBatchSampler(PairUnits([1.0] * 3), 1, processes=4, micro_steps=1, seed=0))) == [
        1,
        1,
        1,
        1,
    ]
    with pytest.raises(ValueError, match="holds no whole round of 6 pairs"):
        BalancedBatchSampler(PairUnits([1.0] * 5), 3, processes=2, micro_steps=1, seed=0, drop_last=True)


def test_budget_bins_are_dealt_so_each_micro_step_gets_bins_of_neighbouring_cost():
    lengths = [p + c + r for p, c, r in shipped_lengths()][:200]
    budget = TokenBudgetBatchSampler(PairUnits(lengths), 4096, seed=0, num_processes=2)
    costs = SHIPPED_COSTS[:200]
    dealt = BalancedBudgetBins(budget, costs, processes=2, micro_steps=2)
    assert sorted(map(sorted, dealt)) == sorted(map(sorted, budget))  # the same bins
    rows = list(dealt)
    for start in range(0, len(rows) - 3, 4):
        row_costs = [sum(costs[i] for i in row) for row in rows[start : start + 4]]
        assert row_costs == sorted(row_costs, reverse=True)


# ---------------------------------------------------------------------------------------------------------------------
# Costs


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_a_collated_row_costs_its_pairs_as_priced_from_the_dataset(prefix_sharing):
    """`row_cost` (the logged cost, from the collated row's host integers) and `pair_costs` (the partition's, from the
    tokenized dataset with the collator's truncation and sharing) agree pair by pair."""
    trainer = make_trainer(True, num_pairs=8, max_length=48, prefix_sharing=prefix_sharing)
    dataset = trainer.train_dataset
    minimum = trainer.data_collator.prefix_sharing_min_prompt_tokens if prefix_sharing else None
    costs = pair_costs(dataset, SHAPE, 48, "keep_start", minimum, reference_forward=True)
    for index in range(len(dataset)):
        row = concatenated_inputs(
            [dataset[index]],
            max_length=48,
            prefix_sharing=prefix_sharing,
            prefix_sharing_min_prompt_tokens=minimum or 2,
        )["host_row"]
        assert row_cost(SHAPE, row) == pytest.approx(costs[index], rel=1e-12)
    both = concatenated_inputs([dataset[0], dataset[1]], max_length=48, prefix_sharing=prefix_sharing)["host_row"]
    assert row_cost(SHAPE, both) == pytest.approx(costs[0] + costs[1], rel=1e-12)  # costs add up
    assert row_cost(SHAPE, both, reference_forward=False) == pytest.approx(0.75 * (costs[0] + costs[1]), rel=1e-12)


def test_pair_cost_and_row_cost_agree_on_a_hand_built_row():
    row = concatenated_inputs([{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]}])["host_row"]
    assert row.scored_tokens == 3
    assert row_cost(SHAPE, row) == pair_cost(SHAPE, 5, 4, scored_tokens=3)


# ---------------------------------------------------------------------------------------------------------------------
# The trainer, one process


def test_one_process_trains_the_default_global_batch_as_padded_trl_does():
    """Balanced with 3 micro-steps of about 2 pairs against TRL's padded trainer with one batch of 6: the same pairs
    (the default sampler's first 6), the same loss and gradient norm."""
    options = dict(num_pairs=12, max_steps=2, logging_steps=1, learning_rate=1e-3, lr_scheduler_type="constant")
    balanced = make_trainer(
        True, batch_size=2, gradient_accumulation_steps=3, train_sampling_strategy="batch_rebalance", **options
    )
    balanced.train()
    padded = make_trainer(False, batch_size=6, **options)
    padded.train()
    logged = [entry for entry in balanced.state.log_history if "loss" in entry]
    expected = [entry for entry in padded.state.log_history if "loss" in entry]
    for ours, theirs in zip(logged, expected, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=LOSS_ATOL)
        for key in ("grad_norm", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
        assert ours["padfree/balance_cost_max_over_mean"] == 1.0  # one process: nothing to wait for


def test_token_budget_bins_are_dealt_balanced_and_a_step_trains_as_padded_trl_on_its_pairs():
    options = dict(num_pairs=16, max_steps=1, max_grad_norm=0.0, logging_steps=1, gradient_accumulation_steps=2)
    trainer = make_trainer(True, max_tokens_per_batch=160, train_sampling_strategy="batch_rebalance", **options)
    assert isinstance(trainer._batches.sampler, BalancedBudgetBins)
    trainer.train()
    sampler = trainer._batches.sampler
    sampler.set_epoch(0)
    pairs = [index for batch in list(sampler)[:2] for index in batch]
    padded = make_trainer(False, num_pairs=16, batch_size=len(pairs))
    padded.model.train()
    batch = padded._prepare_inputs(padded.data_collator([padded.train_dataset[index] for index in pairs]))
    with padded.compute_loss_context_manager():
        loss = padded.compute_loss(padded.model, batch).item()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert logged["loss"] == pytest.approx(loss, abs=LOSS_ATOL)


def test_precomputed_reference_log_probs_price_rows_without_the_reference_forward():
    trainer = make_trainer(
        True, num_pairs=8, batch_size=2, precompute_ref_log_probs=True, train_sampling_strategy="batch_rebalance"
    )
    shape, reference_forward = trainer._batches.shape, trainer._batches.reference_forward
    assert reference_forward is False and trainer._batches.pair_weights.reference_forward is False
    full = pair_costs(trainer.train_dataset, shape, trainer.args.max_length, "keep_start", None, True)
    assert trainer._batches.costs == pytest.approx([0.75 * cost for cost in full], rel=1e-12)  # 3 forwards of 4


def test_resume_continues_with_the_same_balanced_batches(tmp_path):
    options = dict(num_pairs=12, batch_size=2, gradient_accumulation_steps=2, max_steps=4, num_train_epochs=2)
    options.update(learning_rate=0.5, optim="sgd", logging_steps=1, train_sampling_strategy="batch_rebalance")
    options.update(save_strategy="steps", save_steps=2, output_dir=str(tmp_path))
    uninterrupted = make_trainer(True, **options)
    uninterrupted.train()
    resumed = make_trainer(True, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    losses = [
        [entry["loss"] for entry in run.state.log_history if "loss" in entry] for run in (uninterrupted, resumed)
    ]
    assert losses[1][-2:] == pytest.approx(losses[0][-2:], abs=RESUMED_LOSS_ATOL)  # step 4 is the second epoch's first


def test_vision_language_pairs_are_priced_as_collated_with_their_images():
    from tiny_vision import make_vision_trainer, vision_preference_rows

    trainer = make_vision_trainer(
        "qwen2_5_vl", True, vision_preference_rows("qwen2_5_vl", 6), train_sampling_strategy="batch_rebalance",
        per_device_train_batch_size=2, max_steps=1,
    )  # fmt: skip
    shape = trainer._batches.shape
    rows = [trainer.data_collator([example])["host_row"] for example in trainer.train_dataset]
    assert trainer._batches.costs == [row_cost(shape, row) for row in rows]
    assert len(set(trainer._batches.costs)) > 1
    trainer.train()  # the image pairs train balanced
    assert trainer.state.log_history[0]["padfree/balance_cost_max_over_mean"] == 1.0


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(loss_type=["aot"]), r"loss_type \['aot'\].*sorts the micro-batch's log-ratios"),
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]), r"'sft' is the mean over all"),
    ],
)
def test_loss_types_that_couple_a_micro_batchs_pairs_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        make_trainer(True, num_pairs=8, train_sampling_strategy="batch_rebalance", **options)


def test_other_couplings_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match="router's auxiliary loss.*output_router_logits=False"):
        check_balanced_batches_setup(["sigmoid"], aux_loss=True, budget_with_split_rows=False, sized=True)
    with pytest.raises(ValueError, match="max_tokens_per_batch's micro-batches to row groups"):
        check_balanced_batches_setup(["sigmoid"], aux_loss=False, budget_with_split_rows=True, sized=True)
    with pytest.raises(ValueError, match="not an IterableDataset"):
        check_balanced_batches_setup(["sigmoid"], aux_loss=False, budget_with_split_rows=False, sized=False)
    with pytest.raises(ValueError, match="Leave use_seedable_sampler at its default"):
        check_balanced_batches_setup(["sigmoid"], False, False, sized=True, seedable=False)
    check_balanced_batches_setup(["sigmoid", "ipo", "bco_pair", "sigmoid_norm"], False, False, True)  # per pair


def test_padded_mode_keeps_transformers_own_rebalancing():
    trainer = make_trainer(False, num_pairs=8, train_sampling_strategy="batch_rebalance")
    assert trainer._batches.shape is None and trainer._batches.pair_weights is None


# ---------------------------------------------------------------------------------------------------------------------
# Several processes

PAIRS_PER_PROCESS, ACCUMULATION = 2, 2
# Long enough that the shipped pairs differ in cost (at 192 most sequences are cut to the same length)
MAX_LENGTH = "1024"
PER_PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


# A function, not distributed_runs.single_process_padded_fixture: each test has its own world size and steps
def single_process_padded(model_dir, tmp_path, processes: int, steps: int) -> dict:
    """TRL's padded trainer in one process, each micro-batch a whole global batch of the balanced run."""
    global_batch = processes * ACCUMULATION * PAIRS_PER_PROCESS
    options = ("--runs", "trl", "--batch-size", str(global_batch), "--steps", str(steps), "--max-length", MAX_LENGTH)
    return train_in_this_process(model_dir, tmp_path / f"padded{processes}.json", *options)["trl"]


def assert_balanced_training_equals(report: dict, padded: dict, processes: int, uneven: bool = True) -> None:
    """`uneven`: some micro-step's rows hold different numbers of pairs (the runs that price pairs otherwise, on
    the same pairs, may find equal counts best)."""
    assert report["world_size"] == processes
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert report["losses"] == pytest.approx(padded["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    for step, (metrics, expected) in enumerate(zip(report["metrics"], padded["metrics"], strict=True)):
        for key in ("grad_norm", "num_tokens", *PER_PAIR_METRICS):
            assert metrics[key] == pytest.approx(
                expected[key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
            ), (step, key)
    # The engine balanced: rows other than the dealt ones, of different pair counts, no costlier at any step
    balanced = report["balanced"]
    assert balanced["bins"] != balanced["dealt_bins"]
    assert not uneven or any(len({len(row) for row in step}) > 1 for bins in balanced["bins"] for step in bins)
    logged = [metrics["padfree/balance_cost_max_over_mean"] for metrics in report["metrics"]]
    assert logged == pytest.approx(balanced["imbalance"][: len(logged)], rel=1e-9)
    assert all(
        ours <= dealt + 1e-12 for ours, dealt in zip(balanced["imbalance"], balanced["dealt_imbalance"], strict=True)
    )


@pytest.mark.parametrize(
    "config, processes",
    # One launch in the default suite (its time): ZeRO-3, with prefix sharing beside; plain data parallelism (and the
    # precomputed reference's pricing, also checked in one process), 4 processes (on 2 cores) and FSDP2 with -m slow
    [
        pytest.param("multi_gpu.yaml", 2, marks=pytest.mark.slow),
        pytest.param("multi_gpu.yaml", 4, marks=pytest.mark.slow),
        ("zero3.yaml", 2),
        pytest.param("fsdp2.yaml", 2, marks=pytest.mark.slow),
    ],
)
def test_balanced_batches_train_as_padded_trl_on_the_same_global_batches(config, processes, model_dir, tmp_path):
    steps = 2  # with 4 processes x 2 x 2 pairs, the 32 pairs of the data
    options = ("--batch-size", str(PAIRS_PER_PROCESS), "--grad-accum", str(ACCUMULATION), "--steps", str(steps))
    runs = ["padding_free+balanced"] if config == "multi_gpu.yaml" else ["padding_free+ref_offload+balanced"]
    if (config, processes) == ("multi_gpu.yaml", 2):  # the options balancing prices differently, in the same launch
        runs += ["padding_free+balanced+prefix_sharing", "padding_free+balanced+explicit_ref+precompute"]
    if (config, processes) == ("zero3.yaml", 2):
        runs += ["padding_free+ref_offload+balanced+prefix_sharing"]
    reports = launch(
        config, model_dir, tmp_path / "report.json", "--runs", ",".join(runs), *options, "--max-length", MAX_LENGTH,
        processes=processes,
    )  # fmt: skip
    padded = single_process_padded(model_dir, tmp_path, processes, steps)
    for run in runs:
        report = reports[run]
        if config.startswith("zero3"):
            assert report["zero_stage"] == 3 and report["policy_sharded"] and report["reference"]["offloaded"]
        if config.startswith("fsdp2"):
            assert report["fsdp_version"] == 2 and report["policy_fsdp"]["sharded"]
        assert_balanced_training_equals(report, padded, processes, uneven=run == runs[0])


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3.yaml", "fsdp2.yaml"])
def test_balanced_batches_on_four_sharded_processes(config, model_dir, tmp_path):
    test_balanced_batches_train_as_padded_trl_on_the_same_global_batches(config, 4, model_dir, tmp_path)


# Split rows: a row group (the ranks sharing a row) counts as one process


# 4 processes on 2 cores: -m slow (the default suite's time); the row groups' dealing runs in one process by default
# (test_every_step_trains_the_pairs_accelerate_and_trainer_give_it)
@pytest.mark.parametrize(
    "config, flags, processes",
    [
        pytest.param("multi_gpu.yaml", ("padding_free+cp+balanced", "--cp-size", "2"), 4, marks=pytest.mark.slow),
        pytest.param("zero3.yaml", ("padding_free+sp+balanced", "--sp-size", "2"), 4, marks=pytest.mark.slow),
    ],
    ids=["context-parallel", "ulysses"],
)
def test_balanced_row_groups_train_as_padded_trl_on_the_same_global_batches(
    config, flags, processes, model_dir, tmp_path
):
    """4 ranks, 2 per row: 2 row groups, each running its 2 ranks' micro-batches one after the other; accumulation
    2 covers a round, so a step is the default's 8 consecutive pairs."""
    run, *sizes = flags
    options = ("--batch-size", str(PAIRS_PER_PROCESS), "--grad-accum", str(ACCUMULATION), "--steps", "2", *sizes)
    report = launch(
        config, model_dir, tmp_path / "report.json", "--runs", run, *options, "--max-length", MAX_LENGTH,
        processes=processes,
    )[run]  # fmt: skip
    assert report["sequence_parallel_size"] * report["context_parallel_size"] == 2
    assert report["sequences_split_across_ranks"] > 0
    # The padded run's micro-batch is a step's pairs: groups x accumulation x batch
    padded = single_process_padded(model_dir, tmp_path, processes // 2, steps=2)
    assert_balanced_training_equals(report, padded, processes)


def test_with_one_micro_step_every_logged_metric_is_padded_trls(model_dir, tmp_path):
    """One micro-step per optimizer step: TRL's token means (entropy, logits/*) are the step's too, gathered over
    the processes' uneven rows; every compared metric equals padded TRL's on the global batch."""
    options = ("--batch-size", "4", "--grad-accum", "1", "--steps", "2", "--max-length", MAX_LENGTH)
    run = "padding_free+balanced"
    report = launch("multi_gpu.yaml", model_dir, tmp_path / "report.json", "--runs", run, *options)[run]
    padded = train_in_this_process(
        model_dir, tmp_path / "padded.json", "--runs", "trl", "--batch-size", "8", "--steps", "2", "--max-length",
        MAX_LENGTH,
    )["trl"]  # fmt: skip
    assert report["balanced"]["bins"] != report["balanced"]["dealt_bins"]
    assert_same_training(report, padded)


@pytest.mark.slow  # the sampler's resume runs in one process by default (test_resume_continues_with_the_same_...)
def test_two_processes_resume_mid_epoch_on_the_same_trajectory(tmp_path):
    """The user's command (trl_padfree/cli/dpo.py, multi_gpu.yaml on 2 CPU processes, --train_sampling_strategy
    batch_rebalance): 64 pairs a step, 5 steps an epoch; a checkpoint at step 6 (the second epoch's first) resumed in
    new processes trains step 7 as the uninterrupted run does: the sampler gets the second epoch's order although
    Trainer's own set_epoch does not reach it past `skip_first_batches`."""
    import json
    import subprocess
    import sys

    from distributed_runs import ACCELERATE_CONFIGS, ROOT, checkout_environment, free_port

    environment = checkout_environment(
        TQDM_DISABLE="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true", TRL_PADFREE_CACHE=str(tmp_path / "cache")
    )

    def step_7(output_dir, *extra: str) -> dict:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "multi_gpu.yaml"),
            "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
            str(ROOT / "trl_padfree" / "cli" / "dpo.py"), "--config", str(ROOT / "trl_padfree" / "cli" / "configs" / "tiny_cpu.yaml"),
            "--model_name_or_path", "trl-padfree/tiny-llama", "--train_sampling_strategy", "batch_rebalance",
            "--per_device_train_batch_size", "32", "--max_steps", "7", "--logging_steps", "1", "--eval_strategy", "no",
            "--max_length", "256", "--save_strategy", "steps", "--save_steps", "1", "--output_dir", str(output_dir),
            *extra,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600)
        assert result.returncode == 0, result.stderr[-6000:]
        state = json.loads((output_dir / "checkpoint-7" / "trainer_state.json").read_text())
        return next(entry for entry in state["log_history"] if entry.get("step") == 7 and "loss" in entry)

    uninterrupted = step_7(tmp_path / "run")
    resumed = step_7(tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "run" / "checkpoint-6"))
    assert resumed["epoch"] == uninterrupted["epoch"] > 1  # the second epoch
    for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "padfree/balance_cost_max_over_mean"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-6), key
