"""TRL's own padded DPOTrainer on Llama4ForCausalLM and GraniteMoeHybridForCausalLM, with `fused_lm_head_lookups`."""

import math

import pytest
import torch
import trl
from tiny_fixtures import make_model, make_preference_dataset, make_tokenizer
from tolerances import (
    BF16_AUTOCAST_LOGPS_RTOL,
    BF16_AUTOCAST_LOSS_ATOL,
    FUSED_HEAD_LOG_PROB_ATOL,
    FUSED_HEAD_LOSS_ATOL,
)
from trainer_utils import first_batch, make_trainer, one_step
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trl_padfree.modeling.fused_lm_head import (
    check_fused_lm_head_lookups,
    fused_lm_head_lookups,
    prepare_for_fused_lm_head,
)

# Small but every feature switched on: Llama4 has a dense layer with RoPE and chunked attention (chunks shorter than
# most sequences) and a MoE layer without RoPE; Granite has a Mamba2 layer, an attention layer and a logits scaling
# that TRL's head must apply itself
TINY_MOE_CONFIGS = {
    "llama4_text": dict(
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
    ),
    "granitemoehybrid": dict(
        hidden_size=32,
        intermediate_size=64,
        shared_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=16,
        logits_scaling=2.0,
    ),
}
MODEL_TYPES = list(TINY_MOE_CONFIGS)
# What plain TRL 1.16 fails on for each (trl/trainer/utils.py:1618 and :1679)
TRL_FAILURES = {"llama4_text": "last_hidden_state", "granitemoehybrid": "num_experts"}


class FusedLookupsDPOTrainer(trl.DPOTrainer):
    """TRL's trainer with the one change this module asks of a subclass."""

    def __init__(self, *args, **kwargs):
        with fused_lm_head_lookups(self):
            super().__init__(*args, **kwargs)


def moe_trainer(model_type, trainer_class=FusedLookupsDPOTrainer, model_overrides=None, **config_kwargs):
    """A padded TRL trainer whose reference equals the policy, so the DPO loss of any batch is ln 2 before training."""
    config_kwargs.setdefault("num_pairs", 6)
    config_kwargs.setdefault("batch_size", 3)
    return make_trainer(
        False,
        model_type,
        ref_seed=0,
        trainer_class=trainer_class,
        config_class=trl.DPOConfig,
        model_overrides={**TINY_MOE_CONFIGS[model_type], **(model_overrides or {})},
        **config_kwargs,
    )


def plain_log_probs(model, batch) -> torch.Tensor:
    """Per-token log-probs from the model's own logits: log_softmax gathered at the next token, 0 off completions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = batch["input_ids"][:, 1:]
    log_probs = logits[:, :-1].log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs * batch["completion_mask"][:, 1:]


def fused_log_probs(model, batch) -> torch.Tensor:
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True
    ).log_probs


def reference_aux_loss(model, batch) -> torch.Tensor:
    """The load-balancing loss from the plain forward's router logits, with the expert count under its config name."""
    config = model.config
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        output_router_logits=True,
    )
    return load_balancing_loss_func(
        outputs.router_logits, config.num_local_experts, config.num_experts_per_tok, batch["attention_mask"]
    )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plain_trl_crashes_without_the_fix(model_type):
    # The default router_aux_loss_coef of both configs (0.001) turns TRL's MoE aux loss on
    trainer = moe_trainer(model_type, trainer_class=trl.DPOTrainer)
    with pytest.raises(AttributeError, match=TRL_FAILURES[model_type]):
        one_step(trainer)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_trains_two_steps(model_type):
    trainer = moe_trainer(model_type, max_steps=2, logging_steps=1, learning_rate=1e-3)
    assert trainer.aux_loss_enabled  # on by default: the configs' own router_aux_loss_coef
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    coef = trainer.router_aux_loss_coef
    assert coef == 0.001
    assert abs(logs[0]["loss"] - (math.log(2) + coef * logs[0]["aux_loss"])) <= FUSED_HEAD_LOSS_ATOL
    assert any(not torch.equal(param, before[name]) for name, param in trainer.model.named_parameters())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_log_probs_equal_plain_logits(model_type):
    trainer = moe_trainer(model_type)
    batch = first_batch(trainer)
    assert batch["attention_mask"].min() == 0  # padded rows, as TRL's collator makes them
    for model in (trainer.model, trainer.accelerator.unwrap_model(trainer.ref_model)):
        with torch.no_grad():
            expected = plain_log_probs(model, batch)
            fused = fused_log_probs(model, batch)
        torch.testing.assert_close(fused, expected, atol=FUSED_HEAD_LOG_PROB_ATOL, rtol=0)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_first_loss_is_ln2_when_reference_equals_policy(model_type):
    trainer = moe_trainer(model_type, router_aux_loss_coef=0.0)
    assert not trainer.aux_loss_enabled
    assert abs(one_step(trainer).loss - math.log(2)) <= FUSED_HEAD_LOSS_ATOL


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("requested_by", ["dpo_config", "model_config"])
def test_aux_loss_is_included(model_type, requested_by):
    if requested_by == "dpo_config":
        trainer = moe_trainer(model_type, router_aux_loss_coef=0.05)
    else:  # every fused forward, the reference's included, then computes it
        trainer = moe_trainer(model_type, model_overrides=dict(output_router_logits=True, router_aux_loss_coef=0.05))
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.05
    step = one_step(trainer)
    with torch.no_grad():
        expected_aux_loss = reference_aux_loss(trainer.model, first_batch(trainer)).item()
    assert expected_aux_loss > 0.5  # about 1 when balanced: a real term, not a silent 0
    assert abs(step.metrics["aux_loss"] - expected_aux_loss) <= FUSED_HEAD_LOSS_ATOL
    assert abs(step.loss - (math.log(2) + 0.05 * expected_aux_loss)) <= FUSED_HEAD_LOSS_ATOL


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reference_log_probs_precomputed_inside_init(model_type):
    # TRL runs the reference inside __init__ here, so preparing the models after super().__init__ would come too late
    trainer = moe_trainer(model_type, precompute_ref_log_probs=True, router_aux_loss_coef=0.0)
    assert abs(one_step(trainer).loss - math.log(2)) <= FUSED_HEAD_LOSS_ATOL


