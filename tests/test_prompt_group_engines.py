"""`train_sampling_strategy="group_by_prompt"` under the sharding engines, for real: two CPU processes over gloo
launched by `accelerate launch` with the shipped `zero3.yaml` (the reference offloaded) and `fsdp2.yaml` (through
tests/distributed/fsdp_on_cpu.py; the reference sharded, then offloaded), padding-free with prefix sharing, each
process's micro-batch one prompt's 6 pairs (K = 4 completions paired all ways by `pair_scored_completions`:
tests/distributed/train_dpo.py's `--prompt-groups`). Each run is compared step by step with TRL's padded trainer in
one process fed the same global batches: accelerate deals the grouped batches out round-robin, so step N runs batches
2N and 2N + 1, and the baseline's micro-batch N is both. The grouping in one process: tests/test_group_by_prompt.py.

Measured (tiny Llama, fp32, 3 AdamW steps): against the baseline, losses within 2.3e-6, grad_norm 1.7e-5 relative,
rewards 5.7e-6, every other logged value within 2.3e-7 relative; tolerances.DISTRIBUTED_* bound them."""

import math

import pytest
from distributed_runs import assert_same_training, launch, train_in_this_process
from tolerances import DISTRIBUTED_METRIC_ATOL, DISTRIBUTED_METRIC_RTOL, FIRST_LOSS_ATOL

PROCESSES = 2
PAIRS_PER_PROMPT = 6  # K = 4 completions paired all ways
STEPS = 3
# 8 prompts, 48 pairs: 8 grouped batches, 4 steps of 2 processes in an epoch. Up to 512 tokens: no prompt dropped,
# some completions truncated
OPTIONS = ("--prompt-groups", "4", "--num-pairs", "8", "--max-length", "512", "--steps", str(STEPS))
OPTIONS += ("--batch-size", str(PAIRS_PER_PROMPT))
RUN = "padding_free+ref_offload+prefix_sharing"


@pytest.fixture(scope="module")
def single_process_padded(model_dir, tmp_path_factory):
    """TRL's own trainer, padded, in this process, each micro-batch the two processes' grouped batches of a step."""
    output = tmp_path_factory.mktemp("single") / "report.json"
    options = ("--runs", "trl", "--joined-processes", str(PROCESSES), *OPTIONS)
    return train_in_this_process(model_dir, output, *options)["trl"]


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
    assert_grouped_batches_of_the_baseline(report, single_process_padded)
    assert_prompts_shared(report)
    assert_every_logged_metric_equal(report, single_process_padded)


@pytest.mark.parametrize("reference", FSDP2_RUNS)
def test_grouped_batches_under_fsdp2_train_as_padded_trl(fsdp2_runs, single_process_padded, reference):
    report = fsdp2_runs[reference]
    assert report["world_size"] == PROCESSES and report["fsdp_version"] == 2
    assert report["policy_fsdp"]["sharded"], "the policy's parameters are not DTensor shards: FSDP2 did not run"
    assert report["reference_fsdp"]["sharded"]
    assert report["reference_fsdp"]["cpu_offload"] is (reference == "reference_offloaded")
    assert_grouped_batches_of_the_baseline(report, single_process_padded)
    assert_prompts_shared(report)
    assert_every_logged_metric_equal(report, single_process_padded)
