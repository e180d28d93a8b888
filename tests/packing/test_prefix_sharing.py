"""Prefix sharing: the row layout against hand-computed tensors, the two-call attention against dense masked
attention, packed forwards on every verified model type, and the trainer against padded TRL and against padding-free
training without sharing (loss, gradients, metrics).

The hand-computed row (two pairs; the second prompt has 2 tokens, so its prefix is one token):

    input_ids     | 1 2 | 3 4 5 | 3 6 | 7 | 8 9 | 8 10 11 | 0 0 0 |
    position_ids  | 0 1 | 2 3 4 | 2 3 | 0 | 1 2 | 1  2  3 | 0 1 2 |
                   prefix chosen  rej.  prefix ch.  rejected  padding
"""

import dataclasses
import logging
import math
import random

import pytest
import torch
from peft import LoraConfig
from shared_prefix_rows import (
    EXAMPLES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    SHARE,
    dense_attention,
    layout_mask,
    random_examples,
    row_qkv,
    shares_pay,
)
from tiny_fixtures import make_model, make_preference_dataset, make_tokenizer
from tolerances import (
    ATTENTION_ATOL,
    EVAL_METRIC_ATOL,
    EVAL_METRIC_RTOL,
    FIRST_LOSS_ATOL,
    LOG_PROB_ATOL,
    PREDICTION_LOGITS_ATOL,
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

from trl_padfree import ATTN_IMPLEMENTATION, DPOConfig, DPOTrainer, PaddingFreePreferenceCollator
from trl_padfree.costs.flops import DecoderShape
from trl_padfree.modeling.attention.gathered import GatheredKeys
from trl_padfree.modeling.attention.interface import padfree_varlen_attention
from trl_padfree.modeling.attention.rows import row_in_flight
from trl_padfree.modeling.attention.segments import per_segment_attention
from trl_padfree.modeling.check import packability as architecture
from trl_padfree.modeling.check.packability import check_packable, resolve_attn_implementation
from trl_padfree.modeling.packed_forward import PackedBatch, run_packed
from trl_padfree.packing import prefix_sharing
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import HostRow, cu_seq_lens_from_lengths, kept_prompt_and_completion
from trl_padfree.packing.prefix_sharing import (
    GATHER_FLOPS_PER_ELEMENT,
    SharingCost,
    pair_row_tokens,
    shared_prefix_keys,
    shared_prefix_length,
)
from trl_padfree.tiny import TINY_CONFIGS

HAND_EXAMPLES = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11]},
]


# ---------------------------------------------------------------------------------------------------------------------
# The layout


def test_collator_lays_out_each_pair_once_with_positions_continuing_from_the_prompt():
    batch = concatenated_inputs(HAND_EXAMPLES, **SHARE, pad_to_multiple_of=8)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 3, 6, 7, 8, 9, 8, 10, 11, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 1, 2, 3, 0, 1, 2]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0]]
    assert batch["seq_lens"].tolist() == [5, 3, 4, 4]  # the sequences of the unshared layout
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 7, 10, 13, 16]
    assert batch["max_length_q"] == 5
    assert batch["seq_starts"].tolist() == [0, 7, 5, 10]
    assert batch["shared_prefix_starts"].tolist() == [0, 0, 0, 7]
    assert batch["shared_prefix_lens"].tolist() == [0, 0, 2, 1]


def test_padded_views_read_the_same_sequences_as_the_unshared_layout():
    for options in (dict(), dict(max_length=9), dict(max_length=9, truncation_mode="keep_end")):
        unshared = PackedBatch.from_collated(concatenated_inputs(EXAMPLES, **options))
        shared = PackedBatch.from_collated(concatenated_inputs(EXAMPLES, **SHARE, **options))
        assert shared.row_length < unshared.row_length
        for name in ("input_ids", "completion_mask", "attention_mask"):
            assert torch.equal(shared.padded_inputs(0)[name], unshared.padded_inputs(0)[name]), (options, name)
        # Every next-token cell that scores a completion token reads a position whose next row token is that token
        labels = shared.labels()[0]
        next_tokens = torch.cat([labels[1:], labels.new_tensor([-100])])
        scored = shared.padded_shifted(next_tokens.unsqueeze(0), fill_value=-100)
        expected = unshared.padded(unshared.labels(), fill_value=-100)[:, 1:]
        assert torch.equal(scored, expected), options


