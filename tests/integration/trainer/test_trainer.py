"""Padding-free DPOTrainer against TRL 1.16's padded DPOTrainer: loss, gradients and metrics on the same batch."""

import logging
import math

import pytest
import torch
import trl
from peft import LoraConfig
from tolerances import (
    BF16_AUTOCAST_LOGPS_RTOL,
    BF16_AUTOCAST_LOSS_ATOL,
    EVAL_METRIC_ATOL,
    EVAL_METRIC_RTOL,
    FIRST_LOSS_ATOL,
    LOSS_ATOL,
    PREDICTION_LOGITS_ATOL,
    RESUMED_LOSS_ATOL,
    TRAINING_LOSS_ATOL,
)
from trainer_utils import (
    LOSS_TYPES,
    SGD_STEPS_WITH_ACCUMULATION,
    assert_precomputed_reference_matches_padded,
    assert_same_step,
    first_batch,
    make_trainer,
    one_step,
    train_losses,
    with_checkpointing,
)

from trl_padfree import ATTN_IMPLEMENTATION, PaddingFreePreferenceCollator


def assert_equivalent(**options):
    padded = one_step(make_trainer(False, **options))
    packed = one_step(make_trainer(True, **options))
    assert_same_step(padded, packed)
    return padded, packed


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches_padded(loss_type):
    assert_equivalent(loss_type=[loss_type])


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type=["exo_pair"], label_smoothing=1e-3),
        dict(loss_type=["robust"], label_smoothing=0.1),
        dict(loss_type=["aot"], label_smoothing=0.2),
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO
        dict(loss_type=["ipo", "bco_pair", "sft"], loss_weights=[0.3, 1.0, 0.2]),
        dict(f_divergence_type="forward_kl"),
        dict(f_divergence_type="js_divergence", loss_type=["hinge"]),
        dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
        dict(ld_alpha=0.5),
        dict(ld_alpha=0.5, loss_type=["ipo"]),
        dict(use_weighting=True),
        dict(beta=0.5, loss_type=["sigmoid_norm"]),
    ],
    ids=lambda options: "-".join(f"{key}={value}" for key, value in options.items()),
)
def test_options_match_padded(options):
    assert_equivalent(**options)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("packed_attn_implementation", [ATTN_IMPLEMENTATION, "keep"])
def test_attention_backends_match_padded(attn_implementation, packed_attn_implementation):
    assert_equivalent(attn_implementation=attn_implementation, packed_attn_implementation=packed_attn_implementation)


@pytest.mark.parametrize("model_type", ["gpt2", "mistral", "qwen3"])
def test_architectures_match_padded(model_type):
    assert_equivalent(model_type=model_type)


def test_first_loss_is_ln2_when_policy_equals_reference():
    packed = one_step(make_trainer(True, ref_seed=0))
    assert packed.loss == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)


def test_awkward_batches_match_padded():
    # A single pair; truncation cutting prompts (keep_end) and completions (keep_start); a row padded to a multiple
    assert_equivalent(batch_size=1)
    assert_equivalent(max_length=12, truncation_mode="keep_end")
    assert_equivalent(max_length=20)
    _, packed = assert_equivalent(pad_to_multiple_of=64)
    assert packed.metrics["num_tokens"] > 0


def test_precomputed_reference_log_probs_match_padded():
    assert_precomputed_reference_matches_padded()


def test_lora_with_adapter_disabled_reference_matches_padded():
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    padded = one_step(make_trainer(False, peft_config=LoraConfig(**lora)))
    packed = one_step(make_trainer(True, peft_config=LoraConfig(**lora)))
    assert_same_step(padded, packed)
    assert all("lora" in name for name in packed.grads)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_matches_padded(use_reentrant):
    padded = one_step(with_checkpointing(make_trainer(False), use_reentrant))
    packed = one_step(with_checkpointing(make_trainer(True), use_reentrant))
    assert_same_step(padded, packed)


def test_training_losses_match_over_steps_with_accumulation():
    padded = train_losses(make_trainer(False, **SGD_STEPS_WITH_ACCUMULATION))
    packed = train_losses(make_trainer(True, **SGD_STEPS_WITH_ACCUMULATION))
    assert len(packed) == 4
    assert packed == pytest.approx(padded, abs=TRAINING_LOSS_ATOL)
    assert padded[-1] < padded[0] - 0.05  # it learns, so later steps compare trained models


