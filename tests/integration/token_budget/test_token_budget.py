"""Token-budget batching (`max_tokens_per_batch`): the packing covers every pair once within the budget, and an
optimizer step's loss, gradients and per-pair metrics equal padded TRL on one batch of the same pairs, in one process
and in two processes with gradient accumulation. Resume sees the same batches."""

import math
import random

import pytest
import torch
from distributed_runs import launch, train_in_this_process
from tiny_architectures import save_tiny_architecture
from tolerances import (
    DISTRIBUTED_GRAD_ATOL,
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_METRIC_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    GRAD_ATOL,
    LOSS_ATOL,
    RESUMED_LOSS_ATOL,
)
from trainer_utils import FirstStepGradients, make_trainer, train_losses

from trl_padfree import DPOConfig
from trl_padfree.cli.bench.harness import shipped_lengths
from trl_padfree.packing.layout import pair_tokens
from trl_padfree.packing.token_budget import TokenBudgetBatchSampler, pack_window, split_units_to_multiple
from trl_padfree.packing.units import PairUnits

_rng = random.Random(0)
LENGTHS = [_rng.randint(20, 700) for _ in range(500)]  # tokens per pair


def fill_ratio(sampler: TokenBudgetBatchSampler) -> float:
    """Real tokens over budget, across all micro-batches."""
    return sum(sampler.lengths) / (len(sampler) * sampler.budget)


# The packing


@pytest.mark.parametrize("budget, pad_to_multiple_of", [(1024, None), (1500, 64), (4096, None)])
def test_packing_covers_every_pair_once_within_the_budget(budget, pad_to_multiple_of):
    sampler = TokenBudgetBatchSampler(
        PairUnits(LENGTHS), budget, seed=3, window=100, pad_to_multiple_of=pad_to_multiple_of
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(index for batch in batches for index in batch) == list(range(len(LENGTHS)))
        multiple = pad_to_multiple_of or 1
        assert all(math.ceil(sum(LENGTHS[i] for i in batch) / multiple) * multiple <= budget for batch in batches)
    assert len(sampler) == len(batches)


def test_packing_is_deterministic_for_a_seed_and_epochs_reorder_the_same_micro_batches():
    first, again = (TokenBudgetBatchSampler(PairUnits(LENGTHS), 2048, seed=7, window=100) for _ in range(2))
    assert list(first) == list(again)
    assert first.bins != TokenBudgetBatchSampler(PairUnits(LENGTHS), 2048, seed=8, window=100).bins
    first.set_epoch(1)
    epoch_1 = list(first)
    assert epoch_1 != list(again) and sorted(epoch_1) == sorted(list(again))  # same micro-batches, new order


def test_best_fit_decreasing_fills_rows():
    # 60 opens a bin, 50 another; 40 fits the fuller one exactly (room 40), 30 and 20 fill the other
    assert pack_window([0, 1, 2, 3, 4], [60, 50, 40, 30, 20], capacity=100) == [[0, 2], [1, 3, 4]]
    sampler = TokenBudgetBatchSampler(PairUnits(LENGTHS), 4096, seed=0)
    assert fill_ratio(sampler) > 0.97


def split_to_multiple(bins: list[list[int]], lengths: list[int], multiple: int) -> list[list[int]]:
    """Split the bins holding the most pairs until their count is a multiple of `multiple` (a split bin's halves
    each fit, so the budget still holds)."""
    units = [[[index] for index in each] for each in bins]
    split = split_units_to_multiple(units, lambda unit: sum(lengths[index] for index in unit), multiple)
    return [[index for unit in each for index in unit] for each in split]


def test_micro_batch_count_is_a_multiple_of_the_processes():
    for processes in (2, 3, 8):
        sampler = TokenBudgetBatchSampler(PairUnits(LENGTHS), 2048, seed=0, num_processes=processes)
        assert len(sampler) % processes == 0
        assert sorted(i for batch in sampler for i in batch) == list(range(len(LENGTHS)))
    assert split_to_multiple([[0, 1, 2], [3]], [5, 5, 5, 5], 3) == [[0, 2], [3], [1]]
    with pytest.raises(ValueError, match="micro-batches of one pair each, which cannot be shared evenly by 2"):
        split_to_multiple([[0], [1], [2]], [5, 5, 5], 2)


def test_fill_ratio_on_the_shipped_data(capsys):
    """Reported, not a speed claim: how full token-budget rows are on the shipped pairs."""
    lengths = [pair_tokens(prompt, chosen, rejected, 1024) for prompt, chosen, rejected in shipped_lengths()]
    for budget in (2048, 4096, 8192):
        fill = fill_ratio(TokenBudgetBatchSampler(PairUnits(lengths), budget, seed=0))
        with capsys.disabled():
            print(f"\nshipped data, {len(lengths)} pairs, budget {budget}: fill ratio {fill:.3f}")
        assert fill > 0.9


# The trainer, one process


STEP = dict(num_pairs=16, max_steps=1, max_grad_norm=0.0, logging_steps=1)
PER_PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def padded_step_on(pairs: list[int]) -> tuple[float, dict, dict]:
    """TRL's padded loss, gradients and metrics of one batch holding exactly these pairs."""
    trainer = make_trainer(False, **STEP)
    trainer.model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[index] for index in pairs]))
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {key: values[-1] for key, values in trainer._metrics["train"].items()}