def test_pairs_that_cannot_share_keep_their_unshared_segments():
    # keep_end cuts 3 prompt tokens from the chosen sequence and none from the rejected one: prompts differ
    examples = [{"prompt_ids": [1, 2, 3, 4, 5], "chosen_ids": [6, 7, 8, 9, 10], "rejected_ids": [11]}]
    batch = concatenated_inputs(examples, max_length=7, truncation_mode="keep_end", **SHARE)
    assert batch["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 11]]
    assert batch["shared_prefix_lens"].tolist() == [0, 0]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]]
    # A one-token prompt, and a prompt under the minimum
    assert concatenated_inputs([HAND_EXAMPLES[0]], **SHARE)["shared_prefix_lens"].tolist() == [0, 2]
    short = concatenated_inputs(HAND_EXAMPLES, prefix_sharing=True, prefix_sharing_min_prompt_tokens=3)
    assert short["shared_prefix_lens"].tolist() == [0, 0, 2, 0]


def test_short_prompts_fall_back_to_the_unshared_layout_by_default(caplog):
    assert concatenated_inputs(HAND_EXAMPLES, prefix_sharing=True)["shared_prefix_lens"].tolist() == [0, 0, 0, 0]
    with caplog.at_level(logging.INFO, logger="trl_padfree.packing.prefix_sharing"):
        trainer = make_trainer(True, prefix_sharing=True)
    pairs = [trainer.train_dataset[index] for index in range(len(trainer.train_dataset))]
    shared = sum(len(pair["prompt_ids"]) >= 8 for pair in pairs)
    assert 0 < shared < len(pairs)
    assert f"Prefix sharing: {shared} of {len(pairs)} training pairs share their prompt" in caplog.text
    metrics = one_step(trainer).metrics
    assert metrics["padfree/shared_pairs"] == sum(len(pair["prompt_ids"]) >= 8 for pair in pairs[:8]) / 8


def test_shared_prefix_length_rules():
    assert shared_prefix_length(5, 5, 2) == 4
    assert shared_prefix_length(5, 4, 2) == 0  # truncated differently
    assert shared_prefix_length(1, 1, 2) == 0  # nothing before the last prompt token
    assert shared_prefix_length(5, 5, 6) == 0
    assert kept_prompt_and_completion(10, 5, None, "keep_start")[0] == 10
    assert kept_prompt_and_completion(10, 5, 8, "keep_start")[0] == 8
    assert kept_prompt_and_completion(10, 5, 12, "keep_end")[0] == 7
    assert kept_prompt_and_completion(10, 5, 4, "keep_end")[0] == 0


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_pair_row_tokens_count_the_collators_row(truncation_mode):
    rng = random.Random(3)
    shapes = [(rng.randint(0, 30), rng.randint(1, 30), rng.randint(1, 30)) for _ in range(200)]
    for max_length in (None, 8, 25):
        for shape in shapes:
            if max_length is not None and shape[0] >= max_length and truncation_mode == "keep_start":
                continue  # TRL drops pairs whose prompt fills max_length
            for minimum in (2, 8):
                batch = concatenated_inputs(
                    random_examples([shape]),
                    max_length=max_length,
                    truncation_mode=truncation_mode,
                    prefix_sharing=True,
                    prefix_sharing_min_prompt_tokens=minimum,
                )
                expected = batch["input_ids"].shape[1]
                assert pair_row_tokens(*shape, max_length, truncation_mode, minimum) == expected, (shape, max_length)


