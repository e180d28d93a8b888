"""`train_sampling_strategy="group_by_prompt"` under the sharding engines, for real: two CPU processes over gloo
launched by `accelerate launch` with the shipped `zero3.yaml` (the reference offloaded) and `fsdp2.yaml` (through
tests/support/distributed/fsdp_on_cpu.py; the reference sharded, then offloaded), padding-free with prefix sharing, each
process's micro-batch one prompt's 6 pairs (K = 4 completions paired all ways by `pair_scored_completions`:
tests/support/distributed/train_dpo.py's `--prompt-groups`). Each run is compared step by step with TRL's padded trainer in
one process fed the same global batches: accelerate deals the grouped batches out round-robin, so step N runs batches
2N and 2N + 1, and the baseline's micro-batch N is both. The grouping in one process: tests/integration/prompt_groups/test_group_by_prompt.py.

Measured (tiny Llama, fp32, 3 AdamW steps): against the baseline, losses within 2.3e-6, grad_norm 1.7e-5 relative,
rewards 5.7e-6, every other logged value within 2.3e-7 relative; tolerances.DISTRIBUTED_* bound them.

Context parallelism on a long group row (prompts of 329-431 tokens, rows of 758-917 tokens, each split over the two
processes): against the baseline, losses within 6.2e-6, grad_norm 4.3e-6 relative, rewards 8.4e-6, log-probs 2.4e-7
relative (3 float32 quanta of sums near -760), every other logged value within 1.3e-7 relative."""

import math

import pytest
from distributed_runs import (
    assert_same_training,
    assert_split_row_training,
    launch,
    single_process_padded_fixture,
    train_in_this_process,
)
from tolerances import DISTRIBUTED_METRIC_ATOL, DISTRIBUTED_METRIC_RTOL, FIRST_LOSS_ATOL

PROCESSES = 2
PAIRS_PER_PROMPT = 6  # K = 4 completions paired all ways
STEPS = 3
# 8 prompts, 48 pairs: 8 grouped batches, 4 steps of 2 processes in an epoch. Up to 512 tokens: no prompt dropped,
# some completions truncated
OPTIONS = ("--prompt-groups", "4", "--num-pairs", "8", "--max-length", "512", "--steps", str(STEPS))
OPTIONS += ("--batch-size", str(PAIRS_PER_PROMPT))
RUN = "padding_free+ref_offload+prefix_sharing"


# Each micro-batch the two processes' grouped batches of a step
single_process_padded = single_process_padded_fixture({"trl": "trl"}, "--joined-processes", str(PROCESSES), *OPTIONS)


@pytest.fixture(scope="module")
def zero3_run(model_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("zero3") / "report.json"
    return launch("zero3.yaml", model_dir, output, "--runs", RUN, *OPTIONS)[RUN]


# FSDP2's reference: sharded layer by layer in device memory, or its shards offloaded to CPU memory
FSDP2_RUNS = {"reference_sharded": "padding_free+prefix_sharing", "reference_offloaded": RUN}


@pytest.fixture(scope="module")
def fsdp2_runs(model_dir, tmp_path_factory):
    """Both runs of FSDP2_RUNS, one after the other, in the same two FSDP2 processes."""
    output = tmp_path_factory.mktemp("fsdp2") / "report.json"
    reports = launch("fsdp2.yaml", model_dir, output, "--runs", ",".join(FSDP2_RUNS.values()), *OPTIONS)
    return {name: reports[run] for name, run in FSDP2_RUNS.items()}


def assert_grouped_batches_of_the_baseline(report: dict, baseline: dict) -> None:
    """Each process's micro-batch of each step held one prompt's 6 pairs, the grouped batch accelerate dealt it
    (process p's step N: batch 2N + p), and the baseline's micro-batch N held the step's two together."""
    grouping, expected = report["prompt_groups"], baseline["prompt_groups"]
    assert grouping["grouped_batches"] == expected["grouped_batches"], "the processes grouped other batches"
    assert grouping["pairs"] == expected["pairs"], "the processes tokenized other pairs"
    processes = grouping["batches"]  # [process][micro-batch], the dataloader's look-ahead batch included
    assert len(processes) == PROCESSES and all(len(batches) >= STEPS for batches in processes)
    for step in range(STEPS):
        for process, batches in enumerate(processes):
            batch = batches[step]
            assert len(batch["pairs"]) == PAIRS_PER_PROMPT and len(batch["prompts"]) == 1, (step, process)
            dealt = grouping["grouped_batches"][PROCESSES * step + process]
            assert batch["pairs"] == sorted(grouping["pairs"][index] for index in dealt), (step, process)
        together = sorted(pair for batches in processes for pair in batches[step]["pairs"])
        assert expected["batches"][0][step]["pairs"] == together, step


def assert_every_logged_metric_equal(report: dict, expected: dict) -> None:
    """Loss, grad norm and the compared metrics within the distributed bounds (`assert_same_training`), and every
    other value TRL's trainer logged too (accuracies, learning rate, epoch)."""
    assert len(report["losses"]) == len(expected["losses"]) == STEPS
    assert_same_training(report, expected)
    for step, (metrics, expected_metrics) in enumerate(zip(report["metrics"], expected["metrics"], strict=True)):
        assert set(expected_metrics) <= set(metrics), (step, set(expected_metrics) - set(metrics))
        for key, value in expected_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL), (
                step,
                key,
            )


def assert_prompts_shared(report: dict) -> None:
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)  # policy and reference start equal
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])