def test_sync_ref_model_matches_padded():
    options = dict(max_steps=3, learning_rate=0.5, optim="sgd", logging_steps=1, sync_ref_model=True)
    options.update(ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    assert train_losses(make_trainer(True, **options)) == pytest.approx(
        train_losses(make_trainer(False, **options)), abs=TRAINING_LOSS_ATOL
    )


def test_evaluation_and_prediction_step_match_padded():
    padded, packed = make_trainer(False), make_trainer(True)
    padded_metrics, packed_metrics = padded.evaluate(), packed.evaluate()
    for key, value in padded_metrics.items():
        if key.startswith("eval_") and "runtime" not in key and "per_second" not in key:
            assert packed_metrics[key] == pytest.approx(value, rel=EVAL_METRIC_RTOL, abs=EVAL_METRIC_ATOL), key
    batch = first_batch(packed)
    loss, logits, labels = packed.prediction_step(packed.model, batch, prediction_loss_only=False)
    padded_loss, padded_logits, padded_labels = padded.prediction_step(
        padded.model, first_batch(padded), prediction_loss_only=False
    )
    assert loss.item() == pytest.approx(padded_loss.item(), abs=LOSS_ATOL)
    width = int(batch["seq_lens"].max())
    assert labels.shape == (16, width) and logits.shape[:2] == (16, width)
    real = padded_labels[:, :width] != packed._tokenizer.pad_token_id
    torch.testing.assert_close(logits[real], padded_logits[:, :width][real], atol=PREDICTION_LOGITS_ATOL, rtol=0)


def test_plain_trl_config_is_honoured():
    trainer = make_trainer(True, config_class=trl.DPOConfig)
    assert trainer.padding_free_enabled and isinstance(trainer.data_collator, PaddingFreePreferenceCollator)
    assert trainer.model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_no_trl_fallback_warning(caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(True)
    assert trainer.padding_free_enabled and trainer.args.padding_free
    assert "temporarily unavailable" not in caplog.text


def test_policy_forward_sees_one_row_and_no_attention_mask():
    trainer = make_trainer(True)
    seen, attention_calls = [], []
    backbone = trainer.model.model
    backbone.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    trainer.model.model.layers[0].self_attn.register_forward_hook(lambda *args: attention_calls.append(1))
    one_step(trainer)
    policy_call = seen[0]
    real_tokens = sum(len(trainer.train_dataset[i]["prompt_ids"]) for i in range(8)) * 2 + sum(
        len(trainer.train_dataset[i]["chosen_ids"]) + len(trainer.train_dataset[i]["rejected_ids"]) for i in range(8)
    )
    assert policy_call["input_ids"].shape == (1, real_tokens)
    assert policy_call.get("attention_mask") is None
    assert policy_call["cu_seq_lens_q"].dtype == torch.int32 and len(policy_call["cu_seq_lens_q"]) == 17
    assert trainer.model.config._attn_implementation == ATTN_IMPLEMENTATION and attention_calls


def test_packing_metrics_are_logged_with_trl_metrics():
    trainer = make_trainer(True)
    batch = first_batch(trainer)
    seq_lens = batch["seq_lens"]
    metrics = one_step(trainer).metrics
    assert metrics["padfree/real_tokens"] == seq_lens.sum().item() == batch["input_ids"].shape[1]
    assert metrics["padfree/padded_tokens"] == len(seq_lens) * seq_lens.max().item()
    assert metrics["padfree/padding_removed"] == pytest.approx(
        1 - seq_lens.sum().item() / (16 * seq_lens.max().item())
    )
    assert 0 < metrics["padfree/padding_removed"] < 1
    assert metrics["padfree/row_length"] == batch["input_ids"].shape[1]
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "padfree/real_tokens" in entry]
    assert logged and all(0 < entry["padfree/padding_removed"] < 1 for entry in logged)
    assert "eval_padfree/padding_removed" in trainer.evaluate()


def test_packing_metrics_count_the_padded_row_multiple():
    trainer = make_trainer(True, pad_to_multiple_of=64)
    batch = first_batch(trainer)
    metrics = one_step(trainer).metrics
    assert metrics["padfree/row_length"] == batch["input_ids"].shape[1] and metrics["padfree/row_length"] % 64 == 0
    assert metrics["padfree/padded_tokens"] == 16 * 64 * math.ceil(batch["seq_lens"].max().item() / 64)
    assert metrics["padfree/real_tokens"] == batch["seq_lens"].sum().item()


def test_float64_loss_and_metrics_are_exact():
    # Same numbers up to float64 rounding; gradients keep ~1e-6 relative noise from TRL's LM head, which
    # accumulates in fp32 whatever the model dtype, in both modes
    padded = one_step(make_trainer(False, dtype=torch.float64, loss_type=["ipo"]))
    packed = one_step(make_trainer(True, dtype=torch.float64, loss_type=["ipo"]))
    assert packed.loss == pytest.approx(padded.loss, abs=1e-9)
    trl_metrics = {key: value for key, value in packed.metrics.items() if not key.startswith("padfree/")}
    assert trl_metrics == pytest.approx(padded.metrics, abs=1e-9)


def test_bf16_autocast_matches_padded_within_bf16_noise():
    # TRL's default (bf16=True) autocasts the forward; bf16 rounding of ~60-token sums is ~1e-2
    padded = one_step(make_trainer(False, bf16=True))
    packed = one_step(make_trainer(True, bf16=True))
    assert packed.loss == pytest.approx(padded.loss, abs=BF16_AUTOCAST_LOSS_ATOL)
    for key in ("logps/chosen", "logps/rejected"):
        assert packed.metrics[key] == pytest.approx(padded.metrics[key], rel=BF16_AUTOCAST_LOGPS_RTOL)
    assert one_step(make_trainer(True, bf16=True, ref_seed=0)).loss == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)


def test_resume_from_checkpoint_follows_the_same_trajectory(tmp_path):
    options = dict(num_pairs=16, batch_size=4, max_steps=4, learning_rate=0.5, optim="sgd", logging_steps=1)
    options.update(save_strategy="steps", save_steps=2, output_dir=str(tmp_path))
    uninterrupted = train_losses(make_trainer(True, **options))
    resumed = make_trainer(True, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed_losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    assert resumed_losses[-2:] == pytest.approx(uninterrupted[-2:], abs=RESUMED_LOSS_ATOL)