# ---------------------------------------------------------------------------------------------------------------------
# The attention


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_shared_attention_equals_dense_attention_with_the_layout_mask(sliding_window):
    batch = concatenated_inputs(EXAMPLES, **SHARE, pad_to_multiple_of=8)
    packed = PackedBatch.from_collated(batch)
    query, key, value = row_qkv(packed.row_length)
    output, _ = padfree_varlen_attention(
        torch.nn.Module(),
        query,
        key,
        value,
        None,
        sliding_window=sliding_window,
        packed_row=packed.row(),
    )
    expected = dense_attention(query, key, value, layout_mask(batch, sliding_window))
    torch.testing.assert_close(output, expected, atol=ATTENTION_ATOL, rtol=0)
    grads = torch.autograd.grad(output.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=0)


def test_per_segment_attention_aligns_causal_to_the_bottom_right_like_flash_attention():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, 3, HEAD_DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, 5, HEAD_DIM, generator=generator) for _ in range(2))
    output = per_segment_attention(
        query, key, value, torch.tensor([0, 3]), torch.tensor([0, 5]), None, sliding_window=None, dropout=0.0
    )
    allowed = torch.tensor([[k <= q + 2 for k in range(5)] for q in range(3)])
    torch.testing.assert_close(output, dense_attention(query, key, value, allowed), atol=ATTENTION_ATOL, rtol=0)


def test_shared_prefix_keys_put_each_branchs_prefix_before_it():
    # | p p c c c | p r | p c c | p r r |: pair 0 shares 2 prompt tokens, pair 1 one
    row = HostRow(
        cu_seq_lens=(0, 5, 7, 10, 13),
        seq_lens=(5, 3, 4, 4),
        seq_starts=(0, 7, 5, 10),
        prefix_starts=(0, 0, 0, 7),
        prefix_lens=(0, 0, 2, 1),
    )
    keys = shared_prefix_keys(row)
    shared = GatheredKeys.of_pieces(keys, torch.device("cpu"))
    assert shared.key_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8, 9, 7, 10, 11, 12]
    assert shared.bounds_k == (0, 5, 9, 12, 16) and shared.cu_seq_lens_k.tolist() == [0, 5, 9, 12, 16]
    assert shared.cu_seq_lens_k.dtype == torch.int32 and shared.max_length_k == 5
    assert {segment for segment, (_, ranges) in enumerate(keys) if len(ranges) > 1} == {1, 3}  # the branches
    assert shared_prefix_keys(dataclasses.replace(row, prefix_lens=(0, 0, 0, 0))) is None


def test_attention_without_the_layout_during_a_shared_forward_is_an_error():
    packed = PackedBatch.from_collated(concatenated_inputs(HAND_EXAMPLES, **SHARE))
    query = key = value = torch.zeros(1, HEADS, packed.row_length, HEAD_DIM)
    with pytest.raises(ValueError, match="did not receive"), row_in_flight(packed.row()):
        padfree_varlen_attention(torch.nn.Module(), query, key, value, None, cu_seq_lens_q=packed.cu_seq_lens)


def test_shared_row_on_another_attention_is_an_error():
    # Set-up refuses the attention (test_prefix_sharing_refuses_attentions_that_cannot_read_the_layout); a forward
    # run around it, whose attention never reads the row, is refused when it ends
    packed = PackedBatch.from_collated(concatenated_inputs(HAND_EXAMPLES, **SHARE))
    model = make_model("llama", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="No attention layer of this model read the prefix-sharing layout"):
        run_packed(model.forward, packed, {}, model)


# ---------------------------------------------------------------------------------------------------------------------
# Packed forwards on every verified model type


@torch.no_grad()
def sequence_log_probs(model, batch):
    packed = PackedBatch.from_collated(batch)
    logits = model(**packed.model_kwargs()).logits.float().log_softmax(-1)
    return packed.padded(logits)[packed.token_valid]


@pytest.mark.parametrize("model_type", tuple(TINY_CONFIGS))
def test_shared_forward_equals_unshared_forward(model_type):
    model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION).eval()
    unshared = sequence_log_probs(model, concatenated_inputs(EXAMPLES, pad_to_multiple_of=8))
    shared = sequence_log_probs(model, concatenated_inputs(EXAMPLES, **SHARE, pad_to_multiple_of=8))
    assert (shared - unshared).abs().max().item() <= LOG_PROB_ATOL


