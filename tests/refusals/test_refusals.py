"""What padding-free mode refuses, with errors that say what to do."""

import pytest
from peft import PrefixTuningConfig
from trainer_utils import first_batch, make_trainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from trl_padfree import PaddingFreePreferenceCollator
from trl_padfree.modeling.mixers import CACHE_KWARGS
from trl_padfree.modeling.packed_forward import PACKED_BATCH_KWARG, PackedBatch

BLOOM = dict(hidden_size=32, n_layer=2, n_head=4)
OPT = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32)


def test_a_leaking_architecture_is_refused_at_init():
    # OPT's sdpa mask ignores the packed positions (it packs only on padfree_varlen, which the message names)
    with pytest.raises(ValueError, match="model type 'opt'.*packed_attn_implementation='padfree_varlen'"):
        make_trainer(True, model_type="opt", model_overrides=OPT, packed_attn_implementation="sdpa")


def test_a_leaking_architecture_with_no_packing_backend_is_refused_at_init():
    with pytest.raises(ValueError, match="model type 'bloom'.*Train it with padding_free=False"):
        make_trainer(True, model_type="bloom", model_overrides=BLOOM, attn_implementation="eager")


def test_refused_model_still_trains_padded():
    assert (
        make_trainer(
            False, model_type="bloom", model_overrides=BLOOM, attn_implementation="eager"
        ).padding_free_enabled
        is False
    )


def test_attention_that_leaks_is_refused():
    with pytest.raises(ValueError, match="flex_attention.*padding_free=False"):
        make_trainer(True, attn_implementation="flex_attention", packed_attn_implementation="keep")


def test_padded_collator_with_padding_free_is_refused():
    collator = DataCollatorForPreference(pad_token_id=0)
    with pytest.raises(ValueError, match="needs packed batches.*PaddingFreePreferenceCollator"):
        make_trainer(True, data_collator=collator)


def test_packed_batch_without_padding_free_is_refused():
    trainer = make_trainer(False)
    packed = PaddingFreePreferenceCollator.from_padded(trainer.data_collator)
    examples = [trainer.train_dataset[index] for index in range(2)]
    with pytest.raises(ValueError, match="padding_free=False"):
        trainer.compute_loss(trainer.model, packed(examples))


def test_prompt_learning_peft_is_refused():
    with pytest.raises(ValueError, match="prompt-learning"):
        make_trainer(True, peft_config=PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))


def test_kv_cache_on_a_packed_forward_is_refused():
    trainer = make_trainer(True)
    batch = first_batch(trainer, 2)
    packed_batch = PackedBatch.from_collated(batch)
    with pytest.raises(ValueError, match="KV cache.*use_cache=False"):
        trainer.model(input_ids=batch["input_ids"], use_cache=True, **{PACKED_BATCH_KWARG: packed_batch})


@pytest.mark.parametrize("name", CACHE_KWARGS)
def test_a_live_cache_is_refused_under_every_name_transformers_uses(name):
    # transformers 5.24 renamed `past_key_values` / `cache_params` to `cache` (the old names deprecated until 5.40)
    from transformers import DynamicCache

    trainer = make_trainer(True)
    packed_batch = PackedBatch.from_collated(first_batch(trainer, 2))
    with pytest.raises(ValueError, match="KV cache.*use_cache=False"):
        trainer.model(use_cache=False, **{name: DynamicCache(), PACKED_BATCH_KWARG: packed_batch})


def test_mismatched_reference_log_probs_are_refused():
    trainer = make_trainer(True)
    examples = [dict(trainer.train_dataset[index]) for index in range(2)]
    examples[0]["ref_chosen_logps"] = -1.0
    with pytest.raises(ValueError, match="Reference log-probs must come as a pair"):
        trainer.data_collator(examples)
    examples[0]["ref_rejected_logps"], examples[1]["ref_chosen_logps"] = -2.0, -1.0
    examples[1]["ref_rejected_logps"] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        trainer.data_collator(examples)


def test_missing_columns_are_refused():
    trainer = make_trainer(True)
    with pytest.raises(KeyError, match="rejected_ids"):
        trainer.data_collator([{"prompt_ids": [1], "chosen_ids": [2]}])


def test_untested_trl_version_fails_at_import(monkeypatch):
    import trl_padfree._compat as compat

    monkeypatch.setattr(compat, "version", lambda name: "1.17.0")
    with pytest.raises(ImportError, match=r"supports TRL >=1.16.0,<1.17.0.*pip install"):
        compat.check_trl_version()