def test_optimizer_step_equals_padded_trl_on_the_same_pairs_with_accumulation():
    trainer = make_trainer(True, max_tokens_per_batch=160, gradient_accumulation_steps=3, **STEP)
    gradients = FirstStepGradients()
    trainer.add_callback(gradients)
    trainer.train()
    sampler = trainer._batches.budget_sampler
    sampler.set_epoch(0)
    micro_batches = list(sampler)[:3]
    assert len({len(batch) for batch in micro_batches}) > 1, "micro-batches should hold different numbers of pairs"
    loss, grads, metrics = padded_step_on([index for batch in micro_batches for index in batch])

    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert logged["loss"] == pytest.approx(loss, abs=LOSS_ATOL)
    largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(gradients.grads[name], grad, atol=GRAD_ATOL * max(1.0, largest), rtol=0, msg=name)
    for key in PER_PAIR_METRICS:
        assert logged[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-6), key
    pairs = [len(batch) for batch in micro_batches]
    assert logged["padfree/pairs_per_micro_batch"] == pytest.approx(sum(pairs) / 3)
    rows = [sum(sampler.lengths[i] for i in batch) for batch in micro_batches]
    assert logged["padfree/budget_fill"] == pytest.approx(sum(rows) / 3 / 160)


def test_resume_continues_with_the_same_batches(tmp_path):
    options = dict(num_pairs=16, max_tokens_per_batch=160, gradient_accumulation_steps=2, max_steps=4)
    options.update(learning_rate=0.5, optim="sgd", logging_steps=1, num_train_epochs=3)
    options.update(save_strategy="steps", save_steps=2, output_dir=str(tmp_path))
    uninterrupted = make_trainer(True, **options)
    assert (
        len(uninterrupted._batches.budget_sampler) == 4
    )  # 2 optimizer steps per epoch: steps 3-4 are the second epoch
    seen = []
    uninterrupted.data_collator = recording(uninterrupted.data_collator, seen)
    uninterrupted_losses = train_losses(uninterrupted)

    resumed = make_trainer(True, **options)
    seen_after_resume = []
    resumed.data_collator = recording(resumed.data_collator, seen_after_resume)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed_losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    assert seen_after_resume == seen[4:]
    assert resumed_losses[-2:] == pytest.approx(uninterrupted_losses[-2:], abs=RESUMED_LOSS_ATOL)


def recording(collator, seen: list):
    def collate(examples):
        seen.append(sorted(len(example["chosen_ids"]) * 1000 + len(example["prompt_ids"]) for example in examples))
        return collator(examples)

    collate.pad_to_multiple_of = collator.pad_to_multiple_of
    return collate


# Refusals


def test_pair_longer_than_the_budget_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match=r"do not fit max_tokens_per_batch=40 .* set max_length to at most 20"):
        make_trainer(True, num_pairs=8, max_tokens_per_batch=40)