def test_grouped_batches_under_zero3_with_the_reference_offloaded_train_as_padded_trl(
    zero3_run, single_process_padded
):
    report = zero3_run
    assert report["world_size"] == PROCESSES and report["zero_stage"] == report["engine_zero_stage"] == 3
    assert report["policy_sharded"], "the policy's parameters are not ZeRO-3 partitions"
    assert report["reference"] == {"kept": True, "offloaded": True}
    assert_grouped_batches_of_the_baseline(report, single_process_padded["trl"])
    assert_prompts_shared(report)
    assert_every_logged_metric_equal(report, single_process_padded["trl"])


@pytest.mark.parametrize("reference", FSDP2_RUNS)
def test_grouped_batches_under_fsdp2_train_as_padded_trl(fsdp2_runs, single_process_padded, reference):
    report = fsdp2_runs[reference]
    assert report["world_size"] == PROCESSES and report["fsdp_version"] == 2
    assert report["policy_fsdp"]["sharded"], "the policy's parameters are not DTensor shards: FSDP2 did not run"
    assert report["reference_fsdp"]["sharded"]
    assert report["reference_fsdp"]["cpu_offload"] is (reference == "reference_offloaded")
    assert_grouped_batches_of_the_baseline(report, single_process_padded["trl"])
    assert_prompts_shared(report)
    assert_every_logged_metric_equal(report, single_process_padded["trl"])


# ---------------------------------------------------------------------------------------------------------------------
# Context parallelism on a long group row: both processes share each prompt's row (context_parallel_size=2, so one
# data-parallel rank), each running one half of it with the whole row's keys gathered. The group runs its ranks'
# micro-batches one after the other (parallel/batch_hand_out.py): step N is process N % 2's micro-batch N // 2, and the
# baseline is TRL's trainer fed one grouped batch per step.

K = 4  # completions per prompt, paired all ways: PAIRS_PER_PROMPT pairs
# Shipped prompts of 431, 329, 388 and 235 tokens; the first three steps' rows (758, 917 and 787 tokens) are cut in
# the prompt, in a branch and in the first sequence's completion. Four groups: the two processes' dataloaders share
# the epoch evenly (accelerate would wrap an odd one, and the logged epoch would differ from the baseline's)
GROUP_PROMPTS = "13,29,1,4"
MAX_LENGTH = 512
CP_OPTIONS = ("--prompt-groups", str(K), "--group-prompts", GROUP_PROMPTS, "--max-length", str(MAX_LENGTH))
CP_OPTIONS += ("--steps", str(STEPS), "--batch-size", str(PAIRS_PER_PROMPT))
CP_RUN = "padding_free+cp+prefix_sharing"


def test_a_long_group_row_split_by_context_parallelism_trains_as_padded_trl(model_dir, tmp_path):
    padded = train_in_this_process(model_dir, tmp_path / "padded.json", "--runs", "trl", *CP_OPTIONS)["trl"]
    options = ("--runs", CP_RUN, "--cp-size", str(PROCESSES), *CP_OPTIONS)
    report = launch("multi_gpu.yaml", model_dir, tmp_path / "cp.json", *options)[CP_RUN]
    assert report["world_size"] == PROCESSES and report["context_parallel_size"] == PROCESSES
    assert_split_row_training(report, padded)  # sequences crossed the chunk boundary; loss, grad_norm, metrics
    assert_every_logged_metric_equal(report, padded)

    grouping, expected = report["prompt_groups"], padded["prompt_groups"]
    assert grouping["pairs"] == expected["pairs"] and grouping["grouped_batches"] == expected["grouped_batches"]
    cuts = set()
    for step, metrics in enumerate(report["metrics"]):
        process, micro_batch = step % PROCESSES, step // PROCESSES
        batch = grouping["batches"][process][micro_batch]
        assert len(batch["prompts"]) == 1 and len(batch["pairs"]) == PAIRS_PER_PROMPT, step
        assert batch["pairs"] == expected["batches"][0][step]["pairs"], step
        assert batch["pairs"] == sorted(grouping["pairs"][index] for index in grouping["grouped_batches"][step])
        # The row lays the prompt out once and each distinct completion once: the first sequence whole, every other
        # completion a branch after the prompt's last token
        (prompt,), completions = batch["prompt_tokens"], batch["completion_tokens"]
        kept = sorted(min(tokens, MAX_LENGTH - prompt) for tokens in completions)  # TRL's keep_start truncation
        assert len(kept) == K, step
        boundaries, length = grouping["rows"][process][micro_batch]
        laid_out = prompt + sum(kept) + K - 1
        assert boundaries[K] == laid_out and length == boundaries[-1] and length % PROCESSES == 0, step
        segments = [end - start for start, end in zip(boundaries[:K], boundaries[1 : K + 1], strict=True)]
        assert sorted([segments[0] - prompt] + [branch - 1 for branch in segments[1:]]) == kept, step
        assert metrics["padfree/real_tokens"] == 2 * PAIRS_PER_PROMPT * prompt + (K - 1) * sum(kept), step
        assert metrics["padfree/shared_tokens"] == metrics["padfree/real_tokens"] - laid_out, step
        # Where the row's two chunks meet: inside a sequence (the prompt, the rest of the first sequence or a branch)
        cut = length // PROCESSES
        assert cut not in boundaries, step
        cuts.add("prompt" if cut < prompt else "first sequence" if cut < boundaries[1] else "branch")
    assert cuts == {"prompt", "branch", "first sequence"}, cuts