# ---------------------------------------------------------------------------------------------------------------------
# The trainer, against padded TRL and padding-free without sharing


def assert_sharing_equivalent(**options):
    padded = one_step(make_trainer(False, **options))
    unshared = one_step(make_trainer(True, **options))
    trainer = make_trainer(True, **{**SHARE, **options})
    shared = one_step(trainer)
    assert_same_step(padded, shared)
    trl_metrics = {key: value for key, value in unshared.metrics.items() if not key.startswith("padfree/")}
    assert_same_step(dataclasses.replace(unshared, metrics=trl_metrics), shared)
    return trainer, shared


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_matches(loss_type):
    _, shared = assert_sharing_equivalent(loss_type=[loss_type])
    assert shared.metrics["padfree/shared_pairs"] == 1.0 and shared.metrics["padfree/shared_tokens"] > 0


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type=["exo_pair"], label_smoothing=1e-3),
        dict(loss_type=["robust"], label_smoothing=0.1),
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO
        dict(f_divergence_type="js_divergence", loss_type=["hinge"]),
        dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
        dict(ld_alpha=0.5),
        dict(use_weighting=True),
        dict(batch_size=1),
        dict(max_length=20),
        dict(pad_to_multiple_of=64),
        dict(prefix_sharing_min_prompt_tokens=8),
    ],
    ids=lambda options: "-".join(f"{key}={value}" for key, value in options.items()),
)
def test_options_match(options):
    assert_sharing_equivalent(**options)


@pytest.mark.parametrize("model_type", tuple(TINY_CONFIGS))
def test_model_types_match(model_type):
    assert_sharing_equivalent(model_type=model_type)


def test_keep_end_truncation_mixes_shared_and_unshared_pairs():
    _, shared = assert_sharing_equivalent(max_length=30, truncation_mode="keep_end")
    assert 0 < shared.metrics["padfree/shared_pairs"] < 1


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_recomputes_with_the_layout(use_reentrant, monkeypatch):
    # The layout reaches the attention as a keyword argument, so the backward's recomputation sees it too
    branch_calls = []
    attend = GatheredKeys.attend
    monkeypatch.setattr(
        GatheredKeys, "attend", lambda *args, **kwargs: branch_calls.append(1) or attend(*args, **kwargs)
    )
    padded = one_step(with_checkpointing(make_trainer(False), use_reentrant))
    shared = one_step(with_checkpointing(make_trainer(True, **SHARE), use_reentrant))
    assert_same_step(padded, shared)
    assert len(branch_calls) == 3 * 2  # reference, policy and its recomputation, in each of 2 layers


def test_first_loss_is_ln2_when_policy_equals_reference():
    assert one_step(make_trainer(True, **SHARE, ref_seed=0)).loss == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)


def test_shared_row_holds_each_prompt_once():
    trainer = make_trainer(True, **SHARE)
    batch = first_batch(trainer)
    pairs = [trainer.train_dataset[index] for index in range(8)]
    prompts = sum(len(pair["prompt_ids"]) for pair in pairs)
    completions = sum(len(pair["chosen_ids"]) + len(pair["rejected_ids"]) for pair in pairs)
    shared_pairs = sum(len(pair["prompt_ids"]) >= 2 for pair in pairs)
    assert batch["input_ids"].shape[1] == prompts + completions + shared_pairs  # + the repeated last prompt token
    metrics = one_step(trainer).metrics
    assert metrics["padfree/shared_tokens"] == batch["seq_lens"].sum().item() - batch["input_ids"].shape[1]
    assert metrics["padfree/shared_pairs"] == shared_pairs / 8
    assert metrics["padfree/real_tokens"] == batch["seq_lens"].sum().item()


def test_precomputed_reference_log_probs_match():
    assert_precomputed_reference_matches_padded(**SHARE)


def test_lora_with_adapter_disabled_reference_matches():
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    padded = one_step(make_trainer(False, peft_config=LoraConfig(**lora)))
    shared = one_step(make_trainer(True, **SHARE, peft_config=LoraConfig(**lora)))
    assert_same_step(padded, shared)


