"""FSDP2 for real: two CPU processes over gloo launched by `accelerate launch` with the shipped `fsdp2.yaml` (through
tests/support/distributed/fsdp_on_cpu.py, since accelerate runs FSDP only on GPUs), compared step by step with TRL's padded
trainer in one process on the same global batches. Every run asserts the policy's parameters are DTensor shards, so
a fallback to data parallelism fails. The refusals are checked in this process."""

import math
from importlib.metadata import version
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from distributed_runs import (
    ROOT,
    assert_same_bf16_training,
    assert_same_training,
    checkout_environment,
    launch,
    single_process_padded_fixture,
    train_in_this_process,
    train_recipe_to_step_3,
)
from packaging.version import Version
from tolerances import (
    BF16_ENGINE_LOSS_ATOL,
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_METRIC_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    FIRST_LOSS_ATOL,
)

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.placement.deepspeed import check_ref_offload
from trl_padfree.placement.fsdp2 import check_reference_sharded_by_layer, planned_fsdp_version
from trl_padfree.refusals.parallel import check_no_context_parallelism

PAIRS_PER_PROCESS = 2
DECODER_LAYERS = 2  # the tiny Llama of distributed_runs.save_tiny_model
# fp32, 2 processes vs 1, and bf16, packed vs padded with float32 log-probs: tolerances.DISTRIBUTED_* and BF16_ENGINE_*
# (measured here: see docs/guides/multi-gpu.md and docs/concepts/exactness.md)
# The dtype of TRL's log-probs under FSDP2's bf16 mixed precision. TRL's fused LM head computes them in float32, and
# `fully_shard` casts the root's outputs to the policy's `output_dtype`, which accelerate's bf16 policy
# (`FullyShardedDataParallelPlugin.set_mixed_precision`) sets to bf16 up to 1.15 and leaves unset from 1.16:
#   accelerate <= 1.15: bfloat16 (a sequence's log-prob near -500 a multiple of 2; what fp32_log_probs prevents)
#   accelerate >= 1.16: float32 (nothing casts them; fp32_log_probs has nothing to keep)
# transformers plays no part: 5.25 with accelerate 1.15 gives bfloat16, 5.23 with accelerate 1.16 float32.
TRL_FSDP2_BF16_LOG_PROBS = "torch.bfloat16" if Version(version("accelerate")) < Version("1.16") else "torch.float32"

RUNS = {
    "fsdp2": "padding_free+eval",
    "ref_offload": "padding_free+ref_offload",
    "precompute": "padding_free+precompute",
    "precompute_offloaded": "padding_free+ref_offload+precompute",
    "checkpointing": "padding_free+ref_offload+checkpointing",
    "prefix_sharing": "padding_free+prefix_sharing",
    "lora": "padding_free+lora",
    "trl": "trl",
    "bf16": "padding_free+ref_offload+bf16+checkpointing",
    # this package's trainer, padded, with float32 log-probs asked for (unset, they are TRL's bf16 when padded)
    "bf16_padded": "padded+bf16+checkpointing+fp32_sums",
    "bf16_sums": "padding_free+bf16+checkpointing+bf16_sums",  # TRL's precision
    "sync": "padding_free+ref_offload+sync",
    "sync_padded": "trl+sync",
    # padding_free=False with every option of this package unset, against TRL's own trainer: bf16 mixed precision
    "trl_bf16": "trl+bf16",
    "padded_bf16_defaults": "padded+bf16",
}


single_process_padded = single_process_padded_fixture(
    {"full": "trl+eval", "lora": "trl+lora"}, "--batch-size", str(2 * PAIRS_PER_PROCESS)
)


@pytest.fixture(scope="module")
def fsdp2_runs(model_dir, tmp_path_factory):
    """Every run of RUNS, one after the other, in the same two FSDP2 processes."""
    output = tmp_path_factory.mktemp("fsdp2") / "report.json"
    options = ("--runs", ",".join(RUNS.values()), "--batch-size", str(PAIRS_PER_PROCESS))
    reports = launch("fsdp2.yaml", model_dir, output, *options)
    return {name: reports[run] for name, run in RUNS.items()}


def assert_policy_sharded(report: dict) -> None:
    assert report["world_size"] == 2 and report["fsdp_version"] == 2
    assert report["policy_fsdp"]["sharded"], "the policy's parameters are not DTensor shards: FSDP2 did not run"