def test_empty_prompt_matches_padded_mode():
    # TRL never scores a sequence's first token; packed mode must not score it against the previous sequence either
    from trainer_utils import assert_same_step, one_step

    padded, packed = make_trainer(False), make_trainer(True)
    for trainer in (padded, packed):
        trainer.train_dataset = trainer.train_dataset.map(
            lambda example, index: {"prompt_ids": [] if index % 2 else example["prompt_ids"]}, with_indices=True
        )
    assert_same_step(one_step(padded), one_step(packed))


@pytest.mark.parametrize("padding_free", [True, False])
def test_dataset_emptied_by_truncation_is_a_clear_error(padding_free):
    # Every tiny prompt has at least one word: max_length=1 leaves TRL nothing to train on
    with pytest.raises(ValueError, match="no examples left.*max_length=1"):
        make_trainer(padding_free, max_length=1)


def test_accelerate_context_parallelism_names_ours_first_and_its_way_out_holds(tmp_path):
    import yaml

    from trl_padfree import DPOConfig
    from trl_padfree.cli.launch import shipped_configs
    from trl_padfree.refusals.parallel import check_no_context_parallelism

    with pytest.raises(ValueError) as refused:
        check_no_context_parallelism(4)
    message = str(refused.value)
    assert message.index("context_parallel_size=4") < message.index("sequence_parallel_size")
    assert "--accelerate_config fsdp2" in message and "--accelerate_config zero3_sp2" in message
    # The way out as written: the shipped fsdp2 config sets no cp_size, and the DPO config takes ours
    fsdp2 = yaml.safe_load(shipped_configs("accelerate_configs")["fsdp2"].read_text())
    assert "parallelism_config" not in fsdp2 and fsdp2["fsdp_config"]["fsdp_version"] == 2
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, padding_free=True, context_parallel_size=4)
    assert args.context_parallel_size == 4


def test_the_forward_reads_what_set_up_decided_and_checks_only_the_batch(monkeypatch):
    # Set-up records each model's attention, row limit and image rules (packed_forward.ForwardPlan); a forward derives
    # none of them again, and compares its batch with them: a row longer than the recorded limit is refused
    import dataclasses

    import torch

    from trl_padfree.integrations.transformers import set_language_model_attention
    from trl_padfree.modeling import packed_forward
    from trl_padfree.refusals.models import PADFREE_VARLEN

    trainer = make_trainer(True, prefix_sharing=True)
    plan = trainer.model._padfree_forward_plan
    assert plan.attention == PADFREE_VARLEN and plan.row_limit is None and plan.image_marks is None

    def derived_again(*args, **kwargs):
        raise AssertionError("a forward re-derived what set-up decided")

    for name in ("attn_implementation", "packed_row_limit", "image_marks_of_config", "image_family"):
        monkeypatch.setattr(packed_forward, name, derived_again)
    packed_batch = PackedBatch.from_collated(first_batch(trainer, 2))
    assert packed_batch.host.shared_pairs > 0
    with torch.no_grad():
        trainer.model(use_cache=False, **{PACKED_BATCH_KWARG: packed_batch})  # derives nothing

    limit = packed_batch.row_length - 1
    trainer.model._padfree_forward_plan = dataclasses.replace(plan, model_type="llama4_text", row_limit=limit)
    with pytest.raises(ValueError, match=f"A packed row of {limit + 1} tokens is too long for 'llama4_text'"):
        trainer.model(use_cache=False, **{PACKED_BATCH_KWARG: packed_batch})
    # Prefix sharing's attention is set-up's decision (refused there: test_prefix_sharing.py), not checked again per
    # forward: a forward whose attention did not read the shared row is refused when it ends (`row_in_flight`)
    trainer.model._padfree_forward_plan = plan
    set_language_model_attention(trainer.model, "sdpa")
    with pytest.raises(ValueError, match="No attention layer of this model read the prefix-sharing layout"):
        trainer.model(use_cache=False, **{PACKED_BATCH_KWARG: packed_batch})


def test_set_up_records_the_plan_again_when_a_model_is_set_up_again():
    from trl_padfree.integrations.transformers import set_language_model_attention
    from trl_padfree.modeling.packed_forward import add_packed_forward

    trainer = make_trainer(True)
    model = trainer.model
    set_language_model_attention(model, "sdpa")
    add_packed_forward(model)  # already wrapped: the plan alone is decided again
    assert model._padfree_forward_plan.attention == "sdpa"