def test_training_losses_match_over_steps_with_accumulation():
    padded = train_losses(make_trainer(False, **SGD_STEPS_WITH_ACCUMULATION))
    shared = train_losses(make_trainer(True, **SHARE, **SGD_STEPS_WITH_ACCUMULATION))
    assert len(shared) == 4 and shared == pytest.approx(padded, abs=TRAINING_LOSS_ATOL)


def test_token_budget_counts_shared_rows():
    trainer = make_trainer(True, **SHARE, max_tokens_per_batch=160, num_pairs=16, max_steps=2)
    unshared = make_trainer(True, max_tokens_per_batch=160, num_pairs=16, max_steps=2)
    assert sum(trainer._batches.budget_sampler.lengths) < sum(unshared._batches.budget_sampler.lengths)
    for micro_batch in trainer._batches.budget_sampler:
        batch = trainer.data_collator([trainer.train_dataset[index] for index in micro_batch])
        assert batch["input_ids"].shape[1] == sum(
            trainer._batches.budget_sampler.lengths[index] for index in micro_batch
        )
        assert batch["input_ids"].shape[1] <= 160
    trainer.train()
    assert all(0 < entry["padfree/budget_fill"] <= 1 for entry in trainer.state.log_history if "loss" in entry)


def test_token_budget_under_auto_sizes_pairs_unshared():
    # "auto" may lay a text batch out unshared: sized shared, such a micro-batch would overflow the budget
    auto = make_trainer(True, prefix_sharing="auto", max_tokens_per_batch=160, num_pairs=16)
    unshared = make_trainer(True, max_tokens_per_batch=160, num_pairs=16)
    assert auto._batches.budget_sampler.lengths == unshared._batches.budget_sampler.lengths


