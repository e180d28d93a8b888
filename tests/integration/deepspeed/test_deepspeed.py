"""DeepSpeed ZeRO-3 and `ref_offload`, for real: two CPU processes over gloo (`DS_ACCELERATOR=cpu`) launched by
`accelerate launch` with the shipped `zero3.yaml`, compared step by step with TRL's padded trainer in one
process on the same global batches. The refusals and the reference's config are checked in this process."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

deepspeed = pytest.importorskip("deepspeed")

from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from distributed_runs import (  # noqa: E402
    assert_same_bf16_training,
    assert_same_training,
    checkout_environment,
    launch,
    single_process_padded_fixture,
    train_recipe_to_step_3,
)
from tolerances import DISTRIBUTED_LOSS_ATOL, DISTRIBUTED_METRIC_RTOL, FIRST_LOSS_ATOL  # noqa: E402
from transformers.integrations import deepspeed as hf_deepspeed  # noqa: E402

from trl_padfree import DPOConfig, DPOTrainer  # noqa: E402
from trl_padfree.placement.deepspeed import (  # noqa: E402
    check_ref_offload,
    check_reference_offloaded,
    reference_deepspeed_config,
    zero3_init_config,
)

ROOT = Path(__file__).resolve().parents[3]
ZERO3_REF_OFFLOAD = ROOT / "trl_padfree" / "cli" / "accelerate_configs" / "zero3.yaml"
PAIRS_PER_PROCESS = 2

RUNS = {
    "zero3": "padding_free",
    "ref_offload": "padding_free+ref_offload",
    "precompute": "padding_free+ref_offload+explicit_ref+precompute",
    "bf16": "padding_free+ref_offload+bf16+checkpointing",
    "bf16_padded": "padded+bf16+checkpointing",  # this package's trainer, padded: TRL's with float32 log-probs
    "sync": "padding_free+ref_offload+sync",
    "sync_not_offloaded": "padding_free+sync",
    "prefix_sharing": "padding_free+ref_offload+prefix_sharing",
}


single_process_padded = single_process_padded_fixture({"trl": "trl"}, "--batch-size", str(2 * PAIRS_PER_PROCESS))


@pytest.fixture(scope="module")
def zero3_runs(model_dir, tmp_path_factory):
    """Every run of RUNS, one after the other, in the same two DeepSpeed ZeRO-3 processes."""
    output = tmp_path_factory.mktemp("zero3") / "report.json"
    options = ("--runs", ",".join(RUNS.values()), "--batch-size", str(PAIRS_PER_PROCESS))
    reports = launch("zero3.yaml", model_dir, output, *options)
    return {name: reports[run] for name, run in RUNS.items()}


def test_zero3_padding_free_on_two_processes_matches_single_process_padded_trl(zero3_runs, single_process_padded):
    report = zero3_runs["zero3"]
    assert report["world_size"] == 2 and report["zero_stage"] == 3 and report["policy_sharded"]
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)  # policy and reference start equal
    assert len(report["losses"]) == 3
    assert_same_training(report, single_process_padded["trl"])
    # TRL's reference config: sharded like the policy, not offloaded
    assert report["reference"] == {"kept": True, "offloaded": False}
    assert report["metrics"][0]["padfree/padding_removed"] > 0


def test_ref_offload_keeps_reference_on_cpu_and_trains_the_same(zero3_runs, single_process_padded):
    report = zero3_runs["ref_offload"]
    assert report["reference"] == {"kept": True, "offloaded": True}
    assert report["policy_sharded"]
    assert_same_training(report, single_process_padded["trl"])


def test_ref_offload_with_precomputed_log_probs_releases_the_reference(zero3_runs, single_process_padded):
    report = zero3_runs["precompute"]
    assert report["reference"]["kept"] is False
    assert_same_training(report, single_process_padded["trl"])


def test_prefix_sharing_under_zero3_with_ref_offload_trains_the_same(zero3_runs, single_process_padded):
    report = zero3_runs["prefix_sharing"]
    assert report["reference"] == {"kept": True, "offloaded": True}
    assert_same_training(report, single_process_padded["trl"])
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])


def test_zero3_bf16_with_activation_checkpointing_matches_padded_zero3(zero3_runs):
    # DeepSpeed's bf16 runs the model in bf16 (no autocast) and leaves the fused head's float32 log-probs as they are
    packed, padded = zero3_runs["bf16"], zero3_runs["bf16_padded"]
    assert packed["reference"]["offloaded"]
    assert packed["precision"]["hidden_states"] == "torch.bfloat16"
    assert packed["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert_same_bf16_training(packed, padded)


def test_sync_ref_model_updates_an_offloaded_reference(zero3_runs):
    offloaded, sharded = zero3_runs["sync"], zero3_runs["sync_not_offloaded"]
    assert offloaded["reference"]["offloaded"]
    assert offloaded["losses"] == pytest.approx(sharded["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    # The reference moved half way to the policy after each step, so step 3 differs from a fixed reference
    assert abs(offloaded["losses"][2] - zero3_runs["ref_offload"]["losses"][2]) > 100 * DISTRIBUTED_LOSS_ATOL


# Refusals, checked before anything is loaded


def offload_args(stage: int | None, precompute: bool = False) -> SimpleNamespace:
    plugin = DeepSpeedPlugin(zero_stage=stage) if stage is not None else None
    return SimpleNamespace(deepspeed_plugin=plugin, precompute_ref_log_probs=precompute)


def test_ref_offload_without_deepspeed_is_refused_by_the_trainer(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), ref_offload=True, use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(ValueError, match="ref_offload=True needs DeepSpeed ZeRO-3 or FSDP2: launch with"):
        DPOTrainer(model="unused", args=args)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ref_offload_below_stage_3_is_refused(stage):
    with pytest.raises(ValueError, match=f"zero stage {stage}: parameter offload exists only at stage 3"):
        check_ref_offload(offload_args(stage), model="some/model", ref_model=None, peft_config=None)


def test_ref_offload_with_a_peft_reference_is_refused():
    from peft import LoraConfig

    with pytest.raises(ValueError, match="no reference model to offload: with a PEFT adapter"):
        check_ref_offload(offload_args(3), model="some/model", ref_model=None, peft_config=LoraConfig())


def test_ref_offload_with_precompute_and_no_reference_is_refused():
    with pytest.raises(ValueError, match="no reference model to offload: with precompute_ref_log_probs=True"):
        check_ref_offload(offload_args(3, precompute=True), model="some/model", ref_model=None, peft_config=None)


def test_a_reference_left_on_the_gpus_is_caught_after_construction():
    # What happens if TRL stops preparing the reference through the name trl-padfree reroutes
    import torch

    with pytest.raises(RuntimeError, match="not ZeRO-3 shards in CPU memory"):
        check_reference_offloaded(torch.nn.Linear(2, 2))
    check_reference_offloaded(None)


def test_ref_offload_applies_at_stage_3():
    check_ref_offload(offload_args(3), model="some/model", ref_model=None, peft_config=None)


def test_reference_config_offloads_parameters_whatever_the_policy_does(tmp_path):
    policy_plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="none")
    policy_config = {
        **policy_plugin.deepspeed_config,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {}},
        "bf16": {"enabled": "auto"},
    }
    policy_config["zero_optimization"]["reduce_bucket_size"] = "auto"
    policy_config["zero_optimization"]["stage3_max_live_parameters"] = "auto"
    args = DPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=3, gradient_accumulation_steps=2
    )
    with zero3_init_config(None):
        config = reference_deepspeed_config(policy_config, args, hidden_size=64)

    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in zero and "optimizer" not in config and "scheduler" not in config
    assert zero["reduce_bucket_size"] == 64 * 64 and "stage3_max_live_parameters" not in zero  # DeepSpeed's default
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 2
    assert config["bf16"] == {"enabled": True}
    assert "auto" not in json.dumps(config)
    assert policy_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu", "the policy's is untouched"


def test_zero3_init_config_restores_the_trainers_config():
    before = hf_deepspeed.deepspeed_config()
    with zero3_init_config(None):
        outer = hf_deepspeed.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 1})
        with zero3_init_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}):
            assert hf_deepspeed.deepspeed_config()["zero_optimization"]["offload_param"]["device"] == "cpu"
        assert hf_deepspeed.deepspeed_config() is outer.config
        with zero3_init_config(None):
            assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
    assert hf_deepspeed.deepspeed_config() is before


def test_recipe_with_ref_offload_resumes_a_zero3_checkpoint_on_the_same_trajectory(tmp_path):
    """The user's command (trl_padfree/cli/dpo.py, zero3.yaml, --ref_offload true): train 3 steps saving at 2,
    then resume from step 2 in new processes; step 3 must be the same."""
    environment = checkout_environment(
        DS_ACCELERATOR="cpu", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRL_PADFREE_CACHE=str(tmp_path / "cache")
    )

    uninterrupted = train_recipe_to_step_3(ZERO3_REF_OFFLOAD, tmp_path / "run", environment)
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    resumed = train_recipe_to_step_3(
        ZERO3_REF_OFFLOAD, tmp_path / "resumed", environment, "--resume_from_checkpoint", checkpoint
    )
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], abs=DISTRIBUTED_LOSS_ATOL)
    assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=DISTRIBUTED_METRIC_RTOL)


def test_ref_offload_is_a_recipe_option():
    from trl import TrlParser

    (args,) = TrlParser((DPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", "--bf16", "false", "--ref_offload", "true"]
    )
    assert args.ref_offload is True