def test_token_budget_needs_padding_free():
    with pytest.raises(ValueError, match="max_tokens_per_batch needs padding_free=True"):
        make_trainer(False, num_pairs=8, max_tokens_per_batch=4096)


def test_token_budget_config_is_checked(tmp_path):
    with pytest.raises(ValueError, match="max_tokens_per_batch must be at least 1"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, max_tokens_per_batch=0)
    with pytest.raises(ValueError, match="token_budget_window must be at least 1"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget_window=0)


# Two processes (plain data parallelism over gloo, multi_gpu.yaml on CPU) with gradient accumulation
# max_length 1024 drops no pair, so indices into TRL's tokenized set are indices into the shipped data
TWO_PROCESS_OPTIONS = ("--max-tokens-per-batch", "2048", "--grad-accum", "2", "--steps", "1", "--max-length", "1024")


def assert_first_step_equals_padded_trl_on_its_pairs(config: str, model_dir, tmp_path) -> None:
    """Two processes under `config` with a token budget and accumulation, against TRL padded in one process on the
    same global batch: loss, per-pair metrics and gradients."""
    report = launch(config, model_dir, tmp_path / "budget.json", "--runs", "padding_free", *TWO_PROCESS_OPTIONS,
                    "--save-grads", str(tmp_path / "budget.pt"))["padding_free"]  # fmt: skip
    assert report["world_size"] == 2 and report["train_pairs"] == 32
    # accelerate deals micro-batches out round-robin: step 1 is the first 2 processes x 2 accumulation of them
    pairs = [index for batch in report["micro_batches"][:4] for index in batch]
    assert len({len(batch) for batch in report["micro_batches"][:4]}) > 1
    padded_options = ("--pairs", ",".join(map(str, pairs)), "--batch-size", str(len(pairs)), "--steps", "1")
    padded = train_in_this_process(model_dir, tmp_path / "padded.json", "--runs", "trl", *padded_options,
                                   "--max-length", "1024", "--save-grads", str(tmp_path / "padded.pt"))["trl"]  # fmt: skip

    assert report["losses"][0] == pytest.approx(padded["losses"][0], abs=DISTRIBUTED_LOSS_ATOL)
    for key in PER_PAIR_METRICS:
        assert report["metrics"][0][key] == pytest.approx(
            padded["metrics"][0][key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
        ), key
    budget_grads, padded_grads = torch.load(tmp_path / "budget.pt"), torch.load(tmp_path / "padded.pt")
    largest = max(grad.abs().max().item() for grad in padded_grads.values())
    for name, grad in padded_grads.items():
        torch.testing.assert_close(
            budget_grads[name], grad, atol=DISTRIBUTED_GRAD_ATOL * max(1.0, largest), rtol=0, msg=name
        )


def test_two_processes_with_accumulation_equal_padded_trl_on_the_same_pairs(model_dir, tmp_path):
    assert_first_step_equals_padded_trl_on_its_pairs("multi_gpu.yaml", model_dir, tmp_path)


# A hybrid model (LFM2's short convolutions) runs its mixers once per sequence on CPU: under ZeRO-3 each call gathers
# their weights, and a budget's micro-batches give the processes different numbers of sequences. Without the refusal
# gloo aborts ("collective mismatch", measured); the refusal names FSDP2 as a way out, which trains equal to padded TRL
@pytest.mark.slow
def test_a_hybrid_model_with_a_budget_is_refused_under_zero3_and_trains_under_fsdp2(tmp_path):
    pytest.importorskip("deepspeed")
    model_dir = save_tiny_architecture(tmp_path / "lfm2", "lfm2")
    with pytest.raises(AssertionError, match=r"ZeRO-3 cannot train this model with max_tokens_per_batch over 2 proc"):
        launch("zero3.yaml", model_dir, tmp_path / "zero3.json", "--runs", "padding_free", *TWO_PROCESS_OPTIONS)
    assert_first_step_equals_padded_trl_on_its_pairs("fsdp2.yaml", model_dir, tmp_path)