def test_evaluation_matches_padded():
    padded, shared = make_trainer(False), make_trainer(True, **SHARE)
    padded_metrics, shared_metrics = padded.evaluate(), shared.evaluate()
    for key, value in padded_metrics.items():
        if key.startswith("eval_") and "runtime" not in key and "per_second" not in key:
            assert shared_metrics[key] == pytest.approx(value, rel=EVAL_METRIC_RTOL, abs=EVAL_METRIC_ATOL), key
    assert 0 < shared_metrics["eval_padfree/shared_pairs"] <= 1
    # Logits of every real token, read from the shared prefix or the branch, as TRL's padded prediction step has them
    batch = first_batch(shared)
    _, logits, labels = shared.prediction_step(shared.model, batch, prediction_loss_only=False)
    _, padded_logits, padded_labels = padded.prediction_step(padded.model, first_batch(padded), False)
    width = int(batch["seq_lens"].max())
    real = padded_labels[:, :width] != shared._tokenizer.pad_token_id
    assert torch.equal(labels[real], padded_labels[:, :width][real])
    torch.testing.assert_close(logits[real], padded_logits[:, :width][real], atol=PREDICTION_LOGITS_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


def test_prefix_sharing_needs_padding_free():
    with pytest.raises(ValueError, match="needs padding_free=True"):
        DPOConfig(output_dir="/tmp/trl-padfree-tests", prefix_sharing=True, padding_free=False, report_to=[])
    with pytest.raises(ValueError, match="at least 2"):
        DPOConfig(output_dir="/tmp/trl-padfree-tests", padding_free=True, prefix_sharing_min_prompt_tokens=1)
    with pytest.raises(ValueError, match="does not work with sequence parallelism yet"):
        DPOConfig(
            output_dir="/tmp/trl-padfree-tests", padding_free=True, prefix_sharing=True, sequence_parallel_size=2
        )


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flash_attention_2"])
def test_prefix_sharing_refuses_attentions_that_cannot_read_the_layout(attn_implementation):
    with pytest.raises(ValueError, match="prefix_sharing=True needs the `padfree_varlen` attention"):
        resolve_attn_implementation(attn_implementation, "sdpa", prefix_sharing=True)
    with pytest.raises(ValueError, match="prefix_sharing=True needs the `padfree_varlen` attention"):
        make_trainer(True, prefix_sharing=True, packed_attn_implementation="sdpa")
    # `auto` picks ours even for a model that runs flash attention
    assert resolve_attn_implementation("auto", "flash_attention_2", prefix_sharing=True) == ATTN_IMPLEMENTATION


def test_sequence_parallel_shared_row_is_an_error():
    from trl_padfree.parallel.groups import RowGroup
    from trl_padfree.parallel.row_split import SplitRowRun

    packed = PackedBatch.from_collated(concatenated_inputs(HAND_EXAMPLES, **SHARE))
    ulysses = RowGroup(None, 0, 2)
    packed.split = SplitRowRun(row=ulysses, ulysses=ulysses, context=None)
    model = make_model("llama", attn_implementation=ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="sequence parallelism"):
        run_packed(model.forward, packed, {}, model)


def test_cu_seq_lens_of_the_hand_row():
    # The segments of the first call: [prefix + chosen branch] and [rejected branch] per pair, then the padding
    assert concatenated_inputs(HAND_EXAMPLES, **SHARE)["cu_seq_lens_q"].tolist() == (
        cu_seq_lens_from_lengths([5, 2, 3, 3]).tolist()
    )


MIXTRAL = dict(num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.02, hidden_size=32)
MIXTRAL |= dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("from_collator", [False, True], ids=["config", "collator"])
def test_moe_auxiliary_loss_is_refused(from_collator):
    # Sharing asked for by the config, or by a collator passed in with the config's prefix_sharing left off
    options = dict(model_type="mixtral", model_overrides=MIXTRAL)
    if from_collator:
        options["data_collator"] = PaddingFreePreferenceCollator(pad_token_id=0, prefix_sharing=True)
    else:
        options["prefix_sharing"] = True
    with pytest.raises(ValueError, match="Mixture-of-Experts auxiliary loss would count each prompt"):
        make_trainer(True, **options)


def test_a_collator_that_shares_is_honoured_like_the_config():
    collator = PaddingFreePreferenceCollator(pad_token_id=0, prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    with pytest.raises(ValueError, match="prefix_sharing=True needs the `padfree_varlen` attention"):
        make_trainer(True, data_collator=collator, packed_attn_implementation="sdpa")
    trainer = make_trainer(True, data_collator=collator)
    assert one_step(trainer).metrics["padfree/shared_pairs"] > 0


def test_the_architecture_check_also_checks_a_shared_row(monkeypatch):
    model = make_model("starcoder2", attn_implementation=ATTN_IMPLEMENTATION, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    check_packable(model, prefix_sharing=True)
    monkeypatch.setattr(architecture, "_VERDICTS", {})
    monkeypatch.setattr(architecture, "shared_packing_error", lambda twin, attn_implementation, images=False: 0.5)
    check_packable(model)  # without sharing, the shared row is not checked
    with pytest.raises(ValueError, match="prefix_sharing=True cannot train.*prefix-sharing forward differs"):
        check_packable(model, prefix_sharing=True)


def test_a_forward_in_which_no_attention_read_the_layout_is_an_error():
    class NoAttention(torch.nn.Module):  # stands in for layers that mix tokens outside the attention interface
        config = type("Config", (), {"_attn_implementation": ATTN_IMPLEMENTATION})()

        def forward(self, input_ids, **kwargs):
            return {"logits": torch.zeros(*input_ids.shape, 4)}

    packed = PackedBatch.from_collated(concatenated_inputs(HAND_EXAMPLES, **SHARE))
    model = NoAttention()
    with pytest.raises(ValueError, match="No attention layer of this model read the prefix-sharing layout"):
        run_packed(model.forward, packed, {}, model)


def test_streaming_training_set_shares_without_reading_it_up_front(caplog, tmp_path):
    args = DPOConfig(
        output_dir=str(tmp_path), padding_free=True, **SHARE, max_steps=1, per_device_train_batch_size=4, use_cpu=True
    )
    args.report_to, args.bf16 = [], False
    with caplog.at_level(logging.INFO, logger="trl_padfree"):
        trainer = DPOTrainer(
            model=make_model("llama", attn_implementation="sdpa"),
            ref_model=make_model("llama", attn_implementation="sdpa", seed=1),
            args=args,
            train_dataset=make_preference_dataset(8).to_iterable_dataset(),
            processing_class=make_tokenizer(),
        )
    assert "Prefix sharing:" not in caplog.text  # nothing to count without consuming the stream
    trainer.train()
    assert trainer.state.log_history[0]["padfree/shared_pairs"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# prefix_sharing="auto"


def sharing_cost(hidden: int, layers: int, kv_width: int, gather: float) -> SharingCost:
    shape = DecoderShape(
        linear_params=12 * hidden * hidden * layers, hidden_size=hidden, vocab_size=1000, attention_layers=layers,
        num_attention_heads=hidden // 64, head_dim=64,
    )  # fmt: skip
    return SharingCost(shape, kv_width, gather)


def test_auto_shares_when_the_saved_work_outweighs_the_gather():
    lengths, scored = [(300, 250), (120, 180)], 200
    big = sharing_cost(hidden=4096, layers=32, kv_width=1024, gather=GATHER_FLOPS_PER_ELEMENT["cuda"])
    unshared, shared = big.step_costs(lengths, [100, 60], scored)
    assert shared < unshared and shares_pay(big, lengths, [100, 60], scored)
    # A model this narrow gains less per saved token than the row's keys and values cost to gather
    narrow = sharing_cost(hidden=64, layers=2, kv_width=64, gather=GATHER_FLOPS_PER_ELEMENT["cuda"])
    assert not shares_pay(narrow, lengths, [2, 1], scored)
    assert not shares_pay(big, lengths, [0, 0], scored)  # nothing to share


def test_auto_trains_equal_to_unshared_padded_trl_and_logs_its_choice(caplog, monkeypatch):
    monkeypatch.setattr(prefix_sharing, "_OUTCOMES_LOGGED", set())  # logged once per process: an earlier test may have
    padded = one_step(make_trainer(False))
    with caplog.at_level(logging.INFO, logger="trl_padfree.packing.prefix_sharing"):
        trainer = make_trainer(True, prefix_sharing="auto")
        packed = one_step(trainer)
    assert_same_step(padded, packed)
    assert trainer.data_collator.prefix_sharing == "auto" and trainer.data_collator.prefix_sharing_cost is not None
    assert 'prefix_sharing="auto"' in caplog.text


@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_prefix_sharing_takes_auto_true_and_false_on_the_command_line(value):
    from trl import TrlParser

    (args,) = TrlParser((DPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "out", "--padding_free", "true", "--use_cpu", "true", "--prefix_sharing", value]
    )
    assert args.prefix_sharing == {"auto": "auto", "true": True, "false": False}[value]


# ---------------------------------------------------------------------------------------------------------------------
# The walk from the config to the kernel (docs/concepts/prefix-sharing.md#the-walk)

# The package files `prefix_sharing` crosses from DPOConfig to the kernel, in order, in three forms: the setting (True,
# False or "auto"; the collator holds the resolved one), host integers (the collator's `HostRow`), `GatheredKeys`
WALK = (
    "config.py",  # the setting
    "features/padding_free.py",  # resolved once at set-up, handed to the collator
    "packing/collator.py",  # the collator lays each batch out by it: host integers
    "packing/vision.py",  # (image batches: the vision collator, the same way)
    "packing/prefix_sharing.py",  # every host-side rule: each pair's prefix, the pair's layout, each segment's keys
    "modeling/attention/rows.py",  # the row of a HostRow: its keys gathered (GatheredKeys)
    "modeling/attention/gathered.py",  # gathered keys, whoever laid them out
    "modeling/attention/varlen.py",  # the kernel
)
# The output side, not the walk: the per-sequence tensors a prefix-sharing collator also emits, and the padded view
# built from them, which maps the row's outputs back to TRL's layout (and feeds the hybrid mixers)
OUTPUT_SIDE = {"shared_prefix_starts", "shared_prefix_lens", "padded_view_index"}


def _names_prefix_sharing(name: str) -> bool:
    """Whether an identifier is prefix sharing's on the way to the kernel: its setting, its rules and their results,
    its row, its refusals (`prefix_sharing`, `shared_prefix_keys`, `SHARED_PREFIX_LAYOUT`, ...), and the host integers
    its keys are laid out from (`prefix_starts`, `prefix_lens`)."""
    squashed = name.lower().replace("_", "")
    if name in OUTPUT_SIDE:
        return False
    return "prefixsharing" in squashed or "sharedprefix" in squashed or name in ("prefix_starts", "prefix_lens")


def _functions_naming_prefix_sharing(path) -> list[tuple[int, int]]:
    """The line ranges of `path`'s functions whose code (not docstrings or comments) names prefix sharing."""
    import ast

    ranges = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in OUTPUT_SIDE:
            continue
        names = set()
        for inner in ast.walk(node):
            if isinstance(inner, ast.Name):
                names.add(inner.id)
            elif isinstance(inner, ast.Attribute):
                names.add(inner.attr)
            elif isinstance(inner, ast.keyword) and inner.arg:
                names.add(inner.arg)
            elif isinstance(inner, ast.arg):
                names.add(inner.arg)
        if any(map(_names_prefix_sharing, names)):
            ranges.append((min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno))
    return ranges


def test_prefix_sharing_walks_from_the_config_to_the_kernel_through_the_listed_files():
    """The walk, pinned where it runs: a shared batch is collated and its packed forward run, profiled; of the package's
    functions that ran, those whose code names prefix sharing lie in the walk's files from the collator on (the
    collator, prefix sharing's rules, the row), and the kernel is reached through gathered.py and varlen.py, whose code
    names none of it. A step that adds a file to the walk (a forward that checks prefix sharing again, a packed batch
    that builds its own kind of row, a type that carries its keys) names prefix sharing in a function that runs, outside
    the walk. Before the collator, the setting is the config's field, and one feature hands it to the collator. Set-up's
    other readers of the setting (its refusals, the architecture check, the token budget's and balancing's pricing)
    decide or price, and carry nothing to the kernel; context parallelism hands the same keys to its own row
    (parallel/row_split.py, parallel/context.py) in place of rows.py."""
    import ast
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "trl_padfree"
    assert len(WALK) <= 8 and all((package / module).is_file() for module in WALK), WALK

    ran = set()  # (file, first line) of each function called

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(package)):
            ran.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))

    collator = PaddingFreePreferenceCollator(pad_token_id=0, **SHARE)
    model = make_model("llama", attn_implementation=ATTN_IMPLEMENTATION).eval()
    sys.setprofile(profile)
    try:
        packed = PackedBatch.from_collated(collator(EXAMPLES))
        with torch.no_grad():
            run_packed(model.forward, packed, {"use_cache": False}, model)
    finally:
        sys.setprofile(None)
    assert packed.host.shared_pairs > 0

    files_ran = {str(Path(file).relative_to(package)) for file, _ in ran}
    naming = set()
    for file in {file for file, _ in ran}:
        functions = _functions_naming_prefix_sharing(Path(file))
        if any(start <= line <= end for _, line in ran if _ == file for start, end in functions):
            naming.add(str(Path(file).relative_to(package)))
    assert naming == {"packing/collator.py", "packing/prefix_sharing.py", "modeling/attention/rows.py"}, naming
    kernel_side = {"modeling/attention/gathered.py", "modeling/attention/varlen.py"}
    assert kernel_side <= files_ran and not any(_functions_naming_prefix_sharing(package / f) for f in kernel_side)

    # Before the collator: the config's field, set on the collator by one feature
    setters = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call_name = getattr(getattr(node, "func", None), "attr", getattr(getattr(node, "func", None), "id", None))
            if isinstance(node, ast.Call) and call_name == "replace":
                if any(keyword.arg == "prefix_sharing" for keyword in node.keywords):
                    setters.append(str(path.relative_to(package)))
    assert setters == ["features/padding_free.py"], setters
    assert "prefix_sharing" in {
        node.target.id
        for node in ast.walk(ast.parse((package / "config.py").read_text()))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
