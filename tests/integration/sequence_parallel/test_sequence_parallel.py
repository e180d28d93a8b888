"""Sequence parallelism (DeepSpeed Ulysses), for real: CPU processes over gloo under ZeRO-3 split every packed row
over the group, so sequences' log-prob sums cross the chunk boundaries. Every step's loss and metrics (grad_norm
included, and the losses of later steps follow the gradients of earlier ones) must equal TRL's padded trainer, and
sp_size 1 padding-free, in one process on the same micro-batches. `-k sequence_parallel` selects these tests.

Each launch is its own `accelerate launch`: DeepSpeed sets up sequence parallelism once per process."""

import re
from pathlib import Path

import pytest
from transformers import AutoConfig

deepspeed = pytest.importorskip("deepspeed")

from distributed_runs import (  # noqa: E402
    assert_no_object_collective,
    assert_split_row_training,
    launch,
    train_in_this_process,
)
from tolerances import DISTRIBUTED_METRIC_ATOL, DISTRIBUTED_METRIC_RTOL  # noqa: E402

from trl_padfree.modeling.backends import EXACT_UNDER_ULYSSES  # noqa: E402
from trl_padfree.parallel.ulysses import check_ulysses_model  # noqa: E402
from trl_padfree.refusals.parallel import check_sequence_parallel_engine, check_ulysses_without_dropout  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PAIRS = 2  # per micro-batch: with sequence parallelism every rank of the group shares it
STEPS = 4
EVAL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "entropy")
SINGLE_PROCESS_RUNS = ("trl+eval", "padding_free", "trl+lora")


@pytest.fixture(scope="module")
def single_process(model_dir, tmp_path_factory):
    """TRL padded, and our padding-free trainer with sp_size 1, in this process on the same micro-batches."""
    output = tmp_path_factory.mktemp("single") / "report.json"
    options = ("--runs", ",".join(SINGLE_PROCESS_RUNS), "--batch-size", str(PAIRS), "--steps", str(STEPS))
    return train_in_this_process(model_dir, output, *options)


@pytest.fixture(scope="module")
def sequence_parallel_launch(model_dir, tmp_path_factory):
    def run(config: str, run: str, *extra: str, processes: int = 2, sp_size: int = 2) -> dict:
        output = tmp_path_factory.mktemp("sp") / "report.json"
        options = ("--runs", run, "--batch-size", str(PAIRS), "--steps", str(STEPS), "--sp-size", str(sp_size))
        return launch(config, model_dir, output, *options, *extra, processes=processes)[run]

    return run


def assert_same_split_training(report: dict, expected: dict, sp_size: int) -> None:
    assert report["zero_stage"] == 3 and report["sequence_parallel_size"] == sp_size
    assert len(report["losses"]) == STEPS
    assert_split_row_training(report, expected)


