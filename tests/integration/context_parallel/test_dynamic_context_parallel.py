"""Dynamic context parallelism (`dynamic_context_parallel=True`): each micro-step the batch plan splits each row over
as many of its group's ranks as its length needs (packing/rank_shares.py). Here for real, on CPU processes over gloo:
every step equal to TRL's padded trainer in one process fed the same global batches, under DDP, ZeRO-3 with the
reference offloaded and FSDP2, with rows that really ran on one rank and on several."""

import pytest
from tolerances import DISTRIBUTED_LOSS_ATOL, DISTRIBUTED_METRIC_ATOL, DISTRIBUTED_METRIC_RTOL

from trl_padfree import DPOConfig
from trl_padfree.features.pair_weighted_steps import PER_PAIR_METRICS

# The first 48 shipped pairs at max_length 384 run from 229 to 768 tokens: at 640 tokens a rank 28 of them fit one
# rank and 20 need two
MAX_LENGTH = 384
RANK_TOKENS = 640
STEPS = 4


def train_dynamic(
    model, tmp_path, config: str, run: str, processes: int, ranks: int, grad_accum: int = 1, data=("--num-pairs", "48")
) -> dict:
    from distributed_runs import launch

    options = (
        "--runs", run, "--max-tokens-per-batch", str(RANK_TOKENS * ranks), "--max-length", str(MAX_LENGTH),
        "--steps", str(STEPS), "--cp-size", str(ranks), "--grad-accum", str(grad_accum), *data,
    )  # fmt: skip
    return launch(config, model, tmp_path / "dynamic.json", *options, processes=processes)[run]


def padded_on_the_same_steps(model, tmp_path, report: dict, grad_accum: int = 1, data=("--num-pairs", "48")) -> dict:
    """TRL's padded trainer in this process, each step fed the pairs every process of `report`'s run trained then."""
    import json

    from distributed_runs import train_in_this_process

    micro_steps = [[pair for rows in groups for pairs, _, _ in rows for pair in pairs] for groups in
                   report["dynamic"]["plan"]]  # fmt: skip
    steps = [sum(micro_steps[start : start + grad_accum], []) for start in range(0, len(micro_steps), grad_accum)]
    given = tmp_path / "steps.json"
    given.write_text(json.dumps(steps[:STEPS]))
    options = ("--runs", "trl", "--given-batches", str(given), "--steps", str(STEPS), *data)
    return train_in_this_process(model, tmp_path / "padded.json", *options, "--max-length", str(MAX_LENGTH))["trl"]