def test_models_trl_loads_itself_are_prepared(tmp_path):
    # Policy and reference both loaded by TRL from the checkpoint path, inside __init__
    make_model("llama4_text", **TINY_MOE_CONFIGS["llama4_text"]).save_pretrained(tmp_path)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, use_cpu=True, bf16=False, report_to=[]
    )
    trainer = FusedLookupsDPOTrainer(
        model=str(tmp_path), args=args, train_dataset=make_preference_dataset(6), processing_class=make_tokenizer()
    )
    for model in (trainer.model, trainer.accelerator.unwrap_model(trainer.ref_model)):
        assert model.base_model is model.model
    step = one_step(trainer)
    assert abs(step.loss - (math.log(2) + 0.001 * step.metrics["aux_loss"])) <= FUSED_HEAD_LOSS_ATOL


def test_models_that_resolve_are_left_alone():
    for model_type, overrides in [
        ("llama", {}),
        ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    ]:
        model = make_model(
            model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, **overrides
        )
        config_before = model.config.to_dict()
        prepare_for_fused_lm_head(model, router_logits=hasattr(model.config, "output_router_logits"))
        assert "base_model_prefix" not in vars(model)
        assert model.config.to_dict() == config_before


@pytest.mark.parametrize(
    ("model_type", "router_logits", "message"),
    [
        ("llama4_text", False, r"Llama4ForCausalLM\.base_model is the model itself"),
        ("granitemoehybrid", True, r"GraniteMoeHybridForCausalLM returns router logits.*config\.num_experts"),
    ],
)
def test_unprepared_lookups_are_refused_by_name(model_type, router_logits, message):
    model = make_model(model_type, **TINY_MOE_CONFIGS[model_type])
    with pytest.raises(ValueError, match=message):
        check_fused_lm_head_lookups(model, router_logits=router_logits)
    prepare_for_fused_lm_head(model, router_logits=True)
    check_fused_lm_head_lookups(model, router_logits=True)


@pytest.mark.parametrize("cast", [False, True])
def test_cast_lm_head_to_fp32_projects_the_scored_tokens_in_float32(cast):
    # bf16 weights, no autocast (DeepSpeed's bf16): the head's log-probs are float32 either way; with the option its
    # logits tiles are float32 too, so they equal a float32 log-softmax of the same bf16 hidden states and weights
    trainer = make_trainer(True, dtype=torch.bfloat16, cast_lm_head_to_fp32=cast)
    model = trainer.model
    batch = first_batch(trainer)
    captured = {}
    handle = model.model.register_forward_hook(lambda module, args, output: captured.update(hidden=output[0]))
    inputs = trainer._packed(batch, training=False)  # packed, then handed to TRL's loss code as padded views
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        model_kwargs = {k: v for k, v in inputs.items() if k not in ("completion_mask", "input_ids", "attention_mask")}
        outputs = model(**model_kwargs, input_ids=inputs["input_ids"], labels=labels, fused_lm_head=True)
    handle.remove()
    assert outputs.log_probs.dtype == torch.float32
    packed = inputs["packed_batch"]
    hidden = captured["hidden"][0].float()  # (T, H), the packed row
    logits = hidden @ model.lm_head.weight.float().T
    row_log_probs = torch.log_softmax(logits, dim=-1)[:-1].gather(1, packed.input_ids[0, 1:, None])[:, 0]
    expected = packed.padded_shifted(row_log_probs[None])
    scored = labels[:, 1:] != -100
    difference = (outputs.log_probs - expected)[scored].abs().max().item()
    if cast:
        assert difference < 1e-4  # float32 arithmetic, another summation order
    else:
        assert difference > 1e-4  # bf16 logits: each rounded to 8 significant bits (measured 6.9e-4 here)


def test_cast_lm_head_to_fp32_trains_packed_equal_to_padded_under_bf16_autocast():
    # Both modes with float32 logits tiles; the bounds of the bf16 autocast step (tests/integration/trainer/test_trainer.py)
    padded = one_step(make_trainer(False, bf16=True, cast_lm_head_to_fp32=True))
    packed = one_step(make_trainer(True, bf16=True, cast_lm_head_to_fp32=True))
    assert packed.loss == pytest.approx(padded.loss, abs=BF16_AUTOCAST_LOSS_ATOL)
    for key in ("logps/chosen", "logps/rejected"):
        assert packed.metrics[key] == pytest.approx(padded.metrics[key], rel=BF16_AUTOCAST_LOGPS_RTOL)