def test_fsdp2_padding_free_on_two_processes_matches_single_process_padded_trl(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["fsdp2"]
    assert_policy_sharded(report)
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)  # policy and reference start equal
    assert len(report["losses"]) == 3
    assert_same_training(report, single_process_padded["full"])
    assert report["metrics"][0]["padfree/padding_removed"] > 0


def test_fsdp2_evaluation_matches_single_process_padded_trl(fsdp2_runs, single_process_padded):
    evaluated, expected = fsdp2_runs["fsdp2"]["eval"], single_process_padded["full"]["eval"]
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/chosen"):
        assert evaluated[key] == pytest.approx(
            expected[key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
        ), key


def test_reference_is_sharded_layer_by_layer_in_device_memory(fsdp2_runs):
    # TRL shards the reference as one unit; here a unit per decoder layer, the embeddings and the root
    reference = fsdp2_runs["fsdp2"]["reference_fsdp"]
    assert reference == {"sharded": True, "units": DECODER_LAYERS + 2, "cpu_offload": False, "local_devices": ["cpu"]}
    assert fsdp2_runs["trl"]["reference_fsdp"]["units"] == 1  # TRL's own preparation, for contrast


def test_reference_forward_gathers_less_than_the_whole_reference(fsdp2_runs):
    # TRL's single unit gathers every reference parameter at once; ours never gathers the embeddings together with
    # a decoder layer. Tiny model: the embeddings and LM head are most of it (docs/guides/multi-gpu.md has the real shapes)
    ours, trl = fsdp2_runs["fsdp2"], fsdp2_runs["trl"]
    assert trl["reference_gathered_peak_bytes"] == trl["reference_bytes"]
    assert ours["reference_gathered_peak_bytes"] < 0.8 * ours["reference_bytes"]


def test_ref_offload_keeps_the_reference_shards_in_cpu_memory_and_trains_the_same(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["ref_offload"]
    assert_policy_sharded(report)
    assert report["reference_fsdp"]["cpu_offload"] and report["reference_fsdp"]["sharded"]
    assert not report["policy_fsdp"]["cpu_offload"], "the policy keeps its own placement"
    assert_same_training(report, single_process_padded["full"])


@pytest.mark.parametrize("run", ["precompute", "precompute_offloaded"])
def test_precomputed_reference_log_probs_train_the_same(fsdp2_runs, single_process_padded, run):
    # TRL users report crashes of precompute_ref_log_probs under FSDP2; TRL 1.16 loads a reference to precompute with
    report = fsdp2_runs[run]
    assert_policy_sharded(report)
    assert report["reference"]["kept"] is False
    assert_same_training(report, single_process_padded["full"])


def test_activation_checkpointing_under_fsdp2_trains_the_same(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["checkpointing"]
    assert_policy_sharded(report)
    assert_same_training(report, single_process_padded["full"])


def test_prefix_sharing_under_fsdp2_trains_the_same(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["prefix_sharing"]
    assert_policy_sharded(report)
    assert_same_training(report, single_process_padded["full"])
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])


def test_lora_under_fsdp2_matches_single_process_padded_lora(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["lora"]
    assert_policy_sharded(report)
    assert report["reference"]["kept"] is False  # the adapter disabled is the reference
    assert_same_training(report, single_process_padded["lora"])


def test_fsdp2_bf16_with_activation_checkpointing_matches_padded_trl_with_float32_log_probs(fsdp2_runs):
    packed, padded = fsdp2_runs["bf16"], fsdp2_runs["bf16_padded"]
    assert_policy_sharded(packed)
    assert packed["reference_fsdp"]["cpu_offload"]
    assert packed["precision"]["hidden_states"] == "torch.bfloat16"  # the engine really ran the model in bf16
    assert packed["losses"][0] == pytest.approx(
        math.log(2), abs=FIRST_LOSS_ATOL
    )  # float32 sums: policy = reference exactly
    assert_same_bf16_training(packed, padded)
    if TRL_FSDP2_BF16_LOG_PROBS == "torch.float32":  # then TRL's own trainer keeps float32 log-probs too
        assert_same_bf16_training(packed, fsdp2_runs["trl_bf16"])


def test_accelerates_bf16_fsdp2_policy_casts_outputs_as_stated():
    # Where TRL_FSDP2_BF16_LOG_PROBS comes from, read off the installed accelerate's own bf16 policy
    policy = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="bf16").mixed_precision_policy
    assert policy.param_dtype == torch.bfloat16
    assert str(policy.output_dtype or torch.float32) == TRL_FSDP2_BF16_LOG_PROBS, (
        f"accelerate {version('accelerate')} sets FSDP2's bf16 output_dtype to {policy.output_dtype}: "
        "restate TRL_FSDP2_BF16_LOG_PROBS for it"
    )


def test_padding_free_false_under_fsdp2_bf16_is_trls_trainer_exactly(fsdp2_runs):
    # The swap-in's promise: with padding_free=False and this package's options unset, the same numbers as TRL's
    # trainer, bit for bit: the same processes, model, data and seed, so there is no noise to allow for
    ours, trl = fsdp2_runs["padded_bf16_defaults"], fsdp2_runs["trl_bf16"]
    for report in (ours, trl):
        assert_policy_sharded(report)
        assert report["precision"]["hidden_states"] == "torch.bfloat16"  # FSDP2's bf16 mixed precision ran
    # fp32_log_probs is off unset when padded: the log-probs in whatever dtype TRL's trainer gets on this accelerate
    assert ours["precision"] == trl["precision"] and ours["precision"]["log_probs"] == TRL_FSDP2_BF16_LOG_PROBS
    assert ours["reference_fsdp"] == trl["reference_fsdp"] and trl["reference_fsdp"]["units"] == 1  # TRL's one unit
    assert len(ours["losses"]) == 3 and ours["losses"] == trl["losses"]
    assert ours["metrics"] == trl["metrics"]  # every logged value, TRL's metrics and the Trainer's, exactly
    assert not any(key.startswith("padfree/") for metrics in ours["metrics"] for key in metrics)


def test_fsdp2_bf16_without_fp32_log_probs_gives_trls_log_prob_dtype(fsdp2_runs):
    # fp32_log_probs=False with padding-free: the log-probs in the dtype TRL's own trainer gets
    trls, kept = fsdp2_runs["bf16_sums"], fsdp2_runs["bf16"]
    assert trls["precision"]["log_probs"] == fsdp2_runs["trl_bf16"]["precision"]["log_probs"]
    assert trls["precision"]["log_probs"] == TRL_FSDP2_BF16_LOG_PROBS
    if TRL_FSDP2_BF16_LOG_PROBS == "torch.bfloat16":
        # What fp32_log_probs prevents: FSDP2 rounds the fused head's float32 log-probs to bf16, and with them the
        # sums, the margin and the loss
        loss_gap = max(abs(a - b) for a, b in zip(trls["losses"], kept["losses"], strict=True))
        assert loss_gap > 5 * BF16_ENGINE_LOSS_ATOL
    else:
        # Nothing casts them: fp32_log_probs changes nothing, and ref_offload moves no arithmetic
        assert trls["losses"] == kept["losses"]


def test_sync_ref_model_updates_an_offloaded_layer_sharded_reference(fsdp2_runs):
    synced, padded = fsdp2_runs["sync"], fsdp2_runs["sync_padded"]
    assert synced["reference_fsdp"]["cpu_offload"]
    assert synced["losses"] == pytest.approx(padded["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    # The reference moved half way to the policy after each step, so step 3 differs from a fixed reference
    assert abs(synced["losses"][2] - fsdp2_runs["ref_offload"]["losses"][2]) > 100 * DISTRIBUTED_LOSS_ATOL


def test_token_budget_under_fsdp2_equals_padded_trl_on_the_same_pairs(model_dir, tmp_path):
    options = ("--max-tokens-per-batch", "2048", "--steps", "2", "--max-length", "1024")
    report = launch("fsdp2.yaml", model_dir, tmp_path / "budget.json", "--runs", "padding_free", *options)
    report = report["padding_free"]
    assert_policy_sharded(report)
    for step in range(2):
        # accelerate deals the micro-batches out round-robin: step N is micro-batches 2N and 2N+1
        pairs = [index for batch in report["micro_batches"][2 * step : 2 * step + 2] for index in batch]
        padded_options = ("--pairs", ",".join(map(str, pairs)), "--batch-size", str(len(pairs)), "--steps", "1")
        padded = train_in_this_process(
            model_dir, tmp_path / f"padded{step}.json", "--runs", "trl", *padded_options, "--max-length", "1024"
        )["trl"]
        if step == 0:  # later steps follow different weights: only the first starts from the same model
            assert report["losses"][0] == pytest.approx(padded["losses"][0], abs=DISTRIBUTED_LOSS_ATOL)
            for key in ("rewards/chosen", "logps/chosen", "logps/rejected", "grad_norm"):
                assert report["metrics"][0][key] == pytest.approx(
                    padded["metrics"][0][key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
                ), key


@pytest.mark.slow  # resuming runs under ZeRO-3 by default (test_deepspeed.py); FSDP2's checkpoints with -m slow
def test_recipe_with_ref_offload_resumes_an_fsdp2_checkpoint_on_the_same_trajectory(tmp_path):
    """The user's command (trl_padfree/cli/dpo.py, fsdp2.yaml, --ref_offload true): train 3 steps saving a sharded
    checkpoint at 2, then resume from step 2 in new processes; step 3 must be the same."""
    config = ROOT / "trl_padfree" / "cli" / "accelerate_configs" / "fsdp2.yaml"
    environment = checkout_environment(TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRL_PADFREE_CACHE=str(tmp_path / "cache"))

    uninterrupted = train_recipe_to_step_3(config, tmp_path / "run", environment)
    assert (tmp_path / "run" / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # sharded, as the config says
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    resumed = train_recipe_to_step_3(config, tmp_path / "resumed", environment, "--resume_from_checkpoint", checkpoint)
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], abs=DISTRIBUTED_LOSS_ATOL)
    assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=DISTRIBUTED_METRIC_RTOL)


# Refusals, checked in this process


def test_fsdp_version_is_read_from_the_training_arguments_or_accelerate_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert planned_fsdp_version(SimpleNamespace(fsdp_plugin_args=None)) is None
    assert planned_fsdp_version(SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2})) == 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert planned_fsdp_version(SimpleNamespace(fsdp_plugin_args=None)) == 2


def test_an_fsdp_run_that_accelerate_gives_no_fsdp_is_refused(monkeypatch, tmp_path):
    # What an FSDP config does on CPU processes without tests/support/distributed/fsdp_on_cpu.py: DDP, nothing sharded
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    from trainer_utils import make_trainer

    with pytest.raises(ValueError, match="asks for FSDP \\(fsdp_version 2\\) but accelerate set up"):
        make_trainer(padding_free=True, output_dir=str(tmp_path))


def test_ref_offload_under_fsdp1_is_refused():
    args = SimpleNamespace(deepspeed_plugin=None, precompute_ref_log_probs=False)
    with pytest.raises(
        ValueError, match="needs FSDP2, but the run asks for fsdp_version 1.*--accelerate_config fsdp2"
    ):
        check_ref_offload(args, model="some/model", ref_model=None, peft_config=None, fsdp_version=1)


def test_ref_offload_under_fsdp2_accepts_precompute_without_a_reference():
    # Unlike under DeepSpeed: TRL loads a reference to precompute with under FSDP, and that one is offloaded
    args = SimpleNamespace(deepspeed_plugin=None, precompute_ref_log_probs=True)
    check_ref_offload(args, model="some/model", ref_model=None, peft_config=None, fsdp_version=2)


def test_ref_offload_without_deepspeed_or_fsdp_is_refused_by_the_trainer(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), ref_offload=True, use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(
        ValueError, match="ref_offload=True needs DeepSpeed ZeRO-3 or FSDP2: .*--accelerate_config fsdp2"
    ):
        DPOTrainer(model="unused", args=args)


def test_context_parallelism_is_refused_with_padding_free():
    check_no_context_parallelism(1)
    with pytest.raises(
        ValueError, match="context parallelism \\(cp_size=2\\) is not supported.*--accelerate_config zero3_sp2"
    ):
        check_no_context_parallelism(2)


def test_sequence_parallelism_under_fsdp_is_refused_with_the_way_out(monkeypatch, tmp_path):
    # Under FSDP2 accelerate would fail later with an error about `dp_shard_size` that names neither option
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(
        ValueError, match="sequence_parallel_size=2 is not supported under FSDP.*--accelerate_config zero3_sp2"
    ):
        DPOConfig(output_dir=str(tmp_path), padding_free=True, sequence_parallel_size=2, use_cpu=True, bf16=False)


def test_a_reference_that_missed_the_layer_sharding_is_caught_after_construction():
    # What happens if TRL stops preparing the reference through the name trl-padfree reroutes
    with pytest.raises(RuntimeError, match="not sharded by trl-padfree's FSDP2 preparation.*not offloaded"):
        check_reference_sharded_by_layer(torch.nn.Linear(2, 2), offload=True)
    prepared = torch.nn.Linear(2, 2)
    prepared._padfree_reference_offloaded = True
    check_reference_sharded_by_layer(prepared, offload=True)
    check_reference_sharded_by_layer(None, offload=True)  # no reference (PEFT, precomputed log-probs)
