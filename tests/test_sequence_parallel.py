"""Sequence parallelism (DeepSpeed Ulysses through `sequence_parallel_size`), for real: 2 CPU processes over gloo
under ZeRO-3 split every packed row in two, so most sequences' log-prob sums cross the chunk boundary. Every step's
loss and metrics must equal TRL's padded trainer in one process on the same micro-batches. `-k sequence_parallel`
selects these tests."""

import math
from pathlib import Path

import pytest
from transformers import AutoConfig

deepspeed = pytest.importorskip("deepspeed")

from distributed_runs import launch, save_tiny_model, train_in_this_process  # noqa: E402
from test_deepspeed import COMPARED_METRICS, LOSS_ATOL, METRIC_ATOL, METRIC_RTOL  # noqa: E402

from trl_padfree.sequence_parallel import check_sequence_parallel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAIRS = 2  # per micro-batch: with sequence parallelism both ranks share it
STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def single_process_padded(model_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("single") / "report.json"
    options = ("--runs", "trl", "--batch-size", str(PAIRS), "--steps", str(STEPS))
    return train_in_this_process(model_dir, output, *options)["trl"]


@pytest.fixture(scope="module")
def sequence_parallel_runs(model_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("sp") / "report.json"
    options = ("--runs", "padding_free+sp", "--batch-size", str(PAIRS), "--steps", str(STEPS))
    return launch("zero3.yaml", 29533, model_dir, output, *options)


def test_sequence_parallel_2_matches_single_process_padded_trl(sequence_parallel_runs, single_process_padded):
    report = sequence_parallel_runs["padding_free+sp"]
    assert report["world_size"] == 2 and report["zero_stage"] == 3
    assert len(report["losses"]) == STEPS
    assert report["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert report["losses"] == pytest.approx(single_process_padded["losses"], abs=LOSS_ATOL)
    for step, (metrics, expected) in enumerate(zip(report["metrics"], single_process_padded["metrics"], strict=True)):
        for key in COMPARED_METRICS:
            assert metrics[key] == pytest.approx(expected[key], rel=METRIC_RTOL, abs=METRIC_ATOL), (step, key)
        # Both ranks computed the same row: its tokens are counted once
        assert metrics["padfree/real_tokens"] == metrics["num_tokens"] - (
            report["metrics"][step - 1]["num_tokens"] if step else 0
        )


# Refusals


def tiny_config(**overrides):
    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=64, **overrides)
    return config


@pytest.mark.parametrize("attn_implementation", ["sdpa", "flex_attention", "eager"])
def test_sequence_parallel_refuses_attention_that_leaks_across_sequences(attn_implementation):
    with pytest.raises(ValueError, match="attends across the sequences of the row"):
        check_sequence_parallel(tiny_config(), attn_implementation, 2)


def test_sequence_parallel_refuses_head_counts_not_divisible():
    with pytest.raises(ValueError, match="4 attention heads are not divisible by sp_size=3"):
        check_sequence_parallel(tiny_config(), "padfree_varlen", 3)


def test_sequence_parallel_refuses_attention_dropout():
    with pytest.raises(ValueError, match="attention dropout must be 0"):
        check_sequence_parallel(tiny_config(attention_dropout=0.1), "padfree_varlen", 2)


def test_sequence_parallel_accepts_packing_aware_attention():
    check_sequence_parallel(tiny_config(), "padfree_varlen", 2)
    check_sequence_parallel(tiny_config(), "padfree_varlen", 4)  # DeepSpeed replicates the 2 key-value heads


def test_sequence_parallel_size_sets_accelerates_parallelism_config(tmp_path):
    from trl_padfree import DPOConfig

    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], sequence_parallel_size=2)
    assert args.parallelism_config.sp_size == 2 and args.parallelism_config.sp_backend == "deepspeed"
    with pytest.raises(ValueError, match="sequence_parallel_size must be at least 1"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, sequence_parallel_size=0)