def assert_equal_to_padded(report: dict, padded: dict, grad_accum: int = 1) -> None:
    """Every step's loss and metrics equal the padded run's, which trained each step's pairs as one batch. With
    accumulation TRL averages a per-token metric (logits, entropy, token accuracy) over micro-steps as they come,
    whatever their tokens: those are compared without it only."""
    from distributed_runs import COMPARED_METRICS

    per_token = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
    keys = [key for key in (*COMPARED_METRICS, *PER_PAIR_METRICS, "mean_token_accuracy")]
    keys = [key for key in keys if grad_accum == 1 or key not in per_token]
    assert report["losses"] == pytest.approx(padded["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    for step, (metrics, expected) in enumerate(zip(report["metrics"], padded["metrics"], strict=True)):
        for key in keys:
            assert metrics[key] == pytest.approx(
                expected[key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
            ), (step, key)


def assert_rows_on_one_rank_and_on_several(report: dict) -> None:
    """The run really shared ranks out: rows alone on a rank and rows split (with sequences across the split)."""
    ranks = report["dynamic"]["row_ranks"]
    assert 1 in ranks and max(ranks) > 1, ranks
    assert report["dynamic"]["sequences_split"] > 0
    for groups in report["dynamic"]["plan"]:  # every rank of every group trains exactly one row at every micro-step
        for rows in groups:
            assert sorted(rank for _, first, size in rows for rank in range(first, first + size)) == list(
                range(report["context_parallel_size"])
            )


@pytest.mark.parametrize(
    "config, run",
    [
        ("multi_gpu.yaml", "padding_free+cp+dynamic"),
        ("zero3.yaml", "padding_free+cp+dynamic+ref_offload"),
        pytest.param("fsdp2.yaml", "padding_free+cp+dynamic+ref_offload", marks=pytest.mark.slow),
    ],
    ids=["ddp", "zero3", "fsdp2"],
)
def test_dynamic_context_parallel_equals_padded_trl_on_the_same_steps(six_head_model, tmp_path, config, run):
    if config.startswith("zero3"):
        pytest.importorskip("deepspeed")
    report = train_dynamic(six_head_model, tmp_path, config, run, processes=2, ranks=2)
    if config.startswith("zero3"):
        assert report["policy_sharded"] and report["reference"]["offloaded"]
    if config.startswith("fsdp2"):
        assert report["policy_fsdp"]["sharded"] and report["reference_fsdp"]["cpu_offload"]
    assert_rows_on_one_rank_and_on_several(report)
    assert_equal_to_padded(report, padded_on_the_same_steps(six_head_model, tmp_path, report))
    step = report["metrics"][0]
    assert 1 <= step["padfree/ranks_per_row"] <= 2
    assert step["padfree/rank_tokens_max"] <= RANK_TOKENS
    assert step["padfree/real_tokens"] == step["num_tokens"]


def test_prompt_groups_computed_once_inside_rows_of_one_and_two_ranks(six_head_model, tmp_path):
    # 8 shipped prompts with 3 completions each, paired all ways: 3 pairs a prompt, grouped rows of 300-800 tokens
    data = ("--prompt-groups", "3", "--num-pairs", "8")
    run = "padding_free+cp+dynamic+prefix_sharing"
    report = train_dynamic(six_head_model, tmp_path, "multi_gpu.yaml", run, processes=2, ranks=2, data=data)
    assert_rows_on_one_rank_and_on_several(report)
    for batches in report["prompt_groups"]["batches"]:  # every row a prompt's 3 pairs, whole
        assert all(len(batch["pairs"]) == 3 * len(batch["prompts"]) for batch in batches), batches
    assert_equal_to_padded(report, padded_on_the_same_steps(six_head_model, tmp_path, report, data=data))
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])


@pytest.mark.slow
def test_precomputed_reference_log_probs(six_head_model, tmp_path):
    run = "padding_free+cp+dynamic+precompute"
    report = train_dynamic(six_head_model, tmp_path, "multi_gpu.yaml", run, processes=2, ranks=2)
    assert_rows_on_one_rank_and_on_several(report)
    assert_equal_to_padded(report, padded_on_the_same_steps(six_head_model, tmp_path, report))


@pytest.mark.slow  # 4 processes on 2 cores
def test_two_groups_of_four_ranks_with_prefix_sharing_and_accumulation(six_head_model, tmp_path):
    run = "padding_free+cp+dynamic+prefix_sharing"
    report = train_dynamic(six_head_model, tmp_path, "multi_gpu.yaml", run, processes=4, ranks=2, grad_accum=2)
    assert_rows_on_one_rank_and_on_several(report)
    assert len(report["dynamic"]["plan"][0]) == 2  # two groups
    padded = padded_on_the_same_steps(six_head_model, tmp_path, report, grad_accum=2)
    assert_equal_to_padded(report, padded, grad_accum=2)
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])


@pytest.mark.slow  # 4 processes on 2 cores
def test_one_group_of_four_ranks_splits_rows_over_one_two_and_four(six_head_model, tmp_path):
    report = train_dynamic(six_head_model, tmp_path, "multi_gpu.yaml", "padding_free+cp+dynamic", 4, ranks=4)
    sizes = {size for groups in report["dynamic"]["plan"] for rows in groups for _, _, size in rows}
    assert sizes >= {1, 2}, sizes
    assert_equal_to_padded(report, padded_on_the_same_steps(six_head_model, tmp_path, report))


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


def test_the_config_needs_a_power_of_two_and_a_token_budget(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], padding_free=True)
    with pytest.raises(ValueError, match="power of two of at least 2.*got 3"):
        DPOConfig(context_parallel_size=3, dynamic_context_parallel=True, max_tokens_per_batch=64, **common)
    with pytest.raises(ValueError, match="power of two of at least 2.*got 1"):
        DPOConfig(dynamic_context_parallel=True, max_tokens_per_batch=64, **common)
    with pytest.raises(ValueError, match="needs max_tokens_per_batch"):
        DPOConfig(context_parallel_size=2, dynamic_context_parallel=True, **common)
    DPOConfig(context_parallel_size=4, dynamic_context_parallel=True, max_tokens_per_batch=64, **common)


def test_ulysses_and_image_rows_are_refused():
    from trl_padfree.refusals.parallel import check_dynamic_context_parallel_setup

    with pytest.raises(ValueError, match="cannot run with Ulysses.*sequence_parallel_size=1"):
        check_dynamic_context_parallel_setup(ulysses_size=2, vision_dataset=False)
    with pytest.raises(ValueError, match="text rows only.*dynamic_context_parallel=False"):
        check_dynamic_context_parallel_setup(ulysses_size=1, vision_dataset=True)
    check_dynamic_context_parallel_setup(ulysses_size=1, vision_dataset=False)
