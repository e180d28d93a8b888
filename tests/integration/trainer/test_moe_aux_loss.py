"""Mixture-of-Experts with the router's load-balancing loss on: padding-free training equals TRL's padded trainer.

With `router_aux_loss_coef > 0` TRL requests router logits and adds `coef * aux_loss` to the DPO loss, where
`aux_loss` is transformers' `load_balancing_loss_func`: per expert, the fraction of tokens routed to it times its mean
router probability, both averaged over tokens. Which tokens is the whole question:

    padded (TRL)   rows [p p c c . .] [p c c c c c] ...   averaged over the attention mask: real tokens only
    packed         one row | p p c c | p c c c c c | ...  no mask: every token of the row, and every one is real

So the two are the same average over the same tokens, in another order. Padding tokens are routed like any other
token, so a row padded to `pad_to_multiple_of` would count them: that is why the trainer refuses an aux loss with row
padding, and `test_row_padding_would_count_in_the_aux_loss_so_it_is_refused` measures that it would.

The ZeRO-3 runs of the same models are in tests/integration/trainer/test_architectures_end_to_end.py (one launch for every model).
"""

import functools

import pytest
import torch
from tiny_architectures import make_tiny_model
from tiny_fixtures import make_tokenizer
from tolerances import LOSS_ATOL
from trainer_utils import (
    SGD_STEPS_WITH_ACCUMULATION,
    assert_same_step,
    first_batch,
    make_trainer,
    one_step,
    train_losses,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from trl_padfree.modeling.packed_forward import PackedBatch
from trl_padfree.packing.collator import PaddingFreePreferenceCollator

AUX_LOSS_COEF = 0.05  # 50x the configs' default, so the aux term moves the loss by ~0.1
MODEL_TYPES = ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"]


def moe_trainer(padding_free: bool, model_type: str, **options):
    options.setdefault("router_aux_loss_coef", AUX_LOSS_COEF)
    factory = functools.partial(make_tiny_model, model_type, len(make_tokenizer()))
    return make_trainer(padding_free, model_factory=factory, **options)


def router_aux_loss(model, attention_mask=None, **model_kwargs) -> torch.Tensor:
    """transformers' load-balancing loss (the one TRL's fused head computes) from a plain forward's router logits."""
    config = model.config
    num_experts = next(getattr(config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    outputs = model(**model_kwargs, attention_mask=attention_mask, use_cache=False, output_router_logits=True)
    return load_balancing_loss_func(outputs.router_logits, num_experts, config.num_experts_per_tok, attention_mask)


def packed_model_kwargs(batch: dict) -> dict:
    kwargs = PackedBatch.from_collated(batch).model_kwargs()
    kwargs.pop("use_cache")
    return kwargs


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_aux_loss_matches_padded(model_type):
    padded_trainer, packed_trainer = moe_trainer(False, model_type), moe_trainer(True, model_type)
    assert padded_trainer.aux_loss_enabled and packed_trainer.aux_loss_enabled
    padded, packed = one_step(padded_trainer), one_step(packed_trainer)
    assert_same_step(padded, packed)
    # A real term: about top_k (2 here) when the routing is balanced
    assert packed.metrics["aux_loss"] == pytest.approx(2.0, abs=0.1)


def test_aux_loss_is_over_the_same_tokens():
    """The packed row's aux loss (no mask) equals the padded batch's over its attention mask, and differs from the
    padded batch's over every token, padding included: the equality above is not a coincidence of the data."""
    padded_trainer, packed_trainer = moe_trainer(False, "qwen3_moe"), moe_trainer(True, "qwen3_moe")
    model = padded_trainer.model
    padded_batch, packed_batch = first_batch(padded_trainer), first_batch(packed_trainer)
    with torch.no_grad():
        padded = router_aux_loss(model, padded_batch["attention_mask"], input_ids=padded_batch["input_ids"])
        with_padding = router_aux_loss(model, input_ids=padded_batch["input_ids"])
        packed = router_aux_loss(model, **packed_model_kwargs(packed_batch))
    assert packed.item() == pytest.approx(padded.item(), abs=LOSS_ATOL)
    assert abs(with_padding.item() - padded.item()) > 1000 * LOSS_ATOL
    assert packed_batch["input_ids"].shape[1] == packed_batch["seq_lens"].sum()  # no padding in the row


def test_row_padding_would_count_in_the_aux_loss_so_it_is_refused():
    padded_trainer = moe_trainer(False, "qwen3_moe")
    examples = [padded_trainer.train_dataset[index] for index in range(8)]
    padded_batch = padded_trainer.data_collator(examples)
    row_padded = PaddingFreePreferenceCollator(pad_token_id=0, pad_to_multiple_of=64)(examples)
    assert row_padded["input_ids"].shape[1] > row_padded["seq_lens"].sum()  # a padding segment at the end
    with torch.no_grad():
        model = padded_trainer.model
        padded = router_aux_loss(model, padded_batch["attention_mask"], input_ids=padded_batch["input_ids"])
        counting_row_padding = router_aux_loss(model, **packed_model_kwargs(row_padded))
    assert abs(counting_row_padding.item() - padded.item()) > 100 * LOSS_ATOL
    with pytest.raises(ValueError, match="would count the row padding in the load-balancing loss"):
        moe_trainer(True, "qwen3_moe", pad_to_multiple_of=64)
    moe_trainer(True, "qwen3_moe", pad_to_multiple_of=64, router_aux_loss_coef=0.0)  # no aux loss: row padding is fine


def test_aux_loss_training_and_evaluation_match_padded():
    """SGD steps with gradient accumulation (each micro-batch's aux loss averaged), then evaluation."""
    padded_trainer = moe_trainer(False, "qwen3_moe", **SGD_STEPS_WITH_ACCUMULATION)
    packed_trainer = moe_trainer(True, "qwen3_moe", **SGD_STEPS_WITH_ACCUMULATION)
    padded, packed = train_losses(padded_trainer), train_losses(packed_trainer)
    assert len(packed) == 4 and packed == pytest.approx(padded, abs=1e-5)

    def logged(trainer, key):
        return [entry[key] for entry in trainer.state.log_history if key in entry]

    assert logged(packed_trainer, "aux_loss") == pytest.approx(logged(padded_trainer, "aux_loss"), abs=1e-5)
    padded_eval, packed_eval = padded_trainer.evaluate(), packed_trainer.evaluate()
    for key in ("eval_loss", "eval_aux_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/chosen"):
        assert packed_eval[key] == pytest.approx(padded_eval[key], rel=1e-5, abs=1e-5), key