def test_sequence_parallel_2_matches_padded_trl_and_sp_1(sequence_parallel_launch, single_process):
    report = sequence_parallel_launch("zero3.yaml", "padding_free+sp+eval", "--count-collectives")
    assert report["world_size"] == 2
    assert_no_object_collective(report)
    assert_same_split_training(report, single_process["trl+eval"], sp_size=2)
    assert_same_split_training(report, single_process["padding_free"], sp_size=2)
    # Evaluation runs the model in eval mode, where DeepSpeed switches Ulysses off: each rank evaluates whole rows of
    # its own batches, data-parallel. (TRL's logits means weigh tokens across processes: they depend on the grouping.)
    expected = single_process["trl+eval"]["eval"]
    for key in ("eval_loss", *(f"eval_{name}" for name in EVAL_METRICS)):
        assert report["eval"][key] == pytest.approx(
            expected[key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
        ), key


def test_sequence_parallel_from_the_accelerate_config_with_a_separate_reference(
    sequence_parallel_launch, single_process
):
    # zero3_sp2.yaml sets sp_size in its parallelism_config section; the reference is a model of its own, run by its
    # own DeepSpeed engine through the same Ulysses attention
    report = sequence_parallel_launch("zero3_sp2.yaml", "padding_free+explicit_ref")
    assert report["reference"]["kept"]
    assert_same_split_training(report, single_process["trl+eval"], sp_size=2)


def test_sequence_parallel_with_peft_reference(sequence_parallel_launch, single_process):
    # LoRA policy: the reference is the same model with its adapter disabled, run in training mode under Ulysses
    report = sequence_parallel_launch("zero3.yaml", "padding_free+sp+lora")
    assert not report["reference"]["kept"]
    assert_same_split_training(report, single_process["trl+lora"], sp_size=2)


def test_sequence_parallel_with_reference_offloaded(sequence_parallel_launch, single_process):
    report = sequence_parallel_launch("zero3.yaml", "padding_free+sp+ref_offload")
    assert report["reference"]["offloaded"]
    assert_same_split_training(report, single_process["trl+eval"], sp_size=2)


@pytest.mark.slow  # 4 processes on 2 cores; sp 2 runs by default
def test_sequence_parallel_4(sequence_parallel_launch, single_process):
    # 4 ranks split each row in 4; the tiny model's 2 key-value heads are replicated by DeepSpeed
    report = sequence_parallel_launch("zero3.yaml", "padding_free+sp", processes=4, sp_size=4)
    assert report["world_size"] == 4
    assert_same_split_training(report, single_process["trl+eval"], sp_size=4)


# Refusals


def check_sequence_parallel(config, attn_implementation: str, sp_size: int) -> None:
    """The model's side of Ulysses' refusals, as the trainer applies them (features/row_split.py)."""
    check_ulysses_model(config, attn_implementation, sp_size, EXACT_UNDER_ULYSSES)
    check_ulysses_without_dropout(True, getattr(config.get_text_config(), "attention_dropout", 0.0))


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


@pytest.mark.parametrize(
    "model_type, head_dims",
    [("gemma4_text", "[256, 512]"), ("deepseek_v3", "[128, 192]"), ("minicpm3", "[64, 96]")],
    ids=["layers-of-two-widths", "latent-attention", "latent-attention-minicpm3"],
)
def test_sequence_parallel_refuses_head_dims_deepspeed_cannot_exchange(model_type, head_dims):
    # DeepSpeed's Ulysses exchanges every layer at one head size from the config: Gemma 4's global layers (512) failed
    # at setup (its config's per-layer `head_dim`), latent attention's 192-wide query and 128-wide value inside the
    # exchange (head_dim 64, the rope part); context parallelism splits them
    with pytest.raises(ValueError, match=re.escape(f"attention has head dims {head_dims}")) as error:
        check_sequence_parallel(AutoConfig.for_model(model_type), "padfree_varlen", 2)
    assert "context_parallel_size instead" in str(error.value)


def test_sequence_parallel_refuses_attention_dropout():
    with pytest.raises(ValueError, match="attention dropout must be 0"):
        check_sequence_parallel(tiny_config(attention_dropout=0.1), "padfree_varlen", 2)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_sequence_parallel_refuses_zero_below_3(zero_stage):
    # Under ZeRO-1/2 (deepspeed 0.19.8) the step applied 2x the gradient at sp_size 2: an SGD run without clipping
    # left one padded process at its second step, and grad_norm was exactly 2x (docs/guides/long-sequences.md)
    with pytest.raises(
        ValueError, match=f"needs DeepSpeed ZeRO-3, but the DeepSpeed config has zero stage {zero_stage}"
    ):
        check_sequence_parallel_engine(2, deepspeed=True, padding_free=True, zero_stage=zero_stage)
    check_sequence_parallel_engine(2, deepspeed=True, padding_free=True, zero_stage=3)


def test_sequence_parallel_accepts_packing_aware_attention():
    check_sequence_parallel(tiny_config(), "padfree_varlen", 2)
    check_sequence_parallel(tiny_config(), "padfree_varlen", 4)  # DeepSpeed replicates the 2 key-value heads


def test_sequence_parallel_size_sets_accelerates_parallelism_config(tmp_path):
    from trl_padfree import DPOConfig

    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], sequence_parallel_size=2)
    assert args.parallelism_config.sp_size == 2 and args.parallelism_config.sp_backend == "deepspeed"
    with pytest.raises(ValueError, match="sequence_parallel_size must be at least 1"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, sequence_parallel_size=0)


def test_sequence_parallel_size_comes_from_the_accelerate_config(tmp_path, monkeypatch):
    from trl_padfree import DPOConfig

    # what `accelerate launch` passes on from zero3_sp2.yaml's parallelism_config section
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    assert args.sequence_parallel_size == 2 and args.parallelism_config.sp_size == 2
    with pytest.raises(ValueError, match="sequence_parallel_size=4 disagrees with the accelerate config's"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, sequence_parallel_size=4)


def test_sequence_parallel_refuses_a_second_setup_in_one_process(monkeypatch):
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from trl_padfree.parallel.ulysses import check_groups_not_created

    check_groups_not_created()
    monkeypatch.setattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", object())  # as an earlier trainer leaves it
    with pytest.raises(RuntimeError, match="Run each sequence-parallel training in its own `accelerate launch`"):
        check_groups_not_created()
